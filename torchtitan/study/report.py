"""The study's words and tables: the verdict table and the grid (sweep.md), and the one self-contained page
(study.html: the same tables, the figures embedded as base64 PNG, no network).

Text only, from the numbers ``summary.summarize_sweep`` computes; the figures are ``sweep_plot``'s.
"""

from __future__ import annotations

import base64
import html
import time
import urllib.parse
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.config.job_config import JOB_CONFIG_RECORD
from torchtitan.errors import UserError
from torchtitan.files import strict_json, write_text_atomically
from torchtitan.study.confirmation import read_confirmation_windows
from torchtitan.study.figures import (
    plot_budgets,
    plot_main,
    plot_selection,
    plot_sensitivity,
    plot_study_health,
    plot_sweep,
)
from torchtitan.study.plan import (
    COMMAND_FILE,
    DIVERGED,
    FAILED,
    FINISHED,
    LOG_FILE,
    RUNS_FOLDER,
    lr_label,
    tokens_label,
)
from torchtitan.study.run_folders import load_sweep_runs, read_status
from torchtitan.study.search import descent_report, read_search
from torchtitan.study.selection import CLOSE_CALL, NEIGHBOURS, choice_text
from torchtitan.study.summary import (
    CONFIRMATION_PENDING,
    DEFAULT_BASELINE,
    HOLM,
    TPS_WARMUP_LOGS,
    cell_runs,
    settings_label,
    settings_order,
    summarize_sweep,
)

REPORT_NAME = "sweep"  # sweep.png, sweep.md, sweep.json
PAGE_NAME = "study.html"  # the one self-contained page: tables and every figure
INTERIM_REPORT_SECONDS = 600.0  # while training, the report is rewritten at most this often

VERDICT_COLUMNS = (
    "optimizer",
    "best settings",
    "how sure the choice is",
    "loss (mean ± 95% CI)",
    "vs baseline: difference [95% CI], verdict",
    "speedup at matched loss [95% CI]",
    "optimizer state",
    "peak memory",
    "tokens/s per process",
)


def loss_text(mean: Optional[float], ci: Optional[float], n: int) -> str:
    if mean is None:
        return "n/a"
    if n < 2:
        return f"{mean:.4f} (1 seed)"
    return f"{mean:.4f} ± {ci:.4f} ({n} seeds)"


# A best cell's confirmation that gives no verdict (summary's ``confirmation``), in words.
CONFIRMATION_TEXT = {
    CONFIRMATION_PENDING: "not confirmed yet: its confirmation runs have not all ended",
    DIVERGED: "diverged on a confirmation seed: no verdict",
    FAILED: "a confirmation run failed: no verdict (the next call trains it again)",
}


def versus_text(optimizer: str, b: dict, report: dict) -> str:
    if optimizer == report["baseline"]:
        return "baseline"
    v = b.get("versus_baseline")
    if b.get("confirmation", FINISHED) != FINISHED:
        return CONFIRMATION_TEXT[b["confirmation"]]
    if b["loss_mean"] is None or not report["baseline_found"]:
        return "n/a"
    base = report["best"].get(report["baseline"])
    if base is None:
        return f"no verdict: {report['baseline']} has no run at this budget"
    if base.get("confirmation", FINISHED) != FINISHED:
        return f"no verdict: {report['baseline']} {CONFIRMATION_TEXT[base['confirmation']]}"
    if v is None:
        return b.get("no_verdict") or "no verdict"
    text = f"{v['difference']:+.4f}{difference_interval_text(v)}, {v['verdict']}"
    if v.get("p_holm") is not None:
        text += f" (Holm p = {_p_text(v['p_holm'])}, family of {report['family']['comparisons']})"
    return text + edge_text(b, report)


def difference_interval_text(v: dict) -> str:
    """The difference's interval and how it was matched; none where the seeds varied nothing."""
    method = v.get("method", "Welch")
    if v["low"] is None:
        return f" (no interval: no spread, {method})"
    level = "unadjusted 95%" if v.get("p_holm") is not None else "95%"
    left_out = v.get("seeds_left_out")
    if left_out:
        method += f" on the seeds both ran; seed {', '.join(map(str, left_out))} on one side only, left out"
    return f" [{v['low']:+.4f}, {v['high']:+.4f}] ({method}, {level})"


def _p_text(p: float) -> str:
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def edge_text(b: dict, report: dict) -> str:
    """ "; at the grid's edge: ..." when a best setting, the optimizer's or the baseline's, is at an end of its grid
    (the verdict may change with a wider grid), naming whose setting and which end."""
    baseline = report["baseline"]
    base = (report["best"].get(baseline, {}).get("edges") if report["baseline_found"] else None) or []
    parts = [f"its best {_edge_words(e)}" for e in b.get("edges") or []]
    parts += [f"{baseline}'s (the baseline's) best {_edge_words(e)}" for e in base]
    if not parts:
        return ""
    return f"; at the grid's edge: {'; '.join(parts)}: may change with a wider grid"


