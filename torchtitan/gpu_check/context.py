"""What a GPU check step is given and shares: the plan's sizes, the packages present, the context and result of
a step, where its results and logs go, and how it runs a command within its budget."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from torchtitan.distributed.cuda_allocator import allocator_environ
from torchtitan.distributed.process_tree import kill_tree

REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
# Optimizers that also run with each implementation and with bf16 state; every registry name runs as it is.
VARIANT_KINDS = ("AdamW", "AdamMini")
VARIANT_OPTIONS = ("implementation=fused", "implementation=foreach", "state_dtype=bfloat16")
# The quick profile's optimizers at 1B (tokens/s, MFU, peaks beside the estimate) and at 8B (does it fit?).
QUICK_OPTIMIZERS = ("AdamW", "AdamMini", "AdamMini8bit", "Muon")
QUICK_8B = ("AdamW:implementation=fused", "AdamW:implementation=foreach", "AdamMini", "AdamMini8bit", "Muon")
# Seconds a command of a step may run before it is killed and counted as that step's (or check's) failure; never
# longer than what is left of the step's budget.
COMMAND_TIMEOUT_S = 300
PYTEST_TIMEOUT_S = 420
# A dry run's budget per step: the CPU of a loaded test machine, not an H200.
DRY_RUN_BUDGET_S = 420
FAILED = "FAILED"  # a component check's result when its command failed; fails the step
# Packages the check reports on its first line; a step or optimizer that needs a missing one is skipped.
PACKAGES = (
    "torch",
    "torchao",
    "torchdata",
    "datasets",
    "adam_mini",
    "pytest",
    "safetensors",
    "transformers",
    "tiktoken",
    "sentencepiece",
    "tensorboard",
    "matplotlib",
    "tomli_w",
)
TRAIN_PY_NEEDS = ("torchdata", "datasets", "tomli_w")  # train.py's data loader and its job_config.toml


# ----------------------------------------------------------------------------------------------------------------
# The plan's sizes


@dataclass
class Sizes:
    """What the steps train: a GPU's real sizes, or a dry run's tiny ones."""

    device: torch.device
    small_flavor: str  # the ~1B model
    large_flavor: str  # Llama 3 8B
    vocab_size: int
    batch_size: int
    seq_len: int
    warmup_steps: int
    timed_steps: int
    compile: bool  # for the steps that measure compiled training
    # Whether the 8B steps estimate each row too. A dry run's "8B" model is the tiny one its 1B steps already
    # estimate every optimizer on: there the 8B steps train each optimizer (full activation checkpointing, their
    # own step counts) and leave the estimates to the 1B steps.
    estimate_large: bool
    bench_runs: dict[str, tuple[tuple[str, str], ...]]  # per bench step: (shapes, dtype) of bench_optimizers.py
    bench_args: tuple[str, ...]
    train_overrides: tuple[str, ...]  # for train.py runs
    seed_run_overrides: tuple[str, ...]  # for the seed run's job (tests/estimation/llama3_8b_seed_run.toml)

    @classmethod
    def for_run(cls, dry_run: bool) -> Sizes:
        if dry_run:
            return cls(
                device=torch.device("cpu"),
                small_flavor="tiny",
                large_flavor="tiny",
                vocab_size=256,
                batch_size=1,
                seq_len=16,
                warmup_steps=1,
                timed_steps=1,
                compile=False,
                estimate_large=False,
                bench_runs={
                    "100m": (("tiny", "float32"),),
                    "1b": (("tiny", "float32"),),
                    "adam_mini": (("tiny", "float32"),),
                },
                bench_args=("--device", "cpu", "--steps", "1", "--warmup", "0"),
                train_overrides=("--training.seq_len", "32", "--training.batch_size", "1"),
                seed_run_overrides=(
                    *("--model.flavor", "tiny", "--training.seq_len", "16", "--training.compile", "false"),
                    *("--memory_estimation.vocab_size", "256", "--memory_estimation.device", "cpu"),
                    *("--memory_estimation.device_memory_gib", "0"),
                ),
            )
        return cls(
            device=torch.device("cuda"),
            small_flavor="1B",
            large_flavor="8B",
            vocab_size=128256,
            batch_size=2,
            seq_len=2048,
            warmup_steps=2,
            timed_steps=5,
            compile=True,
            estimate_large=True,
            bench_runs={
                "100m": (("bench", "float32"), ("bench", "bfloat16")),
                "1b": (("1b", "float32"), ("1b", "bfloat16")),
                # float32: the one-pass operator (Triton), at ~100M and ~1B; bf16 weights: the compiled graphs.
                "adam_mini": (("bench", "float32"), ("1b", "float32"), ("1b", "bfloat16")),
            },
            bench_args=("--steps", "10", "--warmup", "2"),
            train_overrides=("--model.flavor", "debugmodel", "--training.compile", "true"),
            seed_run_overrides=(),
        )


@contextlib.contextmanager
def dry_run_settings() -> Iterator[None]:
    """The dry run's model (the debug model's structure at a few thousand parameters) and eager execution
    (torchao's per-step compile too: a dry run checks the wiring, not speed); both undone afterwards."""
    from torchtitan.models.llama import ModelArgs, llama3_configs

    added = "tiny" not in llama3_configs  # entered again within itself (a step measuring in its own process)
    llama3_configs["tiny"] = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16)
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        if added:
            del llama3_configs["tiny"]


