"""Transformer blocks as ``training.compile`` runs them, for the memory estimate on fake tensors.

``train.py`` compiles each block with ``torch.compile``: TorchDynamo captures it, AOT autograd traces the joint
forward-and-backward graph (with inductor's decompositions) and inductor's partitioner
(``min_cut_rematerialization_partition``) chooses what the forward saves for backward, recomputing cheap
element-wise results rather than keeping them. Dynamo cannot run under the estimate's tracking mode, so the blocks are
compiled here by AOT autograd directly, with the same decompositions and partitioner, once for all blocks (they share
shapes) and on fake tensors; the partitioned forward and backward graphs then run op by op under the tracker, so the
saved activations are the compiled blocks' and each graph frees its inputs and intermediates after their last use.

What differs from inductor: its joint-graph pattern rewrites before partitioning, and its fused kernels, which hold
fewer intermediates at once inside a block (the saved activations are the same partition's).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn


def _partitioned_block(template: nn.Module) -> Callable:
    """The block's forward as AOT autograd compiles it: ``fn(params, x, rope)``, traced on its first call."""
    from functools import partial

    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.nn.utils.stateless import _reparametrize_module

    forward = type(template).forward

    def block(params: dict[str, torch.Tensor], x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        with _reparametrize_module(template, params):
            return forward(template, x, rope)

    def run_as_traced(graph: torch.fx.GraphModule, _inputs) -> Callable:
        # Boxed, as compiled graphs are called: the graph takes its inputs' list and drops each input and
        # intermediate after its last use (saved activations are freed during the backward, not after it).
        def run(args: list) -> Any:
            return torch.fx.Interpreter(graph).boxed_run(args)

        run._boxed_call = True
        return run

    return aot_function(
        block,
        fw_compiler=run_as_traced,
        bw_compiler=run_as_traced,
        partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"),
        decompositions=select_decomp_table(),
    )


@contextmanager
def compiled_blocks(model: nn.Module) -> Iterator[None]:
    """Run ``model.layers``' blocks as compiled (see the module); the first forward, outside any tracker, traces."""
    layers = list(model.layers.values())
    compiled: Optional[Callable] = None

    def compiled_forward(block: nn.Module) -> Callable:
        def forward(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
            nonlocal compiled
            if compiled is None:
                compiled = _partitioned_block(block)
            return compiled(dict(block.named_parameters()), x, rope)

        return forward

    for block in layers:
        block.forward = compiled_forward(block)
    try:
        yield
    finally:
        for block in layers:
            del block.forward
