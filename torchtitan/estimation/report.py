"""The memory estimate as a table for people and as JSON for programs."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.estimation.allocator import Replay
from torchtitan.estimation.simulate import REPLAYED_STEPS, Estimate

GIB, MIB = 2**30, 2**20

# What the simulation cannot see, said with every estimate.
NOT_INCLUDED = (
    "CUDA context and library workspaces (cuBLAS, cuDNN, attention kernels' scratch)",
    "the process-group backend's buffers (NCCL's; on CPU, gloo's temporary copies of gathered tensors)",
    "what the caching allocator reserves for CUDA graphs, cudaMallocAsync, and blocks held by other streams' uses",
    "the data loader, the host memory a checkpoint is staged in, and profiler buffers",
)


def _unit(e: Estimate) -> tuple[str, int]:
    """GiB, or MiB for small models, so that the figures keep two meaningful decimals."""
    largest = max((o.peak for o in e.optimizers), default=0)
    return ("GiB", GIB) if largest >= GIB else ("MiB", MIB)


def _header(e: Estimate) -> list[str]:
    if e.device == "cuda":
        precision = f"{e.param_dtype} parameters, {e.compute_dtype} compute"
        if e.compute_dtype != e.param_dtype:
            data_parallel = e.degrees.get("dp_replicate", 1) * e.degrees.get("dp_shard", 1) > 1
            precision += " (FSDP2 mixed precision)" if data_parallel else " (autocast)"
        simulated = f"CUDA training, {precision}"
    else:
        simulated = f"CPU training, {e.param_dtype} throughout"
    return [
        f"Memory estimate per rank: llama3 {e.flavor} ({e.num_params / 1e9:.2f}B parameters, "
        f"vocabulary {e.vocab_size})",
        f"  layout: {e.world_size} simulated rank(s), {e.layout}; figures are for rank 0",
        f"  batch {e.batch_size} x sequence {e.seq_len} per rank, activation checkpointing: {e.activation_checkpoint}",
        f"  simulated: {simulated}",
    ]


def _aligned(header: tuple[str, ...], rows: list[tuple[str, ...]], text_columns: tuple[int, ...]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) if i in text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in [header, *rows]
    ]


def format_table(e: Estimate) -> str:
    baseline = e.optimizers[0] if e.optimizers else None
    reserved = any(o.reserved for o in e.optimizers)
    header = (
        "optimizer",
        "implementation",
        "parameters",
        "gradients",
        "optimizer state",
        "activations",
        "peak",
        *(("peak reserved",) if reserved else ()),
        "peak saving",
        f"state vs {baseline.label if baseline else '-'}",
        "peak during",
        *(("reserved peak during",) if reserved else ()),
    )
    unit, size = _unit(e)

    def amount(nbytes: int) -> str:
        return f"{nbytes / size:.2f}"

    rows = []
    for o in e.optimizers:
        ratio = o.optimizer_state / baseline.optimizer_state if baseline and baseline.optimizer_state else float("nan")
        job = o.reserved[0] if o.reserved else None
        rows.append(
            (
                o.label,
                o.implementation,
                amount(o.params),
                amount(o.gradients),
                amount(o.optimizer_state),
                amount(o.activations),
                amount(o.peak),
                *((_reserved_amount(job, amount),) if reserved else ()),
                amount(o.checkpoint_save_peak),
                f"{ratio:.2f}x",
                o.peak_phase,
                *((job.peak_reserved_phase,) if reserved else ()),
            )
        )
    text_columns = (0, 1, len(header) - 1, len(header) - 2) if reserved else (0, 1, len(header) - 1)
    lines = _header(e) + ["", f"{unit} per rank", *_aligned(header, rows, text_columns), ""]
    lines.append(
        "peak: the most live tensor memory at any moment of one training step (forward, loss, backward with "
        "clipping, optimizer step), what torch.cuda.max_memory_allocated shows; the columns are not simultaneous, "
        "activations are freed as gradients appear."
    )
    if reserved:
        lines.append(
            f"peak reserved: what the CUDA caching allocator holds from the GPU (torch.cuda.max_memory_reserved, "
            f"nvidia-smi, what an out-of-memory error is about) over the state's creation, {REPLAYED_STEPS} steps and "
            f"a checkpoint save, with PYTORCH_CUDA_ALLOC_CONF={e.alloc_conf} ({e.alloc_conf_source}); "
            f"{_device_memory(e)}."
        )
    lines.append(
        "activations: what the forward pass keeps for backward up to the final norm; the loss (its logits, whole or "
        "one chunk at a time: loss.num_chunks) counts in the peak."
    )
    lines.append(
        "peak saving: the most live tensor memory while a checkpoint is saved after a step (parameters, gradients, "
        "optimizer state, and a low-bit optimizer's float32 values of one state tensor at a time)."
    )
    lines.append(
        "implementation: the optimizer step simulated; with optimizer.implementation unset, torch's AdamW takes "
        "foreach on CUDA (its temporaries each the size of a whole state list) and its per-tensor loop on CPU."
    )
    if reserved:
        lines += ["", *_alloc_conf_table(e, amount)]
    lines += [f"note: {note}" for note in e.notes]
    lines.append("not included: " + "; ".join(NOT_INCLUDED) + ".")
    return "\n".join(lines)


def _reserved_amount(result: Replay, amount) -> str:
    return "out of memory" if result.out_of_memory else amount(result.peak_reserved)


def _device_memory(e: Estimate) -> str:
    if e.device_memory:
        return f"on a GPU of {e.device_memory / GIB:.1f} GiB (memory_estimation.device_memory_gib)"
    return "on a GPU with room to spare (memory_estimation.device_memory_gib unset)"


def _alloc_conf_table(e: Estimate, amount) -> list[str]:
    """Peak reserved under each allocator setting, and what it saves against the job's."""
    header = ("PYTORCH_CUDA_ALLOC_CONF", "optimizer", "peak reserved", "saving vs the job's", "reserved peak during")
    rows = []
    for index, config in enumerate(e.optimizers[0].reserved):
        for o in e.optimizers:
            result, job = o.reserved[index], o.reserved[0]
            saving = (
                "-"
                if index == 0 or result.out_of_memory or job.out_of_memory
                else amount(job.peak_reserved - result.peak_reserved)
            )
            label = config.config.label + (" (the job's)" if index == 0 else "")
            rows.append((label, o.label, _reserved_amount(result, amount), saving, result.peak_reserved_phase))
    return _aligned(header, rows, (0, 1, 4)) + [
        "each setting replays the same allocations and frees; saving: the job's peak reserved minus the setting's."
    ]


def to_json(e: Estimate) -> dict[str, Any]:
    data = dataclasses.asdict(e)
    data["layout"] = e.layout
    for entry, o in zip(data["optimizers"], e.optimizers):
        entry["label"] = o.label
        for replayed in entry["reserved"]:
            replayed["alloc_conf"] = replayed.pop("config")["text"]
    data["units"] = "bytes per rank"
    data["not_included"] = list(NOT_INCLUDED)
    return data
