"""The scale view of a study over model sizes: what each size's study found, side by side against parameters, with
the laws fitted across sizes (``scale``) — as numbers (``scale.json``), Markdown (``sweep.md``) and the page
(``study.html``), in the study's folder above its sizes' own folders.

Built from each size's report (``report.write_report`` of its folder) and the study's record of its sizes
(``ladder.json``), so that ``--report-only`` rebuilds the same view from disk.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.files import strict_json, write_text_atomically
from torchtitan.study.plan import FINISHED, TOKENS_PER_PARAM, lr_label
from torchtitan.study.report import (
    PAGE_NAME,
    REPORT_NAME,
    STYLE,
    _d_eff_text,
    _figure,
    _html_table,
    _table,
    difference_interval_text,
    loss_text,
    speedup_text,
)
from torchtitan.study.scale import (
    TrendPoint,
    determined,
    fit_log_line,
    fit_saturating,
    fit_trend,
    predicted_against_found,
    significant,
)
from torchtitan.study.statistics import AT_LEAST
from torchtitan.study.summary import settings_label

SCALE_NAME = "scale.json"
NO_PREDICTION = "Predicted against found: from the third size on (the first two sizes fix the law)."


def multiple_label(tokens: Optional[float], params: float) -> str:
    """A budget as the multiple of TOKENS_PER_PARAM tokens per parameter it is for this size (``2x``); the job's
    own steps without budgets."""
    if tokens is None:
        return "the job's steps"
    return f"{significant(tokens / (TOKENS_PER_PARAM * params)):g}x"


def budget_label(tokens: Optional[float], report: dict, params: float) -> str:
    """A budget as the study gave it: the label its runs recorded (``2x`` for a multiple, ``1M`` for a token count:
    a token count is the same budget at every size), else the multiple it is for this size."""
    for run in report.get("runs") or []:
        if run.get("budget") == tokens and run.get("budget_label"):
            return run["budget_label"]
    return multiple_label(tokens, params)


def _confirmed(b: dict) -> bool:
    return b.get("settings") is not None and b.get("confirmation", FINISHED) == FINISHED


def _size_row(optimizer: str, b: dict, report: dict, params: float) -> dict:
    d_eff = {}
    fit = report.get("budget_fit") or {}
    for e in (fit.get("speedups") or {}).get(optimizer, []):
        d_eff[budget_label(e["budget"], report, params)] = {
            "value": e["speedup"],
            "interval": e.get("interval"),
            "below_floor": e["below_floor"],
            "note": e.get("interval_note"),
        }
    return {
        "settings": b.get("settings"),
        "edges": b.get("edges") or [],
        "confirmed": _confirmed(b),
        "confirmation": b.get("confirmation", FINISHED),
        "loss_mean": b.get("loss_mean"),
        "loss_ci": b.get("loss_ci"),
        "seeds": len(b.get("seeds") or []),
        "difference": b.get("versus_baseline"),
        "speedup": b.get("speedup"),
        "d_eff": d_eff,
    }


def _speedup_point(params: float, s: Optional[dict]) -> tuple[Optional[TrendPoint], Optional[str]]:
    """A size's speedup as a point of the trend, or why it is not one."""
    if s is None or s.get("value") is None:
        return None, "no speedup"
    if s["bound"] == AT_LEAST:
        return None, "a lower bound (the baseline never got to its loss: --budgets 1x,2x,4x measure D_eff / D)"
    if s["bound"] is not None:
        return None, "a bound, not a value"
    if s["low"] is None:
        return None, "one seed: no interval"
    if not s["low"] < s["high"]:
        return None, "no spread over seeds"
    return TrendPoint(params, s["value"], s["low"], s["high"], s["seeds"] - 1), None


def size_trend(
    points: Sequence[tuple[str, Optional[TrendPoint], Optional[str]]], target: Optional[float], bends: bool = False
) -> dict:
    """The power law over the sizes with a value; for a speedup (``bends``) with three sizes or more and a target
    past them, the saturating alternative beside it (a speedup that bends toward 1) and whether the two agree."""
    used = [p for _, p, _ in points if p is not None]
    left_out = {size: why for size, p, why in points if p is None}
    trend = fit_trend(used, target)
    result = {"fit": trend.to_json() if trend else None, "left_out": left_out}
    if bends and trend is not None and target and used and target > max(p.params for p in used):
        alternative = fit_saturating(used, target)
        result["saturating"] = alternative.to_json() if alternative else None
        if alternative is not None:
            result["determined"] = determined(trend.target_interval, alternative.target_interval)
    return result


