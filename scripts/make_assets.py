"""Build the bundled offline assets: a sample corpus and two small tokenizers trained on it.

    python scripts/make_assets.py            # writes ./assets/ next to this script's repository
    python scripts/make_assets.py --out DIR  # writes DIR/data/sample/sample.jsonl and DIR/tokenizer/*.model

Everything here is deterministic: the corpus comes from our own template grammar driven by a fixed-seed
SplitMix64 generator (no ``random``, whose algorithms may change between Python versions), the tiktoken-format
BPE from our small trainer, and sentencepiece trains on one thread from an in-memory iterator (so no file path is
recorded in the model); each has its module in ``scripts/assets/``. Running the script twice gives byte-identical
files; ``assets/README.md`` describes what the files are and where the text comes from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # scripts.assets, whether run as a script or loaded from its path

from scripts.assets.bpe import count_words, tiktoken_file_bytes, train_bpe  # noqa: E402
from scripts.assets.corpus import generate_documents, jsonl_line  # noqa: E402
from scripts.assets.sentencepiece_model import train_sentencepiece  # noqa: E402

CORPUS_SEED = 20240611
CORPUS_BYTES = 2_000_000  # stop adding documents once the jsonl holds this many bytes
TIKTOKEN_RANKS = 2000  # 256 single bytes + 1744 merges
SENTENCEPIECE_VOCAB = 2000

SAMPLE_RELPATH = Path("data/sample/sample.jsonl")
TIKTOKEN_RELPATH = Path("tokenizer/tiktoken_test.model")
SENTENCEPIECE_RELPATH = Path("tokenizer/sentencepiece_test.model")


# ----------------------------------------------------------------------------------------------------------------


def build_assets() -> dict[Path, bytes]:
    """Every asset's bytes, keyed by its path inside the assets folder (nothing is written here)."""
    documents = generate_documents(CORPUS_SEED, CORPUS_BYTES)
    corpus = "".join(jsonl_line(text) for text in documents).encode("utf-8")
    ranks = train_bpe(count_words(documents), TIKTOKEN_RANKS)
    return {
        SAMPLE_RELPATH: corpus,
        TIKTOKEN_RELPATH: tiktoken_file_bytes(ranks),
        SENTENCEPIECE_RELPATH: train_sentencepiece(documents, SENTENCEPIECE_VOCAB),
    }


def write_assets(out_dir: Path) -> dict[Path, bytes]:
    assets = build_assets()
    for relpath, data in assets.items():
        path = out_dir / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return assets


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "assets", help="folder to write (default: ./assets)")
    args = parser.parse_args(argv)
    for relpath, data in write_assets(args.out).items():
        print(f"{args.out / relpath}: {len(data):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
