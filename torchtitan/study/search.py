"""Coordinate descent over a sweep's grid: from a start point per optimizer, one setting at a time, to a point that no
single step along any setting improves.

The descent is a pure function of the scores of the points it asks for (:func:`descend`): it asks for a point's
score, and stops with the points it still needs when one is unknown. Running it again over the scores of more
finished runs goes further along the same path, so that the sweep resumes a descent by replaying it over its run
folders, and the report draws the path from the run folders alone (``search.json`` records the grid and the start).

The score of a point is the mean over its seeds of the loss the report ranks by; a point where a seed diverged
scores infinity (worse than any finished point), one where a seed failed blocks the descent until it is trained
again.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from torchtitan.errors import UserError
from torchtitan.files import strict_json, write_text_atomically
from torchtitan.study import selection
from torchtitan.study.plan import (
    FAILED,
    FINISHED,
    Axis,
    Budget,
    RunSpec,
    axes_for,
    axis_value,
    items,
    lr_label,
    lrs_of,
    run_folder,
)
from torchtitan.study.run_folders import SweepRun, load_sweep_run, read_status, status_paths, sweep_order
from torchtitan.study.scheduling import Runner, is_done
from torchtitan.study.summary import cell_runs, summarize_sweep

SEARCH_FILE = "search.json"  # the last search of a dump folder: its method and, for a descent, the grid and start
LR = "lr"  # the coordinate of the sweep's --lrs


class Blocked:
    """The score of a point where a run failed: the descent cannot tell whether it is better."""

    def __repr__(self) -> str:
        return "BLOCKED"


BLOCKED = Blocked()
Score = Union[float, None, Blocked]  # a loss (inf: diverged), None: not known yet, BLOCKED: a run failed


@dataclass(frozen=True)
class Coordinate:
    """One setting the descent moves along: ``lr`` or a train.py option, its values in grid order (numbers
    ascending) as given on the command line."""

    key: str
    values: tuple[str, ...]

    def value(self, index: int):
        return float(self.values[index]) if self.key == LR else axis_value(self.values[index])


@dataclass(frozen=True)
class Space:
    """One optimizer's grid (coordinates, lr first) and where its descent starts (an index per coordinate)."""

    coordinates: tuple[Coordinate, ...]
    start: tuple[int, ...]

    def settings(self, point: Sequence[int]) -> dict:
        """A point as the report keys its cells: ``{"lr": 0.001, "optimizer.weight_decay": 0.1}``."""
        return {c.key: c.value(i) for c, i in zip(self.coordinates, point)}

    def options(self, point: Sequence[int]) -> tuple[tuple[str, str], ...]:
        """A point's swept train.py options other than the lr, as a run spec holds them (by option)."""
        return tuple(sorted((c.key, c.values[i]) for c, i in zip(self.coordinates, point) if c.key != LR))

    def lr(self, point: Sequence[int]) -> float:
        return next(float(c.values[i]) for c, i in zip(self.coordinates, point) if c.key == LR)

    def to_json(self) -> dict:
        return {
            "coordinates": [{"key": c.key, "values": list(c.values)} for c in self.coordinates],
            "start": {c.key: c.values[i] for c, i in zip(self.coordinates, self.start)},
        }

    @classmethod
    def from_json(cls, data: dict) -> "Space":
        coordinates = tuple(Coordinate(c["key"], tuple(c["values"])) for c in data["coordinates"])
        return cls(coordinates, tuple(c.values.index(data["start"][c.key]) for c in coordinates))


# ----------------------------------------------------------------------------------------------------------------
# The descent


@dataclass
class Descent:
    """Where a descent got to: the path so far (its start, then one entry per step along a coordinate), the points
    it needs scored to go on, and its state: ``converged``, ``running`` (points needed) or ``blocked``."""

    path: list[dict]
    needed: list[tuple[int, ...]]
    state: str
    current: tuple[int, ...]
    score: Score