def _settings_laws(optimizer: str, sizes: Sequence[dict], target: Optional[float]) -> list[dict]:
    """Per budget multiple and per swept setting with positive numbers (the lr, a weight decay, ...): the power law
    of the best value against parameters over every size, and predicted against found for every size after the
    first two."""
    found: dict[tuple[str, str], list[tuple[str, float, Optional[float]]]] = {}
    edges: dict[tuple[str, str], dict[str, str]] = {}  # per law, the sizes whose value is at its grid's edge
    steps: dict[tuple[str, str], float] = {}  # per law, the widest step of the grids its values were found on
    searched: set[tuple[str, str]] = set()  # the laws whose value some size chose among two or more it tried
    for size in sizes:
        for entry in size["report"]["best_by_budget"]:
            b = entry["best"].get(optimizer)
            label = budget_label(entry["budget"], size["report"], size["params"])
            if b is None:
                continue
            for key, value in (b.get("settings") or {}).items():
                number = value if isinstance(value, (int, float)) and value > 0 else None
                if key != "lr" and number is None:
                    continue
                found.setdefault((label, key), []).append((size["size"], size["params"], number))
                tried = tried_values(size["report"], optimizer, entry["budget"], key)
                step = grid_step(size["report"], optimizer, entry["budget"], key)
                steps[label, key] = max(steps.get((label, key), 1.0), step)
                if len(tried) != 1:  # none recorded: the report does not say, so the law is kept
                    searched.add((label, key))
                for edge in b.get("edges") or []:
                    if edge["setting"] == key:
                        edges.setdefault((label, key), {})[size["size"]] = edge["end"]
    laws = []
    for (label, key), values in found.items():
        if (label, key) not in searched:  # one value given at every size: nothing was found, so there is no law
            continue
        known = [(p, v) for _, p, v in values if v is not None]
        step = steps.get((label, key), 1.0)
        line = fit_log_line([p for p, _ in known], [v for _, v in known], step)
        if line is None and len(values) < 3:
            continue
        interval = line.exponent_interval() if line else None
        target_interval = line.prediction_interval(target) if line and target else None
        at_edge = edges.get((label, key), {})
        rows = predicted_against_found(values, step)
        for row in rows:
            if row["size"] in at_edge:  # a bound, not an optimum: nothing to hold it against
                row["edge"], row["inside"] = at_edge[row["size"]], None
        laws.append(
            {
                "budget": label,
                "setting": key,
                "found": [{"size": s, "params": p, "value": v, "edge": at_edge.get(s)} for s, p, v in values],
                "grid_step": step,
                "at_edge": at_edge,
                "exponent": line.exponent if line else None,
                "exponent_interval": list(interval) if interval else None,
                "at_target": line.at(target) if line and target else None,
                "target_interval": list(target_interval) if target_interval else None,
                "predicted_vs_found": rows,
            }
        )
    return laws


def tried_values(report: dict, optimizer: str, budget, key: str) -> list[float]:
    """The positive values of ``key`` that the optimizer's cells at ``budget`` tried, in order."""
    tried = sorted(
        {
            c["settings"][key]
            for c in report.get("grid") or []
            if c["optimizer"] == optimizer
            and c["budget"] == budget
            and isinstance(c["settings"].get(key), (int, float))
        }
    )
    return [v for v in tried if v > 0]


def grid_step(report: dict, optimizer: str, budget, key: str) -> float:
    """The widest ratio between neighbouring values of ``key`` that the optimizer's cells at ``budget`` tried (1
    with one value): how finely its best value is known."""
    tried = tried_values(report, optimizer, budget, key)
    return max((b / a for a, b in zip(tried, tried[1:])), default=1.0)


