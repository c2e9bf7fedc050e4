"""What the tests share: the tiny Llama, job configs, tensor comparisons, train.py runs on the debug model and what
they log, and a small checkpointed training setup.

Processes are started through tests/processes.py; gloo workers come from tests/distributed.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from tests import processes
from tests.distributed import free_port, launch_env
from torchtitan.checkpoint import CheckpointManager, SafeFileSystemReader, SafeLoadPlanner
from torchtitan.config.job_config import JobConfig
from torchtitan.models.llama import ModelArgs, Transformer
from torchtitan.models.roles import canonical_name
from torchtitan.optim import AdamMini, build_optimizers
from torchtitan.optim.adam_mini.partition import PER_ROW
from torchtitan.optim.container import tensor_bytes
from torchtitan.training.lr_scheduling import SchedulersContainer

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.py")
DEBUG_CONFIG = str(ROOT / "train_configs" / "debug_model.toml")

# ------------------------------------------------------------------------------------------------------------------
# The tiny Llama

SEQ_LEN = 8  # divisible by tensor-parallel degree 2 (sequence parallelism splits it)
# GQA (4 query heads, 2 key/value heads of 8 rows each), so that tensor parallelism splits both head counts, and
# sizes that FSDP splits unevenly over 2, 3 and 4 ranks (vocabulary 67; the 16 key rows over 3 ranks).
TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=67, multiple_of=16, max_seq_len=SEQ_LEN)
# The tiny model shaped like Llama 3.1 (llama3 RoPE scaling) and Llama 3.2 (tied and scaled). The original context
# puts the tiny head's four frequencies in all three of llama3 scaling's bands (kept, blended, divided by the
# factor) at the default theta.
LLAMA31_TINY = dataclasses.replace(
    TINY,
    rope_scaling="llama3",
    rope_scaling_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=8.0,
    rope_original_max_seq_len=1000,
)
LLAMA32_TINY = dataclasses.replace(LLAMA31_TINY, rope_scaling_factor=32.0, enable_weight_tying=True)
TIED_TINY = dataclasses.replace(TINY, enable_weight_tying=True)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def tiny_model(args: ModelArgs = TINY, dtype: torch.dtype = torch.float64, seed: int = 0) -> Transformer:
    """The test model, built in ``dtype`` and initialised identically wherever it is built."""
    with default_dtype(dtype):
        model = Transformer(args)
    model.init_weights(seed)
    return model


def meta_model(args: ModelArgs = TINY, dtype: torch.dtype = torch.float64) -> Transformer:
    with torch.device("meta"), default_dtype(dtype):
        return Transformer(args)


def materialize(model: Transformer, seed: int = 0) -> Transformer:
    """A (parallelized) meta model on CPU, initialised as ``tiny_model(seed=seed)`` is."""
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.train()


def fsdp(model: Transformer, mesh) -> Transformer:
    """FSDP2 over ``mesh``: every transformer block, then the root (as train.py shards)."""
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def job_config(*argv: str, **sections: dict) -> JobConfig:
    """A JobConfig parsed from the command line ``argv``, then ``section={"key": value}`` set as given (unchecked,
    as a tool that builds a config in code would)."""
    config = JobConfig.parse_args(list(argv))
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    return config


# ------------------------------------------------------------------------------------------------------------------
# Tensors


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor; a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def max_over_ranks(count: int) -> int:
    """The largest ``count`` of all ranks (itself without a process group): for ``read_state(agree_on_count=...)``."""
    if not dist.is_initialized():
        return count
    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole copies of the parameters, by canonical name (the same names however the model is wrapped)."""
    return {canonical_name(name): full(p).detach().clone() for name, p in model.named_parameters()}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(name): full(p.grad).detach().clone() for name, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between same-named tensors (in float64); the names must agree."""
    assert a.keys() == b.keys()
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def to_numpy(value):
    """numpy copies of a tensor or of a dict of tensors (whole, bfloat16 widened exactly to float32), for results
    that travel through a multiprocessing queue: tensors would share memory with a process that has gone."""
    if isinstance(value, dict):
        return {key: to_numpy(tensor) for key, tensor in value.items()}
    value = full(value).detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy().copy()


def initial_state_bytes(optimizers) -> int:
    """An optimizers container's bytes of state as a fresh run has them (created first, as train.py does)."""
    optimizers.initialise_state()
    return optimizers.state_bytes()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's state on this rank (meta and fake tensors count their size)."""
    return sum(tensor_bytes(value) for state in optimizer.state.values() for value in state.values())


