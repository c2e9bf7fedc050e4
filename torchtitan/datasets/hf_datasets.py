"""Text datasets packed into fixed-length training windows, each data-parallel rank reading its share, resumable.

Datasets (``training.dataset``):
  * ``c4``     - ``allenai/c4`` (``en``, train split) streamed from the Hugging Face hub;
  * ``sample`` - the small corpus bundled in ``assets/data/sample`` (offline);
  * ``text``   - local files named by ``training.dataset_path``.
With ``training.dataset_path`` any of them reads local files instead: one file or a folder (searched recursively)
of ``.txt`` (one document per paragraph), ``.json`` / ``.jsonl`` (optionally ``.gz``) or ``.parquet`` files with a
"text" column. A local copy of the c4 hub repository (a folder with ``en/c4-train.*.json.gz``) reads its English
train files only.

The hub: c4 needs the Hugging Face hub (``HF_ENDPOINT``, by default https://huggingface.co). Preflight checks that it
can be reached (one TCP connect with a short timeout, or the hub's offline switches ``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE``) and a hub that fails while loading is reported the same way: one UserError naming the
offline alternative, a local copy of the dataset in ``training.dataset_path``.

Data order: each data-parallel rank reads its own share. A job has R readers, one per loader worker
(``training.data_workers``, or one per rank without workers) on each of its W data-parallel ranks. When the data's
files (for the hub, its shards) are several and R divides their count, reader ``i = rank * workers + worker``
reads files ``i, i + R, i + 2R, ...`` and nothing else (``datasets.distributed.split_dataset_by_node``). Otherwise
it tokenizes documents ``i, i + R, i + 2R, ...`` (the document index counts every document of the epoch), walking
through every document's text (parsing is cheap), and the run says so in one log line. Either way a reader
tokenizes its documents with BOS and EOS, concatenates them into its own token stream and cuts it into windows of
``seq_len + 1`` tokens (inputs are ``window[:-1]``, labels ``window[1:]``), ``batch_size`` windows a batch. A rank
with several workers takes their batches in turn. The order is the dataset's own: no seed (``training.seed``
included) or random state changes it; pre-tokenized data (``torchtitan.datasets.tokens``) has a seeded order.

Resuming: the loader's state holds every reader's position (the dataset state before its current document, that
document's index and how many of its tokens are read), the torchdata loader state of every rank and the data's
fingerprint. With as many readers (the same layout, or another split of them into ranks and workers, such as
2 ranks x 1 worker and 1 x 2) a run resumes exactly: reader i reads the same documents in both. With another
number, the data order cannot be the same (the documents are dealt to other readers): when documents are dealt,
every new reader starts at the furthest position any saved reader reached, so no token is read twice in an epoch,
and the documents before it that slower readers had not reached yet are skipped until the next epoch; when files
are divided, every reader starts the next epoch. Pre-tokenized data resumes exactly at any number of readers.

Held-out split: a stream may read only part of the documents. With ``every = N``, a document is held out when a
64-bit BLAKE2b hash of its text is divisible by N (about one in N). The training stream skips those documents and
validation reads only them (``DocumentSplit``). Deciding by the text, not by the position, keeps even repeated
documents on one side, so the two streams never share a text; and the rule needs neither the dataset's length nor
a pass over it, so it works the same for streamed hub data.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.distributed.collectives import all_gather_objects
from torchtitan.errors import UserError
from torchtitan.logging import logger
from torchtitan.training.preemption import worker_init

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA_DIR = REPO_ROOT / "assets" / "data" / "sample"
DATASET_NAMES = ("c4", "sample", "text", "tokens")
DEFAULT_HUB = "https://huggingface.co"
HUB_CONNECT_TIMEOUT_S = 3.0
ROWS_PER_READ = 64  # rows the dataset hands over at a time
_OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")

# File name endings -> the Hugging Face packaged builder that reads them.
_BUILDER_BY_SUFFIX = {
    ".txt": "text",
    ".txt.gz": "text",
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
}


# ----------------------------------------------------------------------------------------------------------------
# Documents


def is_held_out(text: str, every: int) -> bool:
    """Whether a document belongs to the held-out split that holds out about one in ``every`` (0: none)."""
    if every == 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % every == 0


@dataclass(frozen=True)
class DocumentSplit:
    """Which documents a stream reads: all but the held-out split, or (``held_out``) only the held-out split.

    ``every = 0`` holds nothing out.
    """

    every: int = 0
    held_out: bool = False

    def keeps(self, text: str) -> bool:
        return is_held_out(text, self.every) == self.held_out


class DocumentSource:
    """The "text" values (blank ones skipped) of a Hugging Face streaming dataset, each with its state after it.

    The state comes as a function to call before the next document is drawn: only a reader's own documents need
    the state before them, and writing it down costs more than reading the text.
    """

    def __init__(self, dataset: Any, description: str, section: str = "training", from_hub: bool = False) -> None:
        self.dataset = dataset
        self.description = description
        self.section = section  # the config table that named this data, for error messages
        self.from_hub = from_hub

    @property
    def shards(self) -> int:
        """The files (or hub shards) the dataset reads, which readers can divide between them."""
        return int(getattr(self.dataset, "n_shards", 1))

    def for_reader(self, reader: "Reader") -> "DocumentSource":
        """The documents of ``reader`` alone when it reads by shard (``reader.by_shard``), else all of them."""
        if not reader.by_shard:
            return self
        from datasets.distributed import split_dataset_by_node

        part = split_dataset_by_node(self.dataset, rank=reader.index, world_size=reader.count)
        return DocumentSource(part, self.description, self.section, self.from_hub)

    def documents(self, start_state: str) -> Iterator[tuple[str, Callable[[], str]]]:
        """Documents after ``start_state`` (a JSON state from an earlier pass; "" starts at the beginning)."""
        if not self.from_hub:
            yield from self._documents(start_state)
            return
        try:
            yield from self._documents(start_state)
        except _network_errors() as e:
            raise hub_unreachable(_first_line(e), self.section) from None

    def _documents(self, start_state: str) -> Iterator[tuple[str, Callable[[], str]]]:
        # A state is the dataset's state before a batch of rows and how many of its rows are read. Batches rather
        # than plain iteration: inside a loader worker, plain iteration would hand this worker only some of the
        # files, while every reader must walk through every document (the split is ours); and rows come cheaper
        # in batches.
        if torch.utils.data.get_worker_info() is not None:
            # A forked loader worker inherits fsspec's event-loop lock, whose loop thread it lacks: remote files
            # (the hub) would hang on it. The datasets library resets it in its own worker path, which we bypass.
            import fsspec.asyn

            fsspec.asyn.reset_lock()
        start = json.loads(start_state) if start_state else {"dataset": None, "rows": 0}
        self.dataset.load_state_dict(start["dataset"])
        before_batch, skip = start["dataset"], start["rows"]
        for batch in self.dataset.iter(batch_size=ROWS_PER_READ):
            if "text" not in batch:
                raise UserError(
                    f"{self.description} has no 'text' column (columns: {', '.join(batch)}); "
                    f"give {self.section}.dataset_path files with a 'text' column"
                )
            for row in range(skip, len(batch["text"])):
                text = batch["text"][row]
                if text and not text.isspace():
                    yield text, functools.partial(_source_state, before_batch, row + 1)
            before_batch, skip = self.dataset.state_dict(), 0


def _source_state(before_batch: Optional[dict[str, Any]], rows: int) -> str:
    return json.dumps({"dataset": before_batch, "rows": rows}, sort_keys=True)


def _builder_for(path: Path) -> Optional[str]:
    name = path.name.lower()
    return next((b for suffix, b in _BUILDER_BY_SUFFIX.items() if name.endswith(suffix)), None)


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def local_data_files(dataset_path: str, dataset_name: str, section: str = "training") -> tuple[str, list[str]]:
    """The builder name and the sorted data files that ``{section}.dataset_path`` stands for."""
    root = Path(dataset_path)
    if not root.exists():
        raise UserError(f"{section}.dataset_path '{dataset_path}' does not exist; point it at a file or folder")
    if root.is_file():
        candidates = [root]
    elif dataset_name == "c4" and (root / "en").is_dir():
        candidates = sorted((root / "en").glob("c4-train.*.json*"))  # a local copy of the hub repository
    else:
        candidates = sorted(p for p in root.rglob("*") if p.is_file() and not _is_hidden(p, root))
    builders = {p: _builder_for(p) for p in candidates}
    files = [p for p, builder in builders.items() if builder is not None]
    if not files:
        raise UserError(
            f"{section}.dataset_path '{dataset_path}' holds no .txt, .json, .jsonl or .parquet files; "
            "point it at a file or folder of them"
        )
    kinds = sorted({builders[p] for p in files})
    if len(kinds) > 1:
        raise UserError(
            f"{section}.dataset_path '{dataset_path}' mixes {' and '.join(kinds)} files; keep one kind per dataset"
        )
    return kinds[0], [str(p) for p in files]


def resolve_dataset(
    dataset_name: str, dataset_path: Optional[str], section: str = "training"
) -> Optional[tuple[str, list[str], str]]:
    """Check ``{section}.dataset`` / ``{section}.dataset_path`` without reading any data.

    Returns (datasets builder, files, description) for local data, or None for the c4 hub stream; tokenized data
    is ("tokens", [its folder], description).
    """
    if dataset_name not in DATASET_NAMES:
        raise UserError(f"{section}.dataset '{dataset_name}' is unknown; choose one of {', '.join(DATASET_NAMES)}")
    if dataset_path is None and dataset_name == "text":
        raise UserError(f"{section}.dataset 'text' needs {section}.dataset_path (a file or folder of text data)")
    if dataset_name == "tokens":
        if dataset_path is None:
            raise UserError(
                f"{section}.dataset 'tokens' needs {section}.dataset_path (a folder written by "
                "python -m torchtitan.tools.pretokenize)"
            )
        from torchtitan.datasets.tokens import read_manifest

        read_manifest(dataset_path, section)
        return "tokens", [os.path.abspath(dataset_path)], f"{section}.dataset_path '{dataset_path}'"
    if dataset_path is None and dataset_name == "c4":
        return None
    description = f"{section}.dataset_path '{dataset_path}'"
    if dataset_path is None:
        if not SAMPLE_DATA_DIR.is_dir():
            raise UserError(
                f"the bundled sample dataset is missing ({SAMPLE_DATA_DIR}); run scripts/make_assets.py "
                f"or give {section}.dataset_path"
            )
        dataset_path, description = str(SAMPLE_DATA_DIR), f"the bundled sample dataset ({SAMPLE_DATA_DIR})"
    builder, files = local_data_files(dataset_path, dataset_name, section)
    return builder, files, description


_FINGERPRINT_EDGE_BYTES = 1 << 16


def text_fingerprint(dataset_name: str, dataset_path: Optional[str], tokenizer_fingerprint: str) -> Optional[str]:
    """A fingerprint of local text data read with a tokenizer; None for the c4 hub stream (it can change unseen).

    It covers the tokenizer file and every data file's name (relative to the data's folder), size and first and
    last 64 KiB, so it costs no pass over the data; an edit inside a file that keeps its size is not seen (the
    fingerprint of pre-tokenized data covers every token).
    """
    local = resolve_dataset(dataset_name, dataset_path)
    if local is None:
        return None
    _, files, _ = local
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    digest = hashlib.sha256(f"text {tokenizer_fingerprint}".encode())
    for file in files:
        size = os.path.getsize(file)
        digest.update(f"\0{os.path.relpath(file, root)}\0{size}\0".encode())
        with open(file, "rb") as f:
            if size <= 2 * _FINGERPRINT_EDGE_BYTES:
                digest.update(f.read())
                continue
            digest.update(f.read(_FINGERPRINT_EDGE_BYTES))
            f.seek(size - _FINGERPRINT_EDGE_BYTES)
            digest.update(f.read())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# The hub


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or DEFAULT_HUB


def hub_unreachable(reason: str, section: str = "training") -> UserError:
    return UserError(
        f"{section}.dataset 'c4' streams allenai/c4 from the Hugging Face hub, which cannot be reached from here "
        f"({hub_endpoint()}: {reason}); without network, copy the dataset's en/c4-train.*.json.gz files into a "
        f"folder's en/ subfolder and pass that folder as --{section}.dataset_path"
    )


def check_hub_reachable(dataset_name: str, dataset_path: Optional[str], section: str = "training") -> None:
    """Raise UserError if the job streams from the hub and the hub is off or cannot be connected to (cheap)."""
    if dataset_name != "c4" or dataset_path is not None:
        return
    truthy = ("1", "ON", "YES", "TRUE")
    switched_off = [name for name in _OFFLINE_SWITCHES if os.environ.get(name, "").upper() in truthy]
    if switched_off:
        raise hub_unreachable(f"{switched_off[0]} is set", section)
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return  # reached through a proxy: a direct connect proves nothing; loading reports failures instead
    url = urllib.parse.urlsplit(hub_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise hub_unreachable(e.strerror or str(e) or type(e).__name__, section) from None


def _network_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a failing hub raises through datasets and huggingface_hub (their HTTP clients vary)."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import httpx

        errors.append(httpx.TransportError)
    except ImportError:
        pass
    try:
        import requests

        errors.append(requests.exceptions.ConnectionError)
        errors.append(requests.exceptions.Timeout)
    except ImportError:
        pass
    return tuple(errors)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:160]


def load_documents(dataset_name: str, dataset_path: Optional[str], section: str = "training") -> DocumentSource:
    """The documents of ``{section}.dataset`` (optionally read from ``{section}.dataset_path``)."""
    from datasets import load_dataset  # slow to import; only a data loader needs it

    local = resolve_dataset(dataset_name, dataset_path, section)
    if local is None:
        try:
            hub = load_dataset("allenai/c4", name="en", split="train", streaming=True)
        except _network_errors() as e:
            raise hub_unreachable(_first_line(e), section) from None
        return DocumentSource(hub, "the c4 dataset (allenai/c4, en)", section, from_hub=True)
    builder, files, description = local
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    stream = load_dataset(builder, data_files=files, split="train", streaming=True, **options)
    return DocumentSource(stream, description, section)


# ----------------------------------------------------------------------------------------------------------------
# Readers: who reads which documents


@dataclass(frozen=True)
class Reader:
    """One of the job's ``count`` readers: reader ``index`` tokenizes documents ``index``, ``index + count``, ...
    of the whole stream, or, ``by_shard``, every document of its own files (shards ``index``, ``index + count``,
    ...: see ``reads_by_shard``).

    A job has one reader per loader worker (or per rank without workers) on each data-parallel rank.
    """

    index: int = 0
    count: int = 1
    by_shard: bool = False

    def owns(self, doc_index: int) -> bool:
        return self.by_shard or doc_index % self.count == self.index


def reads_by_shard(shards: int, readers: int) -> bool:
    """Whether readers divide the files (hub shards) between them: when there are several and they divide evenly."""
    return readers > 1 and shards % readers == 0


def rank_readers(dp_rank: int, dp_degree: int, workers: int, shards: int = 1) -> list[Reader]:
    """The readers of data-parallel rank ``dp_rank``: one per loader worker, or one without workers."""
    per_rank = max(1, workers)
    by_shard = reads_by_shard(shards, dp_degree * per_rank)
    return [Reader(dp_rank * per_rank + worker, dp_degree * per_rank, by_shard) for worker in range(per_rank)]


def _this_reader(dp_rank: int, dp_degree: int, shards: int) -> Reader:
    """The reader this process is: in a loader worker, the worker's own; else the rank's only one."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return rank_readers(dp_rank, dp_degree, 0, shards)[0]
    return rank_readers(dp_rank, dp_degree, info.num_workers, shards)[info.id]