def _edge_words(edge: dict) -> str:
    return f"{edge['setting']} {_value_text(edge['setting'], edge['value'])} is the {edge['end']} tried"


def edges_label(b: dict) -> str:
    return "".join(
        f" (at the grid's edge: {_value_text(e['setting'], e['value'])} is the {e['end']} {e['setting']} tried)"
        for e in b.get("edges") or []
    )


SPEEDUP_MATCHING = {"paired on (training seed, data seed)": "paired", "itself": ""}


def level_text(level: float) -> str:
    return f"{100 * level:.3g}%"


def speedup_text(s: Optional[dict]) -> str:
    """A speedup with the level it holds at: an interval (two-sided), or a one-sided bound (the smallest or largest
    per-seed figure, at the level its number of independent seeds gives)."""
    if s is None:
        return "n/a"
    matched = SPEEDUP_MATCHING.get(s.get("matched"), "unpaired")
    if s.get("seeds_left_out"):
        matched += f"; seed {', '.join(map(str, s['seeds_left_out']))} on one side only, left out"
    how = f" ({matched})" if matched else ""
    if s["bound"] == "mixed":
        seeds = ", ".join(f"{_reach_bound(p['bound'])}{p['ratio']:.2f}×" for p in s["per_seed"])
        return f"n/a: seeds bound it both ways ({seeds}){how}"
    if s["bound"] is not None:
        end = "smallest" if s["bound"] == "≥" else "largest"
        level = f"one-sided {level_text(s['level'])}: " if s.get("level") is not None else ""
        return f"{s['bound']}{s['value']:.2f}× ({level}the {end} per-seed figure{', ' + matched if matched else ''})"
    if s["low"] is None:
        return f"{s['value']:.2f}×{how}"
    level = f"{level_text(s['level'])}, " if s.get("level") is not None else ""
    return (
        f"{s['value']:.2f}× [{s['low']:.2f}, {s['high']:.2f}] ({level}{matched})"
        if matched
        else (f"{s['value']:.2f}× [{s['low']:.2f}, {s['high']:.2f}]")
    )


def _reach_bound(bound: Optional[str]) -> str:
    return {">": "≥", "<": "≤"}.get(bound, "")


def verdict_rows(report: dict) -> list[list[str]]:
    rows = []
    for optimizer, b in report["best"].items():
        state = "n/a" if b["optimizer_state_bytes"] is None else f"{b['optimizer_state_bytes'] / 2**30:.3f} GiB"
        memory = "n/a" if b["peak_memory_gib"] is None else f"{b['peak_memory_gib']:.3f} GiB"
        tps = "n/a" if b["mean_tps"] is None else f"{b['mean_tps']:.1f}"
        settings = (
            "none (every setting diverged or failed)"
            if b["settings"] is None
            else f"{settings_label(b['settings'])}{edges_label(b)}"
        )
        rows.append(
            [
                optimizer,
                settings,
                choice_text(b.get("choice")),
                loss_text(b["loss_mean"], b["loss_ci"], len(b["seeds"])),
                versus_text(optimizer, b, report),
                speedup_text(b.get("speedup")),
                state,
                memory,
                tps,
            ]
        )
    return rows


def _cell_runs(cell: dict, runs: Sequence[dict]) -> list[dict]:
    return cell_runs(runs, cell["optimizer"], cell["budget"], cell["settings"])


def cell_text(cell: dict, runs: Sequence[dict]) -> str:
    if cell["outcome"] == FINISHED:
        return loss_text(cell["loss_mean"], cell["loss_ci"], len(cell["seeds"]))
    bad = [r for r in _cell_runs(cell, runs) if r["outcome"] == cell["outcome"]]
    count = f" {len(bad)}/{len(cell['seeds'])} seeds" if len(cell["seeds"]) > 1 else ""
    if cell["outcome"] == DIVERGED:
        steps = sorted(r["diverged_at_step"] for r in bad if r["diverged_at_step"] is not None)
        return f"diverged{count}" + (f" (step {steps[0]})" if steps else "")
    return f"failed{count} (exit {', '.join(str(r['exit_code']) for r in bad)})"


def _grid(report: dict) -> tuple[list[str], list[dict[str, dict]]]:
    """The grid at the verdict's budget: its column labels (every setting, in order) and, per optimizer row, its
    cells by label."""
    budget = report["budgets"][-1] if report["budgets"] else None
    cells = [c for c in report["grid"] if c["budget"] == budget]
    labels = list(
        dict.fromkeys(settings_label(c["settings"]) for c in sorted(cells, key=lambda c: settings_order(c["settings"])))
    )
    rows = [{settings_label(c["settings"]): c for c in cells if c["optimizer"] == o} for o in report["best"]]
    return labels, rows


