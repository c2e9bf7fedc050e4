"""Cutting an optimizer's parameter list into slices that share compiled graphs.

A compiled step over a list of tensors is specialised on every tensor's shape, so one graph over a whole model
compiles code for every parameter (minutes for a few hundred tensors). A model's parameters repeat, though: every
layer has the same weights. Passing the list in slices of one layer's worth gives a few distinct graphs, compiled
once and reused by every other layer, for the cost of one compiled call per layer.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Hashable, Sequence


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
