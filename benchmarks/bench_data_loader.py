"""The data loader's own throughput: tokens per second one data-parallel rank gets, alone and as one of 4 ranks.

    python benchmarks/bench_data_loader.py
    python benchmarks/bench_data_loader.py --dataset text --dataset-path data/ --tokenizer tokenizer.model --ranks 8

Each data-parallel rank reads and tokenizes its own share of the documents, so a rank of 4 should deliver its
batches about as fast as a rank alone (before, every rank tokenized the whole global batch: about 1/4 of the speed).
Ranks are simulated in this process (``dp_rank`` / ``dp_degree`` arguments, no process group); rank 0 is timed,
in this process (no loader workers, so that only the reading and tokenizing is timed). The two layouts take turns,
one batch each per round (a shared machine's speed changes touch both alike); a rate is batches' tokens over their
total time, and the ratio is the rate of the rank of N over that of the rank alone.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.datasets import build_hf_data_loader, build_tokenizer  # noqa: E402

TEST_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "tiktoken_test.model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="sample", help="training.dataset (default: the bundled sample)")
    parser.add_argument("--dataset-path", default=None, help="training.dataset_path")
    parser.add_argument("--tokenizer", default=str(TEST_TOKENIZER), help="tiktoken or sentencepiece model")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel degree compared with 1")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()

    tokenizer = build_tokenizer(args.tokenizer)
    layouts = (1, args.ranks)
    batches = {
        world: iter(
            build_hf_data_loader(
                args.dataset, args.dataset_path, tokenizer, args.batch_size, args.seq_len, 0, world, workers=0
            )
        )
        for world in layouts
    }
    for world in layouts:
        for _ in itertools.islice(batches[world], args.warmup):
            pass
    seconds: dict[int, list[float]] = {world: [] for world in layouts}
    for _ in range(args.rounds):
        for world in layouts:
            begin = time.perf_counter()
            next(batches[world])
            seconds[world].append(time.perf_counter() - begin)

    tokens = args.batch_size * args.seq_len
    print(f"dataset {args.dataset}, batches of {args.batch_size} x {args.seq_len} tokens, {args.rounds} rounds")
    rates = {world: tokens * args.rounds / sum(seconds[world]) for world in layouts}
    for world in layouts:
        print(f"rank 0 of {world}: {rates[world]:12,.0f} tokens/s per rank")
    ratio = rates[args.ranks] / rates[1]
    print(
        f"tokens/s per rank, {args.ranks} ranks vs 1: {ratio:.2f}x (1.0: no cost per rank; 1/{args.ranks}: every rank "
        "tokenizing the whole global batch)"
    )


if __name__ == "__main__":
    main()
