"""Every check that needs a GPU: ``scripts/gpu_check.sh --out DIR [--quick | --only STEPS_OR_GROUPS] [--dry-run]``.

Writes ``DIR/gpu_check.md`` (a table per step) and ``DIR/gpu_check.json``, both rewritten after every step, so a
check stopped at any point still reports what it measured. The plan is a list of named steps (:data:`STEPS`), each
with a time budget; each step runs in a process of its own (``python3 -m torchtitan.tools.gpu_check --child``),
started with the environment ``train.py`` trains in (its CUDA allocator setting, ``PYTHONPATH`` extended), and is
stopped at its budget: overrunning it, failing or lacking a package it needs (skipped, saying which) concerns that
step alone, and the rows it measured before stopping are kept. Running out of GPU memory is a result ("does not
fit"), not a failure. ``--dry-run`` runs the same plan on the CPU with tiny shapes and compilation off, so the test
suite keeps the check from rotting between GPU runs.

The plan is split into groups (:data:`GROUPS`) that each fit one device command of at most 9 minutes on one H200
by the per-step estimates of :data:`STEPS`; ``--quick`` is the group ``quick``. ``docs/gpu-check.md`` lists them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from torchtitan.errors import UserError, exit_code
from torchtitan.gpu_check.context import Context, Sizes
from torchtitan.gpu_check.runner import names_of, run, run_children, steps_of
from torchtitan.gpu_check.steps import GROUPS, STEPS


def main(argv: Optional[list[str]] = None) -> int:
    return exit_code(lambda: _main(argv))


def _main(argv: Optional[list[str]]) -> int:
    from torchtitan.optim.builder import OPTIMIZERS

    parser = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.md, gpu_check.json and logs")
    parser.add_argument("--dry-run", action="store_true", help="the same plan on the CPU with tiny shapes")
    parser.add_argument("--quick", action="store_true", help=f"the quick profile: {', '.join(GROUPS['quick'])}")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated steps ({', '.join(STEPS)}) or groups ({', '.join(GROUPS)})"
    )
    parser.add_argument("--optimizers", default=None, help="comma-separated registry names (default: all)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a step's own process
    parser.add_argument("--step-function", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.quick and options.only:
        raise UserError("--quick is the group 'quick' of --only; give one of them")
    only = steps_of("quick" if options.quick else options.only)
    optimizers = names_of(options.optimizers, list(OPTIMIZERS), "optimizers")
    out = Path(options.out)
    if options.child:
        ctx = Context(sizes=Sizes.for_run(options.dry_run), out=out, dry_run=options.dry_run, optimizers=optimizers)
        return run_children(options.child, options.step_function, ctx)
    report = run(out, options.dry_run, only, optimizers)
    failed = [name for name, step in report["steps"].items() if step["status"] == "failed"]
    print(f"gpu_check: report in {out / 'gpu_check.md'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
