"""Validation: the held-out split, the loss under every data-parallel and tensor-parallel layout, and train.py runs
with validation on (identical training, resume, the logged tags)."""

from __future__ import annotations

import itertools
import json
import shutil
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_workers
from tests.helpers import (
    DEBUG_RUN,
    ROOT,
    SEQ_LEN,
    TINY,
    by_step,
    event_tags,
    job_config,
    materialize,
    meta_model,
    metric_rows,
    run_dir,
    train,
)
from torchtitan.config.job_config import JobConfig
from torchtitan.datasets import DocumentSplit, build_hf_data_loader, build_tokenizer
from torchtitan.datasets.hf_datasets import SAMPLE_DATA_DIR, is_held_out
from torchtitan.datasets.tokens import ShardWriter, TokenArray, read_manifest, write_manifest
from torchtitan.errors import UserError
from torchtitan.parallelisms import ParallelDims, parallelize_llama
from torchtitan.training.validate import load_validation_batches, training_split, validation_data, validation_loss

TOKENIZER = ROOT / "assets" / "tokenizer" / "tiktoken_test.model"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(str(TOKENIZER))


def stream_of(loader) -> list[int]:
    """Every token a finite loader serves, window after window (inputs plus each window's last label)."""
    tokens = []
    for inputs, labels in loader:
        for row in range(len(inputs)):
            tokens += inputs[row].tolist() + labels[row, -1:].tolist()
    return tokens


def encoded(tokenizer, texts: list[str]) -> list[int]:
    return [t for text in texts for t in tokenizer.encode(text, bos=True, eos=True)]


# ----------------------------------------------------------------------------------------------------------------
# The held-out split


def test_held_out_split_of_the_sample_never_overlaps_the_training_stream(tokenizer):
    config = JobConfig.parse_args(["--validation.enable"])
    every = config.validation.held_out_every
    training_part, (_, _, held_out_part) = training_split(config), validation_data(config)  # what train.py reads
    assert training_part == DocumentSplit(every) and held_out_part == DocumentSplit(every, held_out=True)
    texts = [json.loads(line)["text"] for line in (SAMPLE_DATA_DIR / "sample.jsonl").read_text("utf-8").splitlines()]
    held = [text for text in texts if is_held_out(text, every)]
    kept = [text for text in texts if not is_held_out(text, every)]
    # About one in `every`, and a repeated text sits on one side only (the sample repeats some documents).
    assert len(texts) / every * 0.8 < len(held) < len(texts) / every * 1.2
    assert len(set(texts)) < len(texts) and not set(held) & set(kept)

    # One whole pass of each stream: exactly the kept (held-out) documents in order, minus the dropped last batch.
    batch_size, seq_len = 16, 255
    training = build_hf_data_loader(
        "sample", None, tokenizer, batch_size, seq_len, 0, 1, infinite=False, split=training_part
    )
    held_out = build_hf_data_loader(
        "sample", None, tokenizer, batch_size, seq_len, 0, 1, infinite=False, split=held_out_part
    )
    for loader, texts_in_order in ((training, kept), (held_out, held)):
        expected = encoded(tokenizer, texts_in_order)
        got = stream_of(loader)
        assert len(expected) - batch_size * (seq_len + 1) < len(got) <= len(expected)
        assert got == expected[: len(got)]