def grid_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """Every cell at the verdict's budget: one row per optimizer, one column per setting; the best in bold."""
    labels, cells = _grid(report)
    rows = []
    for (optimizer, b), mine in zip(report["best"].items(), cells):
        best = settings_label(b["settings"]) if b["settings"] else None
        row = [optimizer]
        for label in labels:
            text = cell_text(mine[label], report["runs"]) if label in mine else "not run"
            row.append(f"**{text}**" if label == best else text)
        rows.append(row)
    return ["optimizer", *labels], rows


def grid_folders(report: dict) -> list[list[list[tuple[int, str]]]]:
    """(seed, run folder) of each cell of :func:`grid_rows`' rows, in the same places (none in the optimizer
    column)."""
    labels, cells = _grid(report)
    return [
        [
            [],
            *(
                sorted((r["seed"], r["folder"]) for r in _cell_runs(mine[label], report["runs"]))
                if label in mine
                else []
                for label in labels
            ),
        ]
        for mine in cells
    ]


def selection_note(report: dict) -> str:
    """Which seeds chose the best settings and which tested them, and how many settings each optimizer tried."""
    tried = ", ".join(f"{o} {b['settings_tried']}" for o, b in report["best"].items() if "settings_tried" in b)
    selection = ", ".join(map(str, report["selection_seeds"]))
    if report["confirmation_seeds"]:
        confirmation = ", ".join(map(str, report["confirmation_seeds"]))
        return (
            f"Best settings chosen on selection seeds {selection}; the verdict (loss, difference, speedup) uses only "
            f"their runs on confirmation seeds {confirmation}. Settings tried: {tried}.{windows_note(report)}"
            f"{curse_note(report)}"
        )
    return (
        f"Best settings chosen and tested on the same seeds ({selection}): the verdict favours the optimizer that "
        f"tried more settings (settings tried: {tried}); confirm on other seeds with --confirm-seeds."
    )


def curse_note(report: dict) -> str:
    """The winner's curse of each confirmed choice: its selection mean minus its confirmation mean."""
    curses = [(o, b["winners_curse"]) for o, b in report["best"].items() if b.get("winners_curse") is not None]
    if not curses:
        return ""
    return (
        " Winner's curse (the chosen setting's mean on the selection seeds minus on the confirmation seeds; below 0: "
        f"it looked better where it was chosen): {', '.join(f'{o} {c:+.4f}' for o, c in curses)}."
    )


def speedup_note(report: dict) -> str:
    """How the speedup at matched loss is read, matched and given an interval."""
    baseline, seeds = report["baseline"], report["seeds"]
    if report["by_validation"]:
        how = (
            f"the tokens {baseline}'s best runs need to reach the optimizer's last validation loss (linear between "
            f"{baseline}'s logged validation losses) / the tokens the optimizer used"
        )
    else:
        k = report["last_k"]
        how = (
            f"the factor s for which {baseline}'s logged training loss, read at the tokens of the optimizer's last {k} "
            f"logged steps each times s (linear between {baseline}'s logged points), averages to the optimizer's "
            f"final loss (the mean over those {k} steps): the window scales with the speedup, as a run s times as "
            "fast has over its last steps the loss the baseline has over s times their tokens (a window of fixed "
            "width read a made-up speedup of 0.5 as 0.65 at k = 10)"
        )
    text = (
        f"Speedup at matched loss = {how}. Where {baseline}'s curve ends before it gets there (a faster optimizer at "
        f"the same budget), it is read the other way: the optimizer's own curve at {baseline}'s final loss, the "
        f"speedup 1 / that factor, so the end of {baseline}'s curve caps no figure. ≥x: neither curve got to the "
        "other's loss (a lower bound); ≤x: it was there at its first point (an upper bound); a bound is the "
        "smallest (largest) per-seed figure, one-sided at 1 - 2^-n for n independent seeds (87.5% for 3, 96.9% "
        "for 5), its level printed beside it."
    )
    if seeds > 1:
        text += (
            f" Paired on the (training seed, data seed) pairs both ran (a seed only one side ran is left out and "
            "named): the geometric mean and t interval of the per-seed speedups; unpaired where they share fewer "
            f"than two: each seed against each of {baseline}'s, the geometric mean with Welch's interval from the "
            f"spread of the optimizer's seeds and of {baseline}'s (both vary the figure). The column says which; "
            f"{baseline}'s own row is 1.00× by definition."
        )
    return text


