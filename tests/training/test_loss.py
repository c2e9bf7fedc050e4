"""The chunked loss computes what whole logits compute, without the whole logits.

float64 on the tiny Llama of tests/helpers.py: chunking changes only the order of floating-point sums, so loss and
gradients agree with whole logits to 1e-9 relative (observed: ~1e-15). The parallel layouts (FSDP, TP with the
vocabulary-parallel and the gathered loss, FSDP x TP, HSDP, with activation checkpointing) are checked in
tests/parallelisms/test_parallelisms.py, gradient accumulation in tests/training/test_train_step.py, compile in
tests/parallelisms/test_parallel_ac_compile.py, validation in tests/data/test_validation.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import TINY, batch, grads, job_config, tiny_model, with_ignored_labels
from torchtitan.errors import UserError
from torchtitan.training.loss import IGNORE_INDEX, chunk_bounds

TOLERANCE = dict(rtol=1e-9, atol=0.0)


def _loss_and_grads(loss_chunks: int, scale: float = 1.0, labels=None) -> tuple[float, dict]:
    model = tiny_model()
    inputs, batch_labels = batch()
    loss = model(inputs, labels=batch_labels if labels is None else labels, loss_chunks=loss_chunks)
    (loss * scale).backward()
    return loss.item(), grads(model)


@pytest.mark.parametrize("loss_chunks", [2, 5, 96])  # 96: one token per chunk
def test_chunked_loss_and_gradients_equal_whole_logits(loss_chunks):
    whole_loss, whole_grads = _loss_and_grads(1, scale=0.25)  # a scaled loss, as gradient accumulation makes
    loss, chunked_grads = _loss_and_grads(loss_chunks, scale=0.25)
    assert loss == pytest.approx(whole_loss, rel=1e-9)
    assert chunked_grads.keys() == whole_grads.keys()
    for name, grad in chunked_grads.items():
        torch.testing.assert_close(grad, whole_grads[name], **TOLERANCE, msg=name)
    assert whole_grads["output.weight"].abs().sum() > 0 and whole_grads["tok_embeddings.weight"].abs().sum() > 0


def _with_ignored(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` with a third of them, and all of the first sequence, ignored (``IGNORE_INDEX``)."""
    ignored = with_ignored_labels(labels)
    ignored[0] = IGNORE_INDEX
    return ignored


@pytest.mark.parametrize("loss_chunks", [1, 12, 96])  # 12: the first chunk (a sequence) is all ignored
def test_ignored_labels_count_for_nothing_as_in_f_cross_entropy(loss_chunks):
    model = tiny_model()
    inputs, labels = batch()
    labels = _with_ignored(labels)
    assert loss_chunks == 1 or (labels.flatten()[: labels.numel() // loss_chunks] == IGNORE_INDEX).all()
    with torch.no_grad():
        logits = model(inputs).flatten(0, 1)
        expected = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX)
        assert model(inputs, labels=labels, loss_chunks=loss_chunks).item() == pytest.approx(expected.item(), rel=1e-12)
    loss, chunked_grads = _loss_and_grads(loss_chunks, labels=labels)
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    # Its gradients are those of F.cross_entropy too.
    reference = tiny_model()
    F.cross_entropy(reference(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).backward()
    for name, grad in grads(reference).items():
        torch.testing.assert_close(chunked_grads[name], grad, **TOLERANCE, msg=name)


def test_chunked_loss_without_gradients_equals_whole_logits():
    model = tiny_model()
    inputs, labels = batch()
    with torch.no_grad():
        whole = model(inputs, labels=labels)
        chunked = model(inputs, labels=labels, loss_chunks=7)
    assert not chunked.requires_grad
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-12)


class _LargestLogits(TorchDispatchMode):
    """The most rows of any tensor with the vocabulary as last dimension (logits, probabilities, their gradients),
    the output weight's (dim, vocab) transpose aside."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.vocab, self.dim, self.rows = vocab, dim, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                rows = t.numel() // self.vocab
                self.rows = max(self.rows, rows if rows != self.dim else 0)
        return out


@pytest.mark.parametrize("loss_chunks, rows", [(1, 96), (4, 24), (5, 20)])
def test_logits_exist_one_chunk_at_a_time_forward_and_backward(loss_chunks, rows):
    model = tiny_model()
    inputs, labels = batch()
    assert inputs.numel() == 96 and TINY.dim not in (96, 24, 20)
    with _LargestLogits(TINY.vocab_size, TINY.dim) as seen:
        model(inputs, labels=labels, loss_chunks=loss_chunks).backward()
    assert seen.rows == rows


def test_chunks_cover_the_tokens_in_order_with_sizes_within_one():
    assert chunk_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert chunk_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert chunk_bounds(8, 1) == [(0, 8)]


def test_more_chunks_than_tokens_is_refused():
    with pytest.raises(UserError, match="loss.num_chunks 33 exceeds the 32 tokens of a training micro-batch"):
        job_config("--training.batch_size", "2", "--training.seq_len", "16", "--loss.num_chunks", "33")
    args = ["--training.seq_len", "16", "--validation.enable", "--validation.batch_size", "1", "--loss.num_chunks"]
    with pytest.raises(UserError, match="exceeds the 16 tokens of a validation micro-batch"):
        job_config(*args, "17")


def test_a_second_backward_is_refused_rather_than_giving_no_gradient():
    inputs, labels = batch()
    loss = tiny_model()(inputs, labels=labels, loss_chunks=3)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss.backward()


def test_chunked_loss_under_autocast_computes_in_its_dtype_with_float32_gradients():
    """A one-GPU bf16 job runs its forward, the loss included, under autocast (CPU autocast stands in for CUDA's):
    the chunks compute in bfloat16, as whole logits do, and the float32 weights get float32 gradients."""
    results = {}
    for loss_chunks in (1, 4):
        model = tiny_model().float()
        inputs, labels = batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(inputs, labels=labels, loss_chunks=loss_chunks)
        loss.backward()
        results[loss_chunks] = (loss.item(), grads(model))
    (whole_loss, whole_grads), (loss, chunked_grads) = results[1], results[4]
    assert loss == pytest.approx(whole_loss, rel=2e-2)
    for name, grad in chunked_grads.items():
        assert grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, whole_grads[name], rtol=0.1, atol=2e-3, msg=name)
