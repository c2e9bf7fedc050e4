"""Tokenize a dataset once into token shards that ``training.dataset = "tokens"`` reads.

    python -m torchtitan.tools.pretokenize --source SOURCE --tokenizer PATH --out DIR [--workers N]

SOURCE is what ``training.dataset`` reads: ``sample`` (the bundled corpus), ``c4`` (streamed from the Hugging Face
hub), a local file or folder of .txt / .json / .jsonl / .parquet files, or another Hugging Face dataset name
(``owner/name``, with ``--hf-config``, ``--split`` and ``--text-field``). Every non-blank document is tokenized with
BOS and EOS, exactly as the text loader does, in the source's order: with N > 1, N processes tokenize batches of
documents while this one reads and writes them in order (the bytes do not depend on N). DIR gets the shards and
``manifest.json`` (format: see ``torchtitan.datasets.tokens``); it is written into a temporary folder beside DIR and
renamed at the end, so DIR either holds complete data or does not exist. An existing DIR is never overwritten.

``--held-out-every N`` writes only the documents outside the held-out split of about one in N (by a hash of the
text, the text loader's rule), ``--held-out`` only those inside it: two folders with no document in common, one
to train on and one to validate on.
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
    held_out_every: int = 0,
    held_out: bool = False,
) -> dict[str, Any]:
    """Tokenize SOURCE into the tokens folder ``out``; returns its manifest.

    With ``held_out_every`` N > 0 only part of the documents: those outside the text loader's held-out split of
    about one in N (chosen by a hash of the text), or with ``held_out`` only those inside it.
    """
    from torchtitan.datasets.hf_datasets import is_held_out
    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.datasets.tokens import ShardWriter, token_dtype, write_manifest

    target = Path(out)
    if target.exists():
        raise UserError(f"--out '{out}' already exists; choose a new folder (tokenized data is never overwritten)")
    if workers < 1 or shard_tokens < 1:
        raise UserError("--workers and --shard-tokens must be at least 1")
    if held_out_every == 1 or held_out_every < 0:
        raise UserError("--held-out-every must be 0 (every document) or 2 or more")
    if held_out and held_out_every == 0:
        raise UserError("--held-out writes the held-out documents, but --held-out-every is 0 (none); set it")
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
                if held_out_every and is_held_out(text, held_out_every) != held_out:
                    continue
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
        documents_split = {"every": held_out_every, "held_out": held_out} if held_out_every else None
        manifest = write_manifest(temporary, writer, tokenizer, tokenizer_path, described, counted[0], documents_split)
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
    parser.add_argument(
        "--held-out-every",
        type=int,
        default=0,
        help="N: write only the documents outside the held-out split of about 1 in N (validation.held_out_every's "
        "rule for text data); default 0: every document",
    )
    parser.add_argument(
        "--held-out", action="store_true", help="with --held-out-every: write only the held-out documents instead"
    )
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
            args.held_out_every,
            args.held_out,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