def test_split_streams_resume_and_loop_like_the_whole_stream(tokenizer, tmp_path):
    texts = [f"document {i}: " + "word " * (i % 7 + 1) for i in range(60)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    split = DocumentSplit(every=4)
    kept = [t for t in texts if not is_held_out(t, 4)]
    assert 0 < len(texts) - len(kept) < len(texts)

    def loader():
        return build_hf_data_loader("text", str(path), tokenizer, 2, 9, 0, 1, split=split)

    # Two and a half epochs of the training stream are the kept documents, over and over.
    steps = 5 * len(encoded(tokenizer, kept)) // (2 * 2 * 10)
    straight = list(itertools.islice(loader(), steps))
    flat = [
        t for inputs, labels in straight for row in range(2) for t in inputs[row].tolist() + labels[row, -1:].tolist()
    ]
    assert flat == (encoded(tokenizer, kept) * 3)[: len(flat)]
    # Resumed from a state in the middle of the second epoch: the same batches.
    first = loader()
    list(itertools.islice(first, steps // 2))
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict()["readers"]["0"]["epoch"] == 1
    for got, want in zip(itertools.islice(resumed, steps - steps // 2), straight[steps // 2 :], strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_validation_data_and_its_user_errors(tokenizer, tmp_path):
    def config(*argv):
        return JobConfig.parse_args(["--validation.enable", *argv])

    assert validation_data(config()) == ("sample", None, DocumentSplit(20, held_out=True))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "held-out text"}) + "\n")
    assert validation_data(config("--validation.dataset", "text", "--validation.dataset_path", str(other))) == (
        "text",
        str(other),
        DocumentSplit(),  # other data is read whole
    )
    held = next(f"text {i}" for i in range(100) if is_held_out(f"text {i}", 2))
    only_held_out = tmp_path / "held.jsonl"
    only_held_out.write_text(json.dumps({"text": held}) + "\n")
    cases = [
        (
            lambda: next(
                iter(build_hf_data_loader("text", str(only_held_out), tokenizer, 1, 4, 0, 1, split=DocumentSplit(2)))
            ),
            "no document outside the held-out split",
        ),
        (
            lambda: validation_data(config("--validation.dataset_path", str(SAMPLE_DATA_DIR))),
            "name the training data .the same file '.*sample.jsonl'.; remove them to validate on its held-out split",
        ),
        (lambda: config("--validation.held_out_every", "1"), "validation.held_out_every"),
        (lambda: config("--validation.seq_len", "4096"), "validation.seq_len"),
        (lambda: config("--validation.dataset_path", str(tmp_path / "nope")), "validation.dataset_path"),
        (lambda: validation_data(config("--validation.held_out_every", "0")), "validation.held_out_every is 0"),
        (lambda: validation_data(config("--validation.dataset", "wiki")), "validation.dataset 'wiki'"),
        (lambda: validation_data(config("--validation.dataset", "text")), "validation.dataset_path"),
        (lambda: validation_data(config("--validation.dataset", "tokens")), "validation.dataset_path"),
        (
            lambda: load_validation_batches(
                config("--validation.dataset", "text", "--validation.dataset_path", str(other)), tokenizer, 0, 1
            ),
            "less than one batch",
        ),
    ]
    for call, words in cases:
        with pytest.raises(UserError, match=words) as info:
            call()
        assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------------------------
# The loss under parallel layouts


def validation_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12, SEQ_LEN + 1), generator=generator)
    return [(b[:, :-1], b[:, 1:]) for b in tokens]


def reference_loss() -> float:
    """Plain cross-entropy over every token of every batch in one process: the definition."""
    model = materialize(meta_model())
    with torch.no_grad():
        inputs = torch.cat([b[0] for b in validation_batches()])
        labels = torch.cat([b[1] for b in validation_batches()])
        return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()


# name -> (world size, (dp_replicate, dp_shard, tp), rows of each 12-row batch per data-parallel rank, job config
# sections). Unequal shares: a mean of the ranks' means would be off.
LAYOUTS = {
    "one_process": (1, (1, 1, 1), [12], {}),
    "fsdp2_uneven": (2, (1, 2, 1), [8, 4], {}),
    "tp2": (2, (1, 1, 2), [12], {}),
    "tp2_selective_op_ac": (
        2,
        (1, 1, 2),
        [12],
        {"activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"}},
    ),
    "fsdp2_full_ac": (2, (1, 2, 1), [4, 8], {"activation_checkpoint": {"mode": "full"}}),
    "fsdp2_x_tp2": (4, (1, 2, 2), [8, 4], {}),
    "hsdp2x2": (4, (2, 2, 1), [5, 3, 2, 2], {}),
    # The chunked loss, as training computes it (5 uneven chunks of each batch's tokens).
    "one_process_chunked_loss": (1, (1, 1, 1), [12], {"loss": {"num_chunks": 5}}),
    "tp2_chunked_loss": (2, (1, 1, 2), [12], {"loss": {"num_chunks": 5}}),
    "fsdp2_x_tp2_chunked_loss": (4, (1, 2, 2), [8, 4], {"loss": {"num_chunks": 5}}),
}