def summarize_scale(sizes: Sequence[dict], record: dict, baseline: str, target: Optional[float]) -> dict:
    """The scale view's numbers. ``sizes``: {"size", "params", "folder", "report"} per size (its report as
    ``summary.summarize_sweep`` made it); ``record``: ``ladder.json`` (the carried-up grids)."""
    sizes = sorted(sizes, key=lambda s: s["params"])
    optimizers = list(dict.fromkeys(o for s in sizes for o in s["report"]["best"]))
    view: dict = {
        "baseline": baseline,
        "target_params": target,
        "carry_lrs": bool(record.get("carry_lrs")),
        "sizes": [
            {
                "size": s["size"],
                "params": s["params"],
                "folder": s["folder"],
                "budgets": [budget_label(t, s["report"], s["params"]) for t in s["report"]["budgets"]]
                or ["the job's steps"],
                "selection_seeds": s["report"]["selection_seeds"],
                "confirmation_seeds": s["report"]["confirmation_seeds"],
                "carried": (record.get("grids") or {}).get(s["size"]),
            }
            for s in sizes
        ],
        "optimizers": {},
    }
    for optimizer in optimizers:
        rows = {
            s["size"]: _size_row(optimizer, s["report"]["best"][optimizer], s["report"], s["params"])
            for s in sizes
            if optimizer in s["report"]["best"]
        }
        entry: dict = {"rows": rows, "laws": _settings_laws(optimizer, sizes, target)}
        if optimizer != baseline:
            points = []
            for s in sizes:
                row = rows.get(s["size"])
                if row is None:
                    continue
                if not row["confirmed"]:
                    points.append((s["size"], None, "not confirmed"))
                    continue
                points.append((s["size"], *_speedup_point(s["params"], row["speedup"])))
            entry["speedup_trend"] = size_trend(points, target, bends=True)
            multiples = list(dict.fromkeys(m for row in rows.values() for m in row["d_eff"]))
            entry["d_eff_trends"] = {}
            for m in multiples:
                d_points = []
                for s in sizes:
                    e = (rows.get(s["size"]) or {}).get("d_eff", {}).get(m)
                    interval = (e or {}).get("interval")
                    if e is None or e["value"] is None or not interval or None in interval:
                        why = "not run" if e is None else e.get("note") or "no value or interval"
                        d_points.append((s["size"], None, why))
                    else:
                        d_points.append((s["size"], TrendPoint(s["params"], e["value"], *interval, None), None))
                entry["d_eff_trends"][m] = size_trend(d_points, target, bends=True)
        view["optimizers"][optimizer] = entry
    return view


# ----------------------------------------------------------------------------------------------------------------
# Words and tables


