"""Pre-tokenized data: the pretokenize tool, the shard format, the seeded window order, readers, resume, refusals."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import processes
from tests.helpers import job_config
from torchtitan.datasets import build_hf_data_loader, build_tokenizer
from torchtitan.datasets.build import dataset_record
from torchtitan.datasets.tokens import (
    HEADER_BYTES,
    ShardWriter,
    TokenArray,
    WindowOrder,
    WindowSplit,
    build_tokens_data_loader,
    read_manifest,
    token_dtype,
    validation_windows,
    write_manifest,
)
from torchtitan.errors import UserError
from torchtitan.tools.pretokenize import pretokenize

REPO = Path(__file__).resolve().parents[2]
TIKTOKEN = str(REPO / "assets" / "tokenizer" / "tiktoken_test.model")
SENTENCEPIECE = str(REPO / "assets" / "tokenizer" / "sentencepiece_test.model")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TIKTOKEN)


@pytest.fixture(scope="module")
def sample_tokens(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokens") / "sample"
    pretokenize("sample", TIKTOKEN, str(out), shard_tokens=100_000)
    return out


def counting_folder(folder: Path, tokenizer, n_tokens: int, shard_tokens: int) -> Path:
    """A tokens folder whose token i is i (uint32): a window's first token tells which window it is."""
    folder.mkdir(parents=True)
    writer = ShardWriter(folder, np.dtype("<u4"), shard_tokens)
    writer.add(np.arange(n_tokens, dtype=np.int64))
    write_manifest(folder, writer, tokenizer, TIKTOKEN, "counting", documents=1)
    return folder


