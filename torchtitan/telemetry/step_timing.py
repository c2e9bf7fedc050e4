"""Where a step's time goes: data, forward+backward, optimizer and checkpoint, logged as seconds per step.

``time/data(s)`` is the host's wait for the next micro-batches (and their copy to the device being queued),
``time/forward_backward(s)`` the micro-batches' forward and backward, ``time/optimizer(s)`` gradient clipping, the
divergence guard's decision and the optimizer step, ``time/checkpoint(s)`` the save (its blocking part under
async checkpointing). Each is the mean per step over the steps since the last log line; a save made at a log step
is counted in the next window.

On CUDA, forward+backward and optimizer are timed with CUDA events recorded on the stream as the step runs: no
synchronisation per step; the events are read at the log step, which waits for the last one (the log line already
waits for the loss). Data and checkpoint are host time (``time.perf_counter``) on every device, since the host
waits for them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import torch

PARTS = ("data", "forward_backward", "optimizer", "checkpoint")
DEVICE_PARTS = frozenset({"forward_backward", "optimizer"})  # what runs on the device: CUDA events there


def tag(part: str) -> str:
    return f"time/{part}(s)"


class StepTimer:
    def __init__(self, device: torch.device):
        self.use_events = device.type == "cuda"
        self._reset()

    def _reset(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self.steps = 0

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        if name not in PARTS:
            raise ValueError(f"unknown part {name!r}; one of {PARTS}")
        if self.use_events and name in DEVICE_PARTS:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events[name].append((start, end))
            return
        started = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - started

    def step_done(self) -> None:
        self.steps += 1

    def metrics(self) -> dict[str, float]:
        """Seconds per step of each part since the last call; resets the window."""
        if self.events:
            for pairs in self.events.values():
                pairs[-1][1].synchronize()  # the window's last event of each part: every earlier one is done
            for name, pairs in self.events.items():
                self.seconds[name] += sum(start.elapsed_time(end) for start, end in pairs) / 1000
        steps = max(1, self.steps)
        out = {tag(name): self.seconds.get(name, 0.0) / steps for name in PARTS}
        self._reset()
        return out
