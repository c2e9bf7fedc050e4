"""Cutting an optimizer's parameter list into slices that share compiled graphs, and running a compiled step so.

A compiled step over a list of tensors is specialised on every tensor's shape, so one graph over a whole model
compiles code for every parameter (minutes for a few hundred tensors). A model's parameters repeat, though: every
layer has the same weights. Passing the list in slices of one layer's worth gives a few distinct graphs, compiled
once and reused by every other layer, for the cost of one compiled call per layer.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from torchtitan.optim import compile_cache


def repeating_slices(members: Sequence[int], signatures: Sequence[Hashable]) -> list[list[int]]:
    """``members`` cut into slices of which most have the same signatures in the same order.

    Members with equal signatures (the same weight of every layer) form columns; the most common column length is
    the number of slices (a Llama's depth), and slice ``j`` takes every such-length stride of each column from
    position ``j``. A Llama of any depth gives a few distinct slices (the first ones also hold the embedding,
    output and final norm, the norms' column being twice as long as the others).
    """
    if not members:
        return []
    columns: dict[Hashable, list[int]] = defaultdict(list)
    for member, signature in zip(members, signatures):
        columns[signature].append(member)
    depth = Counter(len(column) for column in columns.values()).most_common(1)[0][0]
    return [[member for column in columns.values() for member in column[j::depth]] for j in range(depth)]


class CompiledStep:
    """A local optimizer step over lists of tensors, compiled once per distinct slice and reused.

    ``fn`` is compiled whole (``fullgraph``) with static shapes (the fastest code; the shapes never change, so the
    inputs' sizes need no checking), into an inductor cache folder of its own (``cache_tag``). Meta and fake tensors
    (memory estimates) run ``fn`` eagerly, as does a step under a user's dispatch mode (debugging, CommDebugMode),
    which torch.compile cannot run under.
    """

    def __init__(self, fn: Callable[..., None], cache_tag: str, **inductor_options: Any):
        self.eager = fn
        self.compiled = torch.compile(
            fn, fullgraph=True, dynamic=False, options={"size_asserts": False, **inductor_options}
        )
        self.cache_tag = cache_tag
        self._compiled: set[str] = set()  # signatures of the slices compiled in this process

    def run(self, slices: Iterable[list[int]], arguments: Callable[[list[int]], tuple], tensors: Sequence[Any]) -> None:
        """Call the step once per slice with ``arguments(slice)``; ``tensors`` tell whether it can be compiled."""
        dataless = any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)
        step = self.eager if dataless or _get_current_dispatch_mode() is not None else self.compiled
        # A model's few distinct slices are a few graphs each; dynamo's default limit per function is lower.
        with torch._dynamo.utils.disable_cache_limit():
            for part in slices:
                args = arguments(part)
                # A slice's first compiled call compiles its graph: once per machine (see optimizer_compile). The
                # signature holds every argument: slices of the same shapes may compile different graphs.
                first = compile_cache.signature(args) if step is self.compiled else None
                if first in self._compiled:
                    first = None
                with compile_cache.optimizer_compile(
                    self.cache_tag,
                    subclass_inputs=compile_cache.has_subclass(args),
                    signature=first,
                    device_type=tensors[0].device.type if tensors else None,
                ):
                    step(*args)
                if first is not None:
                    self._compiled.add(first)
