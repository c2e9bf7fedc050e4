"""Sweeps for fair optimizer comparisons: every optimizer at its own best settings.

    python -m torchtitan.tools.sweep --dump-folder outputs/sweep --optimizers AdamW,AdamMini --lrs 3e-4,1e-3,3e-3 \\
        [--seeds 0,1,2] [--vary-data-seed] [--axis [OPTIMIZER:]SECTION.KEY=V1,V2 ...] \\
        [--search grid | coordinate [--start [OPTIMIZER:]SECTION.KEY=V ...]] [--budgets 2e8,4e8 | 1x,2x] \\
        [--warmup-fraction F] [--baseline AdamW] [--nproc N] [--parallel K] [--config-file X.toml] \\
        [--last-k 10] [--confirm-seeds 3,4,5] [--family-correction Holm|unadjusted] \\
        [--scheduler slurm [--slurm-partition P] [--slurm-time T] ... [--wait]] \\
        [--ladder ladder-30M,ladder-60M,... [--size-option FLAVOR:SECTION.KEY=V ...] [--size-nproc FLAVOR=N ...] \\
         [--carry-lrs] [--target-params 8e9]] -- [train.py options]
    python -m torchtitan.tools.sweep --dump-folder outputs/sweep --report-only [--baseline AdamW]

Every (optimizer, lr, seed) runs once through ``run_llama_train.sh`` with the same config and options, in its own
folder ``{dump}/runs/{Optimizer}_lr{lr}_seed{seed}`` (its TensorBoard logs, checkpoints and ``train.log``); with
``--axis`` once per value of every axis, ``..._{option}{value}``, and with ``--budgets`` once per budget,
``..._tokens{budget}``, its training.steps the whole steps that fit in the budget and its warmup a share of them
(docs/study-runs.md). ``--search coordinate`` trains only the points a coordinate descent from a start point visits
(``sweep_search``). ``--parallel K`` trains K runs at once, each on GPUs of its own; ``--scheduler slurm`` submits
them as one Slurm job array instead, K at a time (docs/cluster.md). Each run's folder keeps the command it ran with
(``command.sh``) and, from train.py, its resolved config (``job_config.toml``); after a run ends the sweep writes
``sweep_status.json`` into that folder: the exit code, the command, its environment and the outcome:

* ``finished`` - exit 0 with finite losses;
* ``diverged`` - exit 3 (train.py stopped on non-finite loss or gradients) or a non-finite logged loss;
* ``failed``   - any other exit. The sweep goes on with the other runs and exits 1 at the end, naming the first
  failed run and the first error line of its log (2 for a mistake in the options, which stops it at once).

The exit code is the run's own: train.py's first rank records it in the run's folder (``exit.json``), since torchrun
reports any worker's failure as 1; the launcher's code counts only where no record of this attempt exists. Runs
train with the sweep's own interpreter (``PYTHON``, which run_llama_train.sh uses), whatever ``PATH`` holds.

Finished and diverged runs are never run again: running the same command again resumes an interrupted sweep where
it stopped (failed and interrupted runs start again; with checkpointing on they resume from their own checkpoint),
and adding optimizers, lrs or seeds extends it. The report - ``sweep.png``, ``sweep.md``, ``sweep.json`` and the
self-contained page ``study.html`` in the dump folder - ranks each setting by the last ``validation/loss`` when
every run logs one, else by the mean of the last k logged training losses; with several seeds it gives their mean
± a 95% confidence interval. Each optimizer's best setting is the one with the lowest mean among those where no seed
diverged or failed; it is compared with the baseline's best (difference with a paired or Welch's interval and a
verdict, the verdicts one family under Holm's correction; speedup at matched loss; across three or more budgets a
power-law fit). docs/optimizer-study.md says how each number is
computed.

The study itself is the package ``torchtitan.study`` (``study.sweep`` joins its modules); this module only reads the
command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import exit_code
from torchtitan.study.ladder import add_ladder_options, check_no_ladder_options, is_ladder, ladder_flavors, run_ladder
from torchtitan.study.slurm import SlurmRefused, add_scheduler_options
from torchtitan.study.summary import DEFAULT_BASELINE, FAMILY_CORRECTIONS, HOLM
from torchtitan.study.sweep import run_sweep

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "./train_configs/debug_model.toml"
SEARCHES = ("grid", "coordinate")


# ----------------------------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan.tools.sweep",
        description="Train every optimizer x lr x seed with one config, then compare each optimizer at its best lr. "
        "Options after '--' go to every train.py run.",
    )
    p.add_argument("--dump-folder", required=True, help="the sweep's folder: runs/, sweep.png, sweep.md, sweep.json")
    p.add_argument(
        "--optimizers",
        default="AdamW AdamMini",
        help="optimizer names, space- or comma-separated (default: AdamW AdamMini)",
    )
    p.add_argument(
        "--lrs",
        default="3e-4 1e-3 3e-3",
        help="peak learning rates, space- or comma-separated (default: 3e-4 1e-3 3e-3)",
    )
    p.add_argument("--seeds", default="0", help="training.seed values, space- or comma-separated (default 0)")
    p.add_argument(
        "--vary-data-seed",
        action="store_true",
        help="give each run its seed as training.data_seed too, so that seeds vary the data order as well as the "
        "initial weights (for data that has a seed)",
    )
    p.add_argument(
        "--axis",
        action="append",
        default=[],
        metavar="[OPTIMIZER:]SECTION.KEY=V1,V2",
        help="sweep a train.py option over these values, for every optimizer or for one (AdamW:optimizer.beta2="
        "0.95,0.99); repeat for more axes; every combination is a cell, named by each value",
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="token budgets, each its own run with its own training.steps and schedule: tokens (2e8,4e8) or "
        "multiples of 20 tokens per non-embedding parameter of the model (1x,2x); default: the job's training.steps",
    )
    p.add_argument(
        "--warmup-fraction",
        type=float,
        default=None,
        help="with --budgets: each budget warms up this share of its steps (default: the job's training.warmup_steps "
        "/ training.steps)",
    )
    p.add_argument(
        "--search",
        choices=SEARCHES,
        default="grid",
        help="grid: train every combination of the swept settings; coordinate: coordinate descent from a start "
        "point per optimizer, one setting at a time, to a point no single step improves (default grid)",
    )
    p.add_argument(
        "--start",
        action="append",
        default=[],
        metavar="[OPTIMIZER:]SECTION.KEY=VALUE",
        help="with --search coordinate: where the descent starts on a swept setting (optimizer.lr or an --axis "
        "option), for every optimizer or for one; default: the middle of its values",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes per run (NGPU of run_llama_train.sh; default: the GPUs present / --parallel, else 1)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="runs at once, each on GPUs of its own (CUDA_VISIBLE_DEVICES; --parallel x --nproc at most the GPUs "
        "present), or as K processes on a machine without GPUs (default 1)",
    )
    p.add_argument("--config-file", default=DEFAULT_CONFIG, help=f"job config of every run (default {DEFAULT_CONFIG})")
    p.add_argument(
        "--last-k",
        type=int,
        default=None,
        help="final training loss = mean of the last k logged values (default: the sweep's recorded k, else 10)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help=f"the optimizer every other is compared with: difference, verdict, speedup (default {DEFAULT_BASELINE})",
    )
    p.add_argument("--report-only", action="store_true", help="write the report from the runs there, train nothing")
    p.add_argument(
        "--launcher",
        default=str(REPO_ROOT / "run_llama_train.sh"),
        help="command that trains one run, given NGPU and CONFIG_FILE in its environment and the train.py "
        "options as arguments (default: the repository's run_llama_train.sh)",
    )
    add_verdict_options(p)
    add_scheduler_options(p)
    add_ladder_options(p)
    return p


def add_verdict_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--confirm-seeds",
        default=None,
        help="once the search on --seeds is done, train each optimizer's best settings again on these seeds (space- "
        "or comma-separated, none of --seeds nor of any earlier selection run in the folder); the verdict then uses "
        "only these runs, on fresh validation windows where the held-out tokens data has room",
    )
    p.add_argument(
        "--family-correction",
        choices=FAMILY_CORRECTIONS,
        default=HOLM,
        help="the verdicts (every optimizer against the baseline at every budget) are one family: Holm: a verdict "
        "reads better / worse only where its Holm-adjusted p is below 0.05, holding the chance of any false one at "
        "5%%; unadjusted: each at 95%% on its own (default Holm; the intervals shown are unadjusted either way)",
    )
    p.add_argument(
        "--selection-seeds-max",
        type=int,
        default=None,
        metavar="K",
        help="where an optimizer's choice of settings is a close call (its margin to the runner-up within two "
        "standard errors), train the two contenders on more selection seeds, up to K each, before confirming "
        "(never on confirmation seeds); K above the number of --seeds; a grid only",
    )
    p.add_argument(
        "--extend",
        type=int,
        default=0,
        metavar="N",
        help="with --search coordinate: where a descent stops at an end of its grid, try the next value past it (by "
        "the grid's ratio, or its step), up to N values per optimizer, until the optimum is inside (default 0)",
    )


def sweep(argv: Sequence[str]) -> int:
    argv = list(argv)
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = _parser().parse_args(argv[: len(argv) - len(train_args) - (1 if "--" in argv else 0)])
    try:
        flavors = ladder_flavors(args)
        if flavors or is_ladder(Path(args.dump_folder).resolve()):
            return run_ladder(args, train_args, run_sweep, flavors)
        check_no_ladder_options(args)
        return run_sweep(args, train_args)
    except SlurmRefused as e:  # not a mistake in the options, and not "later": exit 1
        print(f"error: {e}", file=sys.stderr)
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    return exit_code(
        lambda: sweep(sys.argv[1:] if argv is None else argv),
        interrupted="sweep interrupted; run the same command again to resume it",
    )


if __name__ == "__main__":
    sys.exit(main())
