"""Time ``step()`` of AdamMini against AdamW (fused and foreach) and, when installed, the official adam-mini 1.1.1,
on the parameters of a ~100M-parameter Llama in one process; also compare optimizer-state bytes.

    python benchmarks/bench_optimizers.py                 # CUDA when available, else CPU
    python benchmarks/bench_optimizers.py --device cpu --steps 5

Every optimizer steps the same parameters with the same (fixed) gradients; times are medians over the timed steps
and ratios are against fused AdamW measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.models.llama import ModelArgs, Transformer  # noqa: E402
from torchtitan.optim import AdamMini  # noqa: E402

# ~106M parameters: Llama 3 shapes (GQA, SwiGLU) at GPT-2-small width with a 32k vocabulary.
BENCH_ARGS = ModelArgs(dim=768, n_layers=8, n_heads=12, n_kv_heads=4, vocab_size=32000, multiple_of=256)
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def build_model(device: torch.device, dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(BENCH_ARGS)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    model.to(dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, dtype=dtype, generator=generator) * 1e-3
    return model


def optimizers(model: Transformer) -> dict[str, Callable[[], torch.optim.Optimizer]]:
    args = model.args
    candidates: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "AdamW (fused)": lambda: torch.optim.AdamW(model.parameters(), **HYPER, fused=True),
        "AdamW (foreach)": lambda: torch.optim.AdamW(model.parameters(), **HYPER, foreach=True),
        "AdamMini": lambda: AdamMini(model.named_parameters(), **HYPER, dim=args.dim, n_heads=args.n_heads,
                                     n_kv_heads=args.n_kv_heads, param_roles=model.named_param_roles()),
    }
    official = _official_adam_mini(model)
    if official is not None:
        candidates["adam_mini 1.1.1 (official)"] = official
    return candidates


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
            return Adam_mini(model.named_parameters(), **HYPER, dim=args.dim, n_heads=args.n_heads,
                             n_kv_heads=args.n_kv_heads, verbose=False)
        finally:
            torch.cuda.device_count = device_count

    return build


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))


def time_steps(optimizer: torch.optim.Optimizer, device: torch.device, warmup: int, steps: int) -> float:
    """Median seconds per step()."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        optimizer.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        optimizer.step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 50 on CUDA, 5 on CPU)")
    options = parser.parse_args(argv)
    device = torch.device(options.device)
    steps = options.steps or (50 if device.type == "cuda" else 5)
    model = build_model(device, getattr(torch, options.dtype))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.1f}M parameters in {len(list(model.parameters()))} tensors, {options.dtype}, "
          f"{device.type}{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"torch {torch.__version__}, median of {steps} steps after {options.warmup} warm-up")

    results = {}
    for name, build in optimizers(model).items():
        optimizer = build()
        seconds = time_steps(optimizer, device, options.warmup, steps)
        results[name] = (seconds, state_bytes(optimizer))
        del optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()

    base_time, base_bytes = results["AdamW (fused)"]
    print(f"{'optimizer':<28} {'ms/step':>9} {'vs fused AdamW':>15} {'state MiB':>10} {'vs AdamW state':>15}")
    for name, (seconds, nbytes) in results.items():
        print(f"{name:<28} {seconds * 1e3:>9.2f} {seconds / base_time:>14.2f}x {nbytes / 2**20:>10.1f} "
              f"{nbytes / base_bytes:>15.4f}")


if __name__ == "__main__":
    main()