def family_notes(report: dict) -> list[str]:
    """How many comparisons the verdicts are, and how their words hold the family's level."""
    family = report.get("family") or {}
    m, baseline = family.get("comparisons", 0), report["baseline"]
    if m == 0:
        return []
    if family["correction"] == "Holm":
        return [
            f"The verdicts are one family of {m} comparison{'s' if m > 1 else ''} (each optimizer against {baseline} "
            "at each budget, wherever both have an interval): a verdict reads better / worse only where its "
            "Holm-adjusted p is below 0.05 (Holm's step-down correction), which keeps the chance of any false "
            f"better or worse among the {m} at 5% or less; the intervals shown are each at 95%, unadjusted, so one "
            "that excludes 0 may still read no detectable difference."
        ]
    return [
        f"The {m} verdicts (each optimizer against {baseline} at each budget) are each at 95%, unadjusted: among {m} "
        f"comparisons of equal optimizers the chance that some reads better or worse is up to "
        f"{100 * (1 - 0.95**m):.0f}%."
    ]


def windows_note(report: dict) -> str:
    """Which validation windows the confirmation runs scored: fresh ones, or the selection's and why."""
    windows = report.get("confirmation_windows")
    if not windows or not report["by_validation"]:
        return ""
    count, chosen = windows.get("windows"), windows.get("selection_first_window")
    selection = f"(selection: {chosen} to {chosen + count - 1 if count else chosen})"
    if "per_seed" in windows:
        ranges = ", ".join(f"seed {seed} {first} to {first + count - 1}" for seed, first in windows["per_seed"].items())
        return (
            f" Each confirmation seed scored validation windows of its own, which no selection run scored "
            f"({ranges}; {selection[1:]}: a setting's luck on any one set of windows varies from seed to seed, so the "
            "interval counts it, and does not follow it from the windows that chose it into the verdict."
        )
    if "first_window" in windows:
        first = windows["first_window"]
        return (
            f" Confirmation runs scored validation windows {first} to {first + count - 1}, which no selection run "
            f"scored {selection}: a setting's luck on the windows that chose it does not follow it into the verdict "
            "(one range for every seed: room for no more)."
        )
    return f" Confirmation runs scored the selection's validation windows: {windows['reason']}."


def notes(report: dict) -> list[str]:
    """The lines that say what the numbers are: ranking, baseline, intervals, seeds, data."""
    seeds, baseline = report["seeds"], report["baseline"]
    lines = [f"Study in progress: {report['in_progress']}"] if report.get("in_progress") else []
    ranked = f"Ranked by the {report['ranked_by']}, among the settings where no seed diverged or failed"
    if not _settings_chosen(report):
        lines.append(ranked + "; one setting per optimizer: nothing was chosen.")
    else:
        lines.append(
            ranked + "; best settings: along the lr, the value nearest the optimum of a quadratic in log lr fitted "
            f"over the lowest cell and up to {NEIGHBOURS} values each side (the nearest weighted most), pooled over "
            "the selection seeds (each seed an offset of its own); other numbers likewise in their value, words the "
            "lowest cell's. It falls back to the lowest cell, and says so, with fewer than three finished values near "
            "it or a fit that is not a bowl. How sure: the margin to the runner-up against its standard error (the "
            f"fit's residuals, or the seeds' spread); under {CLOSE_CALL:g} standard errors is a close call."
        )
    if seeds < 2:
        lines.append(
            "One seed per cell: no confidence intervals and no verdict (differences this small need seeds: run "
            "--seeds 0,1,2)."
        )
    else:
        lines.append(
            f"± is the 95% confidence interval of the mean over seeds (Student's t); the difference from "
            f"{baseline} is mean minus {baseline}'s mean with a 95% interval, paired (the t interval of per-seed "
            "differences) where both ran the same training and data seeds, else Welch's"
            + (
                "; its words follow the family's correction (next)."
                if (report.get("family") or {}).get("correction") == "Holm" and report["family"]["comparisons"]
                else ": better / worse where the whole interval is below / above 0, else no detectable difference."
            )
            + " Where a side's seeds varied nothing: no interval and no verdict."
        )
        lines += family_notes(report)
    # Which seeds chose and which tested: nothing to say with one seed, or with one setting each and no confirmation.
    if seeds >= 2 and (_settings_chosen(report) or report["confirmation_seeds"]):
        lines.append(selection_note(report))
    if not report["baseline_found"]:
        lines.append(f"The baseline {baseline} is not in this sweep: no differences or speedups.")
    lines.append(speedup_note(report))
    if report.get("older_runs"):
        lines.append(
            f"Not ranked: {len(report['older_runs'])} runs of earlier axes, which fit no setting of the current ones "
            f"({', '.join(report['older_runs'])}); they are listed with every run below."
        )
    lines.append(f"Seeds varied: {report['seeds_varied']}.")
    lines.append(
        f"Tokens/s per process: mean of each run's logged values after the first {TPS_WARMUP_LOGS} (those steps "
        "include torch.compile's compilation), over the optimizer's finished runs."
    )
    data = report["data"]
    if data["fingerprint"] is not None and not data["not_fingerprinted"]:
        lines.append(f"Data: every run read dataset fingerprint {data['fingerprint']}.")
    elif data["fingerprint"] is not None:
        n = len(data["not_fingerprinted"])
        lines.append(f"Data: fingerprint {data['fingerprint']}; {n} runs data not fingerprinted.")
    else:
        lines.append("Data: data not fingerprinted (no run wrote a dataset fingerprint).")
    fit = report["budget_fit"]
    if fit is not None and fit["fit"] is None:
        lines.append(f"Budget fit: {fit['error']}.")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Coordinate descent and the runs