def optimizer_specs(kinds: Optional[list[str]] = None) -> list[str]:
    """Every registry optimizer, plus implementation and bf16-state variants of :data:`VARIANT_KINDS`, as
    ``NAME[:option=value]`` entries (estimation.py's ``memory_estimation.optimizers`` syntax)."""
    from torchtitan.optim.builder import OPTIMIZERS

    specs = []
    for name, kind in OPTIMIZERS.items():
        if kinds is not None and name not in kinds:
            continue
        specs.append(name)
        if name in VARIANT_KINDS:
            specs += [f"{name}:{o}" for o in VARIANT_OPTIONS if o.split("=")[0] in kind.options]
    return specs


def low_bit_names() -> list[str]:
    """The registry's optimizers with quantized state (those that take a quantization block size)."""
    from torchtitan.optim.builder import OPTIMIZERS
    from torchtitan.optim.settings import BLOCK_SIZE

    return [name for name, kind in OPTIMIZERS.items() if BLOCK_SIZE in kind.options]


# ----------------------------------------------------------------------------------------------------------------
# Training in this process (the trainer's own model building and step)


# ----------------------------------------------------------------------------------------------------------------
# Packages


def importable(names: tuple[str, ...] = PACKAGES) -> dict[str, Optional[str]]:
    """Each package's version (``"?"`` if it has none), or None where importing it fails."""
    import importlib
    import importlib.metadata

    found: dict[str, Optional[str]] = {}
    for name in names:
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a package that fails to import is missing, whatever the reason
            found[name] = None
            continue
        version = getattr(module, "__version__", None)
        if version is None:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = "?"
        found[name] = str(version)
    return found


# What the compile probe found, beside the packages: "yes" where a tiny torch.compile runs on the device (on a GPU,
# Triton needs a C compiler and Python's headers), None where it does not.
COMPILE = "torch.compile"


def compile_probe_code(device: str) -> str:
    """A tiny compiled function on a ``device`` tensor, checked: the check's first proof of the machine."""
    return (
        "import torch; double_plus_one = torch.compile(lambda x: x * 2 + 1); "
        f"x = torch.ones(8, device={device!r}); assert torch.equal(double_plus_one(x), x * 3); print('compiled')"
    )


def as_run_here(specs: list[str], found: dict[str, Optional[str]]) -> list[str]:
    """``specs`` as this machine runs them: where it cannot compile, every optimizer that takes an implementation
    runs its foreach one (torch's for AdamW; Adam-mini's reference; the AdamW part of Muon and SOAP), once."""
    if found.get(COMPILE) is not None:
        return list(specs)
    from torchtitan.optim.settings import IMPLEMENTATION, TAKES

    out: list[str] = []
    for spec in specs:
        name, *options = spec.split(":")  # NAME[:option=value[:option=value]], as estimation.py reads them
        if IMPLEMENTATION in TAKES.get(name, ()):
            kept = [o for o in options if not o.startswith(f"{IMPLEMENTATION}=")]
            spec = ":".join([name, *kept, f"{IMPLEMENTATION}=foreach"])
        if spec not in out:
            out.append(spec)
    return out


def imports_line(found: dict[str, Optional[str]]) -> str:
    packages = {name: version for name, version in found.items() if name != COMPILE}
    present = [f"{name} {version}" for name, version in packages.items() if version is not None]
    missing = [name for name, version in packages.items() if version is None]
    return f"gpu_check: imports present: {', '.join(present) or 'none'}; missing: {', '.join(missing) or 'none'}"


