"""The data loader: packing, the rank split of the data order contract, resume, epochs, local files, assets."""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import os
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests import processes
from tests.distributed import free_port
from tests.helpers import DEBUG_RUN, train_command
from torchtitan.datasets import build_hf_data_loader, build_tokenizer, hf_datasets
from torchtitan.errors import UserError

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets"
SAMPLE_JSONL = ASSETS / "data" / "sample" / "sample.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(str(ASSETS / "tokenizer" / "tiktoken_test.model"))


@pytest.fixture(scope="module")
def sample_stream(tokenizer) -> list[int]:
    """The sample corpus tokenized document by document, with BOS/EOS, and concatenated: the reference."""
    texts = [json.loads(line)["text"] for line in SAMPLE_JSONL.read_text(encoding="utf-8").splitlines()]
    return [t for text in texts for t in tokenizer.encode(text, bos=True, eos=True)]


def take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(loader, n))


def sample_loader(tokenizer, batch_size: int, seq_len: int, rank: int = 0, world: int = 1, infinite: bool = True):
    return build_hf_data_loader("sample", None, tokenizer, batch_size, seq_len, rank, world, infinite=infinite)


def global_batch(batches_per_rank: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([b[0] for b in batches_per_rank]), torch.cat([b[1] for b in batches_per_rank])


# ----------------------------------------------------------------------------------------------------------------
# Packing and the rank split


def test_windows_are_contiguous_slices_with_labels_shifted(tokenizer, sample_stream):
    batch_size, seq_len, steps = 3, 20, 5
    batches = take(sample_loader(tokenizer, batch_size, seq_len), steps)
    window = seq_len + 1
    for step, (inputs, labels) in enumerate(batches):
        assert inputs.dtype == labels.dtype == torch.long
        assert inputs.shape == labels.shape == (batch_size, seq_len)
        for row in range(batch_size):
            start = (step * batch_size + row) * window
            expected = torch.tensor(sample_stream[start : start + window])
            assert torch.equal(inputs[row], expected[:-1])
            assert torch.equal(labels[row], expected[1:])
    assert batches[0][0][0, 0].item() == tokenizer.bos_id  # the stream starts with the first document's BOS


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_split_each_global_batch_without_overlap(tokenizer, world):
    batch_size, seq_len, steps = 2, 12, 4
    single = take(sample_loader(tokenizer, batch_size * world, seq_len), steps)
    per_rank = [take(sample_loader(tokenizer, batch_size, seq_len, rank, world), steps) for rank in range(world)]
    for step in range(steps):
        inputs, labels = global_batch([per_rank[rank][step] for rank in range(world)])
        assert torch.equal(inputs, single[step][0]) and torch.equal(labels, single[step][1])
    rows = {tuple(b[0][i].tolist()) for rank in per_rank for b in rank for i in range(batch_size)}
    assert len(rows) == world * batch_size * steps  # every rank got different windows


def test_data_order_does_not_depend_on_the_seed(tokenizer, sample_stream):
    # training.seed seeds torch's global generator (and the weights); the data order is the stream's own.
    batch_size, seq_len = 2, 16
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        runs.append(torch.cat([inputs for inputs, _ in take(sample_loader(tokenizer, batch_size, seq_len), 3)]))
    assert torch.equal(runs[0], runs[1])
    window = seq_len + 1
    for row, inputs in enumerate(runs[1]):
        assert inputs.tolist() == sample_stream[row * window : row * window + seq_len]


def test_sentencepiece_tokenizer_packs_the_same_way():
    spm = build_tokenizer(str(ASSETS / "tokenizer" / "sentencepiece_test.model"))
    first = json.loads(SAMPLE_JSONL.read_text(encoding="utf-8").splitlines()[0])["text"]
    expected = spm.encode(first, bos=True, eos=True)[:9]
    inputs, labels = take(sample_loader(spm, 1, 8), 1)[0]
    assert inputs[0].tolist() == expected[:-1] and labels[0].tolist() == expected[1:]


# ----------------------------------------------------------------------------------------------------------------
# Checkpointable position


def test_resume_continues_exactly(tokenizer):
    batch_size, seq_len, before, after = 2, 16, 7, 5
    uninterrupted = take(sample_loader(tokenizer, batch_size, seq_len), before + after)
    first = sample_loader(tokenizer, batch_size, seq_len)
    take(first, before)
    state = first.state_dict()
    resumed = sample_loader(tokenizer, batch_size, seq_len)
    resumed.load_state_dict(state)
    for got, want in zip(take(resumed, after), uninterrupted[before:], strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_state_is_the_same_on_every_rank_and_world_size(tokenizer):
    seq_len, steps = 10, 6
    states = []
    for world, batch_size in [(1, 4), (2, 2), (4, 1)]:
        for rank in range(world):
            loader = sample_loader(tokenizer, batch_size, seq_len, rank, world)
            take(loader, steps)
            states.append(loader.state_dict())
    assert all(state == states[0] for state in states)
    assert json.loads(json.dumps(states[0])) == states[0]  # plain data: any checkpoint format can hold it
    assert states[0]["dataset_state"]["windows"] == steps * 4


def test_resume_on_a_different_world_size_with_the_same_global_batch(tokenizer):
    seq_len, before, after = 10, 5, 4
    reference = take(sample_loader(tokenizer, 4, seq_len), before + after)
    saver = sample_loader(tokenizer, 2, seq_len, rank=1, world=2)  # any rank's state is the global one
    take(saver, before)
    state = saver.state_dict()
    for world, batch_size in [(1, 4), (4, 1)]:
        resumed = []
        for rank in range(world):
            loader = sample_loader(tokenizer, batch_size, seq_len, rank, world)
            loader.load_state_dict(state)
            resumed.append(take(loader, after))
        for step in range(after):
            inputs, labels = global_batch([resumed[rank][step] for rank in range(world)])
            assert torch.equal(inputs, reference[before + step][0])
            assert torch.equal(labels, reference[before + step][1])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_survives_a_dcp_round_trip(tokenizer, tmp_path):
    import torch.distributed.checkpoint as dcp

    batch_size, seq_len = 2, 8
    loader = sample_loader(tokenizer, batch_size, seq_len)
    expected = take(sample_loader(tokenizer, batch_size, seq_len), 6)[3:]
    take(loader, 3)
    dcp.save({"dataloader": loader.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh = sample_loader(tokenizer, batch_size, seq_len)
    template = {"dataloader": fresh.state_dict()}  # what a checkpoint manager hands to dcp.load
    dcp.load(template, checkpoint_id=str(tmp_path / "ckpt"))
    fresh.load_state_dict(template["dataloader"])
    for got, want in zip(take(fresh, 3), expected, strict=True):
        assert torch.equal(got[0], want[0])


# ----------------------------------------------------------------------------------------------------------------
# Epochs


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


SMALL_TEXTS = [f"Document number {i} says {'hello ' * (i + 1)}." for i in range(5)]


def test_infinite_loader_loops_over_the_data_and_counts_epochs(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "small.jsonl", SMALL_TEXTS)
    one_epoch = [t for text in SMALL_TEXTS for t in tokenizer.encode(text, bos=True, eos=True)]
    batch_size, seq_len = 2, 7
    steps = 3 * len(one_epoch) // (batch_size * (seq_len + 1)) + 1  # a little over three epochs
    loader = build_hf_data_loader("text", str(path), tokenizer, batch_size, seq_len, 0, 1)
    batches = take(loader, steps)
    stream = one_epoch * 4
    window = seq_len + 1
    for step, (inputs, _) in enumerate(batches):
        for row in range(batch_size):
            start = (step * batch_size + row) * window
            assert inputs[row].tolist() == stream[start : start + seq_len]
    assert loader.state_dict()["dataset_state"]["epoch"] == 3
    # Resuming mid-way through a later epoch lands on the same tokens.
    resumed = build_hf_data_loader("text", str(path), tokenizer, batch_size, seq_len, 0, 1)
    resumed.load_state_dict(loader.state_dict())
    start = steps * batch_size * window
    assert take(resumed, 1)[0][0][0].tolist() == stream[start : start + seq_len]


def test_finite_loader_stops_on_the_last_full_global_batch(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "small.jsonl", SMALL_TEXTS)
    total = sum(len(tokenizer.encode(text, bos=True, eos=True)) for text in SMALL_TEXTS)
    batch_size, seq_len, world = 1, 5, 2
    expected_steps = total // (seq_len + 1) // (batch_size * world)
    loaders = [
        build_hf_data_loader("text", str(path), tokenizer, batch_size, seq_len, rank, world, infinite=False)
        for rank in range(world)
    ]
    first_pass = [list(loader) for loader in loaders]
    assert [len(p) for p in first_pass] == [expected_steps] * world
    second_pass = list(loaders[0])  # a new pass starts the next epoch from the first document
    assert [b[0].tolist() for b in second_pass] == [b[0].tolist() for b in first_pass[0]]
    assert loaders[0].state_dict()["dataset_state"]["epoch"] == 2


def test_data_without_text_is_a_user_error(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    loader = build_hf_data_loader("text", str(path), tokenizer, 1, 4, 0, 1)
    with pytest.raises(UserError, match="holds no text"):
        take(loader, 1)


# ----------------------------------------------------------------------------------------------------------------
# Local files and the dataset names


def documents_of(dataset_name: str, dataset_path: str) -> list[str]:
    source = hf_datasets.load_documents(dataset_name, dataset_path)
    return [text for text, _ in source.documents("")]


def test_local_file_formats(tmp_path):
    texts = ["first document", "second — ünïcode", "third"]
    jsonl = _write_jsonl(tmp_path / "a.jsonl", texts)
    assert documents_of("text", str(jsonl)) == texts
    json_array = tmp_path / "array.json"
    json_array.write_text(json.dumps([{"text": t, "id": i} for i, t in enumerate(texts)]), encoding="utf-8")
    assert documents_of("text", str(json_array)) == texts
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    assert documents_of("text", str(gz)) == texts
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts, "score": [1.0, 2.0, 3.0]}), parquet)
    assert documents_of("text", str(parquet)) == texts
    txt = tmp_path / "e.txt"
    txt.write_text("para one line one\npara one line two\n\npara two\n\n  \n\npara three\n", encoding="utf-8")
    paragraphs = ["para one line one\npara one line two", "para two", "para three\n"]  # blank ones are skipped
    assert documents_of("text", str(txt)) == paragraphs
    txt_gz = tmp_path / "f.txt.gz"
    txt_gz.write_bytes(gzip.compress(txt.read_bytes()))
    assert documents_of("text", str(txt_gz)) == paragraphs


def test_local_folder_is_read_recursively_in_name_order(tmp_path):
    (tmp_path / "b").mkdir()
    _write_jsonl(tmp_path / "b" / "part2.jsonl", ["from b"])
    _write_jsonl(tmp_path / "a.jsonl", ["from a"])
    (tmp_path / ".cache").mkdir()
    _write_jsonl(tmp_path / ".cache" / "hidden.jsonl", ["hidden"])
    (tmp_path / "notes.md").write_text("not data")
    assert documents_of("text", str(tmp_path)) == ["from a", "from b"]
    assert documents_of("sample", str(tmp_path)) == ["from a", "from b"]  # a local copy of any dataset


def test_local_c4_copy_reads_english_train_files_only(tmp_path):
    (tmp_path / "en").mkdir()
    (tmp_path / "realnewslike").mkdir()
    for name, text in [
        ("c4-train.00001-of-00002", "train two"),
        ("c4-train.00000-of-00002", "train one"),
        ("c4-validation.00000-of-00001", "validation"),
    ]:
        (tmp_path / "en" / f"{name}.json.gz").write_bytes(gzip.compress(json.dumps({"text": text}).encode()))
    (tmp_path / "realnewslike" / "c4-train.00000-of-00001.json.gz").write_bytes(
        gzip.compress(json.dumps({"text": "news"}).encode())
    )
    assert documents_of("c4", str(tmp_path)) == ["train one", "train two"]


def test_c4_streams_the_english_train_split_from_the_hub(monkeypatch, tmp_path):
    import datasets

    calls = []
    local = _write_jsonl(tmp_path / "stand_in.jsonl", ["hub document"])
    real_load_dataset = datasets.load_dataset

    def fake_load_dataset(path, **kwargs):  # records the hub request, serves a local stand-in
        calls.append((path, kwargs))
        return real_load_dataset("json", data_files=[str(local)], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert documents_of("c4", None) == ["hub document"]
    assert calls == [("allenai/c4", {"name": "en", "split": "train", "streaming": True})]


def test_dataset_user_errors(tokenizer, tmp_path):
    (tmp_path / "mixed").mkdir()
    _write_jsonl(tmp_path / "mixed" / "a.jsonl", ["x"])
    (tmp_path / "mixed" / "b.txt").write_text("y")
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "readme.md").write_text("z")
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text(json.dumps({"content": "x"}) + "\n")
    cases = [
        (lambda: build_hf_data_loader("wikipedia", None, tokenizer, 1, 4, 0, 1), "training.dataset"),
        (lambda: build_hf_data_loader("text", None, tokenizer, 1, 4, 0, 1), "training.dataset_path"),
        (lambda: build_hf_data_loader("text", str(tmp_path / "nope"), tokenizer, 1, 4, 0, 1), "does not exist"),
        (lambda: build_hf_data_loader("c4", str(tmp_path / "nope"), tokenizer, 1, 4, 0, 1), "does not exist"),
        (lambda: build_hf_data_loader("text", str(tmp_path / "mixed"), tokenizer, 1, 4, 0, 1), "mixes"),
        (lambda: build_hf_data_loader("text", str(tmp_path / "nodata"), tokenizer, 1, 4, 0, 1), "holds no"),
        (lambda: take(build_hf_data_loader("text", str(no_text), tokenizer, 1, 4, 0, 1), 1), "'text' column"),
    ]
    for call, words in cases:
        with pytest.raises(UserError, match=words) as info:
            call()
        assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------------------------
# An unreachable hub: one line from rank 0, exit 2, never a real external host


def _hub_off_environment(tmp_path: Path, offline_switches: bool) -> dict[str, str]:
    """The hub made unreachable: its endpoint a local port nobody listens on, optionally the offline switches."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key.upper() not in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        HF_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        HF_HOME=str(tmp_path / "hf_home"),
    )
    if offline_switches:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


@pytest.mark.parametrize("nproc, offline_switches", [(1, False), (2, True)], ids=["refused", "offline_torchrun"])
def test_unreachable_hub_is_one_line_from_rank_0_and_exit_2(tmp_path, nproc, offline_switches):
    command = train_command([*DEBUG_RUN, "--job.dump_folder", str(tmp_path), "--training.dataset", "c4"], nproc)
    proc = processes.run(command, cwd=REPO, env=_hub_off_environment(tmp_path, offline_switches), timeout=300)
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-4000:]
    reason = "HF_HUB_OFFLINE is set" if offline_switches else "Connection refused"
    assert "allenai/c4" in errors[0] and reason in errors[0] and "--training.dataset_path" in errors[0], errors[0]
    if nproc == 1:
        assert proc.returncode == 2 and "Traceback" not in output, output[-4000:]
    else:
        # A worker stopped with the user-error code (torchrun may end the other with SIGTERM once one has exited,
        # so how many report code 2 depends on timing); torchrun's own summary follows.
        assert "exitcode  : 2" in output, output[-4000:]
    assert not (tmp_path / "tb").exists()


def test_hub_failing_while_loading_is_a_user_error(tmp_path):
    # Past preflight (e.g. the hub fails between the check and the load): the loader says the same in one line.
    script = textwrap.dedent(
        """
        from torchtitan.datasets.hf_datasets import load_documents
        from torchtitan.errors import UserError
        try:
            load_documents("c4", None)
        except UserError as e:
            print("USER ERROR:", e)
        """
    )
    proc = processes.run(
        [sys.executable, "-c", script], cwd=REPO, env=_hub_off_environment(tmp_path, True), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("USER ERROR:")]
    assert len(lines) == 1 and "Couldn't reach 'allenai/c4'" in lines[0] and "training.dataset_path" in lines[0], (
        proc.stdout + proc.stderr[-3000:]
    )


# ----------------------------------------------------------------------------------------------------------------
# Bundled assets


def test_make_assets_reproduces_the_committed_assets(tmp_path):
    """One fresh run of the script (about 3 s) must give the committed bytes: the script is deterministic."""
    out = tmp_path / "assets"
    made = processes.run([sys.executable, str(REPO / "scripts" / "make_assets.py"), "--out", str(out)], timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("make_assets", REPO / "scripts" / "make_assets.py")
    make_assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_assets)
    relpaths = [make_assets.SAMPLE_RELPATH, make_assets.TIKTOKEN_RELPATH, make_assets.SENTENCEPIECE_RELPATH]
    for relpath in relpaths:
        assert (out / relpath).read_bytes() == (ASSETS / relpath).read_bytes(), relpath
    assert 1_000_000 <= (ASSETS / make_assets.SAMPLE_RELPATH).stat().st_size <= 3_000_000