def _value_text(key: str, value) -> str:
    return lr_label(value) if key == "lr" else str(value)


def _score_text(loss: Optional[float], failed: bool = False) -> str:
    if failed:
        return "failed"
    if loss is None:
        return "not run"
    return "diverged" if loss == float("inf") else f"{loss:.4f}"


DESCENT_STATES = {
    "converged": "converged",
    "running": "not finished (run the sweep again to go on)",
    "blocked": "stopped at a run that failed (run the sweep again to retry it)",
}


def descent_sections(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """One (title, header, rows) per descent: its start, then each step along a setting, what it tried and where
    it went."""
    sections = []
    for d in report.get("descents") or []:
        budget = "" if d["budget"] is None else f" at {tokens_label(d['budget'])} tokens"
        title = (
            f"{d['optimizer']}{budget}: {DESCENT_STATES[d['state']]} at {settings_label(d['best'])} "
            f"(loss {_score_text(d['best_loss'])}); {d['points_scored']} of {d['grid_points']} grid points trained."
        )
        start = d["path"][0]
        rows = [["start", "", "", f"{settings_label(start['settings'])}: {_score_text(start['loss'])}", ""]]
        for number, step in enumerate(d["path"][1:], 1):
            key = step["setting"]
            tried = ", ".join(
                f"{_value_text(key, t['value'])}: {_score_text(t['loss'], t['failed'])}" for t in step["tried"]
            )
            went = f"moved to {_value_text(key, step['to'])}" if step["moved"] else "stayed"
            went = "stopped" if step["moved"] is None else went
            rows.append([str(number), key, _value_text(key, step["from"]), tried, went])
        sections.append((title, ["step", "setting", "from", "tried (loss)", "then"], rows))
    return sections


RUN_COLUMNS = ("run", "outcome", "why it ended", "loss ranked", "seconds", "command", "config", "log")


def why_it_ended(run: dict) -> str:
    """A run's ending in words: what stopped it (its status' message), and how often Slurm requeued it."""
    requeued = f"requeued {run['requeues']} time(s)" if run.get("requeues") else ""
    if run["outcome"] == FINISHED:
        return f"finished its steps{', ' + requeued if requeued else ''}"
    return "; ".join(part for part in (run.get("message") or f"exit {run.get('exit_code')}", requeued) if part)


Link = tuple[str, str]  # (text, path relative to the sweep's folder)


def run_rows(report: dict) -> list[list]:
    """Every run: its folder, outcome, ranked loss, time, and links to its command.sh, job_config.toml and
    train.log (cells that are links are (text, path))."""
    rows = []
    for r in report["runs"]:
        config = r.get("config")
        rows.append(
            [
                (r["name"], r["folder"] + "/"),
                r["outcome"],
                why_it_ended(r),
                _score_text(r["rank_loss"]) if r["outcome"] == FINISHED else r["outcome"],
                "n/a" if r.get("seconds") is None else f"{r['seconds']:.0f}",
                (COMMAND_FILE, f"{r['folder']}/{COMMAND_FILE}"),
                (JOB_CONFIG_RECORD, config) if config else "n/a",
                (LOG_FILE, f"{r['folder']}/{LOG_FILE}"),
            ]
        )
    return rows


def _md_cell(cell) -> str:
    return f"[{cell[0]}]({urllib.parse.quote(cell[1])})" if isinstance(cell, tuple) else cell


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows),
    ]


def budget_rows(report: dict) -> Optional[tuple[list[str], list[list[str]]]]:
    fit = report["budget_fit"]
    if fit is None or fit["fit"] is None:
        return None
    budgets = [p["tokens"] for p in fit["points"]]
    header = ["optimizer", *(f"D_eff / D at {d:,.0f} tokens" for d in budgets)]
    rows = []
    for optimizer, entries in fit["speedups"].items():
        by_budget = {round(e["tokens"]): e for e in entries}
        row = [optimizer]
        for d in budgets:
            e = by_budget.get(round(d))
            row.append("not run" if e is None else _d_eff_text(e, fit))
        rows.append(row)
    return header, rows


