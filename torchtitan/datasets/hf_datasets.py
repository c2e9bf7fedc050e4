"""Text datasets packed into fixed-length training windows, split across data-parallel ranks, resumable.

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

Data order: documents are tokenized with BOS and EOS, concatenated into one token stream and cut into windows of
``seq_len + 1`` tokens (inputs are ``window[:-1]``, labels ``window[1:]``). Every rank reads the same stream;
global batch k is windows ``[k*W*B, (k+1)*W*B)`` for W data-parallel ranks of B sequences, and rank r takes the
B windows starting at ``k*W*B + r*B``. The global batch therefore depends on W*B only, and the position in the
stream - the loader's state - is the same on every rank and for every world size, so checkpoints reshard exactly.
The order is the dataset's own: no seed (``training.seed`` included) or random state changes it.

Held-out split: a stream may read only part of the documents. With ``every = N``, a document is held out when a
64-bit BLAKE2b hash of its text is divisible by N (about one in N). The training stream skips those documents and
validation reads only them (``DocumentSplit``). Deciding by the text, not by the position, keeps even repeated
documents on one side, so the two streams never share a text; and the rule needs neither the dataset's length nor
a pass over it, so it works the same for streamed hub data.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA_DIR = REPO_ROOT / "assets" / "data" / "sample"
DATASET_NAMES = ("c4", "sample", "text")
DEFAULT_HUB = "https://huggingface.co"
HUB_CONNECT_TIMEOUT_S = 3.0
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
    """The "text" values (blank ones skipped) of a Hugging Face streaming dataset, each with its state after it."""

    def __init__(self, dataset: Any, description: str, section: str = "training", from_hub: bool = False) -> None:
        self.dataset = dataset
        self.description = description
        self.section = section  # the config table that named this data, for error messages
        self.from_hub = from_hub

    def documents(self, start_state: str) -> Iterator[tuple[str, str]]:
        """Documents after ``start_state`` (a JSON state from an earlier pass; "" starts at the beginning)."""
        if not self.from_hub:
            yield from self._documents(start_state)
            return
        try:
            yield from self._documents(start_state)
        except _network_errors() as e:
            raise hub_unreachable(_first_line(e), self.section) from None

    def _documents(self, start_state: str) -> Iterator[tuple[str, str]]:
        self.dataset.load_state_dict(json.loads(start_state) if start_state else None)
        for example in self.dataset:
            if "text" not in example:
                raise UserError(
                    f"{self.description} has no 'text' column (columns: {', '.join(example)}); "
                    f"give {self.section}.dataset_path files with a 'text' column"
                )
            if example["text"] and not example["text"].isspace():
                yield example["text"], json.dumps(self.dataset.state_dict(), sort_keys=True)


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

    Returns (datasets builder, files, description) for local data, or None for the c4 hub stream.
    """
    if dataset_name not in DATASET_NAMES:
        raise UserError(f"{section}.dataset '{dataset_name}' is unknown; choose one of {', '.join(DATASET_NAMES)}")
    if dataset_path is None and dataset_name == "text":
        raise UserError(f"{section}.dataset 'text' needs {section}.dataset_path (a file or folder of text data)")
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
# The token stream and its position


def start_position(epoch: int = 0, windows: int = 0) -> dict[str, Any]:
    """The position at the start of an epoch: plain ints and one string, so checkpoints store it as is."""
    return {"epoch": epoch, "doc_index": 0, "token_offset": 0, "source_state": "", "windows": windows}


class TokenStream:
    """All documents' tokens, concatenated, read forward from a position.

    ``position`` names the next unread token: the dataset state just before its document (``source_state``),
    that document's index in the epoch (``doc_index``) and how many of its tokens are already read
    (``token_offset``), plus the epoch and the windows served so far. Documents the split leaves out are passed
    over without being tokenized; they still count in ``doc_index``.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        position: dict[str, Any],
        infinite: bool,
        split: DocumentSplit = DocumentSplit(),
    ):
        self.position = dict(position)
        self._source = source
        self._tokenizer = tokenizer
        self._infinite = infinite
        self._split = split
        self._documents = source.documents(self.position["source_state"])
        self._tokens: Optional[list[int]] = None
        self._state_after_document = ""
        # Whether this pass read the epoch from its first document, and kept any: an epoch with nothing to keep
        # would otherwise loop forever.
        self._whole_epoch = self.position["doc_index"] == 0 and self.position["token_offset"] == 0
        self._kept_in_epoch = 0

    def read(self, n: int, keep: bool = True) -> Optional[list[int]]:
        """The next ``n`` tokens (an empty list when ``keep`` is False); None when a finite stream runs out."""
        kept: list[int] = []
        while n > 0:
            tokens = self._current_document()
            if tokens is None:
                return None
            start = self.position["token_offset"]
            stop = min(len(tokens), start + n)
            if keep:
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
                text, self._state_after_document = document
                if not self._split.keeps(text):
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
        section = self._source.section
        if self.position["doc_index"] == 0:
            raise UserError(f"{self._source.description} holds no text; point {section}.dataset_path at real data")
        if self._whole_epoch and self._kept_in_epoch == 0:
            raise UserError(
                f"{self._source.description} has no document {'in' if self._split.held_out else 'outside'} the "
                f"held-out split (about 1 in "
                f"{self._split.every} of {self.position['doc_index']} documents); give more data or raise "
                "validation.held_out_every"
            )
        self.position = start_position(self.position["epoch"] + 1, self.position["windows"])
        self._documents = self._source.documents("")
        self._whole_epoch, self._kept_in_epoch = True, 0
        return True


# ----------------------------------------------------------------------------------------------------------------
# The dataset and its loader


class PackedTextDataset(IterableDataset):
    """Yields this rank's ``(inputs, labels)`` for each global batch; ``state_dict()`` is the global position."""

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

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        stream = TokenStream(self.source, self.tokenizer, self._position, self.infinite, self.split)
        window = self.seq_len + 1
        windows_per_batch = self.batch_size * self.dp_world_size
        before_mine = self.dp_rank * self.batch_size * window
        mine = self.batch_size * window
        after_mine = windows_per_batch * window - before_mine - mine
        while True:
            tokens = None
            if stream.read(before_mine, keep=False) is not None:
                tokens = stream.read(mine)
            if tokens is None or stream.read(after_mine, keep=False) is None:
                # A finite pass drops its last, partial global batch (on every rank alike); the next pass
                # starts a new epoch.
                self._position = start_position(stream.position["epoch"] + 1, stream.position["windows"])
                return
            stream.position["windows"] += windows_per_batch
            self._position = dict(stream.position)
            windows = torch.tensor(tokens, dtype=torch.long).view(self.batch_size, window)
            yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return dict(self._position)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = set(start_position()) - set(state_dict)
        if missing:
            raise ValueError(f"data loader state lacks {sorted(missing)}; it was not saved by this data loader")
        self._position = {key: state_dict[key] for key in start_position()}


def _keep_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset yields whole batches; the loader passes them on unchanged."""
    return batch


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
) -> StatefulDataLoader:
    """A checkpointable loader of this rank's ``(inputs, labels)``, each a ``(batch_size, seq_len)`` LongTensor.

    ``split`` picks the documents read (all by default); ``section`` is the config table named in error messages.
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
    # batch_size=None: each item already is a batch, so a state snapshot always falls between global batches.
    # Its own generator keeps the loader from drawing on the global torch RNG.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")  # torchdata on newer torch
        return StatefulDataLoader(
            dataset, batch_size=None, num_workers=0, collate_fn=_keep_batch, generator=torch.Generator()
        )
