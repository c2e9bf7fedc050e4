"""The study's figures: the sweep's overview (loss at each optimizer's best lr, final loss against lr, memory,
tokens/s), the main picture (loss against tokens at the best settings, final loss ± CI), sensitivity to each swept
hyperparameter, and the fit over budgets."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Optional, Sequence

from torchtitan.study import statistics
from torchtitan.study.plan import DIVERGED, FINISHED, lr_label
from torchtitan.study.run_folders import LOSS, VALIDATION_LOSS, Series, SweepRun
from torchtitan.study.summary import loss_curve, run_settings, settings_label


def _mean_curve(series: Sequence[Series]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean, min and max over runs (one at least) at the steps every run logged."""
    steps = sorted(set.intersection(*(set(s.steps) for s in series)))
    columns = [[dict(zip(s.steps, s.values))[step] for s in series] for step in steps]
    return steps, [sum(c) / len(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


def _best_runs(runs: Sequence[SweepRun], optimizer: str, best: dict, budget) -> list[SweepRun]:
    """The finished runs of an optimizer's best cell on the verdict's seeds (its confirmation seeds, if any)."""
    return [
        r
        for r in runs
        if r.spec.optimizer == optimizer
        and r.status.get("budget") == budget
        and run_settings(r) == best["settings"]
        and r.status["outcome"] == FINISHED
        and r.spec.seed in best["seeds"]
    ]


def _figure(size: tuple[float, float], *grid: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(*grid)


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def plot_main(runs: Sequence[SweepRun], report: dict) -> bytes:
    """(a) the ranked loss against tokens at each optimizer's best settings: mean over seeds, band = 95% CI of the
    mean at each point; (b) each optimizer's final loss, mean ± 95% CI, with the baseline's interval as a band."""
    fig, (curves, finals) = _figure((14, 5.5), 1, 2)
    best = report["best"]
    budget = report["budgets"][-1] if report["budgets"] else None
    colors = {o: f"C{i % 10}" for i, o in enumerate(best)}
    for optimizer, b in best.items():
        if b["settings"] is None:
            continue
        chosen = [
            loss_curve(r.scalars, report["by_validation"], report["last_k"])
            for r in _best_runs(runs, optimizer, b, budget)
        ]
        chosen = [c for c in chosen if c is not None]
        if not chosen:
            continue
        common = sorted(set.intersection(*(set(t) for t, _ in chosen)))
        columns = [[dict(zip(t, v))[x] for t, v in chosen] for x in common]
        mean = [statistics.mean(c) for c in columns]
        seeds = f"{len(chosen)} seed{'s' if len(chosen) > 1 else ''}"
        label = f"{optimizer} ({settings_label(b['settings'])}, {seeds})"
        curves.plot(common, mean, "-", color=colors[optimizer], label=label)
        if len(chosen) > 1:
            half = [statistics.mean_ci(c) for c in columns]
            curves.fill_between(
                common,
                [m - h for m, h in zip(mean, half)],
                [m + h for m, h in zip(mean, half)],
                color=colors[optimizer],
                alpha=0.2,
            )
    curves.set(title=f"{report['curve']} at each optimizer's best settings", xlabel="tokens", ylabel="loss")
    names = [o for o, b in best.items() if b["loss_mean"] is not None]
    for i, optimizer in enumerate(names):
        b = best[optimizer]
        finals.errorbar([i], [b["loss_mean"]], yerr=[b["loss_ci"] or 0.0], fmt="o", capsize=6, color=colors[optimizer])
    base = best.get(report["baseline"])
    if base and base["loss_mean"] is not None and base["loss_ci"] is not None:
        finals.axhspan(
            base["loss_mean"] - base["loss_ci"], base["loss_mean"] + base["loss_ci"], color="gray", alpha=0.2
        )
    finals.set_xticks(range(len(names)), names)
    finals.set(title=f"final loss, mean ± 95% CI over seeds (band: {report['baseline']})", ylabel="final loss")
    for ax in (curves, finals):
        ax.grid(alpha=0.3)
    if curves.get_legend_handles_labels()[0]:
        curves.legend(fontsize="small")
    return _png(fig)


def swept_hyperparameters(report: dict) -> list[str]:
    """The settings that took more than one value at the verdict's budget."""
    budget = report["budgets"][-1] if report["budgets"] else None
    cells = [c for c in report["grid"] if c["budget"] == budget]
    keys = list(dict.fromkeys(k for c in cells for k in c["settings"]))
    return [k for k in keys if len({repr(c["settings"].get(k)) for c in cells}) > 1]


def plot_sensitivity(report: dict) -> Optional[bytes]:
    """One panel per swept hyperparameter: final loss (mean ± 95% CI) against its value, every other setting at
    the optimizer's best; diverged or failed values marked at the top. None when nothing was swept."""
    keys = swept_hyperparameters(report)
    if not keys:
        return None
    fig, axes = _figure((6.5 * len(keys), 4.5), 1, len(keys))
    axes = [axes] if len(keys) == 1 else list(axes)
    budget = report["budgets"][-1] if report["budgets"] else None
    for ax, key in zip(axes, keys):
        for i, (optimizer, b) in enumerate(report["best"].items()):
            if b["settings"] is None or key not in b["settings"]:  # an axis of other optimizers only
                continue
            others = {k: v for k, v in b["settings"].items() if k != key}
            cells = [
                c
                for c in report["grid"]
                if c["optimizer"] == optimizer
                and c["budget"] == budget
                and {k: v for k, v in c["settings"].items() if k != key} == others
            ]
            numeric = all(isinstance(c["settings"].get(key), (int, float)) for c in cells)
            ok = sorted(
                (c for c in cells if c["outcome"] == FINISHED),
                key=lambda c: str(c["settings"][key]) if not numeric else c["settings"][key],
            )
            xs = [c["settings"][key] if numeric else str(c["settings"][key]) for c in ok]
            ax.errorbar(
                xs,
                [c["loss_mean"] for c in ok],
                yerr=[c["loss_ci"] or 0.0 for c in ok],
                fmt="-o",
                capsize=3,
                color=f"C{i % 10}",
                label=optimizer,
            )
            for c in cells:
                if c["outcome"] != FINISHED:
                    x = c["settings"][key] if numeric else str(c["settings"][key])
                    ax.plot(
                        [x],
                        [0.95 - 0.05 * i],
                        "x" if c["outcome"] == DIVERGED else "s",
                        color=f"C{i % 10}",
                        transform=ax.get_xaxis_transform(),
                        markersize=9,
                    )
            if numeric and key == "lr":
                ax.set_xscale("log")
        ax.set(title=f"sensitivity to {key} (x: diverged, ■: failed)", xlabel=key, ylabel="final loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _png(fig)


def _lr_line(b: dict) -> Optional[dict]:
    """The choice along the lr of an optimizer's best settings (``selection.LineChoice.to_json``), if it had one."""
    return next((line for line in (b.get("choice") or {}).get("lines", []) if line["setting"] == "lr"), None)


def plot_selection(report: dict) -> Optional[bytes]:
    """One panel per optimizer at the verdict's budget: its selection losses against the lr (each seed's run, and
    the cell's mean), the other settings at its best; the quadratic in log lr fitted over them and its optimum; the
    chosen lr and the lowest cell. None where no optimizer tried two lrs."""
    shown = [(o, b, line) for o, b in report["best"].items() if (line := _lr_line(b)) is not None]
    if not shown:
        return None
    fig, axes = _figure((5.5 * len(shown), 4.5), 1, len(shown))
    axes = [axes] if len(shown) == 1 else list(axes)
    budget = report["budgets"][-1] if report["budgets"] else None
    selection_seeds = set(report["selection_seeds"])
    for i, (ax, (optimizer, b, line)) in enumerate(zip(axes, shown)):
        color = f"C{i % 10}"
        others = {k: v for k, v in b["choice"]["settings"].items() if k != "lr"}
        runs = [
            r
            for r in report["runs"]
            if r["optimizer"] == optimizer
            and r["budget"] == budget
            and r["seed"] in selection_seeds
            and r["rank_loss"] is not None
            and {k: v for k, v in r["settings"].items() if k != "lr"} == others
        ]
        ax.plot([r["lr"] for r in runs], [r["rank_loss"] for r in runs], ".", color=color, alpha=0.5, label="a run")
        finished = [(v, m) for v, m in zip(line["values"], line["means"]) if m is not None]
        ax.plot(*zip(*finished), "o", color=color, label="mean over seeds")
        curve = line["curve"]
        if curve is not None:
            low, high = math.log(min(line["fitted"])), math.log(max(line["fitted"]))
            us = [low + (high - low) * k / 100 for k in range(101)]
            u0 = curve["centre"]
            fitted = [curve["a"] + curve["b"] * (u - u0) + curve["c"] * (u - u0) ** 2 for u in us]
            ax.plot([math.exp(u) for u in us], fitted, "-", color="gray", label="quadratic in log lr")
            if line["optimum"] is not None and min(line["values"]) / 4 <= line["optimum"] <= max(line["values"]) * 4:
                optimum = line["optimum"]
                ax.axvline(optimum, color="gray", linestyle=":", label=f"fitted optimum {optimum:.3g}")
        chosen_mean = line["means"][line["values"].index(line["chosen"])]
        ax.plot([line["chosen"]], [chosen_mean], "*", color="black", markersize=14, label="chosen")
        if line["lowest"] != line["chosen"]:
            lowest_mean = line["means"][line["values"].index(line["lowest"])]
            ax.plot([line["lowest"]], [lowest_mean], "o", mfc="none", mec="red", markersize=13, label="lowest cell")
        how = "fitted" if line["method"] == "fit" else f"lowest cell: {line['fallback'] or 'no fit'}"
        close = " (a close call)" if line["close"] else ""
        ax.set(xscale="log", title=f"{optimizer}: lr {lr_label(line['chosen'])}, {how}{close}", xlabel="lr")
        ax.set(ylabel="selection loss")
        ax.set_xticks(line["values"], [lr_label(v) for v in line["values"]], fontsize="small")
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _png(fig)


def plot_budgets(report: dict) -> Optional[bytes]:
    """(a) the baseline's best loss at each budget with its power-law fit and every optimizer's best losses;
    (b) D_eff / D per optimizer against the budget. None without a fit."""
    fit = report["budget_fit"]
    if fit is None or fit["fit"] is None:
        return None
    f = fit["fit"]
    law = statistics.PowerLaw(f["alpha"], f["beta"], f["gamma"], f["rms_residual"])
    fig, (losses, speedups) = _figure((14, 5), 1, 2)
    budgets = [p["tokens"] for p in fit["points"]]
    low, high = min(budgets) / 1.5, max(budgets) * 1.5
    xs = [low * (high / low) ** (i / 100) for i in range(101)]
    losses.plot(xs, [law.loss(x) for x in xs], "--", color="gray", label=f"{fit['baseline']} fit")
    for i, (optimizer, entries) in enumerate(fit["speedups"].items()):
        color = f"C{i % 10}"
        losses.plot([e["tokens"] for e in entries], [e["loss"] for e in entries], "o", color=color, label=optimizer)
        shown = [e for e in entries if e["speedup"] is not None]
        speedups.plot([e["tokens"] for e in shown], [e["speedup"] for e in shown], "-o", color=color, label=optimizer)
    speedups.axhline(1.0, color="gray", linewidth=0.8)
    losses.set(xscale="log", title="best loss against tokens; L(D) = α·D^(−β) + γ", xlabel="tokens", ylabel="loss")
    speedups.set(xscale="log", title=f"D_eff / D against {fit['baseline']}'s fit", xlabel="tokens", ylabel="speedup")
    for ax in (losses, speedups):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _png(fig)


def plot_sweep(runs: Sequence[SweepRun], report: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(15, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (curves, by_lr), (memory, speed) = fig.subplots(2, 2)
    best = report["best"]
    budget = report["budgets"][-1] if report["budgets"] else None
    grid = [c for c in report["grid"] if c["budget"] == budget and set(c["settings"]) == {"lr"}]
    optimizers = list(best)
    colors = {o: f"C{i % 10}" for i, o in enumerate(optimizers)}
    # A line style per optimizer too: optimizers that train alike (AdamW and its 8-bit form) keep both curves visible.
    dashes = {o: ("-", "--", ":", "-.")[i % 4] for i, o in enumerate(optimizers)}

    # (a) each optimizer's loss curve at its best lr (mean over seeds, band from min to max).
    for optimizer, b in best.items():
        if b["lr"] is None:
            continue
        chosen = _best_runs(runs, optimizer, b, budget)
        seeds = f", {len(chosen)} seeds" if len(chosen) > 1 else ""
        for tag, marker, suffix in ((LOSS, "", ""), (VALIDATION_LOSS, "o", " (validation)")):
            series = [r.scalars[tag] for r in chosen if tag in r.scalars]
            if not series or len(series) != len(chosen):  # none yet: confirmation runs still to come
                continue
            steps, mean, low, high = _mean_curve(series)
            curves.plot(
                steps,
                mean,
                dashes[optimizer] + marker,
                color=colors[optimizer],
                markersize=3,
                label=f"{optimizer} lr {lr_label(b['lr'])}{seeds}{suffix}",
            )
            if len(series) > 1:
                curves.fill_between(steps, low, high, color=colors[optimizer], alpha=0.2)
    curves.set(title="loss at each optimizer's best lr", xlabel="step", ylabel="loss")

    # (b) the ranking loss against lr; diverged and failed lrs marked in a band above the finite values.
    top = by_lr.get_xaxis_transform()  # x in data, y in axes fractions
    for optimizer in optimizers:
        cells = [c for c in grid if c["optimizer"] == optimizer]
        ok = [c for c in cells if c["outcome"] == FINISHED]
        if ok:
            by_lr.errorbar(
                [c["lr"] for c in ok],
                [c["loss_mean"] for c in ok],
                yerr=[c["loss_std"] or 0.0 for c in ok],
                fmt=dashes[optimizer] + "o",
                capsize=3,
                color=colors[optimizer],
                label=optimizer,
            )
        if best[optimizer]["lr"] is not None:
            by_lr.plot(
                [best[optimizer]["lr"]], [best[optimizer]["loss_mean"]], "*", markersize=16, color=colors[optimizer]
            )
    unfinished = any(c["outcome"] != FINISHED for c in grid)
    if by_lr.lines and unfinished:  # keep the finite values in the lower 75% of the panel
        low, high = by_lr.get_ylim()
        by_lr.set_ylim(low, high + (high - low) / 3)
    for index, optimizer in enumerate(optimizers):
        for c in (c for c in grid if c["optimizer"] == optimizer and c["outcome"] != FINISHED):
            marker = "x" if c["outcome"] == DIVERGED else "s"
            # One row per optimizer, so that two optimizers diverging at one lr stay visible.
            by_lr.plot(
                [c["lr"]],
                [0.95 - 0.05 * index],
                marker,
                transform=top,
                color=colors[optimizer],
                markersize=10,
                label=f"{optimizer} lr {lr_label(c['lr'])} {c['outcome']}",
            )
    if unfinished:
        by_lr.plot([0, 1], [0.78, 0.78], ":", color="gray", transform=by_lr.transAxes)
        by_lr.text(0.01, 0.8, "diverged (x) / failed (■)", transform=by_lr.transAxes, fontsize="small", color="gray")
    by_lr.set_xscale("log")
    lrs = sorted({c["lr"] for c in grid})
    by_lr.set_xticks(lrs, [lr_label(lr) for lr in lrs])
    by_lr.minorticks_off()
    by_lr.set(title=f"final loss vs lr (★ best; {report['ranked_by']})", xlabel="peak lr", ylabel="final loss")

    # (c) peak memory and optimizer state; (d) tokens/s.
    x = list(range(len(optimizers)))
    mem_label = (
        "peak memory (RSS)" if any(b["peak_memory_tag"] == "memory/rss(GiB)" for b in best.values()) else "peak memory"
    )
    legend = []
    for offset, key, label, hatch in (
        (-0.2, "peak_memory_gib", mem_label, None),
        (0.2, "optimizer_state_bytes", "optimizer state", "//"),
    ):
        scale = 2**30 if key == "optimizer_state_bytes" else 1
        values = [(best[o][key] or 0.0) / scale for o in optimizers]
        bars = memory.bar(
            [i + offset for i in x],
            values,
            width=0.4,
            label=label,
            hatch=hatch,
            color=[colors[o] for o in optimizers],
            edgecolor="black",
        )
        memory.bar_label(bars, fmt="%.3f", fontsize="small")
        legend.append(Patch(facecolor="white", edgecolor="black", hatch=hatch, label=label))
    memory.set(
        title="peak memory per process; optimizer state over all processes",
        ylabel="GiB",
        xticks=x,
        xticklabels=optimizers,
    )
    memory.legend(handles=legend, fontsize="small")
    mean_tps = [best[o]["mean_tps"] or 0.0 for o in optimizers]
    spread = [
        [m - (best[o]["min_tps"] or m) for o, m in zip(optimizers, mean_tps)],
        [(best[o]["max_tps"] or m) - m for o, m in zip(optimizers, mean_tps)],
    ]
    bars = speed.bar(x, mean_tps, yerr=spread, capsize=4, color=[colors[o] for o in optimizers], edgecolor="black")
    speed.bar_label(bars, fmt="%.0f", fontsize="small", label_type="center")
    speed.set(
        title="tokens/s per process (mean over finished runs; bars: min to max)",
        ylabel="tokens/s",
        xticks=x,
        xticklabels=optimizers,
    )
    for ax in (curves, by_lr, speed):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    memory.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")


# Optimizer health (torchtitan/telemetry/health.py): the role groups each panel shows, one line style per group.
HEALTH_PANELS = (
    ("embedding and output", ("embedding", "output")),
    ("attention q, k, v, o", ("q", "k", "v", "o")),
    ("MLP in and out", ("mlp_in", "mlp_out")),
    ("norms", ("norm",)),
)
HEALTH_QUANTITIES = (("update_rms", "update RMS"), ("update_to_weight", "update / weight"))
ATTN_LOGIT_MAX = "health/attn_logit_max"
WEIGHT_NORM_ALL = "health/weight_norm/all"
_GROUP_STYLES = ("-", "--", ":", "-.")


def _health_curve(scalars: Sequence[dict[str, Series]], tag: str) -> Optional[tuple[list[int], list[float]]]:
    """``tag``'s mean over runs (seeds) at the steps every one of them logged; None if any run lacks it."""
    series = [s[tag] for s in scalars if tag in s]
    if not series or len(series) != len(scalars):
        return None
    steps, mean, _, _ = _mean_curve(series)
    return (steps, mean) if steps else None


def has_health(scalars: dict[str, Series]) -> bool:
    return any(tag.startswith("health/update_rms/") for tag in scalars)


def plot_health(curves: Sequence[tuple[str, Sequence[dict[str, Series]]]]) -> Optional[bytes]:
    """Optimizer health over steps, one colour per entry of ``curves`` (a label and the scalars of its runs, e.g.
    an optimizer's seeds at its best settings; a mean over them is drawn): per group of weights the update RMS (top
    row) and the update-to-weight ratio (bottom row), log scale; the largest attention logit (top right) and the
    weight norm (bottom right). None when no run logged health (``metrics.health_freq`` 0)."""
    curves = [(label, runs) for label, runs in curves if runs and all(has_health(s) for s in runs)]
    if not curves:
        return None
    fig, axes = _figure((22, 8), 2, len(HEALTH_PANELS) + 1)
    for index, (label, runs) in enumerate(curves):
        color = f"C{index % 10}"
        for row, (quantity, name) in enumerate(HEALTH_QUANTITIES):
            for column, (title, groups) in enumerate(HEALTH_PANELS):
                ax = axes[row][column]
                for style, group in zip(_GROUP_STYLES, groups):
                    curve = _health_curve(runs, f"health/{quantity}/{group}")
                    if curve is not None:
                        ax.plot(*curve, style, color=color, label=f"{label}: {group}")
                ax.set(title=f"{name}: {title}", xlabel="step", yscale="log")
        for row, (tag, title) in enumerate(
            ((ATTN_LOGIT_MAX, "largest attention logit"), (WEIGHT_NORM_ALL, "weight norm (all)"))
        ):
            curve = _health_curve(runs, tag)
            if curve is not None:
                axes[row][-1].plot(*curve, "-", color=color, label=label)
            axes[row][-1].set(title=title, xlabel="step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small")
    return _png(fig)


def plot_study_health(runs: Sequence[SweepRun], report: dict) -> Optional[bytes]:
    """:func:`plot_health` at each optimizer's best settings (the largest budget), mean over its seeds."""
    budget = report["budgets"][-1] if report["budgets"] else None
    curves = []
    for optimizer, b in report["best"].items():
        if b["settings"] is None:
            continue
        chosen = _best_runs(runs, optimizer, b, budget)
        curves.append((f"{optimizer} ({settings_label(b['settings'])})", [r.scalars for r in chosen]))
    return plot_health(curves)
