"""A tiny portable random generator for the asset corpus."""

from __future__ import annotations

from typing import Sequence

# ----------------------------------------------------------------------------------------------------------------
# A tiny portable random generator (SplitMix64): same numbers on every Python version and platform.

_MASK64 = (1 << 64) - 1


class Rng:
    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next64() % n

    def between(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        return low + self.below(high - low + 1)

    def choice(self, items: Sequence):
        return items[self.below(len(items))]

    def chance(self, probability: float) -> bool:
        return self.next64() < int(probability * (1 << 64))

    def pick_distinct(self, items: Sequence, k: int) -> list:
        pool = list(items)
        return [pool.pop(self.below(len(pool))) for _ in range(k)]