# ----------------------------------------------------------------------------------------------------------------
# A reader's token stream and its position


def start_position(epoch: int = 0, windows: int = 0) -> dict[str, Any]:
    """The position at the start of an epoch: plain ints and one string, so checkpoints store it as is."""
    return {"epoch": epoch, "doc_index": 0, "token_offset": 0, "source_state": "", "windows": windows}


def furthest_position(positions: list[dict[str, Any]]) -> dict[str, Any]:
    """The position furthest into the data (epoch, then document, then token) of several readers'."""
    return max(positions, key=lambda p: (p["epoch"], p["doc_index"], p["token_offset"]))


class TokenStream:
    """One reader's documents' tokens, concatenated, read forward from a position.

    ``position`` names the next unread token: the dataset state just before its document (``source_state``),
    that document's index in the epoch (``doc_index``, counted over all documents, whoever reads them) and how many
    of its tokens are already read (``token_offset``), plus the epoch and the windows served so far. Documents of
    other readers and those the split leaves out are passed over without being tokenized.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        position: dict[str, Any],
        infinite: bool,
        split: DocumentSplit = DocumentSplit(),
        reader: Reader = Reader(),
    ):
        self.position = dict(position)
        self._source = source
        self._tokenizer = tokenizer
        self._infinite = infinite
        self._split = split
        self._reader = reader
        self._documents = source.documents(self.position["source_state"])
        self._tokens: Optional[list[int]] = None
        self._state_after_document = ""
        # Whether this pass read the epoch from its first document, and kept any: an epoch with nothing to keep
        # would otherwise loop forever.
        self._whole_epoch = self.position["doc_index"] == 0 and self.position["token_offset"] == 0
        self._kept_in_epoch = 0

    def read(self, n: int) -> Optional[list[int]]:
        """The next ``n`` tokens; None when a finite stream runs out."""
        kept: list[int] = []
        while n > 0:
            tokens = self._current_document()
            if tokens is None:
                return None
            start = self.position["token_offset"]
            stop = min(len(tokens), start + n)
            kept.extend(tokens[start:stop])
            n -= stop - start
            self.position["token_offset"] = stop
        return kept

    def _current_document(self) -> Optional[list[int]]:
        while True:
            if self._tokens is None:
                document = next(self._documents, None)
                if document is None:
                    if not self._start_next_epoch():
                        return None
                    continue
                text, state_after = document
                # The position names the state before a document only at this reader's own documents.
                next_is_mine = self._reader.owns(self.position["doc_index"] + 1)
                self._state_after_document = state_after() if next_is_mine else ""
                if not (self._reader.owns(self.position["doc_index"]) and self._split.keeps(text)):
                    self._next_document()
                    continue
                self._tokens = self._tokenizer.encode(text, bos=True, eos=True)
                self._kept_in_epoch += 1
            if self.position["token_offset"] < len(self._tokens):
                return self._tokens
            self._next_document()  # this document is used up

    def _next_document(self) -> None:
        """Move the position to the start of the document after the current one."""
        self.position.update(
            source_state=self._state_after_document, doc_index=self.position["doc_index"] + 1, token_offset=0
        )
        self._tokens = None

    def _start_next_epoch(self) -> bool:
        if not self._infinite:
            return False
        section, documents = self._source.section, self.position["doc_index"]
        if documents == 0:
            raise UserError(f"{self._source.description} holds no text; point {section}.dataset_path at real data")
        if self._whole_epoch and self._kept_in_epoch == 0:
            held_out = f" {'in' if self._split.held_out else 'outside'} the held-out split" if self._split.every else ""
            raise UserError(
                f"{self._source.description} has no document{held_out} among those of data reader "
                f"{self._reader.index} ({documents} documents dealt to {self._reader.count} readers: data-parallel "
                "ranks x training.data_workers); give more data, or use fewer ranks or workers"
                + (", or raise validation.held_out_every" if self._split.every else "")
            )
        self.position = start_position(self.position["epoch"] + 1, self.position["windows"])
        self._documents = self._source.documents("")
        self._whole_epoch, self._kept_in_epoch = True, 0
        return True


# ----------------------------------------------------------------------------------------------------------------
# The dataset and its loader


@dataclass(frozen=True)
class ReaderFailure:
    """A user error met in a loader worker, carried to the training process to be raised there as one line."""

    message: str


class PackedTextDataset(IterableDataset):
    """Yields this reader's ``(inputs, labels, (reader index, position after the batch))`` batches.

    In a loader worker the reader is the worker's; ``state_dict()`` is this reader's position.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        infinite: bool,
        split: DocumentSplit = DocumentSplit(),
    ) -> None:
        if batch_size < 1 or seq_len < 1 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"bad batch_size={batch_size}, seq_len={seq_len}, dp_rank={dp_rank}/{dp_world_size}")
        self.source = source
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self.split = split
        self._position = start_position()
        # Positions by reader index, each taken by its reader's first pass (a resume at another layout of as many
        # readers); afterwards, and in every other case, a reader goes on from ``_position``.
        self.reader_starts: dict[int, dict[str, Any]] = {}

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._batches(_this_reader(self.dp_rank, self.dp_world_size, self.source.shards))
        except UserError as e:
            if torch.utils.data.get_worker_info() is None:
                raise
            yield ReaderFailure(str(e))  # a worker's exception would reach the user wrapped in a traceback

    def _batches(self, reader: Reader) -> Iterator[Any]:
        self._position = self.reader_starts.pop(reader.index, self._position)
        source = self.source.for_reader(reader)
        stream = TokenStream(source, self.tokenizer, self._position, self.infinite, self.split, reader)
        window = self.seq_len + 1
        while True:
            tokens = stream.read(self.batch_size * window)
            if tokens is None:
                # A finite pass drops its last, partial batch; the next pass starts a new epoch.
                self._position = start_position(stream.position["epoch"] + 1, stream.position["windows"])
                return
            stream.position["windows"] += self.batch_size
            self._position = dict(stream.position)
            windows = torch.tensor(tokens, dtype=torch.long).view(self.batch_size, window)
            yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous(), (reader.index, dict(self._position))

    def state_dict(self) -> dict[str, Any]:
        reader = _this_reader(self.dp_rank, self.dp_world_size, self.source.shards)
        return dict(self.reader_starts.get(reader.index, self._position))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = set(start_position()) - set(state_dict)
        if missing:
            raise ValueError(f"data loader state lacks {sorted(missing)}; it was not saved by this data loader")
        self._position = {key: state_dict[key] for key in start_position()}
        self.reader_starts = {}


