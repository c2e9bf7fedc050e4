"""Select, then confirm: once the search on the selection seeds is done, each optimizer's best settings train again
on confirmation seeds, and the verdict reads only those runs (``summary.summarize_sweep``'s ``confirm_seeds``).

Choosing the best of many settings on the same seeds that then test it favours the optimizer that tried more
settings (the best of eight noisy cells is lower than one cell by luck alone); fresh seeds remove that luck.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.errors import UserError
from torchtitan.files import strict_json, write_text_atomically
from torchtitan.study.plan import RUNS_FOLDER, RunSpec, parse_seeds, resolved_job
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


CONFIRMATION_FILE = "confirmation.json"  # which validation windows the confirmation runs score, and why


def _held_out_windows(config_file: str, train_args: Sequence[str]):
    """(the selection's first window, validation.windows, validation windows the held-out tokens data holds), or a
    reason why confirmation cannot score other windows."""
    from torchtitan.datasets.tokens import open_validation_windows
    from torchtitan.training.validate import validation_data

    config = resolved_job(config_file, train_args)
    t, v = config.training, config.validation
    if not v.enable:
        return "validation is off (the study ranks by training loss)"
    name, path, split = validation_data(config)
    if name != "tokens":
        return f"{name} validation data scores its first validation.steps batches, not numbered windows"
    _, held, pieces = open_validation_windows(path, t.seq_len, v.seq_len or t.seq_len, split.every, v.windows)
    return v.first_window, v.windows, held.count * pieces


def fresh_validation_windows(
    config_file: str, train_args: Sequence[str], confirm_seeds: Sequence[int], recorded: Optional[dict] = None
) -> dict:
    """The validation windows a study's confirmation runs score, past the ``validation.windows`` the selection
    scores (from its ``validation.first_window``): where the held-out tokens data has room, each confirmation seed
    its own range (``{"per_seed": {seed: first window}, ...}``: a setting's luck on any one set of windows then
    varies from seed to seed, and the interval counts it); with room for one more range only, one range for every
    confirmation seed (``{"first_window": ...}``); else ``{"reason"}``, why they score the selection's own
    (validation off, text data, too few windows). On the windows that chose a setting its luck there follows it
    into the verdict. ``recorded`` per-seed ranges are kept, and seeds added since get the next ones."""
    held = _held_out_windows(config_file, train_args)
    if isinstance(held, str):
        return {"reason": held}
    selection, count, total = held
    start = selection + count
    chosen = {"windows": count, "selection_first_window": selection}
    per_seed = dict((recorded or {}).get("per_seed") or {})
    following = max(per_seed.values(), default=start - count) + count
    for seed in sorted(confirm_seeds):
        if str(seed) not in per_seed:
            per_seed[str(seed)], following = following, following + count
    if following <= total:
        return {**chosen, "per_seed": per_seed}
    if recorded is not None:  # per-seed ranges recorded, no room for the seeds added since
        added = sorted(set(map(str, confirm_seeds)) - set(recorded["per_seed"]))
        raise UserError(
            f"the held-out data holds {total} validation windows, no room for a range of {count} of its own for "
            f"confirmation seed {', '.join(added)}; confirm on the seeds already run, or give more held-out data"
        )
    if start + count <= total:
        return {**chosen, "first_window": start}
    return {
        "reason": f"the held-out data holds {total} validation windows, fewer than {start + count} (two ranges of "
        f"validation.windows {count})"
    }


def confirmation_windows(
    dump: Path, recorded: Sequence[int], confirm_seeds: Sequence[int], config_file: str, train_args: Sequence[str]
) -> dict:
    """The windows this study's confirmation runs score (:func:`fresh_validation_windows`), keeping those recorded
    by an earlier call; the selection's where confirmation runs trained before windows were recorded (every
    confirmation run of a study scores alike, so that its differences stay paired)."""
    windows = read_confirmation_windows(dump)
    if windows is None and set(recorded) and any(seed in recorded for seed in _run_seeds(dump)):
        return {
            "reason": "this study's first confirmation runs scored the selection's windows (they trained before "
            "fresh windows per phase), and every confirmation run scores alike"
        }
    if windows is not None and "per_seed" not in windows:
        return windows
    return fresh_validation_windows(config_file, train_args, confirm_seeds, windows)


def _run_seeds(dump: Path) -> set[int]:
    folder = dump / RUNS_FOLDER
    names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    return {int(m.group(1)) for m in map(_SEED_IN_NAME.search, names) if m}


def write_confirmation_windows(dump: Path, windows: dict) -> None:
    write_text_atomically(dump / CONFIRMATION_FILE, strict_json(windows))


def read_confirmation_windows(dump: Path) -> Optional[dict]:
    path = dump / CONFIRMATION_FILE
    return json.loads(path.read_text()) if path.exists() else None


def windows_options(windows: Optional[dict], seed: int) -> tuple[tuple[str, str], ...]:
    """The train.py option that moves a confirmation seed's validation to its fresh windows (none without room, or
    for a seed added after the ranges were recorded: it scores the shared range, or the selection's)."""
    first = ((windows or {}).get("per_seed") or {}).get(str(seed), (windows or {}).get("first_window"))
    return () if first is None else (("validation.first_window", str(first)),)


