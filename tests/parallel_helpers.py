"""A tiny float64 Llama, one training step on it, and its loss, full gradients and updated weights, for comparing
a parallelized model against the same model in one process."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.config_manager import JobConfig
from torchtitan.models.llama import ModelArgs, Transformer
from torchtitan.models.roles import canonical_name

SEED = 3
BATCH, SEQ_LEN = 12, 8  # batch divisible by every data-parallel degree tested (2, 3, 4); SEQ_LEN by TP 2
# GQA (4 query heads, 2 key/value heads) so that tensor parallelism splits both head counts.
TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=64, max_seq_len=SEQ_LEN)
LR = 1e-2


def job_config(**sections) -> JobConfig:
    """A default JobConfig with ``section={"key": value}`` overrides."""
    config = JobConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    return config


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def meta_model(args: ModelArgs = TINY, dtype: torch.dtype = torch.float64) -> Transformer:
    with torch.device("meta"), default_dtype(dtype):
        return Transformer(args)


def materialize(model: Transformer) -> Transformer:
    model.to_empty(device="cpu")
    model.init_weights(seed=SEED)
    return model.train()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train_step(model: Transformer, inputs, labels, loss_context=contextlib.nullcontext) -> dict:
    """One forward, backward and foreach-AdamW step.

    Returns the mean cross-entropy ("loss"), and the whole gradients ("grads") and updated weights ("weights") keyed
    by canonical parameter name. foreach AdamW fails when DTensor and plain parameters are mixed, so the step also
    checks that tensor parallelism left no plain parameter behind.
    """
    with loss_context():
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
    grads = {canonical_name(name): full(p.grad).detach().clone() for name, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LR, foreach=True).step()
    weights = {canonical_name(name): full(p).detach().clone() for name, p in model.named_parameters()}
    return {"loss": full(loss).item(), "grads": grads, "weights": weights}


def reference_step() -> dict:
    inputs, labels = batch()
    return train_step(materialize(meta_model()), inputs, labels)
