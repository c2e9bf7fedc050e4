"""Select, then confirm: once the search on the selection seeds is done, each optimizer's best settings train again
on confirmation seeds, and the verdict reads only those runs (``summary.summarize_sweep``'s ``confirm_seeds``).

Choosing the best of many settings on the same seeds that then test it favours the optimizer that tried more
settings (the best of eight noisy cells is lower than one cell by luck alone); fresh seeds remove that luck.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError
from torchtitan.study.plan import RUNS_FOLDER, RunSpec, parse_seeds
from torchtitan.study.run_folders import load_sweep_runs, read_status
from torchtitan.study.search import read_search
from torchtitan.study.summary import DEFAULT_BASELINE, cell_runs, summarize_sweep


def _seeds_text(seeds) -> str:
    return ", ".join(map(str, sorted(seeds)))


_SEED_IN_NAME = re.compile(r"_seed(\d+)(?:_|$)")


def earlier_selection_seeds(dump: Path, recorded: Sequence[int]) -> dict[int, str]:
    """Each seed that a selection run already in ``dump`` trained on (any run, ended or not, whose seed is not one of
    the study's recorded confirmation seeds), with one such run's name."""
    used: dict[int, str] = {}
    folder = dump / RUNS_FOLDER
    for run_dir in sorted(folder.iterdir()) if folder.is_dir() else ():
        status = read_status(run_dir)
        if status is not None:
            seed = int(status["seed"])
        else:  # started, not ended (or interrupted): its folder's name carries its seed
            match = _SEED_IN_NAME.search(run_dir.name)
            if match is None:
                continue
            seed = int(match.group(1))
        if seed not in recorded:
            used.setdefault(seed, run_dir.name)
    return used


def parse_confirm_seeds(
    raw: Optional[str], seeds: Sequence[int], recorded: Sequence[int] = (), earlier: Optional[dict[int, str]] = None
) -> list[int]:
    """The confirmation seeds of ``--confirm-seeds``; when not given, those the dump folder's earlier calls recorded
    (a call that leaves the flag out must not turn a confirmed study back into one judged on its selection seeds).

    They must differ from this call's selection seeds and from every seed an earlier selection run of the folder
    trained on (``earlier``, :func:`earlier_selection_seeds`): a seed that helped choose a setting cannot test it.
    They must keep the recorded ones (the runs already confirmed on them would otherwise rank as selection runs)."""
    if raw is None:
        confirm = list(recorded)
    else:
        confirm = parse_seeds(raw)
        if not confirm:
            raise UserError("--confirm-seeds is empty; give seeds other than --seeds, like '3,4,5', or leave it out")
    given = "--confirm-seeds" if raw is not None else "the confirmation seeds this study recorded"
    shared = sorted(set(confirm) & set(seeds))
    if shared:
        raise UserError(
            f"{given} {_seeds_text(shared)} also in --seeds: confirmation needs seeds the search did not "
            "choose on; give other seeds"
        )
    earlier = earlier or {}
    chosen_on = sorted(set(confirm) & set(earlier))
    if chosen_on:
        raise UserError(
            f"{given} {_seeds_text(chosen_on)}: earlier selection runs in this folder trained on "
            f"{'them' if len(chosen_on) > 1 else 'it'} ({', '.join(earlier[s] for s in chosen_on)}), so they helped "
            f"choose the settings; confirm on seeds no run here used, like {_fresh(earlier, confirm, seeds)}"
        )
    dropped = sorted(set(recorded) - set(confirm))
    if dropped:
        raise UserError(
            f"--confirm-seeds leaves out {_seeds_text(dropped)}, which this study's confirmation runs used (they "
            f"would rank as selection runs); give them too: --confirm-seeds {_seeds_text(set(confirm) | set(dropped))}"
        )
    return confirm


def _fresh(earlier: dict[int, str], confirm: Sequence[int], seeds: Sequence[int]) -> str:
    """As many seeds as ``confirm`` that neither selection used, for the refusal's example."""
    taken = set(earlier) | set(seeds) | set(confirm)
    start = max(taken) + 1
    return "'" + ",".join(str(start + i) for i in range(len(confirm))) + "'"


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