# ------------------------------------------------------------------------------------------------------------------
# One training step of the tiny model, for comparing a parallelized model with the same model in one process

BATCH = 12  # divisible by every data-parallel degree tested (2, 3, 4)
LR = 1e-2


def batch(seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed global batch of BATCH sequences of SEQ_LEN tokens: (inputs, labels)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def micro_batches(accumulation: int, dp_rank: int, dp_degree: int, seed: int):
    """This rank's micro-batches of the global batch ``batch(seed)``, in the data loader's order."""
    inputs, labels = batch(seed)
    rows = BATCH // (accumulation * dp_degree)
    for m in range(accumulation):
        start = (m * dp_degree + dp_rank) * rows
        yield inputs[start : start + rows], labels[start : start + rows]


def with_ignored_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` with every third position of each sequence ignored (-100): the same count in every sequence, so
    that every data-parallel share holds as many targets."""
    ignored = labels.clone()
    ignored[:, ::3] = -100
    return ignored


def adamw_step(model: Transformer, inputs, labels, loss_context=contextlib.nullcontext, loss_chunks: int = 1) -> dict:
    """One forward, backward and foreach-AdamW step, the loss over ``loss_chunks`` chunks of tokens.

    Returns the mean cross-entropy ("loss"), and the whole gradients ("grads") and updated weights ("weights") keyed
    by canonical parameter name. foreach AdamW fails when DTensor and plain parameters are mixed, so the step also
    checks that tensor parallelism left no plain parameter behind.
    """
    with loss_context():
        loss = model(inputs, labels=labels, loss_chunks=loss_chunks)
        loss.backward()
    gradients = grads(model)
    torch.optim.AdamW(model.parameters(), lr=LR, foreach=True).step()
    return {"loss": full(loss).item(), "grads": gradients, "weights": weights(model)}


def reference_step(args: ModelArgs = TINY) -> dict:
    """adamw_step of the plain tiny float64 model (of shape ``args``) on batch()."""
    return adamw_step(materialize(meta_model(args)), *batch())


# ------------------------------------------------------------------------------------------------------------------
# Adam-mini on the tiny model, with synthetic gradients

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def synthetic_grad(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    """A deterministic float64 gradient for (parameter name, step), with rows of very different scales."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 100 + step)
    grad = torch.randn(shape, generator=generator, dtype=torch.float64)
    if grad.dim() >= 2:
        grad *= torch.rand(shape[0], 1, generator=generator, dtype=torch.float64) * 3 + 0.1
    return grad


def set_synthetic_grads(model: torch.nn.Module, step: int) -> None:
    """Every parameter's ``synthetic_grad`` for ``step``, in the parameter's dtype."""
    for name, p in model.named_parameters():
        p.grad = synthetic_grad(name, tuple(p.shape), step).to(p.dtype)


def grad_from_values(name: str, param: torch.Tensor, step: int) -> torch.Tensor:
    """A deterministic gradient computed entry by entry from the parameter's current values.

    Every shard of a sharded parameter computes its own part without knowing where it sits, so the gradients of
    a distributed run do not depend on how DTensor maps shards to ranks.
    """
    values = param.detach()
    salt = zlib.crc32(name.encode()) % 97
    return torch.sin(values * 100 + (step + salt)) * (values.abs() * 10 + 1)


def adam_mini_for(model: Transformer, **options) -> AdamMini:
    """AdamMini with HYPER (and ``options``) on a Llama, its shape and roles taken from the model."""
    args = model.args
    return AdamMini(
        model.named_parameters(),
        **{**HYPER, **options},
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        param_roles=model.named_param_roles(),
    )


def muon_for(model: torch.nn.Module, *argv: str, name: str = "Muon") -> torch.optim.Optimizer:
    """Muon (or NorMuon, by ``name``) as the builder makes it, with HYPER's lr and float64 Newton–Schulz (exact
    across layouts), plus ``argv``."""
    argv = ("--optimizer.name", name, "--optimizer.lr", str(HYPER["lr"]), "--optimizer.ns_dtype", "float64", *argv)
    return build_optimizers([model], job_config(*argv)).optimizers[0]


def normuon_for(model: torch.nn.Module, *argv: str) -> torch.optim.Optimizer:
    """NorMuon as :func:`muon_for` makes Muon."""
    return muon_for(model, *argv, name="NorMuon")


def ademamix_for(model: torch.nn.Module, *argv: str) -> torch.optim.Optimizer:
    """AdEMAMix as the builder makes it, with HYPER's lr, beta3 0.99 and a warm-up of 4 steps (a run of 5 steps
    passes through both schedules and past their end), plus ``argv``."""
    options = ("--optimizer.lr", str(HYPER["lr"]), "--optimizer.ademamix_beta3", "0.99")
    warmup = ("--optimizer.ademamix_warmup_steps", "4")
    return build_optimizers([model], job_config("--optimizer.name", "AdEMAMix", *options, *warmup, *argv)).optimizers[0]


def run_single_process(
    steps: int, value_blocks: str = PER_ROW, grads_from_values: bool = False, **options
) -> dict[str, torch.Tensor]:
    """Parameters of the tiny float64 model after ``steps`` AdamMini steps on synthetic gradients."""
    model = tiny_model()
    optimizer = adam_mini_for(model, value_blocks=value_blocks, **options)
    for step in range(steps):
        if grads_from_values:
            for name, p in model.named_parameters():
                p.grad = grad_from_values(name, p, step)
        else:
            set_synthetic_grads(model, step)
        optimizer.step()
    return weights(model)


def debug_model(job: JobConfig, vocab_size: int, mesh, parallel_dims, device: torch.device) -> Transformer:
    """``job``'s model with ``vocab_size`` tokens, parallelized and initialised as train.py builds it, on ``device``."""
    from torchtitan.config.preflight import model_args_for
    from torchtitan.parallelisms import parallelize_llama

    with torch.device("meta"):
        model = Transformer(model_args_for(job, vocab_size))
    parallelize_llama(model, mesh, parallel_dims, job)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model.train()


def random_batches(job: JobConfig, vocab_size: int, seed: int):
    """Endless (inputs, labels) of ``job``'s batch shape, drawn uniformly from ``vocab_size`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    t = job.training
    while True:
        yield tuple(torch.randint(0, vocab_size, (t.batch_size, t.seq_len), generator=generator) for _ in range(2))


# ------------------------------------------------------------------------------------------------------------------
# train.py on the debug model, and what it logs

# A short debug-model run: 6 steps of 2 sequences of 32 tokens, every step logged. Later options override these.
DEBUG_RUN = [
    "--job.config_file",
    DEBUG_CONFIG,
    "--training.seq_len",
    "32",
    "--training.batch_size",
    "2",
    "--training.steps",
    "6",
    "--training.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
]
LOSS = "loss_metrics/global_avg_loss"
# Saves stall in this script's processes (see tests/stall_in_save.py): a test SIGKILLs them mid-save.
STALL_IN_SAVE = str(ROOT / "tests" / "stall_in_save.py")
# One rank dies once after a chosen step, so that torchrun restarts the group (see tests/kill_rank_once.py).
KILL_RANK_ONCE = str(ROOT / "tests" / "kill_rank_once.py")


def train_command(args: Sequence[str], nproc: int = 1, script: str = TRAIN) -> list[str]:
    """``script`` (train.py) with ``args``: in this Python for one process (no process group), under torchrun for
    more."""
    if nproc == 1:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def restartable_command(script: str, *args: str, nproc: int = 2) -> list[str]:
    """``script`` under torchrun with one restart allowed, on a port of its own (static rendezvous, as on a
    cluster: the agent's store lives through the restart)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--max-restarts",
        "1",
        "--master-port",
        str(free_port()),
        script,
        *args,
    ]


def train(dump, *args: str, nproc: int = 1, cpu: bool = False, check: bool = True, base: Sequence[str] = DEBUG_RUN):
    """Run train.py with ``base`` and ``args``, dumping into ``dump``; on CPU when ``cpu`` or when the machine has
    fewer GPUs than ``nproc``. The finished process (a CompletedProcess); with ``check``, it must have exited 0."""
    command = train_command([*base, "--job.dump_folder", str(dump), *args], nproc)
    env = launch_env(nproc, cpu, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = processes.run(command, cwd=ROOT, env=env, timeout=600)
    if check:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def run_dirs(dump, optimizer: str = "") -> list[Path]:
    """The run folders train.py logged into under ``dump`` (those of ``optimizer``), oldest first."""
    return [Path(d) for d in sorted(glob.glob(str(Path(dump) / "tb" / f"*_{optimizer}*")))]


def run_dir(dump, optimizer: str = "") -> Path:
    """The one run folder under ``dump``."""
    dirs = run_dirs(dump, optimizer)
    assert len(dirs) == 1, dirs
    return dirs[0]


def metric_rows(run: Path) -> list[dict]:
    """A run folder's metrics.jsonl, row by row."""
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def by_step(rows: list[dict], tag: str = LOSS) -> dict[int, float]:
    """``tag``'s value at each step that logged it (a later row for the same step wins)."""
    return {row["step"]: row[tag] for row in rows if tag in row}


def losses(dump) -> list[float]:
    """The training losses logged by the one run under ``dump``, step by step."""
    return list(by_step(metric_rows(run_dir(dump))).values())


# What train.py logs to TensorBoard and metrics.jsonl at every logged step.
PER_STEP_TAGS = [
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "lr",
    "throughput/tps",
    "throughput/tokens_seen",
]


def event_tags(path) -> set[str]:
    """The scalar tags of the TensorBoard events in ``path``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path))
    events.Reload()
    return set(events.Tags()["scalars"])


def read_checkpoint(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole (DCP reshards the saved shards into full tensors)."""
    reader = SafeFileSystemReader(str(path))
    entries = reader.read_metadata().state_dict_metadata
    state = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in entries.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    return state


# ------------------------------------------------------------------------------------------------------------------
# A small checkpointed training setup, in this process or in gloo workers: the tiny float64 Llama (FSDP2 when
# distributed), AdamW behind the optimizer container's checkpoint interface, one LambdaLR, a stateful loader keeping
# the data order contract, and a step counter, all saved by the project's CheckpointManager.

CHECKPOINT_SEED = 5
GLOBAL_BATCH = 6  # divisible by the world sizes 1, 2, 3


class Windows(IterableDataset):
    """Global window g is random tokens seeded by g; rank r of W takes windows k*W*B + r*B ... of global batch k.

    Its state (batches consumed) is world-size independent, like the project's loaders.
    """

    def __init__(self, rank: int, world_size: int, local_batch: int):
        self.rank, self.world_size, self.local_batch = rank, world_size, local_batch
        self.batches = 0

    def __iter__(self):
        while True:
            first = self.batches * self.world_size * self.local_batch + self.rank * self.local_batch
            self.batches += 1  # counted as the batch starts: the loader reads our state between batches
            for g in range(first, first + self.local_batch):
                generator = torch.Generator().manual_seed(1000 + g)
                yield torch.randint(0, TINY.vocab_size, (SEQ_LEN + 1,), generator=generator)

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


class Optimizers:
    """The optimizer container's checkpoint interface around one AdamW."""

    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state):
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self.options)


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step, "history": (1, 2.5, "x")}

    def load_state_dict(self, state):
        assert state["history"] == (1, 2.5, "x")  # tuples survive the JSON encoding
        self.step = state["step"]


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def checkpoint_job(dump_folder: str, steps: int = 4, **checkpoint) -> JobConfig:
    """A job of ``steps`` steps saving into ``{dump_folder}/checkpoint``, with ``[checkpoint]`` options."""
    # An explicit folder is used as given, with no per-optimizer-state subfolder.
    return job_config(
        job={"dump_folder": dump_folder},
        training={"steps": steps},
        checkpoint={"enable_checkpoint": True, "folder": "checkpoint", **checkpoint},
    )