def _keep_batch(batch: Any) -> Any:
    """The dataset yields whole batches; the loader passes them on unchanged."""
    return batch


def merge_rank_states(rank_states: list[dict[str, Any]]) -> dict[str, Any]:
    """The loader state of a job from its ranks' own (tensor-parallel peers give the same one twice)."""
    first = rank_states[0]
    return {
        "layout": first["layout"],
        "ranks": {str(s["dp_rank"]): s["loader"] for s in rank_states},
        "readers": {index: position for s in rank_states for index, position in s["readers"].items()},
    }


class TextDataLoader:
    """This rank's ``(inputs, labels)`` batches, each a ``(batch_size, seq_len)`` LongTensor; checkpointable.

    ``workers`` loader processes tokenize off the training thread (0: in this process), each one reader.
    ``state_dict()`` is the job's (every rank's readers, gathered over ``group``, and the data's ``fingerprint``),
    the same on every rank. Loaded on the same number of readers it resumes exactly where the saved run was, each
    reader at its own position, whatever the split into ranks and workers; on another, every reader starts where
    the furthest saved reader was (see the module docstring). A checkpoint of other data (another fingerprint, or
    tokenized data) is refused unless ``allow_data_change``, which starts this data from its beginning.
    """

    def __init__(
        self,
        dataset: PackedTextDataset,
        workers: int,
        pin_memory: bool,
        group: Optional[dist.ProcessGroup],
        fingerprint: Optional[str] = None,
        allow_data_change: bool = False,
    ) -> None:
        self.dataset = dataset
        self.fingerprint = fingerprint
        self._allow_data_change = allow_data_change
        self.workers = workers
        shards = dataset.source.shards
        self._readers = rank_readers(dataset.dp_rank, dataset.dp_world_size, workers, shards)
        by_shard = self._readers[0].by_shard
        self.layout = {"dp_degree": dataset.dp_world_size, "workers": workers, "by_shard": by_shard}
        self._group = group
        readers = self._readers[0].count
        if by_shard:
            logger.info(f"data: {shards} files/shards, divided between {readers} readers ({shards // readers} each)")
        elif readers > 1:
            logger.info(  # as expected for a single file, the bundled sample data included: nothing to fix
                f"data: {readers} readers share the documents of {dataset.source.description} "
                f"({shards} file(s)/shard(s)), each tokenizing one document in {readers}"
            )
        self._pin_memory = pin_memory
        self._positions = {str(r.index): start_position() for r in self._readers}
        self._loader = self._new_loader()

    def _new_loader(self) -> StatefulDataLoader:
        # batch_size=None: each item already is a batch, so a state snapshot always falls between batches.
        # Its own generator keeps the loader from drawing on the global torch RNG.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")  # torchdata on newer torch
            return StatefulDataLoader(
                self.dataset,
                batch_size=None,
                num_workers=self.workers,
                collate_fn=_keep_batch,
                generator=torch.Generator(),
                worker_init_fn=worker_init(),  # a stop signal is the training process's (training/preemption.py)
                pin_memory=self._pin_memory,
            )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for item in self._loader:
            if isinstance(item, ReaderFailure):
                raise UserError(item.message)
            inputs, labels, (reader, position) = item
            self._positions[str(reader)] = position
            yield inputs, labels

    def rank_state(self) -> dict[str, Any]:
        """This rank's share of the state: its loader's own state and its readers' positions."""
        return {
            "layout": self.layout,
            "dp_rank": self.dataset.dp_rank,
            "loader": self._loader.state_dict(),
            "readers": dict(self._positions),
        }

    def state_dict(self) -> dict[str, Any]:
        """The job's loader state (a collective over ``group``: every rank calls it)."""
        state = merge_rank_states(all_gather_objects(self.rank_state(), self._group))
        return {**state, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_fingerprint = state.get("fingerprint", self.fingerprint)  # checkpoints before fingerprints: unchecked
        if state.get("kind") == "tokens" or saved_fingerprint != self.fingerprint:
            from torchtitan.datasets.tokens import data_changed

            was = "tokenized data" if state.get("kind") == "tokens" else f"fingerprint {saved_fingerprint}"
            what = f"{was} then, fingerprint {self.fingerprint} now"
            if not self._allow_data_change:
                raise data_changed(what)
            logger.info(f"data: the checkpoint read other data ({what}); training.allow_data_change: starting over")
            return
        if "layout" not in state:
            raise UserError(
                "the checkpoint's data position was saved by an earlier version (one stream read whole by every "
                "rank); resume it with that version, or start from its model weights with checkpoint.initial_load_path"
            )
        if state["layout"] == self.layout:
            self._loader.load_state_dict(state["ranks"][str(self.dataset.dp_rank)])
            self._positions = {str(r.index): state["readers"][str(r.index)] for r in self._readers}
            return
        saved = state["layout"]
        if len(state["readers"]) == len(self._readers) * self.dataset.dp_world_size:
            # As many readers, split otherwise between ranks and workers: each reader is the same document subset.
            self._positions = {str(r.index): dict(state["readers"][str(r.index)]) for r in self._readers}
            self.dataset.reader_starts = {r.index: dict(self._positions[str(r.index)]) for r in self._readers}
            self._loader = self._new_loader()
            logger.info(
                f"data: the checkpoint was read by {saved['dp_degree']} data-parallel rank(s) x {saved['workers']} "
                f"worker(s), this job uses {self.layout['dp_degree']} x {self.workers}: as many readers, each "
                "continues exactly at its own position"
            )
            return
        if saved.get("by_shard") or self.layout["by_shard"]:
            # Readers of files see streams of their own: no position of one means anything to another reader.
            epoch = max(position["epoch"] for position in state["readers"].values()) + 1
            self.dataset.load_state_dict(start_position(epoch))
            self._loader = self._new_loader()
            self._positions = {str(r.index): start_position(epoch) for r in self._readers}
            logger.info(
                f"data: the checkpoint was read by {len(state['readers'])} readers, this job has "
                f"{len(self._readers) * self.dataset.dp_world_size}, and files are divided between readers: every "
                f"reader starts epoch {epoch} (the rest of the saved epoch is skipped)"
            )
            return
        start = {**furthest_position(list(state["readers"].values())), "windows": 0}
        self.dataset.load_state_dict(start)
        self._loader = self._new_loader()  # its workers, if started (a state_dict() starts them), hold the old start
        self._positions = {str(r.index): dict(start) for r in self._readers}
        logger.info(
            f"data: the checkpoint was read by {saved['dp_degree']} data-parallel rank(s) x {saved['workers']} "
            f"worker(s), this job uses {self.layout['dp_degree']} x {self.workers}: every reader continues from "
            f"the furthest saved position (epoch {start['epoch']}, document {start['doc_index']}); documents "
            "before it that were not read yet are skipped in this epoch"
        )


def build_hf_data_loader(
    dataset_name: str,
    dataset_path: Optional[str],
    tokenizer: Tokenizer,
    batch_size: int,
    seq_len: int,
    dp_rank: int,
    dp_world_size: int,
    infinite: bool = True,
    split: DocumentSplit = DocumentSplit(),
    section: str = "training",
    workers: int = 0,
    pin_memory: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    fingerprint: Optional[str] = None,
    allow_data_change: bool = False,
) -> TextDataLoader:
    """A checkpointable loader of this rank's ``(inputs, labels)``, each a ``(batch_size, seq_len)`` LongTensor.

    ``split`` picks the documents read (all by default); ``section`` is the config table named in error messages;
    ``workers`` loader processes tokenize (0: this process); ``pin_memory`` pins batches for fast copies to a GPU;
    ``group`` is the process group the loader's state is gathered over (None: one process); ``fingerprint`` names
    the data in the checkpoint (``text_fingerprint``) and ``allow_data_change`` lets a checkpoint of other data
    resume from this data's start.
    """
    source = load_documents(dataset_name, dataset_path, section)
    dataset = PackedTextDataset(
        source,
        tokenizer,
        batch_size=batch_size,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        split=split,
    )
    return TextDataLoader(dataset, workers, pin_memory, group, fingerprint, allow_data_change)
