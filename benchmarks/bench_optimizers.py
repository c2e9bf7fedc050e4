"""Time ``step()`` of every AdamMini variant (foreach, fused; float32, bf16, 8-bit, 4-bit momentum), bf16-state
AdamW, Muon and NorMuon (bfloat16 and float32 Newton–Schulz) and SOAP (fused AdamW for their other weights),
AdEMAMix (float32 and bf16 moments) against AdamW (fused and foreach) and, when installed, the official adam-mini
1.1.1, on the parameters of a Llama in one process; also count kernel launches (profiler) and compare
optimizer-state bytes, and give NorMuon's step time against Muon's.

    python benchmarks/bench_optimizers.py                 # CUDA when available, else CPU
    python benchmarks/bench_optimizers.py --device cpu --steps 5
    python benchmarks/bench_optimizers.py --shapes many_small     # ~450 small tensors
    python benchmarks/bench_optimizers.py --shapes 1b             # ~1B parameters (GPU)
    python benchmarks/bench_optimizers.py --optimizers AdamMini,Muon   # only these registry optimizers' variants

Every optimizer steps the same parameters with the same (fixed) gradients. The optimizers take turns, one step each
per round; times are medians over the rounds and ratios are the median, over rounds, of the step's time divided by
fused AdamW's in the same round (NorMuon against Muon: the median of its time over Muon's, same Newton–Schulz
dtype, same round). SOAP refreshes its eigenbases every ``precondition_frequency`` (10) steps, which a median
leaves out: its mean step time over the rounds, against fused AdamW's mean, is printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.errors import UserError, exit_code  # noqa: E402
from torchtitan.models.llama import ModelArgs, Transformer  # noqa: E402
from torchtitan.optim import AdamMini  # noqa: E402
from torchtitan.optim.adam_mini.one_pass import compiled_graphs_only  # noqa: E402
from torchtitan.optim.ademamix.optimizer import AdEMAMix  # noqa: E402
from torchtitan.optim.container import tensor_bytes  # noqa: E402
from torchtitan.optim.lowbit.adamw import LowPrecisionAdam  # noqa: E402
from torchtitan.optim.muon.normuon import NorMuon  # noqa: E402
from torchtitan.optim.muon.optimizer import Muon, split_hidden_matrices  # noqa: E402
from torchtitan.optim.soap.optimizer import SOAP  # noqa: E402

# ~106M parameters: Llama 3 shapes (GQA, SwiGLU) at GPT-2-small width with a 32k vocabulary.
BENCH_ARGS = ModelArgs(dim=768, n_layers=8, n_heads=12, n_kv_heads=4, vocab_size=32000, multiple_of=256)
SHAPES = {
    "bench": BENCH_ARGS,
    # Many small tensors: 48 layers x 9 tensors + 3 = 435 tensors of dim 128 (per-call overheads dominate).
    "many_small": ModelArgs(dim=128, n_layers=48, n_heads=4, n_kv_heads=2, vocab_size=4096, multiple_of=128),
    # A few thousand parameters: scripts/gpu_check.sh --dry-run checks the wiring with it.
    "tiny": ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16),
    # ~1B parameters (Llama 3.2 1B-like), for GPUs.
    "1b": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=256, ffn_dim_multiplier=1.5
    ),
}
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BASELINE = "AdamW (fused)"  # every ratio's denominator: timed whatever is selected
# The registry optimizer (``optimizer.name``) each timed variant belongs to, for --optimizers.
FAMILY = {
    "AdamW (fused)": "AdamW",
    "AdamW (foreach)": "AdamW",
    "AdamW bf16 state": "AdamW",
    "AdamMini (foreach)": "AdamMini",
    "AdamMini (fused)": "AdamMini",
    "AdamMini (compiled graphs)": "AdamMini",
    "AdamMini bf16 m (fused)": "AdamMini",
    "AdamMini8bit (fused)": "AdamMini8bit",
    "AdamMini4bit (fused)": "AdamMini4bit",
    "Muon (bf16 NS)": "Muon",
    "Muon (fp32 NS)": "Muon",
    "NorMuon (bf16 NS)": "NorMuon",
    "NorMuon (fp32 NS)": "NorMuon",
    "AdEMAMix": "AdEMAMix",
    "AdEMAMix bf16 state": "AdEMAMix",
    "SOAP": "SOAP",
    "adam_mini 1.1.1 (official)": "AdamMini",
}
FAMILIES = tuple(dict.fromkeys(FAMILY.values()))


def build_model(device: torch.device, dtype: torch.dtype, args: ModelArgs = BENCH_ARGS) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    model.to(dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=generator) * 1e-3
    return model


def optimizers(model: Transformer) -> dict[str, Callable[[], torch.optim.Optimizer]]:
    args = model.args

    def adam_mini(**options) -> Callable[[], torch.optim.Optimizer]:
        return lambda: AdamMini(
            model.named_parameters(),
            **HYPER,
            dim=args.dim,
            n_heads=args.n_heads,
            n_kv_heads=args.n_kv_heads,
            param_roles=model.named_param_roles(),
            **options,
        )

    def muon(cls: type = Muon, **options) -> Callable[[], torch.optim.Optimizer]:
        def build() -> torch.optim.Optimizer:
            matrices, others = split_hidden_matrices(model.named_parameters(), model.named_param_roles())
            rest = torch.optim.AdamW([p for _, p in others], **HYPER, fused=True)
            if cls is SOAP:
                return SOAP([p for _, p in matrices], **HYPER, others=rest, **options)
            lr, weight_decay = HYPER["lr"], HYPER["weight_decay"]
            return cls([p for _, p in matrices], lr=lr, weight_decay=weight_decay, others=rest, **options)

        return build

    candidates: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "AdamW (fused)": lambda: torch.optim.AdamW(model.parameters(), **HYPER, fused=True),
        "AdamW (foreach)": lambda: torch.optim.AdamW(model.parameters(), **HYPER, foreach=True),
        "AdamW bf16 state": lambda: LowPrecisionAdam(model.parameters(), **HYPER, decoupled=True),
        "AdamMini (foreach)": adam_mini(implementation="foreach"),
        "AdamMini (fused)": adam_mini(implementation="fused"),
        "AdamMini (compiled graphs)": lambda: CompiledGraphsOnly(adam_mini(implementation="fused")()),
        "AdamMini bf16 m (fused)": adam_mini(implementation="fused", momentum_storage="bfloat16"),
        "AdamMini8bit (fused)": adam_mini(implementation="fused", momentum_storage="int8"),
        "AdamMini4bit (fused)": adam_mini(implementation="fused", momentum_storage="int4"),
        "Muon (bf16 NS)": muon(),
        "Muon (fp32 NS)": muon(ns_dtype="float32"),
        "NorMuon (bf16 NS)": muon(NorMuon),
        "NorMuon (fp32 NS)": muon(NorMuon, ns_dtype="float32"),
        "AdEMAMix": lambda: AdEMAMix(model.parameters(), **HYPER, warmup_steps=1000),
        "AdEMAMix bf16 state": lambda: AdEMAMix(model.parameters(), **HYPER, warmup_steps=1000, state_dtype="bfloat16"),
        "SOAP": muon(SOAP),
    }
    official = _official_adam_mini(model)
    if official is not None:
        candidates["adam_mini 1.1.1 (official)"] = official
    return candidates


class CompiledGraphsOnly:
    """Steps an AdamMini's fused back end as compiled graphs alone, without its one-pass operator."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.state = optimizer, optimizer.state

    def step(self) -> None:
        with compiled_graphs_only():
            self.optimizer.step()