def _validate_layout(world_size: int, name: str) -> dict:
    _, degrees, shares, sections = LAYOUTS[name]
    dims = ParallelDims(*degrees, world_size, enable_loss_parallel=True)
    mesh = dims.build_mesh("cpu")
    config = job_config(**sections)
    model = materialize(parallelize_llama(meta_model(), mesh, dims, config))
    dp_rank, _ = dims.dp_rank_and_degree(mesh)
    start = sum(shares[:dp_rank])
    mine = [(x[start : start + shares[dp_rank]], y[start : start + shares[dp_rank]]) for x, y in validation_batches()]
    dp_group = dims.dp_mesh(mesh).get_group() if dims.dp_enabled else None
    rng_before = torch.get_rng_state()
    loss, tokens = validation_loss(model, mine, dims, dp_group, torch.device("cpu"), config.loss.num_chunks)
    return {
        "loss": loss,
        "tokens": tokens,
        "training_mode": model.training,
        "no_grads": all(p.grad is None for p in model.parameters()),
        "rng_untouched": torch.equal(torch.get_rng_state(), rng_before),
    }


def _validate_layouts(rank: int, world_size: int, names: list[str]) -> dict:
    return {name: _validate_layout(world_size, name) for name in names}


@pytest.fixture(scope="module")
def layout_results() -> dict:
    """Every layout's result; one launch per world size."""
    results = {}
    for world_size in sorted({layout[0] for layout in LAYOUTS.values()}):
        names = [name for name, layout in LAYOUTS.items() if layout[0] == world_size]
        if world_size == 1:
            results.update(_validate_layouts(0, 1, names))
            continue
        per_rank = run_workers(_validate_layouts, world_size=world_size, args=(names,))
        for name in names:
            assert all(rank[name] == per_rank[0][name] for rank in per_rank), name  # one global number
            results[name] = per_rank[0][name]
    return results


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_validation_loss_matches_one_process(layout_results, name):
    # float64 throughout: layouts differ from the definition only in the order of floating-point sums.
    result = layout_results[name]
    assert result["loss"] == pytest.approx(reference_loss(), rel=1e-10)
    assert result["tokens"] == 2 * 12 * SEQ_LEN
    assert result["training_mode"] and result["no_grads"] and result["rng_untouched"]


def test_validation_loss_is_a_token_weighted_mean_without_a_process_group():
    model = materialize(meta_model())
    batches = validation_batches()
    uneven = [batches[0], (batches[1][0][:3], batches[1][1][:3])]  # 12 rows, then 3
    loss, tokens = validation_loss(model, uneven, ParallelDims(1, 1, 1, 1), None, torch.device("cpu"))
    with torch.no_grad():
        inputs = torch.cat([b[0] for b in uneven])
        expected = F.cross_entropy(model(inputs).flatten(0, 1), torch.cat([b[1] for b in uneven]).flatten())
    assert tokens == 15 * SEQ_LEN and loss == pytest.approx(expected.item(), rel=1e-12)
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------------------------------------------
# train.py with validation on


