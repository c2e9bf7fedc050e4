"""What recording checksums costs a checkpoint save: DCP's FileSystemWriter against ChecksummingWriter.

    python benchmarks/bench_checkpoint_checksums.py [--rounds 5] [--fsdp 256] [--folder /tmp]

Four comparisons:
- a save as a run makes it (``CheckpointManager.save``: the state gathered, checked finite, written, published) of
  the debug model (``train_configs/debug_model.toml``) with AdamW's state, its writer ChecksummingWriter or DCP's;
- DCP's save alone (``dcp.save``) of the same state: the upper bound of the relative cost;
- DCP's save alone of one rank's shards of Llama 3 8B under FSDP over ``--fsdp`` ranks (each weight's first dimension
  cut in that many rows; 256 ranks: ~360 MiB a rank, parameters and both moments in float32), shapes from the model's
  own definition (built on the meta device);
- the checksums' own cost, apart from DCP's: the same 8B shards' bytes written into one file, tensor after tensor
  (each with a few small writes before it, as a tensor's header comes), through DCP's file system and through the
  checksumming one (``_HashingFileSystem``): the seconds it adds are what the checksums cost the save above (its
  ratio is of the bytes alone, not of a save).

The two writers take turns, round by round (a shared machine's speed changes touch both alike), each saving into a
fresh folder under ``--folder``; printed: the seconds of each, wall and CPU (this process, all threads), and
the ratio ChecksummingWriter / FileSystemWriter. The target is at most 1.05. The checksum is XXH3-128 over each file
written, computed on the bytes on their way to the file (never read back). Medians and minima are both printed: on a
shared machine the minimum is the steadier estimate of what the work itself costs.
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

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # noqa: E402

from torchtitan.checkpoint import CheckpointManager, manager  # noqa: E402
from torchtitan.checkpoint.integrity import ChecksummingWriter, _HashingFileSystem  # noqa: E402
from torchtitan.config.job_config import JobConfig  # noqa: E402
from torchtitan.config.preflight import preflight  # noqa: E402
from torchtitan.models.llama import Transformer, llama3_configs  # noqa: E402
from torchtitan.optim import build_optimizers  # noqa: E402
from torchtitan.training.step import build_model, init_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

DEBUG_VOCAB = 2256  # the debug config's test tokenizer
LLAMA3_VOCAB = 128256


def state_of(flavor: str, vocab_size: int, shards: int) -> dict[str, torch.Tensor]:
    """Parameters and AdamW's moments of ``flavor``, each cut to one rank's rows of ``shards``, random float32."""
    args = dataclasses.replace(llama3_configs[flavor], vocab_size=vocab_size)
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        rows = -(-shape[0] // shards)
        local = (rows, *shape[1:])
        for kind in ("model", "exp_avg", "exp_avg_sq"):
            state[f"{kind}.{name}"] = torch.randn(local, generator=generator)
    return state


def debug_run(folder: Path):
    """The debug config's model with AdamW's state after one step, and a CheckpointManager saving into ``folder``."""
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
    dims, model_args, _ = preflight(job, 1)
    model = init_model(build_model(job, model_args, dims, None), torch.device("cpu"), job.training.seed)
    optimizers = build_optimizers([model], job)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizers.step()
    checkpoint = CheckpointManager(
        data_loader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=None, states={}, job_config=job
    )
    return model, optimizers, checkpoint


def manager_rounds(rounds: int, folder: Path) -> None:
    """Saves of the debug run through the manager, its writer ChecksummingWriter or DCP's, taking turns."""
    model, optimizers, checkpoint = debug_run(folder)
    writers = {"ChecksummingWriter": manager.ChecksummingWriter, "FileSystemWriter": FileSystemWriter}
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    seconds: dict = {name: [] for name in writers}
    step = 0
    for round_index in range(rounds + 1):
        for name in writers if round_index % 2 == 0 else list(writers)[::-1]:
            manager.ChecksummingWriter = writers[name]
            step += 1
            wall, cpu = time.perf_counter(), time.process_time()
            checkpoint.save(step, force=True)
            if round_index:  # the first round warms up
                seconds[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    manager.ChecksummingWriter = writers["ChecksummingWriter"]
    checkpoint.close()
    report(
        f"debug model, CheckpointManager.save ({size / 2**20:,.0f} MiB of weights, AdamW state 2x that)",
        seconds,
        rounds,
    )


def report(label: str, seconds: dict, rounds: int) -> None:
    """Medians and minima of each writer's (wall, CPU) seconds, and the ratios ChecksummingWriter / FileSystemWriter."""
    lines = []
    for summary in (statistics.median, min):
        base_wall, base_cpu = (summary(s[i] for s in seconds["FileSystemWriter"]) for i in (0, 1))
        wall, cpu = (summary(s[i] for s in seconds["ChecksummingWriter"]) for i in (0, 1))
        lines.append(
            f"  {summary.__name__:6s} FileSystemWriter {base_wall:.3f} s wall, {base_cpu:.3f} s CPU | "
            f"ChecksummingWriter {wall:.3f} s wall, {cpu:.3f} s CPU | ratio {wall / base_wall:.3f} wall, "
            f"{cpu / base_cpu:.3f} CPU"
        )
    print(f"{label}: {rounds} rounds", *lines, sep="\n")


def timed_save(state: dict, writer_class, folder: Path) -> tuple[float, float]:
    target = folder / f"save-{writer_class.__name__}"
    wall, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer_class(str(target)))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    shutil.rmtree(target)
    return wall, cpu