def _official_adam_mini(model: Transformer) -> Optional[Callable[[], torch.optim.Optimizer]]:
    try:
        from adam_mini import Adam_mini
    except ImportError:
        return None
    args = model.args

    def build() -> torch.optim.Optimizer:
        # The official class takes its world size from torch.cuda.device_count(); this benchmark is one process.
        device_count = torch.cuda.device_count
        torch.cuda.device_count = lambda: min(device_count(), 1)
        try:
            return Adam_mini(
                model.named_parameters(),
                **HYPER,
                dim=args.dim,
                n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads,
                verbose=False,
            )
        finally:
            torch.cuda.device_count = device_count

    return build


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(value) for state in optimizer.state.values() for value in state.values())


def kernel_launches(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Kernels one step() launches: CUDA kernels on a GPU; on a CPU, the innermost operators the profiler records
    (each runs one kernel; a compiled graph's generated C++ kernels run inside the graph's call and are not seen)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    if device.type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if not e.cpu_children and not e.name.startswith(("Optimizer.", "ProfilerStep")))


WALL, CPU = "wall", "cpu"


def cpu_clock() -> Callable[[], float]:
    """The CPU-time clock of a step: this thread's with one thread (nothing else runs the step), the process's with
    several, whose idle threads must then sleep rather than spin (``OMP_WAIT_POLICY=PASSIVE``) or their spinning
    would be counted as the step's."""
    if torch.get_num_threads() == 1:
        return time.thread_time
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        raise UserError(
            f"--clock cpu with {torch.get_num_threads()} threads counts spinning threads: set OMP_WAIT_POLICY=PASSIVE "
            "(or OMP_NUM_THREADS=1)"
        )
    return time.process_time


