"""The training data loader a job asks for, and the record of which data a run reads.

``build_data_loader`` picks the text loader (``sample``, ``c4``, ``text``) or the tokens loader (``tokens``).
``dataset_record`` is what ``train.py`` writes as ``dataset.json`` into the run folder (beside metrics.jsonl):
``{"fingerprint": ..., "source": ..., "data_seed": ...}``. The fingerprint of tokens data is the manifest's (every
token); of local text data, a fingerprint of its files and the tokenizer (``text_fingerprint``); of the c4 hub
stream, null: the hub's files can change unseen. ``data_seed`` is null for text data, whose order has no seed.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch.distributed as dist

from torchtitan.datasets.hf_datasets import DocumentSplit, build_hf_data_loader, text_fingerprint
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.datasets.tokens import build_tokens_data_loader, read_manifest

DATASET_RECORD = "dataset.json"


def dataset_record(job_config: Any, tokenizer: Tokenizer) -> dict[str, Any]:
    """{"fingerprint", "source", "data_seed"} of the job's training data."""
    t = job_config.training
    if t.dataset == "tokens":
        manifest = read_manifest(t.dataset_path)
        return {
            "fingerprint": manifest["fingerprint"],
            "source": f"tokens {os.path.abspath(t.dataset_path)} (from {manifest['source']})",
            "data_seed": t.data_seed,
        }
    source = t.dataset if t.dataset_path is None else f"{t.dataset} {os.path.abspath(t.dataset_path)}"
    return {
        "fingerprint": text_fingerprint(t.dataset, t.dataset_path, tokenizer.fingerprint),
        "source": source,
        "data_seed": None,
    }


def build_data_loader(
    job_config: Any,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_degree: int,
    fingerprint: Optional[str],
    split: DocumentSplit,
    pin_memory: bool = False,
    group: Optional[dist.ProcessGroup] = None,
):
    """This rank's checkpointable training loader of ``training.dataset``, reading outside the held-out ``split``."""
    t = job_config.training
    if t.dataset == "tokens":
        return build_tokens_data_loader(
            t.dataset_path,
            tokenizer,
            job_config.model.tokenizer_path,
            t.batch_size,
            t.seq_len,
            dp_rank,
            dp_degree,
            seed=t.data_seed,
            held_out_every=split.every,
            workers=t.data_workers,
            pin_memory=pin_memory,
            group=group,
            allow_data_change=t.allow_data_change,
        )
    return build_hf_data_loader(
        t.dataset,
        t.dataset_path,
        tokenizer,
        t.batch_size,
        t.seq_len,
        dp_rank,
        dp_degree,
        split=split,
        workers=t.data_workers,
        pin_memory=pin_memory,
        group=group,
        fingerprint=fingerprint,
        allow_data_change=t.allow_data_change,
    )