def descend(space: Space, score: Callable[[tuple[int, ...]], Score]) -> Descent:
    """Coordinate descent from ``space.start``: along each coordinate in turn, score the neighbours of the current
    point (the next value on each side) and move to the value the study's rule chooses among the values scored
    along that coordinate in this pass (:func:`selection.choose_along`: for numbers the grid value nearest the
    optimum of a quadratic fitted near the lowest, for words the lowest); keep going while the value moved to has a
    neighbour not scored yet; stop when every coordinate has been tried since the last move (or the descent comes
    back to a point and coordinate it passed from before)."""
    current = space.start
    current_score = score(current)
    path = [{"step": "start", "point": current, "score": current_score}]
    if current_score is None:
        return Descent(path, [current], "running", current, None)
    if current_score is BLOCKED:
        return Descent(path, [], "blocked", current, current_score)
    count, coordinate, unchanged = len(space.coordinates), 0, 0
    passed: set[tuple] = set()
    while unchanged < count and (current, coordinate) not in passed:
        passed.add((current, coordinate))
        size = len(space.coordinates[coordinate].values)
        line = {current[coordinate]: current_score}  # index along the coordinate: score, scored in this pass
        moved = False
        while True:
            tried = [_along(current, coordinate, d) for d in (-1, 1)]
            tried = [p for p in tried if 0 <= p[coordinate] < size and p[coordinate] not in line]
            if not tried:
                break
            scores = [score(p) for p in tried]
            unknown = [p for p, s in zip(tried, scores) if s is None]
            if unknown:
                return Descent(path, unknown, "running", current, current_score)
            step = {"step": "try", "coordinate": coordinate, "from": current, "tried": list(zip(tried, scores))}
            path.append(step)
            if any(s is BLOCKED for s in scores):
                return Descent(path, [], "blocked", current, current_score)
            line.update({p[coordinate]: s for p, s in zip(tried, scores)})
            to = _line_choice(space.coordinates[coordinate], line, current[coordinate])
            if to == current[coordinate]:
                step["moved"] = False
                break
            current = _at(current, coordinate, to)
            step["moved"], step["to"] = True, current
            current_score, moved = line[to], True
        unchanged = 1 if moved else unchanged + 1
        coordinate = (coordinate + 1) % count
    return Descent(path, [], "converged", current, current_score)


def _line_choice(c: Coordinate, line: dict[int, Score], here: int) -> int:
    """The index along ``c`` that :func:`selection.choose_along` picks among the scored ones in ``line`` (a mean
    over the descent's seeds each: every point has the same seeds, so its fit is that of the pooled runs);
    ``here`` where none finished."""
    indices = sorted(line)
    values = [c.value(i) for i in indices]
    losses = [{0: line[i]} if isinstance(line[i], float) and math.isfinite(line[i]) else None for i in indices]
    numeric = all(selection.is_number(c.value(i)) for i in range(len(c.values)))
    choice = selection.choose_along(values, losses, numeric, indices.index(here), selection.scale_of(c.key))
    return here if choice.index is None else indices[choice.index]


def _at(point: tuple[int, ...], coordinate: int, index: int) -> tuple[int, ...]:
    return tuple(index if c == coordinate else i for c, i in enumerate(point))


def _along(point: tuple[int, ...], coordinate: int, direction: int) -> tuple[int, ...]:
    return tuple(i + direction if c == coordinate else i for c, i in enumerate(point))


# ----------------------------------------------------------------------------------------------------------------
# From the command line: the grid and the start of each optimizer


def parse_starts(raw: Sequence[str]) -> list[tuple[Optional[str], str, str]]:
    """``--start [OPTIMIZER:]KEY=VALUE`` as (optimizer or None, key, value)."""
    starts = []
    for entry in raw:
        head, equals, value = entry.partition("=")
        scope, _, key = head.rpartition(":")
        if not equals or "." not in key or not value or len(items(value)) != 1:
            raise UserError(
                f"--start '{entry}' is not a start point; give one value of a swept setting, like "
                "'optimizer.lr=1e-3' or 'AdamW:optimizer.weight_decay=0.1'"
            )
        starts.append((scope or None, key, value))
    return starts


def _grid_order(values: Sequence[str], numeric: Callable[[str], object]) -> tuple[str, ...]:
    parsed = [numeric(v) for v in values]
    if all(isinstance(p, (int, float)) for p in parsed):
        return tuple(v for _, v in sorted(zip(parsed, values), key=lambda pv: pv[0]))
    return tuple(values)  # words: in the order given


