"""The tiktoken-format tokenizer's trainer."""

from __future__ import annotations

import base64
import heapq
from collections import Counter
from typing import Iterable

import regex

# The Llama 3 pre-tokenizer pattern; the trainer must split text exactly as the tokenizer will.
LLAMA3_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501 - one regular expression


# ----------------------------------------------------------------------------------------------------------------
# Our byte-level BPE trainer (tiktoken format). Words are pre-split with the Llama 3 pattern; pair counts are
# kept incrementally and the most frequent pair comes from a lazy max-heap, ties broken by the smaller byte pair.


def count_words(texts: Iterable[str]) -> Counter[bytes]:
    splitter = regex.compile(LLAMA3_SPLIT_PATTERN)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(piece.encode("utf-8") for piece in splitter.findall(text))
    return counts


def _pairs(symbols: list[bytes]) -> Iterable[tuple[bytes, bytes]]:
    return zip(symbols, symbols[1:])


def _merge_symbols(symbols: list[bytes], left: bytes, right: bytes) -> list[bytes]:
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
            merged.append(left + right)
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged


def train_bpe(word_counts: Counter[bytes], n_ranks: int) -> dict[bytes, int]:
    """Ranks for the 256 single bytes (rank = byte value) followed by merged tokens in the order learned."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in word] for word in sorted(word_counts)]
    freqs = [word_counts[word] for word in sorted(word_counts)]
    pair_counts: Counter[tuple[bytes, bytes]] = Counter()
    pair_words: dict[tuple[bytes, bytes], set[int]] = {}
    for index, (symbols, freq) in enumerate(zip(words, freqs)):
        for pair in _pairs(symbols):
            pair_counts[pair] += freq
            pair_words.setdefault(pair, set()).add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    while len(ranks) < n_ranks and heap:
        negative_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative_count:
            continue  # stale entry: this pair's count changed after it was pushed
        if -negative_count < 2:
            break  # nothing left that repeats
        left, right = pair
        ranks.setdefault(left + right, len(ranks))
        changed: set[tuple[bytes, bytes]] = set()
        for index in sorted(pair_words.pop(pair)):
            old = words[index]
            new = _merge_symbols(old, left, right)
            if len(new) == len(old):
                continue  # the pair left this word through an earlier merge
            for old_pair in _pairs(old):
                pair_counts[old_pair] -= freqs[index]
                changed.add(old_pair)
            for new_pair in _pairs(new):
                pair_counts[new_pair] += freqs[index]
                pair_words.setdefault(new_pair, set()).add(index)
                changed.add(new_pair)
            words[index] = new
        for changed_pair in sorted(changed):
            count = pair_counts[changed_pair]
            if count > 0:
                heapq.heappush(heap, (-count, changed_pair))
            else:
                del pair_counts[changed_pair]
    return ranks


def tiktoken_file_bytes(ranks: dict[bytes, int]) -> bytes:
    lines = [
        base64.b64encode(token) + b" " + str(rank).encode()
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    return b"\n".join(lines) + b"\n"
