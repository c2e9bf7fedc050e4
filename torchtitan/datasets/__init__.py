"""Tokenizers, the packed, rank-split, resumable text data loader and the pre-tokenized data loader (tokens.py)."""

from torchtitan.datasets.hf_datasets import DocumentSplit, build_hf_data_loader, check_hub_reachable, resolve_dataset
from torchtitan.datasets.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "DocumentSplit",
    "Tokenizer",
    "build_hf_data_loader",
    "build_tokenizer",
    "check_hub_reachable",
    "resolve_dataset",
]
