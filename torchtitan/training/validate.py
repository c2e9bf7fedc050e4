"""Validation: the loss on held-out text, a token-weighted mean over every data-parallel rank, and its perplexity.

By default validation reads the held-out split of the training data (about one document in
``validation.held_out_every``, chosen by a hash of its text, which the training stream skips: see
``torchtitan.datasets.hf_datasets``; for tokens data every N-th window: see ``torchtitan.datasets.tokens``); other
data named in ``validation.dataset`` / ``validation.dataset_path`` is read whole, and refused when it shares anything
with the training data. On tokens data the first ``validation.windows`` validation windows are scored, divided
between the data-parallel ranks, so every layout scores the same windows; on text data each rank reads
``validation.steps`` batches of its share. The batches are read once, at start, with a loader of their own: every
evaluation sees exactly the same tokens, and the training loader, its checkpointed position and the random number
generators are never touched. Evaluation runs the training forward and loss (same
layout, same dtype policy, loss parallel under TP) without gradients.
"""

from __future__ import annotations

import itertools
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig
from torchtitan.datasets import DocumentSplit, build_hf_data_loader, resolve_dataset
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.datasets.tokens import check_tokenizer, open_validation_windows, read_manifest, validation_windows
from torchtitan.distributed.collectives import all_reduce_scalar, all_reduce_sum_
from torchtitan.errors import UserError
from torchtitan.logging import logger
from torchtitan.parallelisms import ParallelDims, loss_parallel_context
from torchtitan.training.loss import IGNORE_INDEX

Batch = tuple[torch.Tensor, torch.Tensor]


def training_split(job_config: JobConfig) -> DocumentSplit:
    """The documents the training stream reads: all but the held-out split, whether validation is on or not."""
    return DocumentSplit(every=job_config.validation.held_out_every)


def validation_data(job_config: JobConfig) -> tuple[str, Optional[str], DocumentSplit]:
    """(dataset, dataset_path, split) that validation reads; raises UserError for a job that cannot validate.

    Unset ``validation.dataset`` and ``validation.dataset_path`` read the training data's held-out split. Data named
    there is read whole, so it must share nothing with the training data: not a file or folder (compared by real
    path, through symbolic links), not a tokens dataset's fingerprint, not the source it was tokenized from.
    """
    t, v = job_config.training, job_config.validation
    if v.dataset is None and v.dataset_path is None:
        if v.held_out_every == 0:
            raise UserError(
                "validation on the training data needs a held-out split, but validation.held_out_every is 0; "
                "set it to 2 or more, or name other data in validation.dataset / validation.dataset_path"
            )
        return t.dataset, t.dataset_path, DocumentSplit(every=v.held_out_every, held_out=True)
    name = v.dataset or t.dataset
    # Training reads the documents outside the held-out split of its source; named validation data reads all of its.
    theirs = _data_identity(t.dataset, t.dataset_path, "training", (v.held_out_every, False))
    mine = _data_identity(name, v.dataset_path, "validation", ALL_DOCUMENTS)
    shared = [item for item, part in mine.items() if item in theirs and _parts_overlap(part, theirs[item])]
    if shared:
        kind, value = min(shared, key=lambda item: _IDENTITY_KINDS.index(item[0]))
        raise UserError(
            f"validation.dataset / validation.dataset_path name the training data (the same {kind} {value}); remove "
            "them to validate on its held-out split (validation.held_out_every), or name data that training never "
            "reads"
        )
    return name, v.dataset_path, DocumentSplit()


# Which documents of a source a dataset holds: (every, held_out) as in DocumentSplit; (0, False) is all of them.
Part = tuple[int, bool]
ALL_DOCUMENTS: Part = (0, False)
_IDENTITY_KINDS = ("tokens folder", "tokens fingerprint", "file", "hub stream")  # the most telling first


def _parts_overlap(a: Part, b: Part) -> bool:
    """False only for the two sides of one split (the held-out documents and the others, by the same hash rule)."""
    return not (a[0] == b[0] > 0 and a[1] != b[1])