def jsonl(path) -> list[dict]:
    return metric_rows(run_dir(path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, debug_run):
    """Three 6-step runs of the debug model: without validation (the suite's shared run), and, checkpointing every 3
    steps, with validation every 4 steps and that run resumed from its step-3 checkpoint."""
    root = tmp_path_factory.mktemp("validation_runs")

    def run(name, *extra):
        path = root / name
        proc = train(
            path,
            "--checkpoint.enable_checkpoint",
            "--checkpoint.interval",
            "3",
            "--checkpoint.folder",
            str(path / "ckpt"),
            *extra,
        )
        return path, proc.stderr

    validation = ["--validation.enable", "--validation.freq", "4", "--validation.steps", "3"]
    plain = debug_run[0], debug_run[1].stderr
    validated = run("validated", *validation)
    (root / "resumed" / "ckpt").mkdir(parents=True)
    shutil.copytree(validated[0] / "ckpt" / "step-3", root / "resumed" / "ckpt" / "step-3")
    resumed = run("resumed", *validation)
    return plain, validated, resumed


def test_validation_leaves_training_bit_identical(runs):
    (plain, _), (validated, _), _ = runs
    tag = "loss_metrics/global_avg_loss"
    assert by_step(jsonl(validated), tag) == by_step(jsonl(plain), tag)
    assert len(by_step(jsonl(plain), tag)) == 6
    assert by_step(jsonl(plain), "validation/loss") == {}


def test_validation_is_logged_at_its_steps_and_the_last(runs):
    _, (validated, log), _ = runs
    rows = jsonl(validated)
    losses, perplexities = by_step(rows, "validation/loss"), by_step(rows, "validation/perplexity")
    assert sorted(losses) == sorted(perplexities) == [4, 6]
    for step, loss in losses.items():
        assert perplexities[step] == pytest.approx(torch.tensor(loss, dtype=torch.float64).exp().item(), rel=1e-12)
    assert losses[6] < losses[4]  # the model learns something that carries over to unseen text
    assert {"validation/loss", "validation/perplexity"} <= event_tags(run_dir(validated))
    assert f"validation at step 4: loss {losses[4]:.8f}" in log and "validation at step 6:" in log
    assert "3 batches of 2 x 32 tokens from the held-out split" in log


def test_resume_with_validation_logs_identical_validation_losses(runs):
    _, (validated, _), (resumed, log) = runs
    assert "resumed from step 3" in log
    straight, again = jsonl(validated), jsonl(resumed)
    for tag in ("validation/loss", "validation/perplexity", "loss_metrics/global_avg_loss"):
        assert by_step(again, tag) == {s: v for s, v in by_step(straight, tag).items() if s > 3}, tag
    assert sorted(by_step(again, "validation/loss")) == [4, 6]


def test_help_lists_the_validation_table(capsys):
    with pytest.raises(SystemExit):
        JobConfig.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "[validation]" in out and "--validation.held_out_every" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--validation.held_out_every", "0"], "validation.held_out_every is 0"),
        # 64 x 513 tokens: more than the whole held-out split of the sample (about 23,000 tokens)
        (["--validation.batch_size", "64", "--training.seq_len", "512"], "less than one batch"),
        (["--validation.dataset_path", str(SAMPLE_DATA_DIR)], "name the training data (the same file"),
        (["--validation.windows", "8"], "validation.windows counts windows of tokens data"),
    ],
)
def test_train_py_reports_validation_mistakes_before_training(tmp_path, monkeypatch, capsys, args, message):
    import train as train_module

    monkeypatch.setattr(
        sys, "argv", ["train.py", *DEBUG_RUN, "--job.dump_folder", str(tmp_path), "--validation.enable", *args]
    )
    monkeypatch.chdir(ROOT)
    assert train_module.run() == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("[titan]")]
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "tb").exists()


# ----------------------------------------------------------------------------------------------------------------
# Tokens data: one set of validation windows for every layout

VALIDATION_WINDOWS = 7  # over 3 ranks: 2, 2 and 3 windows, so that some ranks end with a padding batch


def random_tokens_folder(folder, tokenizer, windows: int) -> str:
    """A tokens folder of ``windows`` training windows of SEQ_LEN + 1 random ids the tiny model reads."""
    folder.mkdir(parents=True)
    writer = ShardWriter(folder, np.dtype("<u2"), shard_tokens=50)  # windows cross shards
    ids = np.random.default_rng(3).integers(0, TINY.vocab_size, windows * (SEQ_LEN + 1) + 5)
    writer.add(ids)
    write_manifest(folder, writer, tokenizer, str(TOKENIZER), "random", documents=1)
    return str(folder)


def tokens_validation_job(folder: str, batch_size: int, *extra: str) -> JobConfig:
    return job_config(
        "--model.tokenizer_path", str(TOKENIZER), "--training.dataset", "tokens", "--training.dataset_path", folder,
        "--training.seq_len", str(SEQ_LEN), "--validation.enable", "--validation.held_out_every", "4",
        "--validation.windows", str(VALIDATION_WINDOWS), "--validation.batch_size", str(batch_size), *extra,
    )  # fmt: skip


