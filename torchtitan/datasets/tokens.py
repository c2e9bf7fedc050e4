"""Pre-tokenized data: token shards on disk, read as a seeded permutation of fixed windows, exact at any reader count.

A tokens folder (written by ``python -m torchtitan.tools.pretokenize``) holds ``shard_NNNNN.bin`` files and a
``manifest.json``. A shard is a 64-byte header (the magic ``TTTOKNS1``, the bytes per token as a little-endian
uint32, the token count as a little-endian uint64, zeros) followed by the tokens: uint16 when the vocabulary fits
in 65,536 ids, else uint32. The shards, in order, are one token stream: every document with its BOS and EOS,
exactly as the text loader tokenizes it. The manifest holds the documents, the tokens, the shards, the tokenizer's
fingerprint, the source and the dataset's fingerprint (SHA-256 of the token bytes in order and their width); and,
for a part of the source's documents (``pretokenize --held-out-every``), which part (``documents_split``).

Reading (``training.dataset = "tokens"``): the stream is cut into windows of ``seq_len + 1`` tokens (the tail that
fills no window is not read). With ``validation.held_out_every = N`` every N-th window (window ``0, N, 2N, ...``) is
held out: training never reads it and validation reads only those. The training windows are read in an order fixed
by ``training.data_seed``: a new permutation of them each epoch, computed window by window (a keyed Feistel
permutation of the window indices), so no reader holds anything that grows with the dataset; the tokens are
memory-mapped.

Readers: a job of D data-parallel ranks with W loader workers each (W = 0 counts as one reader per rank) walks one
global sequence of positions. Rank ``r``'s ``n``-th batch (in the order its loader hands them over) is positions
``base + (n * D + r) * batch_size`` onwards, ``batch_size`` of them, and worker ``n mod W`` reads it. Position ``p``
is window ``permutation(epoch)[p mod n]`` of epoch ``p // n`` (n training windows). After every rank has taken the
same number of batches (at every step) the positions read are exactly the first ones: the state is one number, the
windows read so far. A resume at any number of ranks, workers or batch size continues with the next position, so no
window is read twice or skipped within an epoch.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from torchtitan.distributed.collectives import all_gather_objects
from torchtitan.errors import UserError
from torchtitan.logging import logger
from torchtitan.training.loss import IGNORE_INDEX
from torchtitan.training.preemption import worker_init

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
MAGIC = b"TTTOKNS1"
HEADER_BYTES = 64
BATCHES_AT_ONCE = 32
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


# ----------------------------------------------------------------------------------------------------------------
# The shard format


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return _DTYPES[2] if vocab_size <= 1 << 16 else _DTYPES[4]


def shard_header(token_bytes: int, tokens: int) -> bytes:
    header = MAGIC + token_bytes.to_bytes(4, "little") + tokens.to_bytes(8, "little")
    return header + bytes(HEADER_BYTES - len(header))


def read_shard_header(path: str) -> tuple[np.dtype, int]:
    """(dtype, token count) of a shard; UserError if it is not one or is cut short."""
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    token_bytes = int.from_bytes(header[8:12], "little") if len(header) == HEADER_BYTES else 0
    if header[:8] != MAGIC or token_bytes not in _DTYPES:
        raise UserError(f"'{path}' is not a token shard (no {MAGIC.decode()} header); pretokenize the data again")
    tokens = int.from_bytes(header[12:20], "little")
    if os.path.getsize(path) != HEADER_BYTES + tokens * token_bytes:
        raise UserError(f"token shard '{path}' is cut short or too long for its header; pretokenize the data again")
    return _DTYPES[token_bytes], tokens


class ShardWriter:
    """Writes a token stream into shards of at most ``shard_tokens`` tokens; ``close()`` returns the manifest part.

    Every id is checked before it is narrowed to ``dtype``: below ``vocab_size`` when given, else within the dtype.
    """

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, vocab_size: Optional[int] = None) -> None:
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.id_limit = vocab_size if vocab_size is not None else int(np.iinfo(dtype).max) + 1
        if self.id_limit > int(np.iinfo(dtype).max) + 1:
            raise ValueError(f"a vocabulary of {vocab_size} ids does not fit {dtype.name}")
        self.shards: list[dict[str, Any]] = []
        self.tokens = 0
        self._digest = hashlib.sha256(f"tokens {dtype.str}".encode())
        self._file = None
        self._in_shard = 0

    def add(self, tokens: np.ndarray) -> None:
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.id_limit):
            bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
            raise UserError(
                f"token id {bad} is outside the vocabulary of {self.id_limit:,} ids that the tokens are stored for "
                f"({self.dtype.name}); the tokenizer gives ids its vocabulary size does not count: fix the tokenizer "
                "file"
            )
        tokens = tokens.astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                self._open()
            take = min(tokens.size, self.shard_tokens - self._in_shard)
            data = tokens[:take].tobytes()
            self._file.write(data)
            self._digest.update(data)
            self._in_shard += take
            self.tokens += take
            tokens = tokens[take:]
            if self._in_shard == self.shard_tokens:
                self._close_shard()

    def _open(self) -> None:
        name = f"shard_{len(self.shards):05d}.bin"
        self._file = open(self.out / name, "wb")
        self._file.write(shard_header(self.dtype.itemsize, 0))  # the count is written when the shard is full
        self.shards.append({"file": name, "tokens": 0})
        self._in_shard = 0

    def _close_shard(self) -> None:
        self._file.seek(0)
        self._file.write(shard_header(self.dtype.itemsize, self._in_shard))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1]["tokens"] = self._in_shard
        self._file = None

    def close(self) -> tuple[list[dict[str, Any]], str]:
        """(shards, dataset fingerprint)."""
        if self._file is not None:
            self._close_shard()
        return self.shards, self._digest.hexdigest()[:16]


def write_manifest(
    folder: Path,
    writer: ShardWriter,
    tokenizer: Any,
    tokenizer_path: str,
    source: str,
    documents: int,
    documents_split: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Close ``writer`` and write the manifest of its shards into ``folder``; returns the manifest.

    ``documents_split`` (``{"every": N, "held_out": bool}``) says that the source's documents were split as the text
    loader splits them and which part these are; without it, they are every document of the source.
    """
    shards, fingerprint = writer.close()
    manifest = {
        "format": FORMAT_VERSION,
        "dtype": writer.dtype.str,
        "documents": documents,
        "tokens": writer.tokens,
        "shards": shards,
        "tokenizer": {
            "path": os.path.abspath(tokenizer_path),
            "fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.n_words,
        },
        "source": source,
        "fingerprint": fingerprint,
    }
    if documents_split is not None:
        manifest["documents_split"] = documents_split
    with open(folder / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(path: str, section: str = "training") -> dict[str, Any]:
    """The manifest of the tokens folder ``path`` (shards checked against it); UserError for anything else."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        raise UserError(
            f"{section}.dataset_path '{path}' has no {MANIFEST}; {section}.dataset 'tokens' reads a folder written "
            "by python -m torchtitan.tools.pretokenize"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"'{manifest_path}' cannot be read ({e}); pretokenize the data again") from None
    if not isinstance(manifest, dict) or "format" not in manifest:
        raise UserError(f"'{manifest_path}' has no key 'format'; pretokenize the data again")
    if manifest["format"] != FORMAT_VERSION:
        raise UserError(
            f"'{manifest_path}' has format {manifest['format']!r}, this version reads {FORMAT_VERSION}; "
            "pretokenize the data again"
        )
    _check_manifest_keys(manifest, manifest_path)
    for shard in manifest["shards"]:
        file = str(Path(path) / shard["file"])
        if not os.path.isfile(file):
            raise UserError(f"token shard '{file}' named in '{manifest_path}' is missing; pretokenize the data again")
        dtype, tokens = read_shard_header(file)
        if tokens != shard["tokens"] or dtype.str != manifest["dtype"]:
            raise UserError(f"token shard '{file}' does not match '{manifest_path}'; pretokenize the data again")
    return manifest


_MANIFEST_KEYS = ("dtype", "documents", "tokens", "shards", "tokenizer", "source", "fingerprint")
_SHARD_KEYS = ("file", "tokens")
_TOKENIZER_KEYS = ("path", "fingerprint", "vocab_size")


def _check_manifest_keys(manifest: dict[str, Any], manifest_path: Path) -> None:
    """UserError naming the first key a manifest lacks, a width no shard has, or a vocabulary its width cannot hold."""

    def missing(key: str) -> UserError:
        return UserError(f"'{manifest_path}' has no key {key}; pretokenize the data again")

    for key in _MANIFEST_KEYS:
        if key not in manifest:
            raise missing(repr(key))
    if not isinstance(manifest["shards"], list) or not isinstance(manifest["tokenizer"], dict):
        raise UserError(f"'{manifest_path}' has malformed 'shards' or 'tokenizer'; pretokenize the data again")
    for i, shard in enumerate(manifest["shards"]):
        for key in _SHARD_KEYS:
            if not isinstance(shard, dict) or key not in shard:
                raise missing(f"'shards[{i}].{key}'")
    for key in _TOKENIZER_KEYS:
        if key not in manifest["tokenizer"]:
            raise missing(f"'tokenizer.{key}'")
    for key in ("every", "held_out") if "documents_split" in manifest else ():  # optional: a part of the source
        if not isinstance(manifest["documents_split"], dict) or key not in manifest["documents_split"]:
            raise missing(f"'documents_split.{key}'")
    widths = {dtype.str: dtype for dtype in _DTYPES.values()}
    if manifest["dtype"] not in widths:
        raise UserError(
            f"'{manifest_path}' has dtype {manifest['dtype']!r}, not one of {', '.join(widths)}; "
            "pretokenize the data again"
        )
    vocab_size, dtype = manifest["tokenizer"]["vocab_size"], widths[manifest["dtype"]]
    if not isinstance(vocab_size, int) or not 0 < vocab_size <= int(np.iinfo(dtype).max) + 1:
        raise UserError(
            f"'{manifest_path}' holds {dtype.name} tokens, which cannot hold the ids of its tokenizer's vocabulary "
            f"of {vocab_size!r}; pretokenize the data again"
        )


def check_tokenizer(manifest: dict[str, Any], path: str, tokenizer_path: str, tokenizer_fingerprint: str) -> None:
    """UserError unless the tokens were made by the job's tokenizer."""
    made_with = manifest["tokenizer"]
    if made_with["fingerprint"] != tokenizer_fingerprint:
        raise UserError(
            f"training.dataset_path '{path}' was tokenized with '{made_with['path']}' (fingerprint "
            f"{made_with['fingerprint']}), but model.tokenizer_path is '{tokenizer_path}' (fingerprint "
            f"{tokenizer_fingerprint}); pretokenize the data with model.tokenizer_path, or point it at that tokenizer"
        )


class TokenArray:
    """The shards of a tokens folder as one read-only token sequence, memory-mapped on first read.

    Pickling (a loader worker that is spawned) carries the paths only, never the tokens.
    """

    def __init__(self, path: str, manifest: dict[str, Any]) -> None:
        self.files = [str(Path(path) / shard["file"]) for shard in manifest["shards"]]
        counts = [shard["tokens"] for shard in manifest["shards"]]
        self.starts = np.cumsum([0] + counts)
        self._shard_starts = [int(start) for start in self.starts]
        self.dtype = np.dtype(manifest["dtype"])
        self._maps: Optional[list[np.ndarray]] = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    def _memmaps(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [
                # A plain array over the mapping: slicing it costs less than slicing a memmap.
                np.memmap(file, dtype=self.dtype, mode="r", offset=HEADER_BYTES, shape=(int(n),)).view(np.ndarray)
                for file, n in zip(self.files, np.diff(self.starts))
            ]
        return self._maps

    def rows(self, starts: np.ndarray, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) LongTensors of ``len(starts)`` rows: row ``i`` of inputs is tokens ``[starts[i],
        starts[i] + length - 1)``, of labels the same one token later."""
        maps = self._memmaps()
        inputs = np.empty((len(starts), length - 1), dtype=np.int64)
        labels = np.empty((len(starts), length - 1), dtype=np.int64)
        shard_starts = self._shard_starts
        for row, start in enumerate(starts.tolist()):
            shard = bisect.bisect_right(shard_starts, start) - 1
            offset = start - shard_starts[shard]
            if offset + length <= len(maps[shard]):
                tokens = maps[shard][offset : offset + length]
            else:  # the window crosses into the next shard(s)
                tokens = np.empty(length, dtype=np.int64)
                self.read(start, length, tokens)
            inputs[row] = tokens[:-1]
            labels[row] = tokens[1:]
        return torch.from_numpy(inputs), torch.from_numpy(labels)

    def read(self, start: int, count: int, out: np.ndarray) -> None:
        """Copy tokens ``[start, start + count)`` into ``out`` (any integer dtype)."""
        maps = self._memmaps()
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < count:
            offset = start + done - int(self.starts[shard])
            take = min(count - done, len(maps[shard]) - offset)
            out[done : done + take] = maps[shard][offset : offset + take]
            done += take
            shard += 1


# ----------------------------------------------------------------------------------------------------------------
# Windows: the held-out split and the seeded order


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class WindowOrder:
    """A permutation of ``range(n)`` fixed by ``(seed, epoch)``, computed for any indices without a table.

    A four-round Feistel network over the smallest even number of bits that covers ``n``, whose round keys come
    from numpy's SeedSequence of ``(seed, epoch)``; values at or past ``n`` are encrypted again until they fall
    inside (cycle walking), which keeps it a permutation of ``range(n)``.
    """

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        self.half = max(1, math.ceil(math.log2(max(n, 2)) / 2))
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence([seed, epoch]).generate_state(self.ROUNDS, dtype=np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            out = self._encrypt(np.asarray(indices, dtype=np.uint64))
            outside = out >= np.uint64(self.n)
            while outside.any():
                out[outside] = self._encrypt(out[outside])
                outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


class WindowSplit:
    """Which windows of ``windows`` a stream reads: with ``every = N``, window ``w`` is held out when ``w % N == 0``.

    ``window(i)`` is the ``i``-th window the stream reads, in index order; ``count`` is how many it reads.
    """

    def __init__(self, windows: int, every: int, held_out: bool) -> None:
        self.every, self.held_out = every, held_out
        if every == 0:
            self.count = 0 if held_out else windows
        else:
            held = (windows + every - 1) // every
            self.count = held if held_out else windows - held

    def window(self, i: np.ndarray) -> np.ndarray:
        if self.every == 0:
            return i
        if self.held_out:
            return i * self.every
        kept = self.every - 1
        return (i // kept) * self.every + 1 + i % kept


# ----------------------------------------------------------------------------------------------------------------
# The loaders


class TokenWindows(IterableDataset):
    """This rank's ``(inputs, labels)`` training batches, from global position ``base`` on (see the module docstring).

    In a loader worker it reads the batches of that worker's turns.
    """

    def __init__(
        self,
        tokens: TokenArray,
        *,
        window: int,
        batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        split: WindowSplit,
        base: int = 0,
    ) -> None:
        self.tokens, self.window, self.batch_size = tokens, window, batch_size
        self.dp_rank, self.dp_degree, self.seed, self.split, self.base = dp_rank, dp_degree, seed, split, base
        self._orders: dict[int, WindowOrder] = {}  # by epoch; a few numbers each

    def order(self, epoch: int) -> WindowOrder:
        if epoch not in self._orders:
            self._orders = {epoch: WindowOrder(self.split.count, self.seed, epoch)}  # the last one only
        return self._orders[epoch]

    def positions(self, n: int) -> np.ndarray:
        """The global positions of this rank's ``n``-th batch."""
        first = self.base + (n * self.dp_degree + self.dp_rank) * self.batch_size
        return np.arange(first, first + self.batch_size, dtype=np.int64)

    def windows_at(self, positions: np.ndarray) -> np.ndarray:
        """The window index read at each global position."""
        count = self.split.count
        epochs, within = positions // count, positions % count
        if epochs.min() == epochs.max():
            return self.split.window(self.order(int(epochs[0]))(within))
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self.split.window(self.order(int(epoch))(within[chosen]))
        return out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        n = worker
        while True:  # the windows of BATCHES_AT_ONCE batches are computed at once (numpy works per call)
            batches = range(n, n + BATCHES_AT_ONCE * workers, workers)
            windows = self.windows_at(np.concatenate([self.positions(b) for b in batches]))
            for windows_of_batch in windows.reshape(BATCHES_AT_ONCE, self.batch_size):
                yield read_windows(self.tokens, windows_of_batch, self.window)
            n += BATCHES_AT_ONCE * workers


def read_windows(tokens: TokenArray, windows: np.ndarray, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) LongTensors of the given windows of ``window`` tokens."""
    return tokens.rows(windows * window, window)


def data_changed(what: str, allow_option: str = "training.allow_data_change") -> UserError:
    return UserError(
        f"the checkpoint was trained on other data than this job reads ({what}); resume on the checkpoint's data, "
        f"or set {allow_option} to continue on this data from its start on purpose"
    )


class TokenDataLoader:
    """This rank's ``(inputs, labels)`` training batches of a tokens folder; checkpointable by windows read.

    ``state_dict()`` is the job's (gathered over ``group``: every rank calls it) and names the data it read: the
    dataset fingerprint, the window length, ``training.data_seed`` and the held-out split.
    """

    def __init__(
        self,
        dataset: TokenWindows,
        fingerprint: str,
        workers: int,
        pin_memory: bool,
        group: Optional[dist.ProcessGroup],
        allow_data_change: bool = False,
    ) -> None:
        self.dataset, self.fingerprint, self.workers = dataset, fingerprint, workers
        self._pin_memory, self._group, self._allow = pin_memory, group, allow_data_change
        self._taken = 0  # batches handed to training since base

    def identity(self) -> dict[str, Any]:
        d = self.dataset
        return {
            "kind": "tokens",
            "fingerprint": self.fingerprint,
            "window_tokens": d.window,
            "data_seed": d.seed,
            "held_out_every": d.split.every,
        }

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from the first window not handed over yet (a new iterator goes on where the last one was)."""
        self.dataset.base, self._taken = self._windows_read(), 0
        if self.workers == 0:  # read here: no loader machinery around a few memory copies
            for inputs, labels in self.dataset:
                if self._pin_memory:
                    inputs, labels = inputs.pin_memory(), labels.pin_memory()
                self._taken += 1
                yield inputs, labels
            return
        loader = DataLoader(
            self.dataset,
            batch_size=None,
            num_workers=self.workers,
            pin_memory=self._pin_memory,
            generator=torch.Generator(),  # the loader never draws on the global torch RNG
            persistent_workers=False,
            worker_init_fn=worker_init(),  # a stop signal is the training process's (training/preemption.py)
        )
        for batch in loader:
            self._taken += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        ranks = dict(all_gather_objects((self.dataset.dp_rank, self._taken), self._group))
        if len(set(ranks.values())) > 1:
            raise RuntimeError(f"data-parallel ranks took different numbers of batches: {ranks}")
        return {**self.identity(), "windows": self._windows_read()}

    def _windows_read(self) -> int:
        return self.dataset.base + self._taken * self.dataset.batch_size * self.dataset.dp_degree

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.identity()
        differs = [key for key in mine if state.get(key) != mine[key]]
        if differs:
            what = ", ".join(f"{key} {state.get(key)!r} then, {mine[key]!r} now" for key in differs)
            if not self._allow:
                raise data_changed(what)
            logger.info(f"data: the checkpoint read other data ({what}); training.allow_data_change: starting over")
            return
        self.dataset.base, self._taken = int(state["windows"]), 0
        epoch, within = divmod(self.dataset.base, self.dataset.split.count)
        logger.info(f"data: resuming at window {within:,} of epoch {epoch} ({self.dataset.base:,} windows read)")


def open_tokens(path: str, window: int, split_every: int, held_out: bool, section: str) -> tuple:
    """(manifest, TokenArray, WindowSplit) of a tokens folder for windows of ``window`` tokens."""
    manifest = read_manifest(path, section)
    tokens = TokenArray(path, manifest)
    split = WindowSplit(len(tokens) // window, split_every, held_out)
    if split.count == 0:
        which = "held-out " if held_out else ""
        raise UserError(
            f"{section}.dataset_path '{path}' holds {len(tokens):,} tokens: no {which}window of {window} tokens "
            f"({section}.seq_len + 1){' outside the held-out split' if split_every and not held_out else ''}; "
            "give more data or a shorter seq_len" + (", or lower validation.held_out_every" if held_out else "")
        )
    return manifest, tokens, split


def build_tokens_data_loader(
    path: str,
    tokenizer: Any,
    tokenizer_path: str,
    batch_size: int,
    seq_len: int,
    dp_rank: int,
    dp_degree: int,
    *,
    seed: int,
    held_out_every: int,
    workers: int = 0,
    pin_memory: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    allow_data_change: bool = False,
) -> TokenDataLoader:
    """A checkpointable loader of this rank's training windows of the tokens folder ``path``."""
    manifest, tokens, split = open_tokens(path, seq_len + 1, held_out_every, False, "training")
    check_tokenizer(manifest, path, tokenizer_path, tokenizer.fingerprint)
    dataset = TokenWindows(
        tokens,
        window=seq_len + 1,
        batch_size=batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        seed=seed,
        split=split,
    )
    logger.info(
        f"data: {path}: {len(tokens):,} tokens, {split.count:,} training windows of {seq_len + 1} tokens in the "
        f"order of training.data_seed {seed} (fingerprint {manifest['fingerprint']})"
    )
    return TokenDataLoader(dataset, manifest["fingerprint"], workers, pin_memory, group, allow_data_change)


def open_validation_windows(
    path: str, train_seq_len: int, seq_len: int, every: int, count: int, first: int = 0
) -> tuple[TokenArray, WindowSplit, int]:
    """(tokens, split, validation windows per split window) of a tokens folder's validation windows (see
    ``validation_windows``); UserError when it holds fewer than ``first + count``. Reads the manifest and shard
    headers only."""
    train_window, window = train_seq_len + 1, seq_len + 1
    _, tokens, split = open_tokens(path, train_window if every else window, every, every > 0, "validation")
    pieces = train_window // window if every else 1
    total = split.count * pieces
    if total < first + count:
        where = f"the held-out split (1 in {every} windows of {train_window} tokens)" if every else f"'{path}'"
        wanted = (
            f"validation.first_window {first} + validation.windows {count}" if first else f"validation.windows {count}"
        )
        raise UserError(
            f"{where} holds {total:,} validation windows of {window} tokens, fewer than {wanted}; lower "
            + ("validation.first_window or " if first else "")
            + "validation.windows"
            + (" or validation.held_out_every" if every else "")
            + ", or give more data"
        )
    return tokens, split, pieces


def validation_windows(
    path: str,
    train_seq_len: int,
    seq_len: int,
    batch_size: int,
    dp_rank: int,
    dp_degree: int,
    every: int,
    count: int,
    first_window: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of validation windows ``first_window .. first_window + count - 1`` of a tokens folder, in
    batches (a study's confirmation runs score windows its selection runs did not).

    With ``every`` > 0 the validation windows are the held-out windows of the training windows (``train_seq_len + 1``
    tokens), each cut into ``(train_seq_len + 1) // (seq_len + 1)`` validation windows, numbered in index order; with
    0, every window of ``seq_len + 1`` tokens. Which windows are scored depends on ``first_window``, ``count`` and
    the data only: rank ``r`` of ``D`` takes windows ``first_window`` plus ``r * count // D`` up to
    ``(r + 1) * count // D``. Every rank returns as many
    batches (each forward of a sharded model is a collective), enough for the largest share in batches of at most
    ``batch_size``, its windows spread evenly over them; a rank with fewer windows than batches (``batch_size`` 1, or
    fewer windows than ranks) ends with padding batches of one window whose labels are all ``IGNORE_INDEX``, which
    count for nothing.
    """
    train_window, window = train_seq_len + 1, seq_len + 1
    tokens, split, pieces = open_validation_windows(path, train_seq_len, seq_len, every, count, first_window)
    first = first_window + dp_rank * count // dp_degree
    end = first_window + (dp_rank + 1) * count // dp_degree
    most = (count + dp_degree - 1) // dp_degree  # windows of the ranks with the most
    batches_per_rank = (most + batch_size - 1) // batch_size

    def starts(v: np.ndarray) -> np.ndarray:
        return split.window(v // pieces) * train_window + (v % pieces) * window

    # As many batches on every rank, each as even as can be: a padding batch only where a rank has fewer windows.
    parts = np.array_split(np.arange(first, end, dtype=np.int64), batches_per_rank)
    batches = [tokens.rows(starts(part), window) for part in parts if len(part)]
    while len(batches) < batches_per_rank:
        inputs, labels = tokens.rows(starts(np.full(1, first_window, dtype=np.int64)), window)
        batches.append((inputs, torch.full_like(labels, IGNORE_INDEX)))
    return batches