def _timed_step(optimizer: torch.optim.Optimizer, device: torch.device, clock: Callable[[], float]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - start


def interleaved_times(
    built: dict[str, torch.optim.Optimizer],
    device: torch.device,
    warmup: int,
    steps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds of each timed step() of every optimizer, and of its first step (state creation and compile).

    The optimizers take turns, one step each per round, so that a change in the machine's speed (a shared or
    throttled host) touches every optimizer of a round alike: ratios are taken within rounds.
    """
    first = {name: _timed_step(optimizer, device, time.perf_counter) for name, optimizer in built.items()}
    for _ in range(warmup):
        for optimizer in built.values():
            optimizer.step()
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(steps):
        for name, optimizer in built.items():
            times[name].append(_timed_step(optimizer, device, clock))
    return times, first


def selected_families(value: Optional[str]) -> Optional[list[str]]:
    """``--optimizers``' registry names (None: all); UserError for a name with no variant timed here."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise UserError(
            f"--optimizers: {', '.join(unknown) or 'empty list'} not timed here; choose from {', '.join(FAMILIES)}"
        )
    return names


def is_selected(name: str, wanted: Optional[list[str]], families: Optional[list[str]]) -> bool:
    """Whether variant ``name`` is timed: the baseline always; others if ``--only`` and ``--optimizers`` allow."""
    if name == BASELINE:
        return True
    if families is not None and FAMILY[name] not in families:
        return False
    return not wanted or any(w in name for w in wanted)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 50 on CUDA, 15 on CPU)")
    parser.add_argument(
        "--shapes",
        default="bench",
        choices=tuple(SHAPES),
        help="bench: ~100M Llama; many_small: 48 layers of dim 128 (~450 tensors); 1b: a ~1B Llama (for GPUs)",
    )
    parser.add_argument("--only", default=None, help="comma-separated substrings: time only matching optimizers")
    parser.add_argument(
        "--optimizers",
        default=None,
        help=f"comma-separated registry names ({', '.join(FAMILIES)}): time only their variants",
    )
    parser.add_argument(
        "--clock",
        default=WALL,
        choices=(WALL, CPU),
        help="wall: elapsed time; cpu (CPU only): CPU time of the step, this thread's with OMP_NUM_THREADS=1, the "
        "process's with more threads and OMP_WAIT_POLICY=PASSIVE (steady on a shared machine)",
    )
    options = parser.parse_args(argv)
    families = selected_families(options.optimizers)
    device = torch.device(options.device)
    if options.clock == CPU and device.type != "cpu":
        raise UserError("--clock cpu times CPU steps only: pass --device cpu (a GPU's steps are timed by the wall)")
    clock = cpu_clock() if options.clock == CPU else time.perf_counter
    steps = options.steps or (50 if device.type == "cuda" else 15)
    model = build_model(device, getattr(torch, options.dtype), SHAPES[options.shapes])
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{n_params / 1e6:.1f}M parameters in {len(list(model.parameters()))} tensors, {options.dtype}, "
        f"{device.type}{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
        f"torch {torch.__version__}, median of {steps} interleaved rounds after {options.warmup} warm-up, "
        f"{options.clock} time, {torch.get_num_threads()} threads"
    )

    wanted = [w.strip() for w in options.only.split(",")] if options.only else None
    built = {name: build() for name, build in optimizers(model).items() if is_selected(name, wanted, families)}
    times, first_steps = interleaved_times(built, device, options.warmup, steps, clock)
    base = times[BASELINE]
    results = {
        name: (
            statistics.median(times[name]),
            statistics.median(t / b for t, b in zip(times[name], base)),
            state_bytes(optimizer),
            kernel_launches(optimizer, device),
            first_steps[name],
        )
        for name, optimizer in built.items()
    }

    _, _, base_bytes, base_launches, _ = results[BASELINE]
    print(
        f"{'optimizer':<28} {'ms/step':>9} {'vs fused AdamW':>15} {'kernels':>8} {'vs AdamW':>9} "
        f"{'state MiB':>10} {'vs AdamW state':>15} {'first step s':>13}"
    )
    for name, (seconds, ratio, nbytes, launches, first) in results.items():
        print(
            f"{name:<28} {seconds * 1e3:>9.2f} {ratio:>14.2f}x {launches:>8d} "
            f"{launches / max(base_launches, 1):>8.2f}x {nbytes / 2**20:>10.1f} {nbytes / base_bytes:>15.4f} "
            f"{first:>13.1f}"
        )
    for ns in ("bf16", "fp32"):
        normuon, muon = f"NorMuon ({ns} NS)", f"Muon ({ns} NS)"
        if normuon in times and muon in times:
            ratio = statistics.median(n / m for n, m in zip(times[normuon], times[muon]))
            print(f"{normuon} step time vs {muon}: {ratio:.3f}x (median over rounds)")
    if "SOAP" in times:
        ratio = statistics.mean(times["SOAP"]) / statistics.mean(base)
        print(f"SOAP mean step time vs {BASELINE}'s, eigenbasis refreshes included: {ratio:.2f}x")


if __name__ == "__main__":
    sys.exit(exit_code(main))