def _score_validation_windows(rank: int, world_size: int, folder: str, batch_size: int) -> dict:
    """This rank's scored rows and the global loss, with the tiny model sharded by FSDP2 over every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import fsdp
    from torchtitan.training.loss import IGNORE_INDEX

    tokenizer = build_tokenizer(str(TOKENIZER))
    group = dist.group.WORLD if world_size > 1 else None
    batches = load_validation_batches(tokens_validation_job(folder, batch_size), tokenizer, rank, world_size, group)
    model = meta_model()
    if world_size > 1:
        model = fsdp(model, init_device_mesh("cpu", (world_size,)))
    model = materialize(model)
    dims = ParallelDims(1, world_size, 1, world_size)
    loss, tokens = validation_loss(model, batches, dims, group, torch.device("cpu"))
    scored = [row.tolist() for inputs, labels in batches for row, y in zip(inputs, labels) if (y != IGNORE_INDEX).all()]
    padding = sum(bool((labels == IGNORE_INDEX).all()) for _, labels in batches)
    return {"rows": scored, "batches": len(batches), "padding": padding, "loss": loss, "tokens": tokens}


def _score_at_batch_sizes(rank: int, world_size: int, folder: str, batch_sizes: list[int]) -> list[dict]:
    return [_score_validation_windows(rank, world_size, folder, batch_size) for batch_size in batch_sizes]


def test_tokens_validation_scores_the_same_windows_and_loss_at_any_data_parallel_degree(tokenizer, tmp_path):
    # 40 training windows, 10 of them held out (every 4th), each cut into one validation window.
    folder = random_tokens_folder(tmp_path / "tokens", tokenizer, 40)
    stored = np.empty(40 * (SEQ_LEN + 1), dtype=np.int64)
    manifest = read_manifest(folder)
    TokenArray(folder, manifest).read(0, len(stored), stored)
    held_out = [stored[w * (SEQ_LEN + 1) : w * (SEQ_LEN + 1) + SEQ_LEN].tolist() for w in range(0, 40, 4)]
    expected = held_out[:VALIDATION_WINDOWS]  # the first windows by index, whatever the layout

    one = _score_validation_windows(0, 1, folder, 4)
    assert one["rows"] == expected and one["batches"] == 2 and one["tokens"] == VALIDATION_WINDOWS * SEQ_LEN
    for world_size, batch_sizes in ((2, [3]), (3, [1, 2])):  # one launch per world size
        per_rank = run_workers(_score_at_batch_sizes, world_size=world_size, args=(folder, batch_sizes))
        for i, batch_size in enumerate(batch_sizes):
            ranks = [results[i] for results in per_rank]
            # Rank r holds a contiguous share; in rank order they are the same windows, each once.
            assert [row for rank in ranks for row in rank["rows"]] == expected, (world_size, batch_size)
            assert len({rank["batches"] for rank in ranks}) == 1  # as many forwards on every rank: no rank waits
            # Shares of 2, 2 and 3 windows in batches of 1: the first two ranks end with a batch of padding.
            assert sum(rank["padding"] for rank in ranks) == (2 if batch_size == 1 else 0)
            for rank in ranks:
                assert rank["tokens"] == one["tokens"]
                assert rank["loss"] == pytest.approx(one["loss"], rel=1e-12)  # float64: only the sums' order differs


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--training.dataset", "tokens", "--training.dataset_path", "TOKENS", "--validation.steps", "3"],
            "validation.steps counts batches of text data, but validation reads tokens data, scored by "
            "validation.windows",
        ),
        (
            ["--validation.windows", "8"],
            "validation.windows counts windows of tokens data, but validation reads sample",
        ),
    ],
)
def test_the_option_that_does_not_count_for_the_data_is_refused(tokenizer, tmp_path, argv, message):
    folder = random_tokens_folder(tmp_path / "tokens", tokenizer, 8)
    argv = [folder if arg == "TOKENS" else arg for arg in argv]
    with pytest.raises(UserError, match=message) as error:
        JobConfig.parse_args(["--validation.enable", *argv])
    assert "\n" not in str(error.value)
    JobConfig.parse_args(argv)  # validation off: nothing is scored


def test_validation_data_that_names_the_training_data_is_refused(tokenizer, tmp_path):
    from torchtitan.tools.pretokenize import pretokenize

    def source(name: str, texts: list[str]) -> str:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        return str(path)

    train_text = source("train", [f"training document {i} " * 20 for i in range(30)])
    other_text = source("other", [f"other document {i} " * 20 for i in range(30)])
    trained = str(tmp_path / "trained_tokens")
    pretokenize(train_text, str(TOKENIZER), trained)
    copy = tmp_path / "copy_of_trained"
    shutil.copytree(trained, copy)  # the same tokens (fingerprint) in another folder
    (tmp_path / "link").symlink_to(trained)  # the same folder by another name
    (tmp_path / "text_link.jsonl").symlink_to(train_text)
    retokenized = str(tmp_path / "retokenized")  # the training source, tokenized again with other shards
    pretokenize(train_text, str(TOKENIZER), retokenized, shard_tokens=1000)
    other = str(tmp_path / "other_tokens")
    pretokenize(other_text, str(TOKENIZER), other)

    def validation(training: list[str], dataset: str, path: str):
        return validation_data(
            JobConfig.parse_args(
                ["--validation.enable", "--validation.dataset", dataset, "--validation.dataset_path", path, *training]
            )
        )

    tokens = ["--training.dataset", "tokens", "--training.dataset_path", trained]
    text = ["--training.dataset", "text", "--training.dataset_path", train_text]
    refused = [
        (tokens, "tokens", trained, f"the same tokens folder '{trained}'"),
        (tokens, "tokens", str(tmp_path / "link"), f"the same tokens folder '{trained}'"),
        (tokens, "tokens", str(copy), f"the same tokens fingerprint {read_manifest(trained)['fingerprint']}"),
        (tokens, "tokens", retokenized, f"the same tokens fingerprint {read_manifest(trained)['fingerprint']}"),
        (tokens, "text", str(tmp_path / "text_link.jsonl"), f"the same file '{train_text}'"),
        (text, "text", str(tmp_path / "text_link.jsonl"), f"the same file '{train_text}'"),
        (text, "tokens", retokenized, f"the same file '{train_text}'"),
        (text, "text", str(tmp_path), f"the same file '{train_text}'"),  # a folder that holds a training file
    ]
    for training, dataset, path, shared in refused:
        with pytest.raises(UserError) as error:
            validation(training, dataset, path)
        message = str(error.value)
        assert "\n" not in message and f"name the training data ({shared});" in message, (path, message)
    # Data that training never reads is read whole.
    assert validation(tokens, "tokens", other) == ("tokens", other, DocumentSplit())
    assert validation(text, "text", other_text) == ("text", other_text, DocumentSplit())


def test_pretokenized_held_out_documents_validate_a_run_that_never_reads_them(tokenizer, tmp_path):
    """pretokenize --held-out-every N [--held-out]: two folders with no document in common, the held-out one exactly
    the text loader's held-out split, accepted as validation data of the other (and of the text source)."""
    from torchtitan.tools.pretokenize import main as pretokenize_main

    texts = [f"document {i}: " + "word " * (i % 9 + 1) for i in range(80)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    kept, held = str(tmp_path / "kept"), str(tmp_path / "held")
    common = ["--source", str(source), "--tokenizer", str(TOKENIZER), "--held-out-every", "4"]
    assert pretokenize_main([*common, "--out", kept]) == 0
    assert pretokenize_main([*common, "--out", held, "--held-out"]) == 0
    held_texts = [text for text in texts if is_held_out(text, 4)]
    kept_texts = [text for text in texts if not is_held_out(text, 4)]
    for folder, part, held_out in ((kept, kept_texts, False), (held, held_texts, True)):
        manifest = read_manifest(folder)
        stored = np.empty(manifest["tokens"], dtype=np.int64)
        TokenArray(folder, manifest).read(0, manifest["tokens"], stored)
        assert stored.tolist() == encoded(tokenizer, part)  # the documents of each part, in the source's order
        assert manifest["documents"] == len(part) and manifest["documents_split"] == {"every": 4, "held_out": held_out}
    assert 0 < len(held_texts) < len(kept_texts)

    def validation(*argv: str):
        return validation_data(JobConfig.parse_args(["--validation.enable", "--validation.dataset", "tokens", *argv]))

    tokens = ["--training.dataset", "tokens", "--training.dataset_path", kept, "--validation.held_out_every", "0"]
    assert validation(*tokens, "--validation.dataset_path", held) == ("tokens", held, DocumentSplit())
    text = ["--training.dataset", "text", "--training.dataset_path", str(source)]
    # The text loader at validation.held_out_every 4 trains on the kept documents: the held-out ones are unseen.
    assert validation(*text, "--validation.held_out_every", "4", "--validation.dataset_path", held)[1] == held
    for argv in (
        [*text, "--validation.held_out_every", "5", "--validation.dataset_path", held],  # another split: shared
        [*text, "--validation.held_out_every", "4", "--validation.dataset_path", kept],
    ):
        with pytest.raises(UserError, match=f"name the training data .the same file '{source}'."):
            validation(*argv)
    lone = ["--source", str(source), "--tokenizer", str(TOKENIZER), "--out", str(tmp_path / "x"), "--held-out"]
    assert pretokenize_main(lone) == 2 and not (tmp_path / "x").exists()  # --held-out needs --held-out-every
