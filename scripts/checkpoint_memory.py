"""How much a checkpoint save and load raise a GPU's peak allocated memory, per optimizer.

    python scripts/checkpoint_memory.py                       # CUDA; every low-bit optimizer and AdamW
    python scripts/checkpoint_memory.py --optimizers AdamW4bit --async-save
    python scripts/checkpoint_memory.py --dry-run             # a tiny model on CPU: the script runs, nothing checked

For each optimizer, one process builds a Llama-shaped model on the GPU, creates the optimizer's state, saves a
checkpoint with the trainer's ``CheckpointManager`` and loads it into a fresh model and optimizer, each time measuring
``torch.cuda.max_memory_allocated`` above what was allocated before. A low-bit optimizer must stay within
``RISE_LIMIT`` times its largest state tensor in float32 (dequantizing one tensor holds its float32 values, the code
values they are scaled from and, for 4-bit, the unpacked codes), far below a float32 copy of all its state, which the
table shows next to it; an optimizer with plain state (AdamW) within one of its largest state tensors (a per-tensor
temporary while loading), not a copy of its state. Both allow ``ALLOCATOR_SLACK`` more. Exits 1 if any rise is over
its limit.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.config.job_config import JobConfig  # noqa: E402
from torchtitan.gpu_check.context import low_bit_names  # noqa: E402
from torchtitan.models.llama import ModelArgs, Transformer  # noqa: E402
from torchtitan.optim import build_optimizers  # noqa: E402
from torchtitan.optim.state.quantized_checkpoint import QuantizedEntry  # noqa: E402

RISE_LIMIT = 2.5  # times the largest quantized state tensor's float32 bytes (2.25 expected for 4-bit)
PLAIN_RISE_LIMIT = 1.0  # times the largest plain state tensor's bytes: one per-tensor temporary
ALLOCATOR_SLACK = 2**20  # the caching allocator's rounding of the few blocks involved, and the steps' scalars
# ~0.5B parameters: the embedding (32000 x 2048) is the largest tensor, a small part of all the state.
GPU_MODEL = ModelArgs(dim=2048, n_layers=8, n_heads=16, vocab_size=32000, max_seq_len=512)
DRY_RUN_MODEL = ModelArgs(dim=256, n_layers=2, n_heads=4, vocab_size=128, multiple_of=256, max_seq_len=8)
MIB = 2**20


def _setup(name: str, args: ModelArgs, device: torch.device, folder: str, async_save: bool):
    argv = [
        "--job.dump_folder", folder,
        "--checkpoint.enable_checkpoint",
        "--checkpoint.folder", "checkpoint",
        "--checkpoint.async_mode", "async" if async_save else "disabled",
        "--optimizer.name", name,
    ]  # fmt: skip
    job = JobConfig.parse_args(argv)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    optimizers = build_optimizers([model], job)
    with torch.compiler.set_stance("force_eager"):  # the state as a fresh optimizer has it, without compiling
        optimizers.state_dict()
    return model, optimizers, CheckpointManager(None, [model], optimizers, None, {}, job)


def _rise(device: torch.device, action) -> int:
    """The peak allocated memory above the current allocation while ``action`` runs (0 on CPU: not measured)."""
    if device.type != "cuda":
        action()
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    action()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure(name: str, args: ModelArgs, device: torch.device, async_save: bool) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as folder:
        _, optimizers, manager = _setup(name, args, device, folder, async_save)
        entries = [v for v in optimizers.state_dict().values() if isinstance(v, QuantizedEntry)]
        plain = [v for v in optimizers.state_dict().values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        # An async save: its staging, until save returns.
        save = _rise(device, functools.partial(manager.save, 1, force=True))
        manager.close()
        del optimizers, manager
        _, fresh_optimizers, fresh_manager = _setup(name, args, device, folder, async_save)
        load = _rise(device, functools.partial(fresh_manager.load, 1))
    return {
        "save": save,
        "load": load,
        "largest": max((e.local_float32_bytes for e in entries), default=0),
        "all": sum(e.local_float32_bytes for e in entries),
        "largest plain": max((v.numel() * v.element_size() for v in plain), default=0),
    }


def rise_limit(measured: dict[str, int]) -> int:
    """The most a save or load may raise the peak: quantized state by its largest tensor's dequantization, plain
    state by one of its largest tensors."""
    quantized = RISE_LIMIT * measured["largest"]
    return int(max(quantized, PLAIN_RISE_LIMIT * measured["largest plain"]) + ALLOCATOR_SLACK)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizers", default=",".join(("AdamW", *low_bit_names())))
    parser.add_argument("--async-save", action="store_true", help="save with checkpoint.async_mode = async")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on CPU; nothing is measured")
    options = parser.parse_args(argv)
    if not options.dry_run and not torch.cuda.is_available():
        print("error: needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if options.dry_run else "cuda")
    args = DRY_RUN_MODEL if options.dry_run else GPU_MODEL
    print(f"{'optimizer':<14}{'save rise':>11}{'load rise':>11}{'largest f32':>13}{'all f32':>10}{'limit':>9}  MiB")
    failed = []
    for name in options.optimizers.split(","):
        m = measure(name, args, device, options.async_save)
        limit = rise_limit(m)
        columns = (("save", 11), ("load", 11), ("largest", 13), ("all", 10))
        print(f"{name:<14}" + "".join(f"{m[key] / MIB:>{width}.1f}" for key, width in columns) + f"{limit / MIB:>9.1f}")
        if device.type == "cuda" and max(m["save"], m["load"]) > limit:
            failed.append(f"{name}: rise {max(m['save'], m['load']) / MIB:.1f} MiB over {limit / MIB:.1f} MiB")
    for line in failed:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