def _d_eff_text(e: dict, fit: dict) -> str:
    """A D_eff / D cell: the figure, its interval (an end no number holds: ∞) and why an end or the whole interval
    is missing."""
    if e["below_floor"]:
        return f"below {fit['baseline']}'s floor"
    note = f" ({e['interval_note']})" if e.get("interval_note") else ""
    if e.get("interval") is None:
        return f"{e['speedup']:.2f}×{note}"
    low, high = e["interval"]
    low_text = "0" if low is None else f"{low:.2f}"
    high_text = "∞" if high is None else f"{high:.2f}"
    paired = " paired" if e.get("paired") else ""
    return f"{e['speedup']:.2f}× [{low_text}, {high_text}]{paired}{note}"


def _end(x: Optional[float], digits: str, infinite: str) -> str:
    return infinite if x is None else format(x, digits)


# What the page may say of its intervals' calibration without a number it did not compute: the measured coverage
# lives in docs/optimizer-study.md, beside the command that measures it.
FIT_COVERAGE_NOTE = (
    "Each is at 95% by construction; over made-up studies they hold their truth at least that often (measured in "
    "docs/optimizer-study.md, not for this study)"
)


def fit_text(report: dict) -> Optional[str]:
    fit = report["budget_fit"]
    if fit is None or fit["fit"] is None:
        return None
    f, i = fit["fit"], fit.get("interval")
    text = (
        f"{fit['baseline']}'s best loss over {len(fit['points'])} budgets: L(D) = {f['alpha']:.4g} · "
        f"D^(−{f['beta']:.4f}) + {f['gamma']:.4f} (rms residual {f['rms_residual']:.4f}); D_eff = the tokens this "
        "fit needs for an optimizer's loss."
    )
    if i is None:
        text += f" {fit.get('interval_note', 'no bootstrap interval')}."
    else:
        failed = i.get("failed", i["resamples"] - i["fits"])
        text += (
            f" 95% bootstrap intervals over seeds, {i['resamples']} resamples ({failed} found no power law"
            + (", counted as unknown at both ends rather than dropped" if failed else "")
            + f"): α [{_end(i['alpha'][0], '.4g', '−∞')}, {_end(i['alpha'][1], '.4g', '∞')}], β "
            f"[{_end(i['beta'][0], '.4f', '−∞')}, {_end(i['beta'][1], '.4f', '∞')}], γ "
            f"[{_end(i['gamma'][0], '.4f', '−∞')}, {_end(i['gamma'][1], '.4f', '∞')}]. {FIT_COVERAGE_NOTE}. "
            f"D_eff / D: a cell whose runs ran {fit['baseline']}'s seeds at its budget is drawn with "
            f"{fit['baseline']}'s point there (paired); {fit['baseline']}'s own is 1 by definition."
        )
    if fit.get("exact"):
        text += (
            " With exactly three budgets the fit's three parameters pass through its three points: it cannot show "
            "a misfit, and its floor γ moves far with small noise (add budgets to test it)."
        )
    return text


def answer_line(report: dict) -> str:
    """sweep.md's first line: the optimizers by loss, and what the sweep can say of their differences."""
    best, baseline = report["best"], report["baseline"]
    ranked = sorted((b["loss_mean"], o) for o, b in best.items() if b["loss_mean"] is not None)
    if not ranked:
        return "No optimizer has a finished run yet: nothing to rank (every run is listed below)."
    order = ", ".join(f"{o} {loss:.4f} ({settings_label(best[o]['settings'])})" for loss, o in ranked)
    if report["seeds"] < 2:
        return (
            f"Lowest loss first: {order}. With one seed, whether they differ beyond seed-to-seed noise cannot be "
            "judged: run --seeds 0,1,2."
        )
    against = "; ".join(f"{o}: {versus_text(o, b, report)}" for o, b in best.items() if o != baseline)
    return f"Lowest loss first: {order}. Against {baseline}: {against}."


def _settings_chosen(report: dict) -> bool:
    """Whether any optimizer's best settings were chosen among several (one setting each chose nothing)."""
    return any(b.get("settings_tried", 1) > 1 for b in report["best"].values())


def _judged(report: dict) -> tuple[list[str], list[list[str]]]:
    """The verdict table, without what the study cannot judge: the difference from the baseline with one seed, how
    sure a choice is with one setting per optimizer."""
    columns, rows = list(VERDICT_COLUMNS), verdict_rows(report)
    unjudged = set()
    if report["seeds"] < 2:
        unjudged.add("vs baseline: difference [95% CI], verdict")
    if not _settings_chosen(report):
        unjudged.add("how sure the choice is")
    if not unjudged:
        return columns, rows
    keep = [i for i, c in enumerate(columns) if c not in unjudged]
    return [columns[i] for i in keep], [[row[i] for i in keep] for row in rows]