def window_ids(batch, window: int) -> list[int]:
    inputs, _ = batch
    return [int(first) // window for first in inputs[:, 0]]


def tokens_loader(folder, tokenizer, batch_size, seq_len, rank, world, workers=0, seed=0, every=0, allow=False):
    return build_tokens_data_loader(
        str(folder),
        tokenizer,
        TIKTOKEN,
        batch_size,
        seq_len,
        rank,
        world,
        seed=seed,
        held_out_every=every,
        workers=workers,
        allow_data_change=allow,
    )


# ----------------------------------------------------------------------------------------------------------------
# Tokenize once


def test_pretokenized_tokens_are_those_of_the_text_loader(tokenizer, sample_tokens):
    manifest = read_manifest(str(sample_tokens))
    stored = np.empty(manifest["tokens"], dtype=np.int64)
    TokenArray(str(sample_tokens), manifest).read(0, manifest["tokens"], stored)
    # One reader, nothing held out: the text loader's windows are its token stream cut in pieces.
    window = 64
    text = build_hf_data_loader("sample", None, tokenizer, 1, window - 1, 0, 1, infinite=False)
    streamed = [int(t) for inputs, labels in text for t in torch.cat([inputs[0], labels[0, -1:]])]
    assert len(streamed) == manifest["tokens"] // window * window
    assert stored[: len(streamed)].tolist() == streamed
    assert len(manifest["shards"]) == -(-manifest["tokens"] // 100_000)  # read across shard boundaries above
    assert manifest["documents"] == len((REPO / "assets/data/sample/sample.jsonl").read_text().splitlines())
    assert manifest["tokenizer"]["fingerprint"] == tokenizer.fingerprint
    assert manifest["dtype"] == "<u2" and manifest["source"] == "sample"


def test_workers_write_the_same_bytes_and_a_folder_source_in_file_order(tokenizer, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    texts = [f"document {i}: " + "word " * (i % 7) for i in range(700)]
    for part in range(3):
        (data / f"part{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[part::3]))
    one = pretokenize(str(data), TIKTOKEN, str(tmp_path / "one"), workers=1)
    two = pretokenize(str(data), TIKTOKEN, str(tmp_path / "two"), workers=2, shard_tokens=5000)
    assert one["fingerprint"] == two["fingerprint"] and one["tokens"] == two["tokens"] and one["documents"] == 700
    in_file_order = [t for part in range(3) for t in texts[part::3]]
    expected = [i for t in in_file_order for i in tokenizer.encode(t, bos=True, eos=True)]
    for name in ("one", "two"):
        manifest = read_manifest(str(tmp_path / name))
        stored = np.empty(manifest["tokens"], dtype=np.int64)
        TokenArray(str(tmp_path / name), manifest).read(0, manifest["tokens"], stored)
        assert stored.tolist() == expected


def test_shard_format_and_width():
    assert token_dtype(65_536) == np.dtype("<u2") and token_dtype(65_537) == np.dtype("<u4")
    assert token_dtype(128_256) == np.dtype("<u4")


def test_wide_tokens_round_trip_and_the_header(tokenizer, tmp_path):
    folder = tmp_path / "wide"
    folder.mkdir()
    values = np.array([0, 70_000, 128_255, 5, 1 << 31], dtype=np.int64)
    writer = ShardWriter(folder, np.dtype("<u4"), 3)
    writer.add(values)
    manifest = write_manifest(folder, writer, tokenizer, TIKTOKEN, "wide", documents=1)
    assert [s["tokens"] for s in manifest["shards"]] == [3, 2]
    first = (folder / "shard_00000.bin").read_bytes()
    assert first[:8] == b"TTTOKNS1" and int.from_bytes(first[8:12], "little") == 4
    assert int.from_bytes(first[12:20], "little") == 3 and len(first) == HEADER_BYTES + 3 * 4
    out = np.empty(5, dtype=np.int64)
    TokenArray(str(folder), read_manifest(str(folder))).read(0, 5, out)
    assert out.tolist() == values.tolist()


def test_pretokenize_refuses_an_existing_folder_and_a_damaged_shard(tmp_path, sample_tokens):
    proc = processes.run(
        [sys.executable, "-m", "torchtitan.tools.pretokenize", "--source", "sample", "--tokenizer", TIKTOKEN]
        + ["--out", str(sample_tokens)],
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: --out '{sample_tokens}' already exists; choose a new folder (tokenized data is never overwritten)"
    ]
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in sample_tokens.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes()[:-2] if file.suffix == ".bin" else file.read_bytes())
    with pytest.raises(UserError, match="cut short"):
        read_manifest(str(damaged))


def with_manifest(tmp_path: Path, sample_tokens: Path, edit) -> Path:
    """A copy of the sample tokens folder whose manifest ``edit`` (called on the parsed JSON) changed."""
    folder = tmp_path / "tokens"
    shutil.copytree(sample_tokens, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


MANIFEST_KEYS = [
    ("format",),
    ("dtype",),
    ("documents",),
    ("tokens",),
    ("shards",),
    ("shards", 0, "file"),
    ("shards", 0, "tokens"),
    ("tokenizer",),
    ("tokenizer", "path"),
    ("tokenizer", "fingerprint"),
    ("tokenizer", "vocab_size"),
    ("source",),
    ("fingerprint",),
]


@pytest.mark.parametrize("key", MANIFEST_KEYS, ids=lambda key: ".".join(map(str, key)))
def test_a_manifest_without_a_key_is_one_line_naming_it(tmp_path, sample_tokens, key):
    from torchtitan.config.preflight import preflight

    def remove(manifest: dict) -> None:
        holder = manifest
        for part in key[:-1]:
            holder = holder[part]
        del holder[key[-1]]

    folder = with_manifest(tmp_path, sample_tokens, remove)
    name = key[0] if len(key) == 1 else f"{key[0]}[0].{key[2]}" if key[0] == "shards" else ".".join(key)
    job = job_config("--training.dataset", "tokens", "--training.dataset_path", str(folder))
    with pytest.raises(UserError) as error:
        preflight(job, 1)  # what train.py and run_llama_train.sh do first: one line, exit code 2
    message = str(error.value)
    assert f"has no key '{name}'" in message and "pretokenize the data again" in message and "\n" not in message


def test_a_manifest_whose_width_cannot_hold_its_vocabulary_is_refused(tmp_path, sample_tokens):
    def widen(manifest: dict) -> None:
        assert manifest["dtype"] == "<u2"
        manifest["tokenizer"]["vocab_size"] = 128_256

    folder = with_manifest(tmp_path, sample_tokens, widen)
    with pytest.raises(UserError, match="uint16 tokens, which cannot hold the ids of its tokenizer's vocabulary"):
        read_manifest(str(folder))


def test_a_documents_split_without_a_key_is_one_line_naming_it(tmp_path, sample_tokens):
    # The optional part, written by pretokenize --held-out-every, without its "every".
    folder = with_manifest(tmp_path, sample_tokens, lambda m: m.update(documents_split={"held_out": True}))
    with pytest.raises(UserError, match="has no key 'documents_split.every'; pretokenize the data again"):
        read_manifest(str(folder))


def test_ids_are_checked_against_the_vocabulary_before_they_are_narrowed(tmp_path, monkeypatch):
    folder = tmp_path / "narrow"
    folder.mkdir()
    # Without a vocabulary, the width itself: 70,000 would wrap to 4,464 in uint16.
    for dtype, ids, bad in (("<u2", [1, 70_000], 70_000), ("<u2", [-1, 2], -1), ("<u4", [1 << 32], 1 << 32)):
        with pytest.raises(UserError, match=f"token id {bad} is outside the vocabulary of"):
            ShardWriter(folder, np.dtype(dtype), 10).add(np.array(ids, dtype=np.int64))
    writer = ShardWriter(folder, np.dtype("<u2"), 10, vocab_size=100)
    writer.add(np.array([0, 99], dtype=np.int64))
    with pytest.raises(UserError, match="token id 100 is outside the vocabulary of 100 ids"):
        writer.add(np.array([5, 100], dtype=np.int64))
    # pretokenize gives the writer the tokenizer's vocabulary: a tokenizer whose ids pass its n_words is refused,
    # and nothing is left behind.
    import torchtitan.datasets.tokenizer as tokenizers

    real = tokenizers.build_tokenizer

    def understated(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        tokenizer.n_words = 100
        return tokenizer

    monkeypatch.setattr(tokenizers, "build_tokenizer", understated)
    with pytest.raises(UserError, match="outside the vocabulary of 100 ids"):
        pretokenize("sample", TIKTOKEN, str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["narrow"]


# ----------------------------------------------------------------------------------------------------------------
# The order


@pytest.mark.parametrize("n", [1, 2, 3, 5, 100, 1023, 1024, 1025, 4099])
def test_window_order_is_a_permutation_fixed_by_seed_and_epoch(n):
    order = WindowOrder(n, seed=7, epoch=0)(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    assert WindowOrder(n, seed=7, epoch=0)(np.arange(n)).tolist() == order.tolist()
    if n >= 100:
        assert WindowOrder(n, seed=7, epoch=1)(np.arange(n)).tolist() != order.tolist()
        assert WindowOrder(n, seed=8, epoch=0)(np.arange(n)).tolist() != order.tolist()
        assert order.tolist() != list(range(n))


def test_held_out_windows_and_the_training_windows_partition_the_data():
    for windows, every in ((100, 20), (101, 3), (7, 2), (40, 0)):
        train = WindowSplit(windows, every, held_out=False)
        held = WindowSplit(windows, every, held_out=True)
        trained = train.window(np.arange(train.count)).tolist()
        validated = held.window(np.arange(held.count)).tolist()
        assert sorted(trained + validated) == list(range(windows))
        assert all(w % every == 0 for w in validated) if every else validated == []


# ----------------------------------------------------------------------------------------------------------------
# Readers and resume


def read_epoch_ids(loaders, steps: int, window: int) -> list[int]:
    """Window ids the ranks' loaders read in ``steps`` steps (one batch per rank per step)."""
    batches = [iter(loader) for loader in loaders]
    return [w for _ in range(steps) for b in batches for w in window_ids(next(b), window)]


def test_readers_take_disjoint_windows_and_an_epoch_covers_each_training_window_once(tokenizer, tmp_path):
    window, every = 9, 5
    folder = counting_folder(tmp_path / "c", tokenizer, 60 * window + 4, shard_tokens=50)
    split = WindowSplit(60, every, held_out=False)  # 48 training windows
    loaders = [tokens_loader(folder, tokenizer, 2, window - 1, rank, 3, seed=1, every=every) for rank in range(3)]
    first_epoch = read_epoch_ids(loaders, 8, window)  # 3 ranks x 2 windows x 8 steps = 48
    assert sorted(first_epoch) == sorted(split.window(np.arange(split.count)).tolist())
    assert all(w % every for w in first_epoch)
    second_epoch = read_epoch_ids(loaders, 8, window)
    assert sorted(second_epoch) == sorted(first_epoch) and second_epoch != first_epoch
    # The tokens are the stored ones, labels shifted by one.
    inputs, labels = next(iter(loaders[0]))
    assert torch.equal(labels[:, :-1], inputs[:, 1:]) and torch.equal(labels[:, -1], inputs[:, -1] + 1)


@pytest.mark.parametrize(
    "before, after",
    [((2, 0, 3), (2, 0, 3)), ((2, 0, 3), (3, 0, 2)), ((1, 0, 4), (4, 0, 1)), ((2, 0, 2), (1, 2, 2))],
    ids=["same", "2x3-to-3x2", "1-to-4", "2-ranks-to-1-rank-2-workers"],
)
def test_resume_at_the_same_or_another_reader_count_is_exact(tokenizer, tmp_path, before, after):
    """(ranks, workers, batch size) before and after: the windows read are those of one uninterrupted order."""
    window = 5
    folder = counting_folder(tmp_path / "c", tokenizer, 97 * window, shard_tokens=64)
    order = [tokens_loader(folder, tokenizer, 1, window - 1, 0, 1, seed=3, every=4)]
    expected = read_epoch_ids(order, 72 * 2, window)  # two epochs of the 72 training windows, one at a time

    ranks, workers, batch = before
    old = [
        tokens_loader(folder, tokenizer, batch, window - 1, r, ranks, workers, seed=3, every=4) for r in range(ranks)
    ]
    read = read_epoch_ids(old, 5, window)
    state = old[0].state_dict()
    assert state["windows"] == 5 * ranks * batch and all(loader.state_dict() == state for loader in old)
    state = json.loads(json.dumps(state))  # as a checkpoint stores it

    ranks, workers, batch = after
    new = [
        tokens_loader(folder, tokenizer, batch, window - 1, r, ranks, workers, seed=3, every=4) for r in range(ranks)
    ]
    for loader in new:
        loader.load_state_dict(state)
    steps = (len(expected) - len(read)) // (ranks * batch)
    read += read_epoch_ids(new, steps, window)
    assert read == expected[: len(read)] and len(read) > 72
    assert sorted(read[:72]) == sorted(set(read[:72]))  # no window twice in the first epoch


def test_workers_split_a_rank_and_pickle_no_tokens(tokenizer, tmp_path):
    window = 5
    folder = counting_folder(tmp_path / "c", tokenizer, 200 * window, shard_tokens=1 << 20)
    alone = read_epoch_ids([tokens_loader(folder, tokenizer, 2, window - 1, 0, 1, seed=2)], 6, window)
    workers = read_epoch_ids([tokens_loader(folder, tokenizer, 2, window - 1, 0, 1, workers=2, seed=2)], 6, window)
    assert workers == alone
    loader = tokens_loader(folder, tokenizer, 2, window - 1, 0, 1)
    next(iter(loader))
    assert isinstance(loader.dataset.tokens._memmaps()[0].base, np.memmap)  # the tokens stay on disk
    assert len(pickle.dumps(loader.dataset)) < 4096  # what a spawned worker receives: paths, not the tokens


def test_validation_reads_only_held_out_windows(tokenizer, tmp_path):
    window = 9
    folder = counting_folder(tmp_path / "c", tokenizer, 50 * window, shard_tokens=100)
    # Validation windows of 4 + 1 tokens: each held-out training window (9 tokens) gives one.
    for rank in range(2):
        for inputs, labels in validation_windows(str(folder), window - 1, 4, 2, rank, 2, every=5, count=10):
            for row in inputs[:, 0].tolist():
                assert (row // window) % 5 == 0 and row % window == 0
            assert torch.equal(labels[:, :-1], inputs[:, 1:])
    everything = validation_windows(str(folder), window - 1, 8, 1, 0, 1, every=0, count=50)
    assert [int(b[0][0, 0]) for b in everything] == [w * window for w in range(50)]
    with pytest.raises(UserError, match="holds 10 validation windows of 5 tokens, fewer than validation.windows 11"):
        validation_windows(str(folder), window - 1, 4, 2, 0, 1, every=5, count=11)


def test_held_out_windows_share_with_training_only_the_documents_across_their_edges(tokenizer, tmp_path):
    """What the docs say is shared: a document that crosses the first or last token of a held-out window; one that a
    held-out window holds whole is never trained on."""
    window, every, windows = 9, 4, 48
    folder = counting_folder(tmp_path / "c", tokenizer, windows * window, shard_tokens=100)  # token i is i
    lengths = np.random.default_rng(0).integers(1, 3 * window, windows * window)
    starts = np.cumsum(np.concatenate([[0], lengths]))
    starts = starts[starts < windows * window]  # documents: [starts[d], starts[d + 1]) of the stream

    def documents(positions) -> set[int]:
        return set((np.searchsorted(starts, np.asarray(positions), side="right") - 1).tolist())

    training = tokens_loader(folder, tokenizer, 4, window - 1, 0, 1, seed=1, every=every)
    batches = iter(training)
    trained = [int(t) for _ in range(9) for t in torch.cat(next(batches), dim=1).flatten()]  # one epoch: 36 windows
    held = validation_windows(str(folder), window - 1, window - 1, 3, 0, 1, every=every, count=windows // every)
    validated = [int(t) for inputs, labels in held for t in torch.cat([inputs, labels], dim=1).flatten()]
    assert len(set(trained)) == 36 * window and not set(trained) & set(validated)  # no token on both sides

    def document(position: int) -> int:
        return int(np.searchsorted(starts, position, side="right")) - 1

    crossing = set()  # a held-out window's first document when it began before, its last when it goes on after
    for first in range(0, windows * window, every * window):
        last = first + window - 1
        if first > 0 and document(first - 1) == document(first):
            crossing.add(document(first))
        if document(last + 1) == document(last):
            crossing.add(document(last))
    shared = documents(trained) & documents(validated)
    assert shared == crossing and 0 < len(shared) < len(documents(validated))


# ----------------------------------------------------------------------------------------------------------------
# Refusals and the record


def test_another_tokenizer_is_one_line_naming_both(sample_tokens):
    other = build_tokenizer(SENTENCEPIECE)
    with pytest.raises(UserError) as error:
        build_tokens_data_loader(str(sample_tokens), other, SENTENCEPIECE, 1, 8, 0, 1, seed=0, held_out_every=0)
    message = str(error.value)
    assert "\n" not in message and TIKTOKEN in message and SENTENCEPIECE in message
    assert other.fingerprint in message and build_tokenizer(TIKTOKEN).fingerprint in message


def test_resume_on_other_data_is_refused_unless_allowed(tokenizer, tmp_path, sample_tokens):
    window = 5
    counting = counting_folder(tmp_path / "c", tokenizer, 100 * window, shard_tokens=1000)
    saved = tokens_loader(counting, tokenizer, 2, window - 1, 0, 1, seed=3)
    next(iter(saved))
    state = saved.state_dict()
    changes = {
        "other data": tokens_loader(sample_tokens, tokenizer, 2, window - 1, 0, 1, seed=3),
        "another seed": tokens_loader(counting, tokenizer, 2, window - 1, 0, 1, seed=4),
        "another seq_len": tokens_loader(counting, tokenizer, 2, window, 0, 1, seed=3),
        "another held-out split": tokens_loader(counting, tokenizer, 2, window - 1, 0, 1, seed=3, every=10),
    }
    for what, loader in changes.items():
        with pytest.raises(UserError, match="training.allow_data_change") as error:
            loader.load_state_dict(state)
        assert "\n" not in str(error.value), what
    allowed = tokens_loader(sample_tokens, tokenizer, 2, window - 1, 0, 1, seed=3, allow=True)
    allowed.load_state_dict(state)
    assert allowed.state_dict()["windows"] == 0
    # A text loader refuses a checkpoint of tokens, and one of other text.
    text = build_hf_data_loader("sample", None, tokenizer, 1, 8, 0, 1, fingerprint="aaaa")
    with pytest.raises(UserError, match="tokenized data then, fingerprint aaaa now.*training.allow_data_change"):
        text.load_state_dict(state)
    other_text = build_hf_data_loader("sample", None, tokenizer, 1, 8, 0, 1, fingerprint="bbbb").state_dict()
    with pytest.raises(UserError, match="fingerprint bbbb then, fingerprint aaaa now"):
        text.load_state_dict(other_text)


def test_dataset_record_of_each_kind(tokenizer, tmp_path, sample_tokens):
    tokens = dataset_record(
        job_config(
            "--training.dataset", "tokens", "--training.dataset_path", str(sample_tokens), "--training.data_seed", "5"
        ),
        tokenizer,
    )
    assert tokens == {
        "fingerprint": read_manifest(str(sample_tokens))["fingerprint"],
        "source": f"tokens {sample_tokens} (from sample)",
        "data_seed": 5,
    }
    sample = dataset_record(job_config(), tokenizer)
    assert sample["data_seed"] is None and sample["source"] == "sample" and len(sample["fingerprint"]) == 16
    assert dataset_record(job_config(), build_tokenizer(SENTENCEPIECE))["fingerprint"] != sample["fingerprint"]
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"text": "one"}) + "\n")
    first = dataset_record(job_config("--training.dataset", "text", "--training.dataset_path", str(data)), tokenizer)
    data.write_text(json.dumps({"text": "two"}) + "\n")
    second = dataset_record(job_config("--training.dataset", "text", "--training.dataset_path", str(data)), tokenizer)
    assert first["fingerprint"] != second["fingerprint"]
    assert dataset_record(job_config("--training.dataset", "c4"), tokenizer)["fingerprint"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.data_seed", "3"], "training.data_seed orders pre-tokenized data, but training.dataset is"),
        (["--training.allow_data_change"], "training.allow_data_change applies to resuming a checkpoint"),
        (["--training.dataset", "tokens"], "training.dataset 'tokens' needs training.dataset_path"),
    ],
)
def test_options_that_cannot_act_are_refused(argv, message):
    from torchtitan.config.preflight import preflight

    with pytest.raises(UserError, match=message):
        preflight(job_config(*argv), 1)


def test_pretokenize_help_runs():
    proc = processes.run([sys.executable, "-m", "torchtitan.tools.pretokenize", "--help"], cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "--workers" in proc.stdout


def _ranks_state(rank: int, world: int, folder: str) -> tuple[dict, list[int]]:
    import torch.distributed as dist

    tokenizer = build_tokenizer(TIKTOKEN)
    loader = build_tokens_data_loader(
        folder, tokenizer, TIKTOKEN, 2, 4, rank, world, seed=5, held_out_every=0, group=dist.group.WORLD
    )
    batches = iter(loader)
    read = [w for _ in range(3) for w in window_ids(next(batches), 5)]
    return loader.state_dict(), read


def test_the_state_is_gathered_over_the_ranks_and_names_every_window_read(tokenizer, tmp_path):
    from tests.distributed import run_workers

    folder = counting_folder(tmp_path / "c", tokenizer, 40 * 5, shard_tokens=1000)
    (state0, read0), (state1, read1) = run_workers(_ranks_state, world_size=2, args=(str(folder),))
    assert state0 == state1 and state0["windows"] == 2 * 3 * 2
    order = read_epoch_ids([tokens_loader(folder, tokenizer, 1, 4, 0, 1, seed=5)], 12, 5)
    assert sorted(read0 + read1) == sorted(order) and not set(read0) & set(read1)


def test_validation_batches_of_tokens_data_are_held_out_windows(tokenizer, sample_tokens):
    from torchtitan.training.validate import load_validation_batches

    job = job_config(
        "--training.dataset", "tokens", "--training.dataset_path", str(sample_tokens), "--training.seq_len", "31",
        "--validation.enable", "--validation.seq_len", "15", "--validation.batch_size", "3",
        "--validation.windows", "12",
    )  # fmt: skip
    manifest = read_manifest(str(sample_tokens))
    stored = np.empty(manifest["tokens"], dtype=np.int64)
    TokenArray(str(sample_tokens), manifest).read(0, manifest["tokens"], stored)
    batches = load_validation_batches(job, tokenizer, 0, 1)
    rows = [row.tolist() for inputs, _ in batches for row in inputs]
    # Held-out training windows 0, 20, 40, ... of 32 tokens, each giving two validation windows of 16.
    expected = [stored[w * 32 + p * 16 : w * 32 + p * 16 + 15].tolist() for w in range(0, 200, 20) for p in (0, 1)]
    assert len(batches) == 4 and rows == expected[:12]


def test_pretokenize_streams_a_hub_dataset_by_name_with_its_text_field(monkeypatch, tokenizer, tmp_path):
    import datasets

    calls = []
    local = tmp_path / "stand_in.jsonl"
    local.write_text("".join(json.dumps({"content": f"hub document {i}", "id": i}) + "\n" for i in range(5)))
    real_load_dataset = datasets.load_dataset

    def fake_load_dataset(path, **kwargs):  # records the hub request, serves a local stand-in
        calls.append((path, kwargs))
        return real_load_dataset("json", data_files=[str(local)], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    manifest = pretokenize(
        "someone/corpus", TIKTOKEN, str(tmp_path / "out"), hf_config="en", split="validation", text_field="content"
    )
    assert calls == [("someone/corpus", {"name": "en", "split": "validation", "streaming": True})]
    assert manifest["source"] == "hf:someone/corpus/en:validation:content" and manifest["documents"] == 5
    stored = np.empty(manifest["tokens"], dtype=np.int64)
    TokenArray(str(tmp_path / "out"), manifest).read(0, manifest["tokens"], stored)
    assert stored.tolist() == [i for d in range(5) for i in tokenizer.encode(f"hub document {d}", bos=True, eos=True)]
    with pytest.raises(UserError, match="neither sample, c4, an existing file or folder"):
        pretokenize("no_such_thing", TIKTOKEN, str(tmp_path / "other"))
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other.tmp-*"))


def test_train_py_on_tokens_records_them_resumes_in_another_layout_and_refuses_other_data(tmp_path, sample_tokens):
    """train.py on pre-tokenized data, the runs sharing their launches: one process (local batch 4, validation batches
    of 4) writes the data's record and saves at step 2; two processes (local batch 2, the same global batch,
    validation batches of 5) resume it and score the same 12 validation windows to the same loss; resuming onto
    other data (the sample text) is refused in one line."""
    from tests.helpers import by_step, metric_rows, run_dir, train

    tokens = [
        "--training.dataset",
        "tokens",
        "--training.dataset_path",
        str(sample_tokens),
        "--training.data_seed",
        "1",
    ]

    def run(name, nproc, batch_size, validation_batch_size):
        dump = tmp_path / name
        proc = train(
            dump,
            *tokens,
            *("--training.steps", "4", "--training.batch_size", str(batch_size)),
            *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--checkpoint.folder", str(dump / "ck")),
            *("--validation.enable", "--validation.freq", "2", "--validation.windows", "12"),
            *("--validation.batch_size", str(validation_batch_size), "--metrics.enable_tensorboard", "false"),
            *("--comm.init_timeout_seconds", "60"),
            nproc=nproc,
            cpu=True,
        )
        return by_step(metric_rows(run_dir(dump)), "validation/loss"), proc.stdout + proc.stderr

    straight, straight_log = run("straight", 1, 4, 4)
    record = json.loads((run_dir(tmp_path / "straight") / "dataset.json").read_text())
    assert record == {
        "fingerprint": read_manifest(str(sample_tokens))["fingerprint"],
        "source": f"tokens {sample_tokens} (from sample)",
        "data_seed": 1,
    }
    (tmp_path / "resumed" / "ck").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "ck" / "step-2", tmp_path / "resumed" / "ck" / "step-2")
    resumed, resumed_log = run("resumed", 2, 2, 5)
    assert "resumed from step 2" in resumed_log and sorted(resumed) == [4]
    scored = "validation: windows 0 to 11 of the held-out split (about 1 in 20 windows), 12 x 32 tokens"
    assert scored in straight_log and scored in resumed_log
    assert "validation at step 4:" in resumed_log and "(384 tokens)" in resumed_log.split("validation at step 4:")[1]
    # float32 on another layout: the training steps' sums differ in order only.
    assert resumed[4] == pytest.approx(straight[4], rel=1e-5)

    # The sample text where the checkpoint's run read tokens: refused, not trained on.
    text = [
        "--training.steps",
        "6",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.folder",
        str(tmp_path / "straight" / "ck"),
    ]
    proc = train(tmp_path / "straight", *text, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training.allow_data_change" in errors[0] and "tokenized data then" in errors[0]


def test_too_few_validation_windows_are_refused_before_any_worker_starts(sample_tokens):
    from torchtitan.config.preflight import preflight

    tokens = ["--training.dataset", "tokens", "--training.dataset_path", str(sample_tokens), "--validation.enable"]
    windows = len(TokenArray(str(sample_tokens), read_manifest(str(sample_tokens)))) // 33  # seq_len 32
    held_out = (windows + 19) // 20  # windows 0, 20, 40, ...
    preflight(job_config(*tokens, "--training.seq_len", "32", "--validation.windows", str(held_out)), 1)
    too_many = job_config(*tokens, "--training.seq_len", "32", "--validation.windows", str(held_out + 1))
    with pytest.raises(UserError) as error:
        preflight(too_many, 1)
    assert str(error.value) == (
        f"the held-out split (1 in 20 windows of 33 tokens) holds {held_out:,} validation windows of 33 tokens, fewer "
        f"than validation.windows {held_out + 1}; lower validation.windows or validation.held_out_every, or give more "
        "data"
    )