def selection_seed_order(seeds: Sequence[int], confirm_seeds: Sequence[int]) -> list[int]:
    """The selection seeds a close call may add, in the order it adds them: the sweep's ``--seeds``, then the
    smallest whole numbers that are neither those nor confirmation seeds (the same for every contender, so that
    their runs pair seed by seed; no confirmation seed ever chooses)."""
    taken = set(seeds) | set(confirm_seeds)
    return [*sorted(seeds), *(n for n in range(len(taken) + 10_000) if n not in taken)]


def close_call_specs(
    dump: Path, last_k: int, seeds: Sequence[int], confirm_seeds: Sequence[int], seeds_max: int
) -> list[RunSpec]:
    """The runs that firm up each close call among the best settings in ``dump`` (``selection.LineChoice.close``):
    the chosen value and its runner-up along that setting, each on the first ``seeds_max`` seeds of
    :func:`selection_seed_order` it has not run yet. Empty when no choice is a close call, or its contenders have
    ``seeds_max`` seeds already."""
    runs = load_sweep_runs(dump)
    if not runs:
        return []
    by_name = {r.spec.name: r for r in runs}
    axes = (read_search(dump) or {}).get("axes")
    report = summarize_sweep(runs, last_k, DEFAULT_BASELINE, confirm_seeds, axes)
    selection = [r for r in report["runs"] if r["seed"] not in set(confirm_seeds)]
    wanted = selection_seed_order(seeds, confirm_seeds)[:seeds_max]
    specs: list[RunSpec] = []
    for entry in report["best_by_budget"]:
        for optimizer, b in entry["best"].items():
            choice = b.get("choice") or {"lines": []}
            for line in (line for line in choice["lines"] if line["close"]):
                for value in (line["chosen"], line["runner_up"]):
                    settings = {**choice["settings"], line["setting"]: value}
                    cell = cell_runs(selection, optimizer, entry["budget"], settings)
                    if not cell:  # a line of an earlier pass, through other settings than the chosen ones
                        continue
                    spec = by_name[cell[0]["name"]].spec
                    have = {r["seed"] for r in cell}
                    specs += [
                        dataclasses.replace(spec, seed=seed)
                        for seed in wanted
                        if seed not in have and dataclasses.replace(spec, seed=seed) not in specs
                    ]
    return specs


def confirmation_specs(
    dump: Path, last_k: int, confirm_seeds: Sequence[int], windows: Optional[dict] = None
) -> list[RunSpec]:
    """The runs of each optimizer's best settings (at every budget) on the confirmation seeds, as chosen by the
    selection runs in ``dump``, each scoring its seed's validation ``windows`` (:func:`fresh_validation_windows`)."""
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
            specs += [
                dataclasses.replace(spec, seed=seed, extra_options=windows_options(windows, seed))
                for seed in confirm_seeds
            ]
    return specs
