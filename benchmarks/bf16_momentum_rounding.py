"""How to store Adam's moments in bfloat16: round-to-nearest, stochastic rounding, or compensated (a bf16 value plus
a bf16 error term), against float32 state. Prints quality (against a float32 moment), state bytes and speed.

    python benchmarks/bf16_momentum_rounding.py                      # quality, bytes and CPU speed
    python benchmarks/bf16_momentum_rounding.py --speed-only cuda    # the speed ratios on a GPU

Quality, second moment ``v <- beta2 * v + (1 - beta2) * g**2``: 300 steps of unit gradients then 2500 of 0.01 (the
gradient shrinks, ``v`` must decay), on 10^5 entries (gradients scaled per entry by log-uniform factors in [0.5, 2],
so entries differ); the ratio bf16 ``v`` / float32 ``v`` at the end, median and 1st/99th percentiles.
Quality, first moment ``m <- lerp(m, g, 1 - beta1)``: 300 steps of gradients = fixed direction + unit noise on 10^6
entries (relative error and mean bias against float32), then the same decay test as for ``v`` with ``m``.
Speed: the compiled ``v`` update per storage, time relative to float32 storage in this process, on a size chosen
so that a call's fixed cost (launch, Python) is at most 2% of its time (:func:`speed_size`: entries quadrupled from
2^16 until the float32 update takes 50 times a one-entry call; at most 2^28, 1 GiB of float32 gradients).
Stochastic rounding is ``torchtitan.optim.state.storage.round_to_bfloat16_stochastically`` (what the optimizers use).
"""

import sys
import time
from typing import Optional

import torch

from torchtitan.optim.state.storage import round_to_bfloat16_stochastically

torch.manual_seed(0)


class Storage:
    """A state kept as ``kind``; ``write(x, step)`` stores float32 ``x``, ``read()`` gives float32 back."""

    def __init__(self, kind: str, shape):
        self.kind = kind
        dtype = torch.float32 if kind == "float32" else torch.bfloat16
        self.hi = torch.zeros(shape, dtype=dtype)
        self.lo = torch.zeros(shape, dtype=torch.bfloat16) if kind == "compensated" else None

    def read(self) -> torch.Tensor:
        value = self.hi.float()
        return value + self.lo.float() if self.lo is not None else value

    def write(self, x: torch.Tensor, step: int) -> None:
        if self.kind == "stochastic":
            self.hi.copy_(round_to_bfloat16_stochastically(x, torch.tensor(step)))
        elif self.kind == "compensated":
            self.hi.copy_(x)
            self.lo.copy_(x - self.hi.float())
        else:
            self.hi.copy_(x)

    def bytes_per_entry(self) -> int:
        return self.hi.element_size() + (self.lo.element_size() if self.lo is not None else 0)


KINDS = ("float32", "nearest", "stochastic", "compensated")


def decay_test(update, n: int = 100_000) -> dict[str, torch.Tensor]:
    """Final states after 300 steps of unit-scale gradients and 2500 of 0.01 (per-entry scales in [0.5, 2])."""
    scale = torch.exp(torch.empty(n).uniform_(-0.69, 0.69))
    states = {kind: Storage(kind, (n,)) for kind in KINDS}
    for step in range(1, 2801):
        g = scale * (1.0 if step <= 300 else 0.01)
        for state in states.values():
            state.write(update(state.read(), g), step)
    return {kind: state.read() for kind, state in states.items()}


def ratio_line(label: str, final: dict[str, torch.Tensor]) -> str:
    parts = []
    for kind in KINDS[1:]:
        ratio = final[kind] / final["float32"]
        q = torch.quantile(ratio, torch.tensor([0.01, 0.5, 0.99])).tolist()
        parts.append(f"{kind} {q[1]:.3f} [{q[0]:.3f}, {q[2]:.3f}]")
    return f"{label}: bf16/float32 median [1%, 99%]: " + "; ".join(parts)


def second_moment_quality() -> None:
    for beta2 in (0.95, 0.99, 0.999):
        final = decay_test(lambda v, g, beta2=beta2: v * beta2 + (1 - beta2) * g * g)
        print(ratio_line(f"v, beta2={beta2}, decay test", final))


