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

REPO = Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def sample_texts() -> list[str]:
    return [json.loads(line)["text"] for line in SAMPLE_JSONL.read_text(encoding="utf-8").splitlines()]


class CountingTokenizer:
    """A tokenizer that records the texts it encodes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: list[str] = []

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        self.texts.append(text)
        return self.tokenizer.encode(text, bos=bos, eos=eos)


def take(loader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(loader, n))


def sample_loader(
    tokenizer, batch_size: int, seq_len: int, rank: int = 0, world: int = 1, infinite: bool = True, workers: int = 0
):
    return build_hf_data_loader(
        "sample", None, tokenizer, batch_size, seq_len, rank, world, infinite=infinite, workers=workers
    )


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
def test_each_rank_packs_its_own_share_of_the_documents(tokenizer, sample_texts, world):
    batch_size, seq_len, steps = 2, 12, 4
    window = seq_len + 1
    for rank in range(world):
        share = [t for text in sample_texts[rank::world] for t in tokenizer.encode(text, bos=True, eos=True)]
        batches = take(sample_loader(tokenizer, batch_size, seq_len, rank, world), steps)
        rows = [inputs[row].tolist() + labels[row, -1:].tolist() for inputs, labels in batches for row in range(2)]
        assert [t for row in rows for t in row] == share[: steps * batch_size * window]


def test_a_rank_tokenizes_only_its_share(sample_texts):
    """Rank 0 of 4 tokenizes about what a single rank does for the same local batches, and ranks never overlap."""
    batch_size, seq_len, steps, world = 2, 64, 8, 4
    tokenized = {}
    for rank, ranks in [(0, 1), *((r, world) for r in range(world))]:
        counting = CountingTokenizer(build_tokenizer(str(ASSETS / "tokenizer" / "tiktoken_test.model")))
        take(sample_loader(counting, batch_size, seq_len, rank, ranks), steps)
        tokenized[rank, ranks] = counting.texts
    alone, rank0 = tokenized[0, 1], tokenized[0, world]
    assert 0.8 < len(rank0) / len(alone) < 1.25  # 4x before each rank read its own share
    assert len(rank0) < len(sample_texts) / world
    indices: dict[str, set[int]] = {}
    for index, text in enumerate(sample_texts):  # the sample repeats a few texts
        indices.setdefault(text, set()).add(index)
    for r in range(world):
        assert all(any(i % world == r for i in indices[text]) for text in tokenized[r, world])


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


def test_workers_take_turns_and_resume_exactly(tokenizer):
    """Two workers on one rank are readers 0 and 1 of 2 (as two ranks without workers); their batches alternate."""
    batch_size, seq_len, before, after = 2, 16, 3, 4
    per_reader = [
        take(sample_loader(tokenizer, batch_size, seq_len, rank, 2), (before + after + 1) // 2) for rank in (0, 1)
    ]
    alternating = [per_reader[step % 2][step // 2] for step in range(before + after)]
    first = sample_loader(tokenizer, batch_size, seq_len, workers=2)
    got = take(first, before)
    state = first.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain data, workers' state included
    resumed = sample_loader(tokenizer, batch_size, seq_len, workers=2)
    resumed.load_state_dict(state)
    got += take(resumed, after)
    for (inputs, labels), (want_inputs, want_labels) in zip(got, alternating, strict=True):
        assert torch.equal(inputs, want_inputs) and torch.equal(labels, want_labels)


def job_state(loaders) -> dict:
    """The state a checkpoint holds for a job whose ranks are ``loaders`` (gathered without a process group)."""
    return hf_datasets.merge_rank_states([loader.rank_state() for loader in loaders])


def test_state_holds_every_reader_of_the_job(tokenizer):
    world, steps = 3, 4
    loaders = [sample_loader(tokenizer, 2, 10, rank, world) for rank in range(world)]
    for loader in loaders:
        take(loader, steps)
    state = job_state(loaders)
    assert json.loads(json.dumps(state)) == state  # plain data: any checkpoint format can hold it
    assert state["layout"] == {"dp_degree": world, "workers": 0, "by_shard": False}  # one file: documents dealt
    assert sorted(state["readers"]) == ["0", "1", "2"] and sorted(state["ranks"]) == ["0", "1", "2"]
    assert all(position["windows"] == steps * 2 for position in state["readers"].values())
    # Each rank restores its own position from the job's state.
    for rank in range(world):
        resumed = sample_loader(tokenizer, 2, 10, rank, world)
        resumed.load_state_dict(state)
        want = take(sample_loader(tokenizer, 2, 10, rank, world), steps + 1)[-1]
        assert torch.equal(take(resumed, 1)[0][0], want[0])


@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_on_another_world_size_reads_no_token_twice(new_world, tmp_path):
    """From the furthest saved reader on: nothing read before is read again; what lay behind it is skipped."""
    # Reader 0 of 2 gets the long documents, reader 1 the short ones: reader 1 runs ahead in the document order.
    texts = [f"document {i} " + "word " * (20 if i % 2 == 0 else 2) for i in range(400)]
    path = _write_jsonl(tmp_path / "docs.jsonl", texts)
    tiktoken_model = str(ASSETS / "tokenizer" / "tiktoken_test.model")
    batch_size, seq_len, steps = 2, 15, 6

    def loader(rank, world, tokenizer):
        return build_hf_data_loader("text", str(path), tokenizer, batch_size, seq_len, rank, world)

    old = [CountingTokenizer(build_tokenizer(tiktoken_model)) for _ in range(2)]
    saved = [loader(rank, 2, old[rank]) for rank in range(2)]
    for rank_loader in saved:
        take(rank_loader, steps)
    state = job_state(saved)
    furthest = hf_datasets.furthest_position(list(state["readers"].values()))

    new = [CountingTokenizer(build_tokenizer(tiktoken_model)) for _ in range(new_world)]
    first_rows = []
    for rank in range(new_world):
        resumed = loader(rank, new_world, new[rank])
        resumed.load_state_dict(state)
        first_rows.append(take(resumed, steps)[0][0][0].tolist())
    # Every document read after the resume lies at or after the furthest position; only the one it was partway
    # through is read on (from its next token).
    read_after = {texts.index(text) for tokenizer in new for text in tokenizer.texts}
    assert min(read_after) >= furthest["doc_index"]
    read_before = {texts.index(text) for tokenizer in old for text in tokenizer.texts}
    assert read_before & read_after <= {furthest["doc_index"]}
    doc, offset = furthest["doc_index"], furthest["token_offset"]
    assert offset > 0  # the furthest reader stopped inside a document: its owner now goes on from the next token
    rest = new[0].tokenizer.encode(texts[doc], bos=True, eos=True)[offset:]
    assert first_rows[doc % new_world][: len(rest)] == rest[:seq_len]
    # The documents the slower reader had not reached yet are skipped this epoch.
    skipped = set(range(furthest["doc_index"])) - read_before
    assert skipped and not skipped & read_after


@pytest.mark.parametrize("before, after", [((2, 1), (1, 2)), ((1, 2), (2, 1))], ids=["2x1-to-1x2", "1x2-to-2x1"])
def test_resume_with_as_many_readers_in_another_layout_is_exact(tokenizer, before, after):
    """(ranks, workers): reader i is the same document subset in both layouts, so each goes on where it was."""
    batch_size, seq_len, taken, more = 2, 16, 3, 3
    # Reader i of 2 alone (rank i of 2 without workers): its whole stream of batches.
    per_reader = [take(sample_loader(tokenizer, batch_size, seq_len, i, 2), 2 * (taken + more)) for i in (0, 1)]
    ranks, workers = before
    saved = [sample_loader(tokenizer, batch_size, seq_len, r, ranks, workers=workers) for r in range(ranks)]
    for loader in saved:
        take(loader, taken)
    state = job_state(saved)
    read = {int(i): p["windows"] // batch_size for i, p in state["readers"].items()}  # batches per reader
    ranks, workers = after
    for rank in range(ranks):
        resumed = sample_loader(tokenizer, batch_size, seq_len, rank, ranks, workers=workers)
        resumed.load_state_dict(state)
        readers = [rank * workers + w for w in range(workers)]
        for step, (inputs, labels) in enumerate(take(resumed, more * workers)):
            reader = readers[step % workers]
            want_inputs, want_labels = per_reader[reader][read[reader] + step // workers]
            assert torch.equal(inputs, want_inputs) and torch.equal(labels, want_labels), (reader, step)


def test_resume_on_another_world_size_reaches_the_workers(tokenizer):
    """The checkpoint manager asks for a state before loading one, which starts workers; they must not keep the
    old start."""
    saved = [sample_loader(tokenizer, 2, 16, rank, 2) for rank in range(2)]
    for loader in saved:
        take(loader, 4)
    state = job_state(saved)
    furthest = hf_datasets.furthest_position(list(state["readers"].values()))
    resumed = sample_loader(tokenizer, 4, 16, workers=1)
    resumed.state_dict()
    resumed.load_state_dict(state)
    take(resumed, 1)
    assert resumed.rank_state()["readers"]["0"]["doc_index"] >= furthest["doc_index"]


def test_checkpoint_of_an_earlier_version_is_a_user_error(tokenizer):
    loader = sample_loader(tokenizer, 2, 8)
    with pytest.raises(UserError, match="earlier version"):
        loader.load_state_dict({"dataset_state": hf_datasets.start_position(), "_num_yielded": 3})


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
    assert loader.state_dict()["readers"]["0"]["epoch"] == 3
    # Resuming mid-way through a later epoch lands on the same tokens.
    resumed = build_hf_data_loader("text", str(path), tokenizer, batch_size, seq_len, 0, 1)
    resumed.load_state_dict(loader.state_dict())
    start = steps * batch_size * window
    assert take(resumed, 1)[0][0][0].tolist() == stream[start : start + seq_len]


def test_finite_loader_stops_on_the_last_full_batch_of_its_share(tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "small.jsonl", SMALL_TEXTS)
    batch_size, seq_len, world = 1, 5, 2
    loaders = [
        build_hf_data_loader("text", str(path), tokenizer, batch_size, seq_len, rank, world, infinite=False)
        for rank in range(world)
    ]
    first_pass = [list(loader) for loader in loaders]
    for rank, batches in enumerate(first_pass):
        share = sum(len(tokenizer.encode(text, bos=True, eos=True)) for text in SMALL_TEXTS[rank::world])
        assert len(batches) == share // (seq_len + 1) // batch_size
    second_pass = list(loaders[0])  # a new pass starts the next epoch from the first document
    assert [b[0].tolist() for b in second_pass] == [b[0].tolist() for b in first_pass[0]]
    assert loaders[0].dataset.state_dict()["epoch"] == 2


@pytest.mark.parametrize("workers", [0, 1])
def test_data_without_text_is_a_user_error(tokenizer, tmp_path, workers):
    path = _write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    loader = build_hf_data_loader("text", str(path), tokenizer, 1, 4, 0, 1, workers=workers)
    with pytest.raises(UserError, match="holds no text") as info:
        take(loader, 1)
    assert "\n" not in str(info.value)  # from a worker too: one line, not the worker's traceback


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
    one_document = _write_jsonl(tmp_path / "one.jsonl", ["the only document"])
    cases = [
        (lambda: build_hf_data_loader("wikipedia", None, tokenizer, 1, 4, 0, 1), "training.dataset"),
        (lambda: build_hf_data_loader("text", None, tokenizer, 1, 4, 0, 1), "training.dataset_path"),
        (lambda: build_hf_data_loader("text", str(tmp_path / "nope"), tokenizer, 1, 4, 0, 1), "does not exist"),
        (lambda: build_hf_data_loader("c4", str(tmp_path / "nope"), tokenizer, 1, 4, 0, 1), "does not exist"),
        (lambda: build_hf_data_loader("text", str(tmp_path / "mixed"), tokenizer, 1, 4, 0, 1), "mixes"),
        (lambda: build_hf_data_loader("text", str(tmp_path / "nodata"), tokenizer, 1, 4, 0, 1), "holds no"),
        (lambda: take(build_hf_data_loader("text", str(no_text), tokenizer, 1, 4, 0, 1), 1), "'text' column"),
        (lambda: take(build_hf_data_loader("text", str(one_document), tokenizer, 1, 4, 1, 2), 1), "data reader 1"),
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


# ----------------------------------------------------------------------------------------------------------------
# Readers split by file


def _files_folder(tmp_path: Path, files: int, per_file: int) -> tuple[Path, list[list[str]]]:
    folder = tmp_path / "files"
    folder.mkdir()
    texts = [[f"file {f} document {d} " + "word " * (d % 5) for d in range(per_file)] for f in range(files)]
    for f, file_texts in enumerate(texts):
        _write_jsonl(folder / f"part{f:02d}.jsonl", file_texts)
    return folder, texts


def test_readers_divide_the_files_between_them_when_they_can(tokenizer, tmp_path, caplog):
    folder, texts = _files_folder(tmp_path, files=4, per_file=30)
    batch_size, seq_len = 2, 12
    for rank in range(2):
        counting = CountingTokenizer(tokenizer)
        with caplog.at_level("INFO", logger="torchtitan"):
            loader = build_hf_data_loader("text", str(folder), counting, batch_size, seq_len, rank, 2, infinite=False)
        assert "4 files/shards, divided between 2 readers (2 each)" in caplog.text
        got = [t for inputs, labels in loader for t in torch.cat([inputs, labels[:, -1:]], 1).flatten().tolist()]
        own = [text for f in (rank, rank + 2) for text in texts[f]]
        # It reads its own files' documents, all of them, and no other file's document.
        assert counting.texts == own
        stream = [i for text in own for i in tokenizer.encode(text, bos=True, eos=True)]
        window = batch_size * (seq_len + 1)
        assert got == stream[: len(stream) // window * window]
        source = hf_datasets.load_documents("text", str(folder))
        reader = hf_datasets.rank_readers(rank, 2, 0, source.shards)[0]
        assert [text for text, _ in source.for_reader(reader).documents("")] == own


def test_readers_that_cannot_divide_the_files_say_so_and_deal_documents(tokenizer, tmp_path, caplog):
    folder, texts = _files_folder(tmp_path, files=4, per_file=30)
    counting = CountingTokenizer(tokenizer)
    with caplog.at_level("INFO", logger="torchtitan"):
        loader = build_hf_data_loader("text", str(folder), counting, 2, 12, 1, 3, infinite=False)
    lines = [r.getMessage() for r in caplog.records if "readers share the documents" in r.getMessage()]
    assert len(lines) == 1 and "data: 3 readers share" in lines[0]
    assert "(4 file(s)/shard(s)), each tokenizing one document in 3" in lines[0]
    take(loader, 100)
    in_order = [text for file_texts in texts for text in file_texts]
    assert counting.texts == in_order[1::3][: len(counting.texts)] and counting.texts


def test_readers_of_files_resume_exactly_at_the_same_reader_count(tokenizer, tmp_path):
    folder, _ = _files_folder(tmp_path, files=4, per_file=40)
    batch_size, seq_len, taken, more = 2, 12, 3, 4

    def loader(rank, world, workers=0):
        return build_hf_data_loader("text", str(folder), tokenizer, batch_size, seq_len, rank, world, workers=workers)

    per_reader = [take(loader(i, 2), taken + more) for i in (0, 1)]
    saved = [loader(rank, 2) for rank in range(2)]
    for rank_loader in saved:
        take(rank_loader, taken)
    state = job_state(saved)
    assert state["layout"]["by_shard"]
    for rank in range(2):  # the same layout
        resumed = loader(rank, 2)
        resumed.load_state_dict(state)
        for got, want in zip(take(resumed, more), per_reader[rank][taken:], strict=True):
            assert torch.equal(got[0], want[0])
    resumed = loader(0, 1, workers=2)  # as many readers, on one rank
    resumed.load_state_dict(state)
    for step, got in enumerate(take(resumed, 2 * more)):
        assert torch.equal(got[0], per_reader[step % 2][taken + step // 2][0])