def search_spaces(
    optimizers: Sequence[str],
    lrs,
    axes: Sequence[Axis],
    starts: Sequence[tuple[Optional[str], str, str]],
) -> dict[str, Space]:
    """Each optimizer's grid (the lrs, then its axes by option; numbers in ascending order) and start point: the
    ``--start`` value of a setting where given, else the middle of its values (the lower middle of an even count).
    ``axes`` and ``optimizers`` are resolved names (``sweep_plan.plan`` checked them)."""
    from torchtitan.optim.builder import resolve_optimizer_name

    resolved = [(resolve_optimizer_name(o).name if o else None, k, v) for o, k, v in starts]
    for optimizer, key, _ in resolved:
        if optimizer is not None and optimizer not in optimizers:
            raise UserError(f"--start {optimizer}:{key}: {optimizer} is not in --optimizers; add it or drop the start")
    spaces = {}
    for optimizer in optimizers:
        coordinates = [Coordinate(LR, _grid_order([lr_label(lr) for lr in lrs_of(lrs, optimizer)], float))]
        coordinates += [Coordinate(a.key, _grid_order(a.values, axis_value)) for a in axes_for(optimizer, axes)]
        start = [(len(c.values) - 1) // 2 for c in coordinates]
        keys = {("optimizer.lr" if c.key == LR else c.key): n for n, c in enumerate(coordinates)}
        mine = [(o, k, v) for o, k, v in resolved if o in (None, optimizer)]
        for scope, key, value in mine:
            if key not in keys:
                raise UserError(
                    f"--start {key} is not a swept setting of {optimizer}'s runs; start from a value of --lrs "
                    "(optimizer.lr) or of an --axis"
                )
            if scope is None and any(o == optimizer and k == key for o, k, _ in mine):
                continue  # the optimizer's own start wins over the global one
            c = coordinates[keys[key]]
            parse = float if c.key == LR else axis_value
            index = next((n for n, v in enumerate(c.values) if parse(v) == parse(value)), None)
            if index is None:
                raise UserError(
                    f"--start {key}={value} is not one of its values ({', '.join(c.values)}); start from one of them"
                )
            start[keys[key]] = index
        spaces[optimizer] = Space(tuple(coordinates), tuple(start))
    return spaces


def write_search(
    dump: Path,
    method: str,
    spaces: dict[str, Space],
    seeds: Sequence[int],
    budgets,
    confirm_seeds: Sequence[int] = (),
    axes: Optional[dict] = None,
) -> None:
    """``search.json``: the last search of the dump folder, which the report draws, its confirmation seeds and each
    optimizer's current axes (the report ranks only the cells of those; an optimizer this call does not sweep keeps
    the axes an earlier call recorded)."""
    data: dict = {"method": method}
    if axes is not None:
        data["axes"] = {**((read_search(dump) or {}).get("axes") or {}), **axes}
    if confirm_seeds:
        data["confirm_seeds"] = list(confirm_seeds)
    if method == "coordinate":
        data["seeds"] = list(seeds)
        data["budgets"] = [None if b is None else b.tokens for b in budgets]
        data["spaces"] = {o: s.to_json() for o, s in spaces.items()}
    write_text_atomically(dump / SEARCH_FILE, strict_json(data))


def read_search(dump: Path) -> Optional[dict]:
    path = dump / SEARCH_FILE
    return json.loads(path.read_text()) if path.exists() else None


# ----------------------------------------------------------------------------------------------------------------
# Scores from a sweep's runs


def point_score(
    summaries: Sequence[dict], optimizer: str, budget: Optional[int], settings: dict, seeds: Sequence[int]
) -> Score:
    """The mean over ``seeds`` of the ranked loss of the point's runs (``summary.summarize_sweep``'s run
    summaries); inf where a seed diverged; BLOCKED where one failed; None while a seed has not ended."""
    by_seed = {r["seed"]: r for r in cell_runs(summaries, optimizer, budget, settings)}
    if any(seed not in by_seed for seed in seeds):
        return None
    runs = [by_seed[seed] for seed in seeds]
    if any(r["outcome"] == FAILED for r in runs):
        return BLOCKED
    losses = [r["rank_loss"] for r in runs]
    if any(r["outcome"] != FINISHED or loss is None for r, loss in zip(runs, losses)):
        return math.inf
    return sum(losses) / len(losses)


Retry = Callable[[str, Optional[int], Space, tuple], bool]


def descents(search: dict, summaries: Sequence[dict], retry: Retry) -> list:
    """(optimizer, budget, space, descent) of every descent ``search`` (``search.json``) holds, over the scores of
    ``summaries``; a failed point for which ``retry(optimizer, budget tokens, space, point)`` is true counts as not
    scored yet."""
    found = []
    for optimizer, data in search["spaces"].items():
        space = Space.from_json(data)
        for budget in search["budgets"]:

            def score(point, optimizer=optimizer, budget=budget, space=space):
                settings = space.settings(point)
                s = point_score(summaries, optimizer, budget, settings, search["seeds"])
                return None if s is BLOCKED and retry(optimizer, budget, space, point) else s

            found.append((optimizer, budget, space, descend(space, score)))
    return found


def descent_report(search: Optional[dict], summaries: Sequence[dict]) -> Optional[list[dict]]:
    """The report's account of each descent: its state, best point and every step, with settings and scores (inf
    for diverged, None for blocked or not yet run). None when the last search of the folder was not a descent."""
    if not search or search.get("method") != "coordinate":
        return None
    report = []
    for optimizer, budget, space, descent in descents(search, summaries, lambda *_: False):
        report.append(
            {
                "optimizer": optimizer,
                "budget": budget,
                "state": descent.state,
                "best": space.settings(descent.current),
                "best_loss": _number(descent.score),
                "points_scored": len(_scored(descent.path)),
                "grid_points": math.prod(len(c.values) for c in space.coordinates),
                "path": [_step(space, s) for s in descent.path],
            }
        )
    return report


def _number(score: Score) -> Optional[float]:
    return score if isinstance(score, float) else None


def _scored(path: Sequence[dict]) -> set:
    points = {path[0]["point"]} if path and path[0]["score"] is not None else set()
    for step in path[1:]:
        points |= {p for p, s in step["tried"] if s is not None}
    return points


def _step(space: Space, step: dict) -> dict:
    if step["step"] == "start":
        return {"step": "start", "settings": space.settings(step["point"]), "loss": _number(step["score"])}
    coordinate = space.coordinates[step["coordinate"]]
    return {
        "step": "try",
        "setting": coordinate.key,
        "from": coordinate.value(step["from"][step["coordinate"]]),
        "tried": [
            {"value": coordinate.value(p[step["coordinate"]]), "loss": _number(s), "failed": s is BLOCKED}
            for p, s in step["tried"]
        ],
        "moved": step.get("moved"),
        "to": coordinate.value(step["to"][step["coordinate"]]) if step.get("moved") else None,
    }


# ----------------------------------------------------------------------------------------------------------------
# Running a descent


# ----------------------------------------------------------------------------------------------------------------
# Past the grid's ends: --extend


def extended_value(c: Coordinate, end: int) -> Optional[str]:
    """The next value past one end of a numeric setting (``end`` -1: below its smallest, 1: above its largest), by
    the grid's own ratio at that end when every value is positive (3e-3 after 1e-3, 3e-4: x3), else by its step
    (0.5 after 0.1, 0.3: +0.2); whole numbers stay whole. None where there is none: fewer than two numeric values, a
    step that would cross or reach zero, or a whole number that would not change."""
    values = [c.value(i) for i in range(len(c.values))]
    if len(values) < 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    edge, inner = (values[0], values[1]) if end < 0 else (values[-1], values[-2])
    new = edge * (edge / inner) if all(v > 0 for v in values) else edge + (edge - inner)
    new = float(f"{new:.12g}")  # 1e-3, not 1e-4 * 9.999999999999998
    if all(isinstance(v, int) for v in values):
        new = int(round(new))
    if new == edge or edge * new <= 0 and not all(v > 0 for v in values):
        return None
    return str(new) if isinstance(new, int) else lr_label(new)


def extend_spaces(
    search: dict,
    found: Sequence,
    used: dict[str, int],
    limit: int,
    refused: Optional[set[tuple[str, str, str]]] = None,
    check: Optional[Callable[[str, Optional[int], Space, tuple], None]] = None,
) -> Optional[str]:
    """Grow one optimizer's grid by one value past the end where a converged descent of it stopped, while it has
    used fewer than ``limit`` extensions (``used`` counts them); ``search`` is updated in place. A line saying what
    grew, or None when no descent stops at an end it may pass.

    ``check(optimizer, tokens, space, point)`` (preflight) sees the job of the new value at the descent's point
    before the grid grows; a value it refuses is not added, and is kept in ``refused`` (optimizer, key, value) so that
    the descent stays at that end."""
    refused = set() if refused is None else refused
    for optimizer, tokens, space, descent in found:
        if descent.state != "converged" or used.get(optimizer, 0) >= limit:
            continue
        for n, c in enumerate(space.coordinates):
            index = descent.current[n]
            end = -1 if index == 0 else 1 if index == len(c.values) - 1 else 0
            new = extended_value(c, end) if end else None
            if new is None or (optimizer, c.key, new) in refused:
                continue
            values = (new, *c.values) if end < 0 else (*c.values, new)
            coordinates = (*space.coordinates[:n], Coordinate(c.key, values), *space.coordinates[n + 1 :])
            start = tuple(i + (1 if m == n and end < 0 else 0) for m, i in enumerate(space.start))
            grown = Space(coordinates, start)
            if check is not None:  # the new value at the descent's point
                point = tuple(
                    (0 if end < 0 else len(values) - 1) if m == n else i for m, i in enumerate(descent.current)
                )
                try:
                    check(optimizer, tokens, grown, point)
                except UserError as error:
                    refused.add((optimizer, c.key, new))
                    return f"{optimizer}: best {c.key} at the grid's end; not extended to {new}: {error}"
            search["spaces"][optimizer] = grown.to_json()
            used[optimizer] = used.get(optimizer, 0) + 1
            search.setdefault("extended", {})[optimizer] = used[optimizer]
            return f"{optimizer}: best {c.key} at the grid's end; extended to {new} ({used[optimizer]} of {limit})"
    return None


def specs_of(optimizer: str, budget: Optional[Budget], space: Space, point, seeds: Sequence[int]) -> list[RunSpec]:
    return [RunSpec(optimizer, space.lr(point), seed, budget, space.options(point)) for seed in seeds]


def _refresh(dump: Path, loaded: dict[Path, SweepRun]) -> list[SweepRun]:
    """The sweep's ended runs, reading the scalars of a run only when its status is new or changed."""
    for path in status_paths(dump):
        status = json.loads(path.read_text())
        if path not in loaded or loaded[path].status != status:
            loaded[path] = load_sweep_run(path)
    return sweep_order(list(loaded.values()))


def run_descents(
    runner: Runner,
    search: dict,
    budgets: Sequence[Optional[Budget]],
    last_k: int,
    extend: int = 0,
    check: Optional[Callable[[RunSpec], None]] = None,
) -> list:
    """Train what the descents of ``search`` need, as many runs at once as the runner has slots, until every descent
    converged or is blocked by a run that failed in this sweep (failed runs of earlier sweeps are tried again);
    returns the descents, as :func:`descents` does. With ``extend`` a descent that converged at an end of its grid
    goes on past it, one value at a time (:func:`extend_spaces`), up to ``extend`` values per optimizer; the grown
    grid is written back to ``search.json``. ``check`` (preflight) sees the job of each value added so before it
    trains; a value it refuses is not added."""
    seeds = search["seeds"]
    by_tokens = {None if b is None else b.tokens: b for b in budgets}
    attempted: set[str] = set()
    loaded: dict[Path, SweepRun] = {}

    def specs(optimizer: str, tokens: Optional[int], space: Space, point) -> list[RunSpec]:
        return specs_of(optimizer, by_tokens[tokens], space, point, seeds)

    def retry(optimizer: str, tokens: Optional[int], space: Space, point) -> bool:
        return not any(spec.name in attempted for spec in specs(optimizer, tokens, space, point))

    def check_new(optimizer: str, tokens: Optional[int], space: Space, point) -> None:
        if check is not None:
            check(specs(optimizer, tokens, space, point)[0])

    started, used, refused = 0, {}, set()
    with runner:
        while True:
            runs = _refresh(runner.dump, loaded)
            summaries = summarize_sweep(runs, last_k)["runs"] if runs else []
            found = descents(search, summaries, retry)
            wanted: list[RunSpec] = []
            for optimizer, tokens, space, descent in found:
                for point in descent.needed:
                    for spec in specs(optimizer, tokens, space, point):
                        if spec.name in attempted or spec in wanted:
                            continue  # running now, or failed in this sweep: the descent is blocked on it
                        if not is_done(read_status(run_folder(runner.dump, spec))):
                            wanted.append(spec)
            while wanted and runner.free():
                started += 1
                spec = wanted.pop(0)
                attempted.add(spec.name)
                runner.start(spec, f"[descent, run {started}]")
            if not runner.running and not wanted:
                grown = extend_spaces(search, found, used, extend, refused, check_new) if extend else None
                if grown is None:
                    return found
                print(grown, flush=True)
                write_text_atomically(runner.dump / SEARCH_FILE, strict_json(search))
                continue
            runner.wait()