def compare(label: str, state: dict, rounds: int, folder: Path) -> None:
    size = sum(t.numel() * t.element_size() for t in state.values())
    writers = [FileSystemWriter, ChecksummingWriter]
    timed_save(state, FileSystemWriter, folder)  # warm-up: allocator, page cache, imports
    seconds: dict = {w: [] for w in writers}
    for round_index in range(rounds):
        for writer in writers if round_index % 2 == 0 else writers[::-1]:
            seconds[writer].append(timed_save(state, writer, folder))
    report(f"{label}, dcp.save ({size / 2**20:,.0f} MiB)", {w.__name__: v for w, v in seconds.items()}, rounds)


def timed_stream(state: dict, fs: FileSystem, folder: Path) -> tuple[float, float]:
    target = folder / "stream"
    wall, cpu = time.perf_counter(), time.process_time()
    with fs.create_stream(target, "wb") as stream:
        for tensor in state.values():
            for _ in range(38):  # what torch.save writes before a tensor's bytes, in small pieces
                stream.write(b"h" * 40)
            stream.write(memoryview(tensor.numpy()))
            stream.flush()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    target.unlink()
    return wall, cpu


def compare_streams(label: str, state: dict, rounds: int, folder: Path) -> None:
    size = sum(t.numel() * t.element_size() for t in state.values())
    systems = {"FileSystemWriter": FileSystem(), "ChecksummingWriter": _HashingFileSystem()}
    timed_stream(state, systems["FileSystemWriter"], folder)
    seconds: dict = {name: [] for name in systems}
    for round_index in range(rounds):
        for name in systems if round_index % 2 == 0 else list(systems)[::-1]:
            seconds[name].append(timed_stream(state, systems[name], folder))
    report(f"{label}, the bytes alone through each writer's file system ({size / 2**20:,.0f} MiB)", seconds, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fsdp", type=int, default=256, help="ranks the 8B model is sharded over")
    parser.add_argument("--folder", default=None, help="where the saves go (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        manager_rounds(args.rounds, Path(folder) / "run")
        compare("debug model, whole", state_of("debugmodel", DEBUG_VOCAB, 1), args.rounds, Path(folder))
        state = state_of("8B", LLAMA3_VOCAB, args.fsdp)
        compare(f"8B, one rank of FSDP {args.fsdp}", state, args.rounds, Path(folder))
        compare_streams(f"8B, one rank of FSDP {args.fsdp}", state, args.rounds, Path(folder))


if __name__ == "__main__":
    main()