def params_text(params: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= scale:
            return f"{params / scale:.3g}{unit}"
    return f"{params:.0f}"


def _value_text(key: str, value) -> str:
    if value is None:
        return "n/a"
    return lr_label(significant(value)) if key == "lr" else f"{value:.3g}"


def _interval_text(interval: Optional[Sequence[float]], fmt: str = ".3g") -> str:
    return "" if not interval else f" [{interval[0]:{fmt}}, {interval[1]:{fmt}}]"


def trend_text(what: str, trend: dict, target: Optional[float]) -> str:
    fit = trend["fit"]
    left_out = "; ".join(f"{size}: {why}" for size, why in trend["left_out"].items())
    left_out = f" Left out: {left_out}." if left_out else ""
    if fit is None:
        return f"{what}: no trend (fewer than two sizes with a value and an interval).{left_out}"
    text = (
        f"{what} ∝ N^{fit['exponent']:+.3f}{_interval_text(fit['exponent_interval'], '+.3f')} over {fit['sizes']} sizes"
    )
    if target:
        at = fit["at_target"]
        if fit["target_interval"] is None:
            text += f"; at {params_text(target)} parameters {at:.2f}×, {fit['note']}"
        else:
            low, high = fit["target_interval"]
            text += f"; at {params_text(target)} parameters {at:.2f}× [{low:.2f}, {high:.2f}]"
    elif fit["note"] and fit["exponent_interval"] is None:
        text += f", {fit['note']}"
    if fit["note"] and fit["exponent_interval"] is not None:
        text += f" ({fit['note']})"
    return text + "." + _saturating_text(trend, target) + left_out


def _saturating_text(trend: dict, target: Optional[float]) -> str:
    """The saturating alternative at the target beside the power law, and what the ladder cannot tell apart."""
    if "saturating" not in trend:
        return ""
    where = params_text(target)
    s = trend["saturating"]
    if s is None:
        return (
            f" A speedup bending toward 1 (1 + a·N^b) fits no law here (the sizes lie on both sides of 1): the "
            f"value at {where} rests on the power law alone."
        )
    low, high = (_end(x, "∞" if i else "−∞") for i, x in enumerate(s["target_interval"]))
    text = (
        f" Bending toward 1 instead (1 + a·N^b, as a speedup that fades with size): {s['at_target']:.2f}× at "
        f"{where} [{low}, {high}]."
    )
    if not trend.get("determined", True):
        text += (
            f" The two laws disagree at {where} beyond their intervals: the sizes trained fit both, so this ladder "
            "does not determine the value at the target; add larger sizes."
        )
    return text


def _end(x: Optional[float], infinite: str) -> str:
    return infinite if x is None or not math.isfinite(x) else f"{x:.2f}"


def _difference_text(d: Optional[dict]) -> str:
    if d is None:
        return "n/a"
    return f"{d['difference']:+.4f}{difference_interval_text(d)}, {d['verdict']}"


def size_rows(view: dict) -> tuple[list[str], list[list[str]]]:
    header = ["size", "parameters", "budgets", "selection seeds", "confirmation seeds", "lr grid", "page"]
    rows = []
    for s in view["sizes"]:
        carried = s["carried"]
        grid = (
            "; ".join(
                f"{o}: centred on {lr_label(significant(c['predicted']))} ({', '.join(map(lr_label, c['lrs']))})"
                + _edges_text(c.get("edges"))
                for o, c in carried.items()
            )
            if carried
            else "--lrs"
        )
        rows.append(
            [
                s["size"],
                f"{s['params']:,}",
                ", ".join(s["budgets"]),
                ", ".join(map(str, s["selection_seeds"])),
                ", ".join(map(str, s["confirmation_seeds"])) or "none",
                grid,
                (PAGE_NAME, f"{s['folder']}/{PAGE_NAME}"),
            ]
        )
    return header, rows


def _edges_text(edges: Optional[dict]) -> str:
    if not edges:
        return ""
    ends = ", ".join(f"{size}'s is the {end} it tried" for size, end in edges.items())
    return f", from best lrs at a grid's edge (bounds, not optima: {ends})"


def optimizer_rows(view: dict, optimizer: str) -> tuple[list[str], list[list[str]]]:
    entry = view["optimizers"][optimizer]
    multiples = list(dict.fromkeys(m for row in entry["rows"].values() for m in row["d_eff"]))
    header = [
        "size",
        "parameters",
        "best settings",
        "loss (mean ± 95% CI)",
        f"vs {view['baseline']}: difference [95% CI]",
        "speedup at matched loss [95% CI]",
        *(f"D_eff / D at {m}" for m in multiples),
    ]
    rows = []
    for s in view["sizes"]:
        row = entry["rows"].get(s["size"])
        if row is None:
            rows.append([s["size"], params_text(s["params"]), "not run", *[""] * (len(header) - 3)])
            continue
        settings = "none" if row["settings"] is None else settings_label(row["settings"])
        settings += " (at the grid's edge)" if row["edges"] else ""
        confirmed = row["confirmed"]
        loss = loss_text(row["loss_mean"], row["loss_ci"], row["seeds"]) if confirmed else row["confirmation"]
        d_eff = []
        for m in multiples:
            e = row["d_eff"].get(m)
            if e is None:
                d_eff.append("not run")
            else:
                cell = {"speedup": e["value"], "interval": e["interval"], "below_floor": e["below_floor"]}
                d_eff.append(_d_eff_text({**cell, "interval_note": e.get("note")}, view))
        rows.append(
            [
                s["size"],
                params_text(s["params"]),
                settings,
                loss,
                "baseline" if optimizer == view["baseline"] else _difference_text(row["difference"]),
                speedup_text(row["speedup"]) if confirmed else "n/a",
                *d_eff,
            ]
        )
    return header, rows


def law_rows(view: dict, optimizer: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Per law of a best setting: its line, and predicted against found for every size after the first two."""
    sections = []
    target = view["target_params"]
    for law in view["optimizers"][optimizer]["laws"]:
        key = law["setting"]
        title = f"{optimizer}'s best {key} at {law['budget']}"
        if law.get("grid_step", 1.0) > 1.0:
            title += f" (found on grids {significant(law['grid_step']):g}× apart; the intervals count that rounding)"
        if law.get("at_edge"):
            ends = ", ".join(f"{size} the {end}" for size, end in law["at_edge"].items())
            title += f"; at the grid's edge, a bound and not an optimum: {ends} tried"
        if law["exponent"] is None:
            title += ": no law (fewer than two sizes found one)"
        else:
            title += f" ∝ N^{law['exponent']:+.3f}{_interval_text(law['exponent_interval'], '+.3f')}"
            if law["exponent_interval"] is None:
                title += " (two sizes: underdetermined)"
            if target:
                title += f"; at {params_text(target)}: {_value_text(key, law['at_target'])}"
                interval = law["target_interval"]
                title += (
                    f" [{_value_text(key, interval[0])}, {_value_text(key, interval[1])}]"
                    if interval
                    else " (no interval: underdetermined)"
                )
        rows = []
        for p in law["predicted_vs_found"]:
            interval = p["interval"]
            predicted = _value_text(key, p["predicted"])
            predicted += (
                f" [{_value_text(key, interval[0])}, {_value_text(key, interval[1])}]"
                if interval
                else " (no interval)"
                if p["predicted"] is not None
                else ""
            )
            inside = {True: "yes", False: "no", None: "n/a"}[p["inside"]]
            if p.get("edge"):
                inside = f"n/a: the {p['edge']} tried, a bound"
            rows.append(
                [
                    p["size"],
                    params_text(p["params"]),
                    str(p["from_sizes"]),
                    predicted,
                    _value_text(key, p["found"]),
                    inside,
                ]
            )
        header = ["size", "parameters", "smaller sizes fitted", "predicted [95% PI]", "found", "inside"]
        sections.append((title, header, rows))
    return sections


def scale_notes(view: dict) -> list[str]:
    baseline, target = view["baseline"], view["target_params"]
    lines = [
        f"One study over {len(view['sizes'])} model sizes, each with its own search and confirmation (its own page "
        "below); the numbers of each size are its verdict's: its best settings on selection seeds, judged on its "
        "confirmation seeds.",
        f"Speedup at matched loss and the difference are against {baseline}'s best at the same size. A trend is "
        "value ∝ N^exponent fitted over the sizes with a value and an interval (N: non-embedding parameters); its "
        "95% interval is a parametric bootstrap that draws each size from its own interval, widened where the sizes "
        "scatter more than those intervals allow; with two sizes it is underdetermined. An optimizer better than the "
        "baseline at one budget has a speedup at matched loss that is only a lower bound (the baseline never gets to "
        "its loss); over three or more --budgets its D_eff / D is a value at each, and has a trend of its own. "
        "Past the largest size, with three sizes or more, each speedup trend is also fitted as 1 + a·N^b (a speedup "
        "that fades toward 1 with size): both values at the target are shown, and where their intervals do not "
        "overlap the page says that the ladder does not determine the value at the target.",
        "Best settings: a power law of each size's best value against N (least squares in log-log, t intervals from "
        "the scatter about it, three or more sizes); for every size after the first two, what the smaller sizes' "
        "law predicted (95% prediction interval) against what its own search found. A best value at the grid's "
        "edge is a bound, not an optimum; a setting given one value at every size was not searched and has no law.",
    ]
    if view["carry_lrs"]:
        lines.append(
            "Carried up (--carry-lrs): from the third size on, each size's lr grid is the --lrs grid moved to centre "
            "on the lr the smaller sizes' law predicts for it (the lr grid column)."
        )
    else:
        lines.append("Every size searched the same --lrs grid (no --carry-lrs).")
    if target:
        lines.append(f"Target: {target:,.0f} parameters (--target-params), {target_place(view)}.")
    else:
        lines.append("No --target-params: the trends are not extrapolated.")
    return lines


def target_place(view: dict) -> str:
    """Where the target lies against the sizes trained, in words: how far an extrapolation to it reaches."""
    target, params = view["target_params"], [s["params"] for s in view["sizes"]]
    smallest, largest = min(params), max(params)
    if target < smallest:
        return (
            f"below the smallest size trained ({params_text(smallest)}): each value at it extrapolates downward, "
            "outside the sizes trained"
        )
    if target <= largest:
        return f"within the sizes trained ({params_text(smallest)} to {params_text(largest)}): values at it interpolate"
    return (
        f"{target / largest:.3g}× past the largest size trained ({params_text(largest)}): a value at it assumes each "
        "law holds that far past the sizes, which they cannot test"
    )


def format_scale_markdown(view: dict) -> str:
    lines = [*scale_notes(view), "", *_table(*size_rows(view))]
    for optimizer, entry in view["optimizers"].items():
        lines += ["", f"## {optimizer}", "", *_table(*optimizer_rows(view, optimizer))]
        if "speedup_trend" in entry:
            lines += ["", trend_text("Speedup at matched loss", entry["speedup_trend"], view["target_params"])]
            for m, trend in entry["d_eff_trends"].items():
                lines += ["", trend_text(f"D_eff / D at {m}", trend, view["target_params"])]
        for title, header, rows in law_rows(view, optimizer):
            lines += ["", title + ".", "", *(_table(header, rows) if rows else [NO_PREDICTION])]
    return "\n".join(lines) + "\n"


def format_scale_html(view: dict, figure: Optional[bytes], title: str) -> str:
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        *(f"<p>{html.escape(line)}</p>" for line in scale_notes(view)),
        "<h2>Sizes</h2>",
        _html_table(*size_rows(view)),
        "<h2>Against size</h2>",
        _figure(
            figure,
            "speedup at matched loss, loss difference and best lr against parameters, per optimizer, with 95% "
            "intervals and the fitted laws",
        ),
    ]
    target = view["target_params"]
    for optimizer, entry in view["optimizers"].items():
        parts += [f"<h2>{html.escape(optimizer)}</h2>", _html_table(*optimizer_rows(view, optimizer))]
        if "speedup_trend" in entry:
            parts.append(f"<p>{html.escape(trend_text('Speedup at matched loss', entry['speedup_trend'], target))}</p>")
            for m, trend in entry["d_eff_trends"].items():
                parts.append(f"<p>{html.escape(trend_text(f'D_eff / D at {m}', trend, view['target_params']))}</p>")
        for law_title, header, rows in law_rows(view, optimizer):
            table = _html_table(header, rows) if rows else f"<p>{html.escape(NO_PREDICTION)}</p>"
            parts += [f"<p>{html.escape(law_title)}.</p>", table]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# The figure


def plot_scale(view: dict) -> Optional[bytes]:
    """:func:`_plot_scale`, without matplotlib's warning about a flat axis (one lr at every size) it widens itself."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Attempting to set identical low and high ylims")
        return _plot_scale(view)


def _plot_scale(view: dict) -> Optional[bytes]:
    """Against parameters (log): speedup at matched loss, loss difference from the baseline, best lr; per optimizer
    with 95% intervals, the fitted laws drawn over the sizes (and on to the target)."""
    from torchtitan.study.figures import _figure as new_figure
    from torchtitan.study.figures import _png

    if not view["sizes"]:
        return None
    fig, (speed, diff, lrs) = new_figure((16, 5), 1, 3)
    for ax in (speed, diff, lrs):  # scales first: set later, they autoscale a flat line to no range
        ax.set_xscale("log")
    lrs.set_yscale("log")
    params = [s["params"] for s in view["sizes"]]
    target = view["target_params"]
    speed.set_xlim(min(params) / 1.5, max(params + ([target] if target else [])) * 1.5)
    for i, (optimizer, entry) in enumerate(view["optimizers"].items()):
        color = f"C{i % 10}"
        dxs, dys, dlows, dhighs = [], [], [], []
        series = {"at matched loss": []}  # per measure of speedup: (params, value, low, high) with an interval
        for s in view["sizes"]:
            row = entry["rows"].get(s["size"])
            if row is None or not row["confirmed"]:
                continue
            point, _ = _speedup_point(s["params"], row["speedup"])
            if point is not None:
                series["at matched loss"].append((point.params, point.value, point.low, point.high))
            for m, e in row["d_eff"].items():
                if e["value"] is not None and e["interval"] and None not in e["interval"]:
                    series.setdefault(f"D_eff / D at {m}", []).append((s["params"], e["value"], *e["interval"]))
            d = row["difference"]
            if d and d["low"] is not None:  # no spread, no interval: the table says so, the figure draws none
                dxs.append(s["params"])
                dys.append(d["difference"])
                dlows.append(d["difference"] - d["low"])
                dhighs.append(d["high"] - d["difference"])
        fits = {"at matched loss": (entry.get("speedup_trend") or {}).get("fit")}
        fits.update({f"D_eff / D at {m}": t.get("fit") for m, t in (entry.get("d_eff_trends") or {}).items()})
        for k, (measure, points) in enumerate(series.items()):
            if optimizer == view["baseline"] or not points:  # the baseline's own is 1 by definition: the grey line
                continue
            xs, ys, lows, highs = zip(*points)
            marker = "os^vD"[k % 5]
            yerr = [[y - low for y, low in zip(ys, lows)], [high - y for y, high in zip(ys, highs)]]
            speed.errorbar(xs, ys, yerr=yerr, fmt=marker, color=color, capsize=3, label=f"{optimizer}, {measure}")
            fit, line = fits.get(measure), fit_log_line(xs, ys)
            if fit is None or line is None:
                continue
            ends = [min(params), max(params + ([target] if target else []))]
            grid = [ends[0] * (ends[1] / ends[0]) ** (n / 40) for n in range(41)]
            speed.plot(grid, [line.at(x) for x in grid], "--", color=color, linewidth=1)
            if target and fit["target_interval"]:
                low, high = fit["target_interval"]
                at = fit["at_target"]
                speed.errorbar([target], [at], yerr=[[at - low], [high - at]], fmt=marker, color=color, capsize=4)
        if dxs:
            diff.errorbar(dxs, dys, yerr=[dlows, dhighs], fmt="o", color=color, capsize=3, label=optimizer)
        for law in entry["laws"]:
            if law["setting"] != "lr":
                continue
            found = [(f["params"], f["value"]) for f in law["found"] if f["value"] is not None]
            if found:
                lrs.plot(
                    *zip(*found), "o^sv"[i % 4], color=color, fillstyle="none", label=f"{optimizer} at {law['budget']}"
                )
                line = fit_log_line(*zip(*found)) if len(found) >= 2 else None
                if line:
                    lrs.plot(params, [line.at(x) for x in params], "--", color=color, linewidth=1)
    for ax, label in (
        (speed, f"speedup over {view['baseline']} (×), 95% CI"),
        (diff, f"loss − {view['baseline']}'s"),
        (lrs, "best lr"),
    ):
        ax.set_xlabel("non-embedding parameters")
        ax.set_ylabel(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    for ax, level in ((speed, 1.0), (diff, 0.0)):
        if not ax.has_data():  # the baseline alone, or no interval yet: a line alone has no range to scale to
            ax.set_ylim(level - 0.5, level + 0.5)
            ax.text(0.5, 0.5, "nothing to compare yet", transform=ax.transAxes, ha="center", color="gray")
        ax.axhline(level, color="gray", linewidth=0.8)
    return _png(fig)


def write_scale_report(dump: Path, sizes: Sequence[dict], record: dict, baseline: str, target: Optional[float]) -> dict:
    """scale.json, sweep.md and study.html in the study's folder."""
    view = summarize_scale(sizes, record, baseline, target)
    write_text_atomically(dump / SCALE_NAME, strict_json(view))
    write_text_atomically(dump / f"{REPORT_NAME}.md", format_scale_markdown(view))
    page = format_scale_html(view, plot_scale(view), f"Optimizer study across sizes: {dump.name}")
    write_text_atomically(dump / PAGE_NAME, page)
    return view
