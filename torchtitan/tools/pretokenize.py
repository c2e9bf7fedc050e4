"""Tokenize a dataset once into token shards that ``training.dataset = "tokens"`` reads.

    python -m torchtitan.tools.pretokenize --source SOURCE --tokenizer PATH --out DIR [--workers N]

SOURCE is what ``training.dataset`` reads: ``sample`` (the bundled corpus), ``c4`` (streamed from the Hugging Face
hub), a local file or folder of .txt / .json / .jsonl / .parquet files, or another Hugging Face dataset name
(``owner/name``, with ``--hf-config``, ``--split`` and ``--text-field``). Every non-blank document is tokenized with
BOS and EOS, exactly as the text loader does, in the source's order: with N > 1, N processes tokenize batches of
documents while this one reads and writes them in order (the bytes do not depend on N). DIR gets the shards and
``manifest.json`` (format: see ``torchtitan.datasets.tokens``); it is written into a temporary folder beside DIR and
renamed at the end, so DIR either holds complete data or does not exist. An existing DIR is never overwritten.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from torchtitan.errors import UserError, exit_code

DOCUMENTS_PER_TASK = 256
DEFAULT_SHARD_TOKENS = 1 << 27
IN_FLIGHT_PER_WORKER = 4  # batches of documents queued per process: memory stays bounded whatever the data's size

_worker_tokenizer = None


def _start_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    from torchtitan.datasets.tokenizer import build_tokenizer

    _worker_tokenizer = build_tokenizer(tokenizer_path)


def _encode(texts: list[str]) -> np.ndarray:
    ids = [i for text in texts for i in _worker_tokenizer.encode(text, bos=True, eos=True)]
    return np.asarray(ids, dtype=np.int64)


def _batched(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _in_order(pool: Any, batches: Iterator[list[str]], in_flight: int) -> Iterator[np.ndarray]:
    """The tokens of each batch, in order, with at most ``in_flight`` batches handed to ``pool`` at a time."""
    pending: collections.deque = collections.deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode, (batch,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def source_documents(source: str, hf_config: Optional[str], split: str, text_field: str):
    """(DocumentSource, description) for SOURCE."""
    from torchtitan.datasets.hf_datasets import DocumentSource, load_documents

    if source in ("sample", "c4"):
        return load_documents(source, None), source
    if os.path.exists(source):
        return load_documents("text", source), os.path.abspath(source)
    if "/" not in source:
        raise UserError(
            f"--source '{source}' is neither sample, c4, an existing file or folder nor a Hugging Face dataset "
            "name (owner/name)"
        )
    from datasets import load_dataset

    from torchtitan.datasets.hf_datasets import _first_line, _network_errors, hub_unreachable

    try:
        stream = load_dataset(source, name=hf_config, split=split, streaming=True)
    except _network_errors() as e:
        raise hub_unreachable(_first_line(e)) from None
    if text_field != "text":
        stream = stream.rename_column(text_field, "text")
    described = f"hf:{source}" + (f"/{hf_config}" if hf_config else "") + f":{split}:{text_field}"
    return DocumentSource(stream, f"the Hugging Face dataset {source}", from_hub=True), described


def pretokenize(
    source: str,
    tokenizer_path: str,
    out: str,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    hf_config: Optional[str] = None,
    split: str = "train",
    text_field: str = "text",
) -> dict[str, Any]:
    """Tokenize SOURCE into the tokens folder ``out``; returns its manifest."""
    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.datasets.tokens import ShardWriter, token_dtype, write_manifest

    target = Path(out)
    if target.exists():
        raise UserError(f"--out '{out}' already exists; choose a new folder (tokenized data is never overwritten)")
    if workers < 1 or shard_tokens < 1:
        raise UserError("--workers and --shard-tokens must be at least 1")
    tokenizer = build_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.n_words)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    pool = None
    try:
        if workers > 1:  # started before any data is opened: the processes inherit no reader threads
            pool = multiprocessing.get_context("fork").Pool(workers, _start_worker, (tokenizer_path,))
        documents, described = source_documents(source, hf_config, split, text_field)
        counted = [0]

        def texts() -> Iterator[str]:
            for text, _ in documents.documents(""):
                counted[0] += 1
                yield text

        batches = _batched(texts(), DOCUMENTS_PER_TASK)
        writer = ShardWriter(temporary, dtype, shard_tokens, tokenizer.n_words)
        started = time.perf_counter()
        if pool is None:
            _start_worker(tokenizer_path)
            encoded: Iterator[np.ndarray] = map(_encode, batches)
        else:
            encoded = _in_order(pool, batches, IN_FLIGHT_PER_WORKER * workers)
        for batch_tokens in encoded:
            writer.add(batch_tokens)
        manifest = write_manifest(temporary, writer, tokenizer, tokenizer_path, described, counted[0])
        os.rename(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    seconds = time.perf_counter() - started
    print(
        f"wrote {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({dtype.name}) in "
        f"{len(manifest['shards'])} shard(s) to {out} in {seconds:.1f} s; fingerprint {manifest['fingerprint']}"
    )
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan.tools.pretokenize", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="sample, c4, a file or folder, or a Hugging Face dataset")
    parser.add_argument("--tokenizer", required=True, help="the tokenizer file (model.tokenizer_path of the runs)")
    parser.add_argument("--out", required=True, help="the new tokens folder (training.dataset_path of the runs)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1: this one)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard at most")
    parser.add_argument("--hf-config", default=None, help="a Hugging Face dataset's configuration name")
    parser.add_argument("--split", default="train", help="a Hugging Face dataset's split (default train)")
    parser.add_argument("--text-field", default="text", help="a Hugging Face dataset's text column (default text)")
    args = parser.parse_args(argv)
    return exit_code(
        lambda: pretokenize(
            args.source,
            args.tokenizer,
            args.out,
            args.workers,
            args.shard_tokens,
            args.hf_config,
            args.split,
            args.text_field,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