def optimizer_needs(spec: str) -> tuple[str, ...]:
    """Packages an optimizer entry cannot be built without (the low-bit ones store their state with torchao)."""
    return ("torchao",) if spec.split(":")[0] in low_bit_names() else ()


def missing_needs(needs: tuple[str, ...], found: dict[str, Optional[str]]) -> list[str]:
    return [name for name in needs if found.get(name) is None]


def skipped_text(needs: list[str]) -> str:
    if COMPILE in needs:
        return "skipped: this machine cannot compile (the check's first line says why)"
    return f"skipped: needs {', '.join(needs)} (not importable)"


# ----------------------------------------------------------------------------------------------------------------
# The steps


@dataclass
class Context:
    sizes: Sizes
    out: Path
    dry_run: bool
    optimizers: Optional[list[str]] = None  # registry names to run (None: all)
    found: dict[str, Optional[str]] = field(default_factory=dict)  # importable(): what this process can import
    step: str = ""  # the step running in this process (a child), whose partial results :meth:`save` writes
    deadline: Optional[float] = None  # time.monotonic() at which the step's budget ends

    def selected(self, specs: list[str] | tuple[str, ...]) -> list[str]:
        return [s for s in specs if self.optimizers is None or s.split(":")[0] in self.optimizers]

    def seconds_left(self, cap: float) -> float:
        """``cap``, or what is left of the step's budget if that is less (at least 1 s)."""
        if self.deadline is None:
            return cap
        return max(1.0, min(cap, self.deadline - time.monotonic()))

    def save(self, result: StepResult) -> None:
        """Write the step's results so far, where the parent reads them even if the step is stopped later."""
        if self.step:
            write_atomically(result_path(self.out, self.step), json.dumps(result_json(result), default=str))


@dataclass
class StepResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    text: str = ""  # preformatted output (a tool's own table)


def result_json(result: StepResult) -> dict[str, Any]:
    return {"rows": result.rows, "notes": result.notes, "text": result.text}


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def result_path(out: Path, step: str) -> Path:
    return out / "steps" / f"{step}.json"


def imports_path(out: Path) -> Path:
    return out / "steps" / "imports.json"


def log_path(out: Path, step: str) -> Path:
    return out / "logs" / f"{step}.log"


@dataclass
class Done:
    """How a step's command ended: its exit code (None: killed at the timeout) and its output."""

    returncode: Optional[int]
    output: str
    timeout: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def how_it_ended(self) -> str:
        if self.returncode is None:
            return f"timed out after {self.timeout} s"
        return f"exited with {self.returncode}"


def run_command(
    command: list[str], ctx: Context, timeout: Optional[float] = None, env: Optional[dict[str, str]] = None
) -> Done:
    """Run ``command`` in the repository root, in ``env`` (default: the step's); past ``timeout`` seconds (default
    :data:`COMMAND_TIMEOUT_S`, and never past the step's budget) it is killed with its children, and the result
    says so."""
    timeout = round(ctx.seconds_left(COMMAND_TIMEOUT_S if timeout is None else timeout), 1)
    env = step_env(ctx) if env is None else env
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env, start_new_session=True
        )
        returncode = wait_or_kill(process, timeout)
        output.seek(0)
        text = output.read()
    if returncode is None:
        return Done(None, f"{text}\n(timed out after {timeout} s)", timeout)
    return Done(returncode, text, timeout)


def wait_or_kill(process: subprocess.Popen, timeout: float) -> Optional[int]:
    """The exit code of ``process`` (started in a session of its own), or None if it ran past ``timeout`` seconds:
    then it and every process it started are killed, as they are if this process is stopped while it waits."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        process.wait()
        return None
    except BaseException:
        kill_tree(process.pid)
        process.wait()
        raise


def step_environment(dry_run: bool, environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of every step and command: the caller's, with ``train.py``'s CUDA allocator setting (kept
    as given if set), the repository first on ``PYTHONPATH`` (what was there kept after it: wheels installed beside
    the project stay importable), and in a dry run no GPU and no compile."""
    environ = dict(os.environ if environ is None else environ)
    env = {**environ, **allocator_environ(environ), "PYTHONUNBUFFERED": "1"}
    paths = [str(REPO_ROOT), *[p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if dry_run:
        env.update(CUDA_VISIBLE_DEVICES="", TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    return env


def step_env(ctx: Context) -> dict[str, str]:
    return step_environment(ctx.dry_run)