def _data_identity(name: str, path: Optional[str], section: str, part: Part) -> dict[tuple[str, str], Part]:
    """What a dataset is made of, each with the part of its documents read: ("file", real path) of each local file,
    ("hub stream", name) of a hub dataset; for tokens data ("tokens folder", real path) and ("tokens fingerprint",
    fingerprint), whole, and its source with the part that the manifest says was tokenized."""
    local = resolve_dataset(name, path, section)  # UserError for data that cannot be read
    if local is None:
        return {("hub stream", "c4"): part}
    if name != "tokens":
        return {("file", f"'{os.path.realpath(file)}'"): part for file in local[1]}
    manifest = read_manifest(path, section)
    identity = {
        ("tokens folder", f"'{os.path.realpath(path)}'"): ALL_DOCUMENTS,
        ("tokens fingerprint", manifest["fingerprint"]): ALL_DOCUMENTS,
    }
    split = manifest.get("documents_split")
    source_part = (int(split["every"]), bool(split["held_out"])) if split else ALL_DOCUMENTS
    source, named = manifest["source"], manifest["source"] in ("sample", "c4")
    if not named and not os.path.exists(source):
        return {**identity, ("hub stream", source): source_part}
    try:  # the files it was tokenized from, where they still are
        return {
            **identity,
            **_data_identity(source if named else "text", None if named else source, section, source_part),
        }
    except UserError:
        return identity


def check_validation(job_config: JobConfig) -> None:
    """UserError for validation that cannot run, before any worker starts: its data (``validation_data``) and, for
    tokens data, enough validation windows (from the manifest, reading no token)."""
    t, v = job_config.training, job_config.validation
    name, path, split = validation_data(job_config)
    if name == "tokens":
        open_validation_windows(path, t.seq_len, v.seq_len or t.seq_len, split.every, v.windows, v.first_window)


def load_validation_batches(
    job_config: JobConfig,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_degree: int,
    dp_group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
) -> list[Batch]:
    """This rank's validation batches.

    Tokens data: its share of the first ``validation.windows`` validation windows, the same windows whatever the
    layout (see ``torchtitan.datasets.tokens.validation_windows``). Text data: its first ``validation.steps`` batches,
    read from its own share of the data; every data-parallel rank keeps as many batches as the one with the fewest
    (each forward of a sharded model is a collective): ``dp_group`` and ``device`` (where its collectives run) agree
    on that count.
    """
    t, v = job_config.training, job_config.validation
    device = device or torch.device("cpu")
    name, path, split = validation_data(job_config)
    batch_size, seq_len = v.batch_size or t.batch_size, v.seq_len or t.seq_len
    what = "the validation data"
    if split.held_out:
        unit = "windows" if name == "tokens" else "documents"
        what = f"the held-out split (about 1 in {split.every} {unit})"
    if name == "tokens":
        check_tokenizer(read_manifest(path, "validation"), path, job_config.model.tokenizer_path, tokenizer.fingerprint)
        # Held out: windows of training.seq_len + 1 tokens, as training cuts them (see torchtitan.datasets.tokens).
        batches = validation_windows(
            path, t.seq_len, seq_len, batch_size, dp_rank, dp_degree, split.every, v.windows, v.first_window
        )
        logger.info(
            f"validation: windows {v.first_window} to {v.first_window + v.windows - 1} of {what}, {v.windows} x "
            f"{seq_len} tokens, the same at any "
            f"layout; {len(batches)} batches of at most {batch_size} per data-parallel rank, every {v.freq} steps "
            "and at the last"
        )
        return batches
    loader = build_hf_data_loader(
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
    batches = list(itertools.islice(iter(loader), v.steps))
    fewest = -all_reduce_scalar(-len(batches), "max", dp_group, device)
    batches = batches[: int(fewest)]
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

    Every rank sums its tokens' losses and counts its tokens (labels ``IGNORE_INDEX`` count for nothing); one
    all-reduce over the data-parallel group adds them up, so the mean weighs every token alike, not every rank.
    Tensor-parallel ranks hold the same batches and compute the same (replicated) loss, so they take no part in the
    sum. The loss is computed as in training, over ``loss_chunks`` chunks of tokens.
    """
    was_training = model.training
    model.eval()  # our Llama has no dropout: eval mode changes no number, it only says what this is
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of token losses, tokens)
    try:
        for inputs, labels in batches:
            counted = int((labels != IGNORE_INDEX).sum())
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with loss_parallel_context(parallel_dims):
                loss = model(inputs, labels=labels, loss_chunks=loss_chunks)
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            if counted:  # a padding batch (every label ignored) runs the forward's collectives and counts for nothing
                totals[0] += loss.to(torch.float64) * counted
                totals[1] += counted
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
