"""What recording checksums costs a checkpoint save: DCP's FileSystemWriter against ChecksummingWriter.

    python benchmarks/bench_checkpoint_checksums.py [--rounds 9] [--fsdp 256] [--folder /tmp]

Two sizes: the debug model (``train_configs/debug_model.toml``) whole, and one rank's shards of Llama 3 8B under FSDP
over ``--fsdp`` ranks (each weight's first dimension cut in that many rows, shapes from the model's own definition
built on the meta device; 256 ranks: ~360 MiB a rank, parameters and both of AdamW's moments in float32). At each:
- the save a run makes (``CheckpointManager.save``: the state gathered, checked finite, written, published, the
  one before pruned) of the model with AdamW's state after a step, its writer ChecksummingWriter or DCP's (the 8B
  shards as a module of the same names and shapes);
- DCP's save alone (``dcp.save``) of parameters and moments: the checksums' upper bound, relative to the least work.

Both writers are DCP's as users run them: one writing thread, each file fsynced (``sync_files``). The two take turns,
round by round (a shared machine's speed changes touch both alike), each saving into a fresh folder under
``--folder``; printed for each: the median and the minimum of its wall and CPU seconds (this process, all threads),
the ratio ChecksummingWriter / FileSystemWriter of those, and the median of the rounds' own CPU ratios (each round's
two saves ran back to back: the steadiest estimate on a shared machine). Then, from as many more checksumming saves,
the hash's own CPU seconds (timed call by call where it runs: on bytes the file has just taken, still in the CPU's
cache), as a share of FileSystemWriter's median save. The target is at most 1.05. FileSystemWriter is DCP's as users
run it, computing torch.save's CRC32 of each record; ChecksummingWriter leaves that CRC32 out (nothing checks it), so
its ratio can sit below 1: the hash's own share is then the cost of checksums on their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # noqa: E402

from torchtitan.checkpoint import CheckpointManager, integrity, manager  # noqa: E402
from torchtitan.checkpoint.integrity import ChecksummingWriter  # noqa: E402
from torchtitan.config.job_config import JobConfig  # noqa: E402
from torchtitan.config.preflight import preflight  # noqa: E402
from torchtitan.models.llama import Transformer, llama3_configs  # noqa: E402
from torchtitan.optim import build_optimizers  # noqa: E402
from torchtitan.training.step import build_model, init_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_XXH3_128 = xxhash.xxh3_128

DEBUG_VOCAB = 2256  # the debug config's test tokenizer
LLAMA3_VOCAB = 128256


def shard_shapes(flavor: str, vocab_size: int, shards: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in one rank's shard of ``flavor`` under FSDP over ``shards`` ranks (first dim cut)."""
    args = dataclasses.replace(llama3_configs[flavor], vocab_size=vocab_size)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
    return {name: (-(-shape[0] // shards), *shape[1:]) for name, shape in shapes.items()}


def state_of(flavor: str, vocab_size: int, shards: int) -> dict[str, torch.Tensor]:
    """Parameters and AdamW's moments of ``flavor``, each cut to one rank's rows of ``shards``, random float32."""
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in shard_shapes(flavor, vocab_size, shards).items():
        for kind in ("model", "exp_avg", "exp_avg_sq"):
            state[f"{kind}.{name}"] = torch.randn(shape, generator=generator)
    return state


def shard_module(flavor: str, vocab_size: int, shards: int) -> nn.Module:
    """A module holding one rank's shards of ``flavor`` as its parameters, under the model's own names."""
    generator = torch.Generator().manual_seed(0)
    root = nn.Module()
    for name, shape in shard_shapes(flavor, vocab_size, shards).items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        module.register_parameter(leaf, nn.Parameter(torch.randn(shape, generator=generator)))
    return root


def manager_of(folder: Path, model: Optional[nn.Module] = None) -> CheckpointManager:
    """A CheckpointManager saving into ``folder`` the debug config's job with ``model`` (default: the debug config's
    model) and AdamW's state after one step."""
    job = JobConfig.parse_args(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "debug_model.toml"),
            "--job.dump_folder",
            str(folder),
            "--checkpoint.enable_checkpoint",
            "--checkpoint.keep_latest_k",
            "1",
        ]
    )
    if model is None:
        dims, model_args, _ = preflight(job, 1)
        model = init_model(build_model(job, model_args, dims, None), torch.device("cpu"), job.training.seed)
    optimizers = build_optimizers([model], job)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizers.step()
    return CheckpointManager(
        data_loader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None, states={}, job_config=job
    )


class _TimedDigest:
    """XXH3-128 whose updates add the CPU seconds they take to ``spent`` (this thread's: DCP writes on the calling
    thread)."""

    spent = 0.0

    def __init__(self) -> None:
        self._digest = _XXH3_128()

    def update(self, data) -> None:
        start = time.thread_time()
        self._digest.update(data)
        _TimedDigest.spent += time.thread_time() - start

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def measure(label: str, save, rounds: int) -> None:
    """``save(writer_class)`` with each writer in turn, round by round, then with the hash timed; the report."""
    writers = [FileSystemWriter, ChecksummingWriter]
    save(FileSystemWriter)  # warm-up: allocator, page cache, imports
    seconds: dict = {w.__name__: [] for w in writers}
    for round_index in range(rounds):
        for writer in writers if round_index % 2 == 0 else writers[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            save(writer)
            seconds[writer.__name__].append((time.perf_counter() - wall, time.process_time() - cpu))
    hashing = []
    integrity.xxhash = SimpleNamespace(xxh3_128=_TimedDigest)
    try:
        for _ in range(rounds):  # apart from the rounds above, which the timing's own calls must not touch
            _TimedDigest.spent = 0.0
            save(ChecksummingWriter)
            hashing.append(_TimedDigest.spent)
    finally:
        integrity.xxhash = xxhash
    report(label, seconds, rounds, hashing)


def manager_rounds(label: str, rounds: int, folder: Path, model: Optional[nn.Module] = None) -> None:
    """Saves through the manager, its writer ChecksummingWriter or DCP's."""
    checkpoint = manager_of(folder, model)
    size = sum(t.numel() * t.element_size() for t in checkpoint._model_state().values())
    step = 0

    def save(writer) -> None:
        nonlocal step
        step += 1
        manager.ChecksummingWriter = writer
        try:
            checkpoint.save(step, force=True)
        finally:
            manager.ChecksummingWriter = ChecksummingWriter

    measure(f"{label}, CheckpointManager.save ({size / 2**20:,.0f} MiB of weights, AdamW state 2x that)", save, rounds)
    checkpoint.close()


def dcp_rounds(label: str, state: dict, rounds: int, folder: Path) -> None:
    """DCP's save alone of ``state``, each into a fresh folder."""

    def save(writer) -> None:
        target = folder / f"save-{writer.__name__}"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=writer(str(target)))
        shutil.rmtree(target)

    size = sum(t.numel() * t.element_size() for t in state.values())
    measure(f"{label}, dcp.save ({size / 2**20:,.0f} MiB)", save, rounds)


def report(label: str, seconds: dict, rounds: int, hashing: list) -> None:
    """Medians and minima of each writer's (wall, CPU) seconds, the ratios ChecksummingWriter / FileSystemWriter, the
    median of the rounds' own CPU ratios and the hash's own CPU seconds."""
    lines = []
    base_seconds, checksummed = seconds["FileSystemWriter"], seconds["ChecksummingWriter"]
    for summary in (statistics.median, min):
        base_wall, base_cpu = (summary(s[i] for s in base_seconds) for i in (0, 1))
        wall, cpu = (summary(s[i] for s in checksummed) for i in (0, 1))
        lines.append(
            f"  {summary.__name__:6s} FileSystemWriter {base_wall:.3f} s wall, {base_cpu:.3f} s CPU | "
            f"ChecksummingWriter {wall:.3f} s wall, {cpu:.3f} s CPU | ratio {wall / base_wall:.3f} wall, "
            f"{cpu / base_cpu:.3f} CPU"
        )
    paired = statistics.median(s[1] / base[1] for s, base in zip(checksummed, base_seconds))
    spent = statistics.median(hashing)
    share = spent / statistics.median(s[1] for s in base_seconds)
    lines.append(f"  median of the rounds' CPU ratios {paired:.3f}")
    lines.append(f"  the hash itself: {spent * 1e3:.1f} ms of CPU a save (median), {share:.1%} of the save")
    print(f"{label}: {rounds} rounds", *lines, sep="\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--fsdp", type=int, default=256, help="ranks the 8B model is sharded over")
    parser.add_argument("--folder", default=None, help="where the saves go (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shards = f"8B, one rank of FSDP {args.fsdp}"
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        manager_rounds("debug model", args.rounds, Path(folder) / "debug")
        manager_rounds(shards, args.rounds, Path(folder) / "8B", shard_module("8B", LLAMA3_VOCAB, args.fsdp))
        dcp_rounds("debug model", state_of("debugmodel", DEBUG_VOCAB, 1), args.rounds, Path(folder))
        dcp_rounds(shards, state_of("8B", LLAMA3_VOCAB, args.fsdp), args.rounds, Path(folder))


if __name__ == "__main__":
    main()
