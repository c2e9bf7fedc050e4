"""Tokenizers: Llama 3 style tiktoken BPE files, sentencepiece models and Hugging Face ``tokenizer.json`` files,
behind one small interface.

``build_tokenizer(path)`` tells the formats apart: a folder (a downloaded Hugging Face model) or a ``*.json`` file
is a Hugging Face tokenizer, read by the ``tokenizers`` library; otherwise, by content, a tiktoken file is text
lines of ``<base64 token> <rank>`` and a sentencepiece model a binary protocol buffer. The tiktoken tokenizer
follows Llama 3: its pre-tokenization pattern, and 256 special tokens (``<|begin_of_text|>``, ``<|end_of_text|>``,
reserved ones, ...) numbered right after the BPE ranks, so Meta's ``tokenizer.model`` (128,000 ranks) gives 128,256
ids; the ``tokenizer.json`` of the same model gives the same ids.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
from abc import ABC, abstractmethod
from typing import Iterable, Iterator

from torchtitan.errors import UserError

LLAMA3_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501 - one regular expression
NUM_SPECIAL_TOKENS = 256
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"

# Very long runs of spaces (or of non-spaces) make the pre-tokenization regex slow, so long texts are cut into
# pieces first: no piece longer than _MAX_PIECE_CHARS, no run longer than _MAX_RUN_CHARS.
_MAX_PIECE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} [0-9]+\r?$")


class Tokenizer(ABC):
    """Text <-> token ids. ``n_words`` is the vocabulary size (the model's embedding rows); ``fingerprint`` is a
    SHA-256 of the tokenizer file (16 hex digits), which tokenized data records."""

    n_words: int
    bos_id: int
    eos_id: int
    fingerprint: str

    @abstractmethod
    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of ``text``, with the BOS / EOS id added in front / at the end when asked."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``."""


def file_fingerprint(path: str) -> str:
    """SHA-256 of a file's bytes, as 16 hex digits."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def llama3_special_tokens() -> list[str]:
    """Llama 3's special tokens in id order (their ids follow the BPE ranks)."""
    named = {
        0: BOS_TOKEN,
        1: EOS_TOKEN,
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        9: "<|eot_id|>",
    }
    tokens, reserved = [], 0
    for index in range(NUM_SPECIAL_TOKENS):
        if index in named:
            tokens.append(named[index])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """The ``token bytes -> rank`` table of a tiktoken BPE file; ranks must be exactly 0..n-1."""
    with open(path, "rb") as f:
        data = f.read()
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise UserError(
                f"model.tokenizer_path '{path}' line {line_number} is not '<base64 token> <rank>'; "
                "point it at a tiktoken BPE file or a sentencepiece model"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) < 256:
        raise UserError(
            f"model.tokenizer_path '{path}' has {len(ranks)} tokens whose ranks are not 0..n-1 (n >= 256); "
            "the tiktoken file is damaged"
        )
    return ranks


def _pieces_for_regex(text: str) -> Iterator[str]:
    """``text`` cut so that the pre-tokenizer never sees an overlong piece or run (short texts pass whole)."""
    if len(text) <= _MAX_RUN_CHARS:
        yield text
        return
    piece: list[str] = []
    piece_chars = 0
    for run in _RUNS.finditer(text):
        run_text = run.group()
        for start in range(0, len(run_text), _MAX_RUN_CHARS):
            part = run_text[start : start + _MAX_RUN_CHARS]
            # A run cut in several parts must be encoded in separate pieces; so must a piece past its size.
            if piece and (start > 0 or piece_chars + len(part) > _MAX_PIECE_CHARS):
                yield "".join(piece)
                piece, piece_chars = [], 0
            piece.append(part)
            piece_chars += len(part)
    if piece:
        yield "".join(piece)


class TikTokenizer(Tokenizer):
    """A tiktoken BPE file with Llama 3's pre-tokenizer and special tokens.

    Text that happens to spell a special token (say ``<|end_of_text|>`` inside a web page) is encoded as plain
    text: only ``bos=True`` / ``eos=True`` produce special ids.
    """

    def __init__(self, path: str) -> None:
        import tiktoken

        ranks = read_tiktoken_ranks(path)
        self.fingerprint = file_fingerprint(path)
        self.special_tokens = {token: len(ranks) + i for i, token in enumerate(llama3_special_tokens())}
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=LLAMA3_SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = self._encoding.n_vocab
        self.bos_id = self.special_tokens[BOS_TOKEN]
        self.eos_id = self.special_tokens[EOS_TOKEN]

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = [self.bos_id] if bos else []
        for piece in _pieces_for_regex(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model; it must define BOS and EOS pieces. Control ids decode to nothing."""

    def __init__(self, path: str) -> None:
        import sentencepiece

        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError):
            raise UserError(
                f"model.tokenizer_path '{path}' is not a sentencepiece model (it could not be parsed); "
                "point it at a sentencepiece .model or tiktoken BPE file"
            ) from None
        self.fingerprint = file_fingerprint(path)
        self.n_words = self._processor.vocab_size()
        self.bos_id = self._processor.bos_id()
        self.eos_id = self._processor.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise UserError(
                f"model.tokenizer_path '{path}' is a sentencepiece model without BOS/EOS pieces; "
                "train it with bos_id and eos_id set"
            )

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self._processor.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        return self._processor.decode([int(i) for i in ids])


HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"


def _token_content(value) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or a dict with its "content"."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (a file, or the one in a model folder), read by ``tokenizers``.

    As for the tiktoken file: text that spells a special token is encoded as plain text, and only ``bos=True`` /
    ``eos=True`` produce special ids (the file's own post-processor, which would add BOS, is not applied). BOS and
    EOS are Llama 3's ``<|begin_of_text|>`` and ``<|end_of_text|>`` when the vocabulary has them (the document
    boundaries Llama 3 was pre-trained with), else the ``bos_token`` / ``eos_token`` of ``tokenizer_config.json``.
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, HF_TOKENIZER_FILE) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise UserError(
                f"model.tokenizer_path '{path}' is a folder without {HF_TOKENIZER_FILE}; point it at a Hugging Face "
                "model folder, a tokenizer.json, or a tiktoken / sentencepiece file"
            )
        try:
            self._tokenizer = RustTokenizer.from_file(file)
        except Exception as error:  # noqa: BLE001 - the library raises plain Exceptions for unparsable files
            raise UserError(f"model.tokenizer_path '{file}' is not a Hugging Face tokenizer.json ({error})") from None
        self._tokenizer.encode_special_tokens = True
        self.n_words = self._tokenizer.get_vocab_size(with_added_tokens=True)
        configured = self._configured_tokens(folder)
        self.bos_id = self._special_id(file, BOS_TOKEN, configured.get("bos_token"), "bos_token")
        self.eos_id = self._special_id(file, EOS_TOKEN, configured.get("eos_token"), "eos_token")
        # The ids depend on tokenizer.json and on which tokens tokenizer_config.json makes BOS and EOS.
        ids = f"{file_fingerprint(file)}:{self.bos_id}:{self.eos_id}".encode()
        self.fingerprint = hashlib.sha256(ids).hexdigest()[:16]

    @staticmethod
    def _configured_tokens(folder: str) -> dict:
        config = os.path.join(folder, HF_TOKENIZER_CONFIG)
        if not os.path.isfile(config):
            return {}
        try:
            with open(config) as f:
                data = json.load(f)
        except (OSError, ValueError) as error:
            raise UserError(f"cannot read {config} ({error}); fix or remove it") from None
        return {key: _token_content(data.get(key)) for key in ("bos_token", "eos_token") if data.get(key)}

    def _special_id(self, file: str, llama3_token: str, configured: str | None, what: str) -> int:
        for token in (llama3_token, configured):
            if token is not None and self._tokenizer.token_to_id(token) is not None:
                return self._tokenizer.token_to_id(token)
        raise UserError(
            f"model.tokenizer_path '{file}' has no {llama3_token} and no {what} in a {HF_TOKENIZER_CONFIG} next to "
            f"it; add {HF_TOKENIZER_CONFIG} with its {what}"
        )

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def looks_like_tiktoken(path: str) -> bool:
    """True when the file starts with a ``<base64 token> <rank>`` line (a sentencepiece model is binary)."""
    with open(path, "rb") as f:
        first_line = f.readline(4096)
    return _TIKTOKEN_LINE.match(first_line.rstrip(b"\n")) is not None


TOKENIZER_TYPES = ("auto", "tiktoken", "sentencepiece", "huggingface")


def build_tokenizer(path: str, kind: str = "auto") -> Tokenizer:
    """The tokenizer stored at ``path``; ``kind`` is "auto" (a folder or ``*.json`` file: Hugging Face; otherwise
    detected by content), "tiktoken", "sentencepiece" or "huggingface"."""
    if kind not in TOKENIZER_TYPES:
        raise UserError(f"model.tokenizer_type '{kind}' is unknown; choose one of {', '.join(TOKENIZER_TYPES)}")
    if not os.path.exists(path):
        raise UserError(
            f"model.tokenizer_path '{path}' does not exist; point it at a Hugging Face model folder, a "
            "tokenizer.json, or a tiktoken BPE or sentencepiece model file"
        )
    if kind == "auto" and (os.path.isdir(path) or path.endswith(".json")):
        kind = "huggingface"
    if os.path.isdir(path) and kind != "huggingface":
        raise UserError(
            f"model.tokenizer_path '{path}' is a folder, which only a Hugging Face tokenizer can be; point it at "
            f"the {kind} file inside it"
        )
    try:
        if kind == "huggingface":
            return HFTokenizer(path)
        if kind == "auto":
            kind = "tiktoken" if looks_like_tiktoken(path) else "sentencepiece"
        return TikTokenizer(path) if kind == "tiktoken" else SentencePieceTokenizer(path)
    except OSError as error:
        raise UserError(f"model.tokenizer_path '{path}' cannot be read ({error.strerror or error})") from None
