"""The training loss, shared by the training step and validation so that both follow one dtype policy.

Two ways to the same number: :func:`cross_entropy` of whole logits (``loss.num_chunks = 1``), and
:func:`chunked_cross_entropy`, which runs the output projection and the cross-entropy over a few chunks of tokens so
that the whole (tokens x vocabulary) logits and their gradient never exist at once. The model calls either from its
own forward (``Transformer.forward(tokens, labels, loss_chunks)``), so that FSDP2 gathers the output weight as for
any other forward.

Chunking without recomputation: while a chunk's logits are alive, its gradients with respect to the hidden states and
the output weight are taken at once (autograd over the cross-entropy, then the two matmuls of the projection's
backward, the weight's accumulated in place in its own dtype). Forward keeps those two gradients, each the size of
its input, and backward only scales them by the incoming gradient. Every matmul runs once, as with whole logits; the
cost is a weight-sized gradient held from the end of forward, where whole logits would be held instead. The weight's
gradient is summed in the weight's compute dtype: under bf16 mixed precision it is rounded once per chunk, where
whole logits round it once.

Labels equal to ``IGNORE_INDEX`` (-100, as in ``F.cross_entropy``) count for nothing: the mean is over the other
tokens, in either way and in every layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

IGNORE_INDEX = -100  # a label that is not a target (padding, masked tokens): F.cross_entropy's default


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least float32 for the softmax; float64 runs stay float64 so that parity checks can be exact.
    return torch.promote_types(dtype, torch.float32)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``(batch, seq, vocab)`` logits against ``(batch, seq)`` labels, over the
    labels that are not ``IGNORE_INDEX``."""
    logits = logits.flatten(0, 1)
    return F.cross_entropy(logits.to(_loss_dtype(logits.dtype)), labels.flatten(), ignore_index=IGNORE_INDEX)


def chunk_bounds(num_tokens: int, num_chunks: int) -> list[tuple[int, int]]:
    """(start, end) of ``num_chunks`` consecutive chunks of tokens whose sizes differ by at most one."""
    edges = [num_tokens * i // num_chunks for i in range(num_chunks + 1)]
    return [(start, end) for start, end in zip(edges, edges[1:]) if end > start]


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, loss_parallel: bool) -> torch.Tensor:
    """Sum of the tokens' cross-entropies; vocabulary-sharded logits are gathered unless the loss is parallel."""
    if isinstance(logits, DTensor) and not loss_parallel:
        logits = logits.full_tensor()
    return F.cross_entropy(logits.to(_loss_dtype(logits.dtype)), labels, reduction="sum", ignore_index=IGNORE_INDEX)


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """How many labels are targets (not ``IGNORE_INDEX``): what the mean divides by (a tensor: no device sync)."""
    return (labels != IGNORE_INDEX).sum()


def _replicated(hidden: torch.Tensor) -> torch.Tensor:
    """Sequence-parallel hidden states gathered once for all chunks, as the column-parallel projection would."""
    if not isinstance(hidden, DTensor):
        return hidden
    return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T``; gradients taken chunk by chunk in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, num_chunks: int, loss_parallel: bool):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_hidden_chunks = []
        total = None
        targets = _targets(labels)
        for start, end in chunk_bounds(labels.numel(), num_chunks):
            chunk = hidden[start:end]
            logits = F.linear(chunk, weight).requires_grad_()
            with torch.enable_grad():
                loss = _summed_cross_entropy(logits, labels[start:end], loss_parallel) / targets
            (grad_logits,) = torch.autograd.grad(loss, logits)
            del logits
            if need_hidden:
                grad_hidden_chunks.append(grad_logits @ weight)
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), chunk)
            del grad_logits
            total = loss.detach() if total is None else total + loss.detach()
        # Kept on ctx rather than saved: they are results, not inputs to recompute from, and backward frees them.
        ctx.grad_hidden = torch.cat(grad_hidden_chunks) if need_hidden else None
        ctx.grad_weight = grad_weight
        ctx.consumed = False
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.consumed:
            raise RuntimeError("the chunked loss's backward runs once (its gradients are scaled in place)")
        ctx.consumed = True
        grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
        ctx.grad_hidden = ctx.grad_weight = None
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None, None


def _chunked_loss_without_grad(hidden, weight, labels, num_chunks: int, loss_parallel: bool) -> torch.Tensor:
    total = None
    for start, end in chunk_bounds(labels.numel(), num_chunks):
        loss = _summed_cross_entropy(F.linear(hidden[start:end], weight), labels[start:end], loss_parallel)
        total = loss if total is None else total + loss
    return total / _targets(labels)


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, num_chunks: int, *, loss_parallel: bool = False
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``labels`` (over those that are not
    ``IGNORE_INDEX``), ``num_chunks`` chunks of tokens at a time: the same loss and gradients as
    :func:`cross_entropy` of whole logits, to rounding.

    ``hidden`` is ``(batch, seq, dim)`` (sequence-sharded under tensor parallelism), ``weight`` the output
    projection's ``(vocab, dim)`` (vocabulary-sharded under tensor parallelism), ``labels`` ``(batch, seq)``.
    ``loss_parallel``: vocabulary-sharded logits go to the vocabulary-parallel cross-entropy (inside
    ``loss_parallel()``) rather than being gathered.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # Under autocast (bf16 compute without FSDP) the projection computes in autocast's dtype, as nn.Linear's
        # would: cast both operands once (the casts' backward returns float32 gradients to the float32 weights) and
        # run the chunks with autocast off, so that the in-place weight-gradient sums see one dtype.
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return chunked_cross_entropy(
                hidden.to(dtype), weight.to(dtype), labels, num_chunks, loss_parallel=loss_parallel
            )
    hidden = _replicated(hidden).flatten(0, 1)
    labels = labels.flatten()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, num_chunks, loss_parallel)
    with torch.no_grad():
        return _chunked_loss_without_grad(hidden, weight, labels, num_chunks, loss_parallel)
