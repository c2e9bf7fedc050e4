"""Select, then confirm: once the search on the selection seeds is done, each optimizer's best settings train again
on confirmation seeds, and the verdict reads only those runs (``summary.summarize_sweep``'s ``confirm_seeds``).

Choosing the best of many settings on the same seeds that then test it favours the optimizer that tried more
settings (the best of eight noisy cells is lower than one cell by luck alone); fresh seeds remove that luck.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError
from torchtitan.study.plan import RunSpec, parse_seeds
from torchtitan.study.run_folders import load_sweep_runs
from torchtitan.study.search import read_search
from torchtitan.study.summary import DEFAULT_BASELINE, cell_runs, summarize_sweep


def parse_confirm_seeds(raw: Optional[str], seeds: Sequence[int], recorded: Sequence[int] = ()) -> list[int]:
    """The confirmation seeds of ``--confirm-seeds``; when not given, those the dump folder's earlier calls recorded
    (a call that leaves the flag out must not turn a confirmed study back into one judged on its selection seeds).
    They must differ from the selection's."""
    if raw is None:
        confirm = list(recorded)
    else:
        confirm = parse_seeds(raw)
        if not confirm:
            raise UserError("--confirm-seeds is empty; give seeds other than --seeds, like '3,4,5', or leave it out")
    shared = sorted(set(confirm) & set(seeds))
    if shared:
        given = "--confirm-seeds" if raw is not None else "the confirmation seeds this study recorded"
        raise UserError(
            f"{given} {', '.join(map(str, shared))} also in --seeds: confirmation needs seeds the search did not "
            "choose on; give other seeds"
        )
    return confirm


def confirmation_specs(dump: Path, last_k: int, confirm_seeds: Sequence[int]) -> list[RunSpec]:
    """The runs of each optimizer's best settings (at every budget) on the confirmation seeds, as chosen by the
    selection runs in ``dump``."""
    runs = load_sweep_runs(dump)
    if not runs or not confirm_seeds:
        return []
    by_name = {r.spec.name: r for r in runs}
    axes = (read_search(dump) or {}).get("axes")  # the cells the report ranks, so both choose the same settings
    report = summarize_sweep(runs, last_k, DEFAULT_BASELINE, confirm_seeds, axes)
    specs = []
    for entry in report["best_by_budget"]:
        for optimizer, b in entry["best"].items():
            chosen = cell_runs(report["runs"], optimizer, entry["budget"], b["settings"])
            selection = [r for r in chosen if r["seed"] not in confirm_seeds]
            if not selection:
                continue  # every setting diverged or failed: nothing to confirm
            spec = by_name[selection[0]["name"]].spec
            specs += [dataclasses.replace(spec, seed=seed) for seed in confirm_seeds]
    return specs
