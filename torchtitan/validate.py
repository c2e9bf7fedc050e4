"""Validation: the loss on held-out text, a token-weighted mean over every data-parallel rank, and its perplexity.

By default validation reads the held-out split of the training data (about one document in
``validation.held_out_every``, chosen by a hash of its text, which the training stream skips: see
``torchtitan.datasets.hf_datasets``); other data named in
``validation.dataset`` / ``validation.dataset_path`` is read whole. The batches are read once, at start, with a
loader of their own: every evaluation sees exactly the same tokens, and the training loader, its checkpointed
position and the random number generators are never touched. Evaluation runs the training forward and loss (same
layout, same dtype policy, loss parallel under TP) without gradients.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.collectives import all_reduce_scalar, all_reduce_sum_
from torchtitan.config_manager import JobConfig
from torchtitan.datasets import DocumentSplit, build_hf_data_loader, resolve_dataset
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.datasets.tokens import check_tokenizer, read_manifest, validation_windows
from torchtitan.errors import UserError
from torchtitan.logging import logger
from torchtitan.parallelisms import ParallelDims, loss_parallel_context

Batch = tuple[torch.Tensor, torch.Tensor]


def training_split(job_config: JobConfig) -> DocumentSplit:
    """The documents the training stream reads: all but the held-out split, whether validation is on or not."""
    return DocumentSplit(every=job_config.validation.held_out_every)


def validation_data(job_config: JobConfig) -> tuple[str, Optional[str], DocumentSplit]:
    """(dataset, dataset_path, split) that validation reads; raises UserError for a job that cannot validate."""
    t, v = job_config.training, job_config.validation
    own_data = v.dataset is not None or v.dataset_path is not None
    name = v.dataset or t.dataset
    path = v.dataset_path if own_data else t.dataset_path
    # The same files (or the same hub stream) as training: only its held-out split is unseen.
    if _files(name, path, "validation") != _files(t.dataset, t.dataset_path, "training"):
        return name, path, DocumentSplit()
    if v.held_out_every == 0:
        raise UserError(
            "validation on the training data needs a held-out split, but validation.held_out_every is 0; "
            "set it to 2 or more, or name other data in validation.dataset / validation.dataset_path"
        )
    return name, path, DocumentSplit(every=v.held_out_every, held_out=True)


def _files(name: str, path: Optional[str], section: str) -> Optional[tuple[str, list[str]]]:
    """(builder, files) of local data; None for the c4 hub stream."""
    local = resolve_dataset(name, path, section)
    return None if local is None else local[:2]


def load_validation_batches(
    job_config: JobConfig,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_degree: int,
    dp_group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
) -> list[Batch]:
    """This rank's first ``validation.steps`` batches of the validation data, read from its own share of it.

    Every data-parallel rank keeps as many batches as the one with the fewest (each forward of a sharded model
    is a collective); ``dp_group`` and ``device`` (where its collectives run) agree on that count.
    """
    t, v = job_config.training, job_config.validation
    device = device or torch.device("cpu")
    name, path, split = validation_data(job_config)
    batch_size, seq_len = v.batch_size or t.batch_size, v.seq_len or t.seq_len
    if name == "tokens":
        check_tokenizer(read_manifest(path, "validation"), path, job_config.model.tokenizer_path, tokenizer.fingerprint)
        # Held out: windows of training.seq_len + 1 tokens, as training cuts them (see torchtitan.datasets.tokens).
        loader: Iterator[Batch] = validation_windows(
            path, t.seq_len, seq_len, batch_size, dp_rank, dp_degree, split.every
        )
    else:
        loader = iter(
            build_hf_data_loader(
                name,
                path,
                tokenizer,
                batch_size,
                seq_len,
                dp_rank,
                dp_degree,
                infinite=False,
                split=split,
                section="validation",
                workers=t.data_workers,
                pin_memory=device.type == "cuda",
            )
        )
    batches = list(itertools.islice(loader, v.steps))
    fewest = -all_reduce_scalar(-len(batches), "max", dp_group, device)
    batches = batches[: int(fewest)]
    unit = "windows" if name == "tokens" else "documents"
    what = f"the held-out split (about 1 in {split.every} {unit})" if split.held_out else "the validation data"
    if not batches:
        raise UserError(
            f"{what} holds less than one batch of {batch_size} x {seq_len + 1} tokens for each data-parallel rank's "
            f"share (1/{dp_degree}); lower validation.batch_size or validation.seq_len, or lower "
            "validation.held_out_every"
        )
    if len(batches) < v.steps:
        logger.warning(f"validation: {what} holds {len(batches)} batches, not validation.steps {v.steps}")
    logger.info(
        f"validation: {len(batches)} batches of {batch_size * dp_degree} x {seq_len} tokens from {what}, "
        f"every {v.freq} steps and at the last"
    )
    return batches


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    batches: list[Batch],
    parallel_dims: ParallelDims,
    dp_group: Optional[dist.ProcessGroup],
    device: torch.device,
    loss_chunks: int = 1,
) -> tuple[float, int]:
    """(mean loss per token over all data-parallel ranks' batches, token count) without gradients.

    Every rank sums its tokens' losses and counts its tokens; one all-reduce over the data-parallel group adds
    them up, so the mean weighs every token alike, not every rank. Tensor-parallel ranks hold the same batches
    and compute the same (replicated) loss, so they take no part in the sum. The loss is computed as in training,
    over ``loss_chunks`` chunks of tokens.
    """
    was_training = model.training
    model.eval()  # our Llama has no dropout: eval mode changes no number, it only says what this is
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of token losses, tokens)
    try:
        for inputs, labels in batches:
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with loss_parallel_context(parallel_dims):
                loss = model(inputs, labels=labels, loss_chunks=loss_chunks)
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            totals[0] += loss.to(torch.float64) * labels.numel()
            totals[1] += labels.numel()
    finally:
        model.train(was_training)
    all_reduce_sum_(totals, dp_group)
    return float(totals[0] / totals[1]), int(totals[1].item())


class Validator:
    """Evaluates the model on fixed validation batches every ``validation.freq`` steps and at the last step."""

    def __init__(
        self,
        job_config: JobConfig,
        tokenizer: Tokenizer,
        parallel_dims: ParallelDims,
        dp_rank: int,
        dp_degree: int,
        dp_group: Optional[dist.ProcessGroup],
        device: torch.device,
    ) -> None:
        self.freq = job_config.validation.freq
        self.last_step = job_config.training.steps
        self.parallel_dims = parallel_dims
        self.dp_group = dp_group
        self.device = device
        self.loss_chunks = job_config.loss.num_chunks
        self.batches = load_validation_batches(job_config, tokenizer, dp_rank, dp_degree, dp_group, device)

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    def run(self, model: torch.nn.Module) -> tuple[dict[str, float], int]:
        """({"validation/loss", "validation/perplexity"}, tokens evaluated over all ranks)."""
        loss, tokens = validation_loss(
            model, self.batches, self.parallel_dims, self.dp_group, self.device, self.loss_chunks
        )
        perplexity = float(torch.tensor(loss, dtype=torch.float64).exp())  # inf rather than an overflow error
        return {"validation/loss": loss, "validation/perplexity": perplexity}, tokens


def build_validator(
    job_config: JobConfig,
    tokenizer: Tokenizer,
    parallel_dims: ParallelDims,
    dp_rank: int,
    dp_degree: int,
    dp_group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> Optional[Validator]:
    """A Validator when ``validation.enable``, else None."""
    if not job_config.validation.enable:
        return None
    return Validator(job_config, tokenizer, parallel_dims, dp_rank, dp_degree, dp_group, device)