def format_markdown(report: dict) -> str:
    header, rows = grid_rows(report)
    lines = [answer_line(report), "", *_table(*_judged(report)), "", *_table(header, rows), "", *notes(report)]
    budget = budget_rows(report)
    if budget is not None:
        lines += ["", fit_text(report), "", *_table(*budget)]
    for title, descent_header, descent_rows in descent_sections(report):
        lines += ["", f"Coordinate descent, {title}", "", *_table(descent_header, descent_rows)]
    lines += ["", "Every run (paths relative to the sweep's folder):", "", *_table(RUN_COLUMNS, run_rows(report))]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# study.html


def _a(text: str, href: str) -> str:
    """A link to a path relative to the page, percent-encoded: a ``#``, ``%`` or space in a run's name (an axis
    value) stays part of the path."""
    return f'<a href="{html.escape(urllib.parse.quote(href))}">{html.escape(text)}</a>'


def _html_table(header: Sequence[str], rows: Sequence[Sequence], links: Optional[Sequence[Sequence]] = None) -> str:
    """A table of text cells (``**bold**``) and link cells ((text, path)); ``links`` adds, per cell, more
    (text, path) links after its text."""

    def cell(content, tag: str, more: Sequence[Link] = ()) -> str:
        if isinstance(content, tuple):
            inner = _a(*content)
        else:
            bold = content.startswith("**") and content.endswith("**")
            inner = html.escape(content[2:-2] if bold else content)
            inner = f"<b>{inner}</b>" if bold else inner
        if more:
            inner += " " + " ".join(_a(*link) for link in more)
        return f"<{tag}>{inner}</{tag}>"

    head = "".join(cell(h, "th") for h in header)
    body = "".join(
        "<tr>" + "".join(cell(c, "td", links[i][j] if links else ()) for j, c in enumerate(row)) + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(png: Optional[bytes], caption: str) -> str:
    if png is None:
        return f"<p><i>{html.escape(caption)}</i></p>"
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


STYLE = (
    "body{font-family:sans-serif;max-width:1250px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #bbb;padding:4px 8px;text-align:left}"
    "th{background:#eee}img{max-width:100%}figcaption{color:#555;font-size:small}"
)


def format_html(report: dict, figures: dict[str, Optional[bytes]], title: str) -> str:
    """The page: notes, verdict table, main picture, grid, tuning, sensitivity, budget fit, the sweep's overview
    figure. ``figures`` maps "main", "selection", "sensitivity", "budgets", "health", "overview" to PNG bytes (None:
    not drawn, said why)."""
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        *(f"<p>{html.escape(line)}</p>" for line in notes(report)),
        "<h2>Verdict</h2>",
        _html_table(VERDICT_COLUMNS, verdict_rows(report)),
        _figure(figures.get("main"), "loss against tokens at each optimizer's best settings, and final loss ± 95% CI"),
        "<h2>Every setting</h2>",
        "<p>Each cell links the run folder of each of its seeds.</p>",
        _html_table(
            *grid_rows(report),
            [
                [[(f"seed {seed}", f"{folder}/") for seed, folder in cell] for cell in row]
                for row in grid_folders(report)
            ],
        ),
        "<h2>Tuning</h2>",
        _figure(
            figures.get("selection"),
            "each optimizer's selection losses against the lr (its other settings at their best), the quadratic in "
            "log lr fitted near the lowest, its optimum, the lr chosen (★) and the lowest cell where that differs (○)"
            if figures.get("selection")
            else "no optimizer tried more than one lr: no tuning curve to show",
        ),
        "<h2>Sensitivity</h2>",
        _figure(
            figures.get("sensitivity"),
            "final loss against each swept hyperparameter, the others at the optimizer's best"
            if figures.get("sensitivity")
            else "no hyperparameter took more than one value: no sensitivity to show",
        ),
        "<h2>Across budgets</h2>",
    ]
    budget = budget_rows(report)
    if budget is None:
        fit = report["budget_fit"]
        why = fit["error"] if fit is not None else "the sweep holds fewer than three token budgets"
        parts.append(f"<p>No budget fit: {html.escape(why)}.</p>")
    else:
        parts += [f"<p>{html.escape(fit_text(report))}</p>", _html_table(*budget)]
        parts.append(_figure(figures.get("budgets"), "the baseline's fit over budgets and D_eff / D per optimizer"))
    sections = descent_sections(report)
    if sections:
        parts.append("<h2>Coordinate descent</h2>")
    for title, descent_header, descent_rows in sections:
        parts += [f"<p>{html.escape(title)}</p>", _html_table(descent_header, descent_rows)]
    parts += [
        "<h2>Optimizer health</h2>",
        _figure(
            figures.get("health"),
            "at each optimizer's best settings (mean over seeds): update RMS and update/weight per group of weights, "
            "the largest attention logit and the weight norm over steps (docs/telemetry.md says how to read them)"
            if figures.get("health")
            else "no run at the best settings logged optimizer health (metrics.health_freq 0)",
        ),
        "<h2>Overview</h2>",
        _figure(figures.get("overview"), "loss curves, loss against lr, memory and tokens/s (sweep.png)"),
        "<h2>Every run</h2>",
        "<p>Each run's folder, the command it ran with (command.sh), its resolved config (job_config.toml) and its "
        "log; paths are relative to this page.</p>",
        _html_table(RUN_COLUMNS, run_rows(report)),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# The report files


def write_report(
    dump: Path,
    last_k: int,
    baseline: Optional[str] = None,
    in_progress: Optional[str] = None,
    family_correction: str = HOLM,
) -> Optional[dict]:
    """sweep.png, sweep.md, sweep.json and study.html in the dump folder; None when no run has ended yet.

    ``baseline`` None compares with AdamW where the sweep has it; a named baseline must be in the sweep.
    ``in_progress``: what a study still training has pending, said first on the page. ``family_correction``: the
    verdicts' words from Holm-adjusted p-values, or "unadjusted" (``summary.verdict_family``)."""
    runs = load_sweep_runs(dump)
    if not runs:
        return None
    search = read_search(dump)
    confirm_seeds = (search or {}).get("confirm_seeds", [])
    axes = (search or {}).get("axes")
    report = summarize_sweep(runs, last_k, baseline or DEFAULT_BASELINE, confirm_seeds, axes, family_correction)
    report["descents"] = descent_report(search, report["runs"])
    report["in_progress"] = in_progress
    report["confirmation_windows"] = read_confirmation_windows(dump) if confirm_seeds else None
    if baseline is not None and not report["baseline_found"]:
        raise UserError(
            f"--baseline {baseline} is not an optimizer of this sweep ({', '.join(report['best'])}); name one of them"
        )
    plot_sweep(runs, report, dump / f"{REPORT_NAME}.png")
    (dump / f"{REPORT_NAME}.md").write_text(format_markdown(report))
    write_text_atomically(dump / f"{REPORT_NAME}.json", strict_json(report))
    figures = {
        "main": plot_main(runs, report),
        "sensitivity": plot_sensitivity(report),
        "selection": plot_selection(report),
        "budgets": plot_budgets(report),
        "health": plot_study_health(runs, report),
        "overview": (dump / f"{REPORT_NAME}.png").read_bytes(),
    }
    write_text_atomically(dump / PAGE_NAME, format_html(report, figures, f"Optimizer study: {dump.name}"))
    return report


def pending_text(dump: Path, phase: str, names: Sequence[str], then: str = "") -> str:
    """What a study still training has to do: how many of this phase's runs (``names``) have ended, the first few
    still to end, and what comes after (``then``)."""
    waiting = [n for n in names if read_status(dump / RUNS_FOLDER / n) is None]
    shown = ", ".join(waiting[:PENDING_NAMES_SHOWN]) + (", ..." if len(waiting) > PENDING_NAMES_SHOWN else "")
    text = f"{len(names) - len(waiting)} of {len(names)} {phase} runs have ended"
    text += f"; pending: {shown}" if waiting else ""
    return text + (f"; then {then}" if then else "") + "."


PENDING_NAMES_SHOWN = 6


class InterimReport:
    """The report rewritten while a sweep trains, after a run ends and at most every ``INTERIM_REPORT_SECONDS``, so
    that ``study.html`` shows a long study as it stands, and what it still has pending (:meth:`expect`). A report
    that cannot be written yet (runs on other data, or any other failure) is one line, and the runs go on; the final
    report says it again and fails."""

    def __init__(self, dump: Path, last_k: int, baseline: Optional[str], family_correction: str = HOLM):
        self.dump, self.last_k, self.baseline = dump, last_k, baseline
        self.family_correction = family_correction
        self.last = time.monotonic()
        self.pending = lambda: "runs are training."

    def expect(self, phase: str, specs: Sequence, then: str = "") -> None:
        """The runs of the phase now training (``specs``: their names are their folders) and what comes next."""
        names = [s.name for s in specs]
        self.pending = lambda: pending_text(self.dump, phase, names, then)

    def say(self, text: str) -> None:
        """What is pending, in words (a descent's runs are known only one step at a time)."""
        self.pending = lambda: text

    def __call__(self) -> None:
        if time.monotonic() - self.last < INTERIM_REPORT_SECONDS:
            return
        try:
            write_report(self.dump, self.last_k, self.baseline, self.pending(), self.family_correction)
            print(f"report so far: {self.dump / PAGE_NAME}", flush=True)
        except Exception as e:  # noqa: BLE001 - a report that fails must not stop the runs; the final one raises
            print(f"note: no report yet: {e}", flush=True)
        self.last = time.monotonic()
