"""The data loader's own throughput: tokens per second one data-parallel rank gets, alone and as one of 4 ranks.

    python benchmarks/bench_data_loader.py
    python benchmarks/bench_data_loader.py --dataset text --dataset-path data/ --tokenizer tokenizer.model --ranks 8
    python benchmarks/bench_data_loader.py --mode tokens [--tokens-path DIR] [--ranks 8]

Each data-parallel rank reads and tokenizes its own share of the documents, so a rank of 4 should deliver its
batches about as fast as a rank alone (before, every rank tokenized the whole global batch: about 1/4 of the speed).
Ranks are simulated in this process (``dp_rank`` / ``dp_degree`` arguments, no process group); rank 0 is timed,
in this process (no loader workers, so that only the reading and tokenizing is timed). The two layouts take turns,
one batch each per round (a shared machine's speed changes touch both alike); a rate is batches' tokens over their
total time, and the ratio is the rate of the rank of N over that of the rank alone.

``--mode tokens`` times pre-tokenized data (``training.dataset = "tokens"``): the same documents tokenized once
(into a temporary folder, or ``--tokens-path``), and in the same rounds three readers: the text loader's reader
alone, a tokens reader alone and a tokens reader that is rank 0 of ``--ranks``. It prints the tokens reader's rate
over the text reader's (the target is at least 20x) and the rank of N's over the lone one's (at least 0.9x).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.datasets import build_hf_data_loader, build_tokenizer  # noqa: E402
from torchtitan.datasets.tokens import build_tokens_data_loader  # noqa: E402
from torchtitan.tools.pretokenize import pretokenize  # noqa: E402

TEST_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "tiktoken_test.model"


def timed_rounds(batches: dict, warmup: int, rounds: int) -> dict:
    """Seconds each loader took for each of its batches, the loaders taking turns one batch each per round (in
    an order that rotates every round)."""
    for name in batches:
        for _ in itertools.islice(batches[name], warmup):
            pass
    seconds: dict = {name: [] for name in batches}
    names = list(batches)
    for round_index in range(rounds):
        shift = round_index % len(names)  # each loader goes first, and after each other, as often
        for name in names[shift:] + names[:shift]:
            begin = time.perf_counter()
            next(batches[name])
            seconds[name].append(time.perf_counter() - begin)
    return seconds


def text_mode(args, tokenizer) -> None:
    layouts = (1, args.ranks)
    batches = {
        world: iter(
            build_hf_data_loader(
                args.dataset, args.dataset_path, tokenizer, args.batch_size, args.seq_len, 0, world, workers=0
            )
        )
        for world in layouts
    }
    seconds = timed_rounds(batches, args.warmup, args.rounds)
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


def tokens_mode(args, tokenizer) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = args.tokens_path
        if path is None:
            path = f"{scratch}/tokens"
            source = args.dataset if args.dataset_path is None else args.dataset_path
            pretokenize(source, args.tokenizer, path)

        def tokens_reader(world: int):
            loader = build_tokens_data_loader(
                path, tokenizer, args.tokenizer, args.batch_size, args.seq_len, 0, world, seed=0, held_out_every=20
            )
            return iter(loader)

        batches = {
            "text": iter(
                build_hf_data_loader(
                    args.dataset, args.dataset_path, tokenizer, args.batch_size, args.seq_len, 0, 1, workers=0
                )
            ),
            "tokens": tokens_reader(1),
            f"tokens, rank 0 of {args.ranks}": tokens_reader(args.ranks),
        }
        seconds = timed_rounds(batches, args.warmup, args.rounds)
    tokens = args.batch_size * args.seq_len
    print(f"dataset {args.dataset}, batches of {args.batch_size} x {args.seq_len} tokens, {args.rounds} rounds")
    rates = {name: tokens * args.rounds / sum(seconds[name]) for name in batches}
    for name, rate in rates.items():
        print(f"{name:>24}: {rate:14,.0f} tokens/s per reader")
    many = f"tokens, rank 0 of {args.ranks}"
    print(f"tokens reader vs text reader: {rates['tokens'] / rates['text']:.1f}x (target: at least 20x)")
    print(
        f"tokens reader, rank 0 of {args.ranks} vs alone: {rates[many] / rates['tokens']:.2f}x (target: at least 0.9x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("text", "tokens"), default="text", help="the loader timed (default text)")
    parser.add_argument("--dataset", default="sample", help="training.dataset (default: the bundled sample)")
    parser.add_argument("--dataset-path", default=None, help="training.dataset_path")
    parser.add_argument("--tokens-path", default=None, help="tokens mode: a pretokenized folder of the same data")
    parser.add_argument("--tokenizer", default=str(TEST_TOKENIZER), help="tiktoken or sentencepiece model")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ranks", type=int, default=None, help="data-parallel degree compared with 1 (4; tokens: 8)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    if args.ranks is None:
        args.ranks = 8 if args.mode == "tokens" else 4
    if args.tokens_path is not None and args.mode != "tokens":
        parser.error("--tokens-path applies to --mode tokens")
    tokenizer = build_tokenizer(args.tokenizer)
    (tokens_mode if args.mode == "tokens" else text_mode)(args, tokenizer)


if __name__ == "__main__":
    main()
