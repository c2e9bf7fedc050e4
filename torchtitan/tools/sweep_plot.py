"""The sweep's figure: loss at each optimizer's best lr, final loss against lr, memory, and tokens/s."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from torchtitan.tools.runs import LOSS, VALIDATION_LOSS, Series, SweepRun
from torchtitan.tools.sweep_plan import DIVERGED, FINISHED, lr_label


def _mean_curve(series: Sequence[Series]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean, min and max over runs at the steps every run logged."""
    steps = sorted(set.intersection(*(set(s.steps) for s in series)))
    columns = [[dict(zip(s.steps, s.values))[step] for s in series] for step in steps]
    return steps, [sum(c) / len(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


def plot_sweep(runs: Sequence[SweepRun], report: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(15, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    (curves, by_lr), (memory, speed) = fig.subplots(2, 2)
    best, grid = report["best"], report["grid"]
    optimizers = list(best)
    colors = {o: f"C{i % 10}" for i, o in enumerate(optimizers)}
    # A line style per optimizer too: optimizers that train alike (AdamW and its 8-bit form) keep both curves visible.
    dashes = {o: ("-", "--", ":", "-.")[i % 4] for i, o in enumerate(optimizers)}

    # (a) each optimizer's loss curve at its best lr (mean over seeds, band from min to max).
    for optimizer, b in best.items():
        if b["lr"] is None:
            continue
        chosen = [r for r in runs if r.spec.optimizer == optimizer and r.spec.lr == b["lr"]]
        seeds = f", {len(chosen)} seeds" if len(chosen) > 1 else ""
        for tag, marker, suffix in ((LOSS, "", ""), (VALIDATION_LOSS, "o", " (validation)")):
            series = [r.scalars[tag] for r in chosen if tag in r.scalars]
            if len(series) != len(chosen):
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