def first_moment_quality(n: int = 1_000_000) -> None:
    direction = torch.randn(n) * 0.5
    for beta1 in (0.9, 0.95, 0.99):
        states = {kind: Storage(kind, (n,)) for kind in KINDS}
        for step in range(1, 301):
            g = direction + torch.randn(n)
            for state in states.values():
                state.write(state.read().lerp(g, 1 - beta1), step)
        m32 = states["float32"].read()
        cells = []
        for kind in KINDS[1:]:
            m = states[kind].read()
            error = ((m - m32).norm() / m32.norm()).item()
            bias = ((m - m32).mean() / m32.abs().mean()).item()
            cells.append(f"{kind} {error:.2e} (bias {bias:+.1e})")
        print(f"m, beta1={beta1}, noisy gradients, 300 steps: relative error " + "; ".join(cells))
        final = decay_test(lambda m, g, beta1=beta1: m.lerp(g, 1 - beta1), n=100_000)
        print(ratio_line(f"m, beta1={beta1}, decay test", final))


def _v_step(v_hi, v_lo, g, step, kind: str, beta2: float = 0.999):
    value = v_hi.float() + (v_lo.float() if kind == "compensated" else 0.0)
    value = value * beta2 + (1 - beta2) * g * g
    if kind == "stochastic":
        v_hi.copy_(round_to_bfloat16_stochastically(value, step))
    else:
        v_hi.copy_(value)
        if kind == "compensated":
            v_lo.copy_(value - v_hi.float())


OVERHEAD_FRACTION = 0.02  # the most of a timed call that its fixed cost may be
SMALLEST, LARGEST = 1 << 16, 1 << 28


def speed_size(seconds_at, smallest: int = SMALLEST, largest: int = LARGEST) -> tuple[int, float]:
    """The entries to time at, and the fixed cost's share of a call there: the smallest of ``smallest`` times a
    power of 4 (at most ``largest``) whose call takes 1 / OVERHEAD_FRACTION times a one-entry call.
    ``seconds_at(n)``: seconds of one call on ``n`` entries."""
    fixed = seconds_at(1)
    n, seconds = smallest, seconds_at(smallest)
    while n < largest and seconds < fixed / OVERHEAD_FRACTION:
        n *= 4
        seconds = seconds_at(n)
    return n, fixed / seconds


def _float32_call_seconds(device: str, repeats: int = 10):
    def seconds_at(n: int) -> float:
        torch._dynamo.reset()  # each size compiles afresh: a recompile limit must not turn it eager
        g = torch.randn(n, device=device)
        v, lo = torch.zeros(n, device=device), torch.zeros(1, dtype=torch.bfloat16, device=device)
        step = torch.tensor(1, device=device)
        compiled = torch.compile(_v_step, fullgraph=True, dynamic=False)
        for _ in range(3):
            compiled(v, lo, g, step, "float32")
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            compiled(v, lo, g, step, "float32")
        _synchronize(device)
        return (time.perf_counter() - start) / repeats

    return seconds_at


def speed(device: str = "cpu", n: Optional[int] = None, repeats: int = 30) -> None:
    if n is None:
        n, fixed_share = speed_size(_float32_call_seconds(device))
        print(f"timing {n} entries (2^{n.bit_length() - 1}): a call's fixed cost is {100 * fixed_share:.1f}% of it")
    torch._dynamo.reset()
    g = torch.randn(n, device=device)
    step = torch.tensor(1, device=device)
    times = {}
    for kind in KINDS:
        storage = Storage(kind, (n,))
        storage.hi = storage.hi.to(device)
        storage.lo = storage.lo.to(device) if storage.lo is not None else None
        lo = storage.lo if storage.lo is not None else torch.zeros(1, dtype=torch.bfloat16, device=device)
        compiled = torch.compile(_v_step, fullgraph=True, dynamic=False)
        for _ in range(3):
            compiled(storage.hi, lo, g, step, kind)
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            compiled(storage.hi, lo, g, step, kind)
        _synchronize(device)
        times[kind] = (time.perf_counter() - start) / repeats
        print(f"v stored as {kind}: {storage.bytes_per_entry()} bytes per entry")
    print(
        f"speed of the compiled v update on {device}, relative to float32 storage: "
        + ", ".join(f"{kind} {times[kind] / times['float32']:.2f}x" for kind in KINDS[1:])
    )


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--speed-only":
        speed(sys.argv[2])
    else:
        second_moment_quality()
        first_moment_quality()
        speed()