def hf_job(dump_folder: str, **checkpoint) -> JobConfig:
    """A one-step float64 job of the tiny model checkpointing into ``{dump_folder}/checkpoint`` (Hugging Face tests)."""
    return job_config(
        job={"dump_folder": dump_folder},
        training={"steps": 1, "param_dtype": "float64"},
        checkpoint={"folder": "checkpoint", **checkpoint},
    )


def tiny_manager(model: Transformer, job: JobConfig) -> CheckpointManager:
    """A CheckpointManager of ``model`` alone, with the job's optimizer (no data loader, no schedules)."""
    return CheckpointManager(
        data_loader=None,
        model_parts=[model],
        optimizers=build_optimizers([model], job),
        lr_schedulers=None,
        states={},
        job_config=job,
    )


class Trainer:
    def __init__(self, config: JobConfig):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        model = meta_model()
        if dist.is_initialized():
            fsdp(model, init_device_mesh("cpu", (world_size,)))
        self.model = materialize(model, seed=CHECKPOINT_SEED)
        self.optimizers = Optimizers(self.model)
        self.schedulers = SchedulersContainer([LambdaLR(self.optimizers.optimizer, warmup)])
        self.loader = StatefulDataLoader(
            Windows(rank, world_size, GLOBAL_BATCH // world_size), batch_size=GLOBAL_BATCH // world_size
        )
        self.train_state = TrainState()
        self.checkpoint = CheckpointManager(
            data_loader=self.loader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.schedulers,
            states={"train_state": self.train_state},
            job_config=config,
        )
        self.batches = None
        self.last_step = config.training.steps

    def step(self) -> float:
        """One training step; the global mean loss."""
        if self.batches is None:
            self.batches = iter(self.loader)  # after a load, so that the restored position applies
        tokens = next(self.batches)
        loss = F.cross_entropy(self.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizers.optimizer.step()
        self.schedulers.step()
        self.optimizers.optimizer.zero_grad()
        self.train_state.step += 1
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        self.checkpoint.save(self.train_state.step, force=self.train_state.step == self.last_step)
        return total.item()

    def run(self, until: int) -> list[float]:
        return [self.step() for _ in range(self.train_state.step, until)]

    def snapshot(self) -> dict:
        """Full (unsharded) parameters and optimizer state as numpy, plus the plain state, on every rank."""
        whole = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        params = get_model_state_dict(self.model, options=whole)
        optim = get_optimizer_state_dict(self.model, self.optimizers.optimizer, options=whole)
        arrays = {f"param/{k}": to_numpy(v) for k, v in params.items()}
        for name, state in optim["state"].items():
            arrays.update({f"optim/{name}/{key}": to_numpy(value) for key, value in state.items()})
        return {
            "arrays": arrays,
            "lr": self.optimizers.optimizer.param_groups[0]["lr"],
            "scheduler_epoch": self.schedulers.schedulers[0].last_epoch,
            "loader": self.loader.state_dict()["dataset_state"],
            "step": self.train_state.step,
        }


def assert_same_snapshot(actual: dict, expected: dict) -> None:
    """Bit for bit the same parameters and optimizer state, and the same lr, schedule, data position and step."""
    assert actual["arrays"].keys() == expected["arrays"].keys()
    for key, value in expected["arrays"].items():
        np.testing.assert_array_equal(actual["arrays"][key], value, err_msg=key)
    for key in ("lr", "scheduler_epoch", "loader", "step"):
        assert actual[key] == expected[key], key


# ------------------------------------------------------------------------------------------------------------------
# Counting collectives


class _NoModuleTracking:
    """Stands in for CommDebugMode's per-module tracker, whose forward hooks lose their place under FSDP2's."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False
    module_parents_dict = {"Global": set()}

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


class CollectiveCounts(CommDebugMode):
    """CommDebugMode over whole training steps (FSDP2 forward and backward included); ``counts()`` maps a
    collective's short name (``allreduce_``, ``reduce_scatter_tensor_``, ...) to how often it ran."""

    def __init__(self):
        super().__init__()
        self.advanced_module_tracker = _NoModuleTracking()

    def counts(self) -> dict[str, int]:
        return {str(op).rsplit(".", 1)[-1]: n for op, n in self.get_comm_counts().items() if n}


# ------------------------------------------------------------------------------------------------------------------
# A Hugging Face tokenizer made here


def hf_tokenizer_folder(folder, tiktoken_file: str | None = None) -> Path:
    """``folder`` with the ``tokenizer.json`` (and ``tokenizer_config.json``) of the tiktoken file, converted by
    transformers' own converter (the way Llama 3's tokenizer.json was made); default: the bundled test tokenizer."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from torchtitan.datasets.tokenizer import BOS_TOKEN, EOS_TOKEN, LLAMA3_SPLIT_PATTERN, llama3_special_tokens

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    converter = TikTokenConverter(
        vocab_file=tiktoken_file or str(ROOT / "assets" / "tokenizer" / "tiktoken_test.model"),
        pattern=LLAMA3_SPLIT_PATTERN,
        extra_special_tokens=llama3_special_tokens(),
    )
    converter.converted().save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# ----------------------------------------------------------------------------------------------------------------
# The sweep: tests/sweep_fake_trainer.py stands in for run_llama_train.sh

FAKE = f"{sys.executable} {ROOT / 'tests' / 'sweep_fake_trainer.py'}"


def sweep_env(**extra) -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        **extra,
    }


def logged(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one tag over all event folders of a run, read straight from TensorBoard, later wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = sorted({p.parent for p in run_dir.rglob("events.out.tfevents*")})
    by_step: dict[int, float] = {}
    for folder in folders:
        acc = EventAccumulator(str(folder))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            by_step.update((e.step, e.value) for e in acc.Scalars(tag))
    return sorted(by_step.items())


def attempts(run_dir: Path) -> int:
    """How many times the sweep launched this run: each launch writes its command line to train.log."""
    return sum(line.startswith("$ ") for line in (run_dir / "train.log").read_text().splitlines())


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.rglob("*") if p.is_file()
    }


def fake_sweep(dump: Path, *args: str, outcomes: dict | None = None, validation: bool = False, **environ) -> int:
    """The sweep's ``main`` with the fake trainer, one process a run; ``outcomes`` and ``validation`` as the fake
    trainer's FAKE_OUTCOMES and FAKE_VALIDATION, ``environ`` more variables for its runs (FAKE_SECONDS, ...)."""
    from torchtitan.tools.sweep import main

    added = {"FAKE_OUTCOMES": json.dumps(outcomes or {}), "FAKE_VALIDATION": "1" if validation else "", **environ}
    os.environ.update(added)
    try:
        return main(["--dump-folder", str(dump), "--launcher", FAKE, "--nproc", "1", "--last-k", "3", *args])
    finally:
        for key in added:
            del os.environ[key]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def status_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "sweep_status.json").read_text())


def two_saved_steps(dump) -> tuple:
    """Trains 2 steps of a checkpointing run into ``dump`` (step-1 and step-2 saved): its checkpoint folder and the
    losses of its steps 1 and 2."""
    trainer = Trainer(checkpoint_job(str(dump), steps=2, interval=1))
    losses = trainer.run(2)
    trainer.checkpoint.close()
    return dump / "checkpoint", losses
