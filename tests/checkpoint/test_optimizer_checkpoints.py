"""End to end: runs that differ in the optimizer keep their checkpoints apart in one dump folder; a warm start takes
another optimizer's model weights with a fresh optimizer; a resume from another optimizer's checkpoint is one line.

One AdamW run (4 steps, float64, checkpoints at steps 2 and 4) is shared by the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers import DEBUG_RUN, LOSS, ROOT, metric_rows, read_checkpoint, run_dirs, train
from torchtitan.checkpoint import SafeFileSystemReader, SafeLoadPlanner, decode_plain

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

ARGS = [
    *DEBUG_RUN,
    "--training.steps",
    "4",
    "--training.param_dtype",
    "float64",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.enable_checkpoint",
    "--checkpoint.interval",
    "2",
]


def metrics(dump: Path, optimizer: str) -> list[list[dict]]:
    """Each run's metrics.jsonl rows, for the runs of ``optimizer`` in ``dump``, oldest run first."""
    return [metric_rows(run) for run in run_dirs(dump, optimizer)]


def steps_of(rows: list[dict]) -> list[int]:
    return [row["step"] for row in rows if LOSS in row]


def loss_of_saved_weights(step_folder: Path) -> float:
    """The loss train.py computes at step 1 of a run (first batch of the data), with the checkpoint's weights."""
    from torchtitan.config.job_config import JobConfig
    from torchtitan.config.preflight import preflight
    from torchtitan.datasets import build_hf_data_loader
    from torchtitan.models.llama import Transformer
    from torchtitan.training.loss import cross_entropy

    config = JobConfig.parse_args(ARGS)
    t = config.training
    _, model_args, tokenizer = preflight(config, 1)
    with torch.device("meta"):
        model = Transformer(model_args).to(torch.float64)
    model.to_empty(device="cpu")
    model.init_weights(seed=t.seed)  # buffers; every weight is then replaced by the checkpoint's
    state = {f"model.{name}": value for name, value in model.state_dict().items()}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(step_folder)), planner=SafeLoadPlanner())
    model.load_state_dict({name.removeprefix("model."): value for name, value in state.items()})
    inputs, labels = next(
        iter(build_hf_data_loader(t.dataset, t.dataset_path, tokenizer, t.batch_size, t.seq_len, 0, 1))
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run (OMP_NUM_THREADS=1): the same order of sums, so the same float64 bits
    try:
        with torch.no_grad():
            return cross_entropy(model(inputs), labels).item()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def adamw_dump(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("runs")
    train(dump, *ARGS)  # AdamW, the debug config's optimizer
    assert sorted(p.name for p in (dump / "checkpoint" / "AdamW").iterdir()) == ["step-2", "step-4"]
    return dump


def test_warm_start_from_adamw_weights_into_a_fresh_adam_mini(adamw_dump, monkeypatch):
    dump = adamw_dump
    adamw_step_4 = dump / "checkpoint" / "AdamW" / "step-4"
    warm = ["--optimizer.name", "AdamMini", "--checkpoint.initial_load_path", str(adamw_step_4)]

    first = train(dump, *ARGS, "--training.steps", "2", *warm)
    assert f"started from the model weights of {adamw_step_4} (written by AdamW)" in first.stderr
    (adamw,), (mini,) = metrics(dump, "AdamW"), metrics(dump, "AdamMini")
    assert steps_of(mini) == [1, 2]  # a fresh step counter ...
    assert mini[1]["lr"] == adamw[1]["lr"]  # ... and lr schedule (step 1 is the first logged row after state_bytes)
    monkeypatch.chdir(ROOT)
    expected = loss_of_saved_weights(adamw_step_4)
    assert mini[1][LOSS] == expected  # step 1 evaluates AdamW's final weights on the first batch, bit for bit
    assert expected != adamw[1][LOSS]  # (which are not the initial weights)

    # Its own checkpoints go to its own folder; AdamW's are untouched. The optimizer state started fresh.
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["AdamMini", "AdamW"]
    assert sorted(p.name for p in (dump / "checkpoint" / "AdamMini").iterdir()) == ["step-2"]
    assert sorted(p.name for p in (dump / "checkpoint" / "AdamW").iterdir()) == ["step-2", "step-4"]
    saved = read_checkpoint(str(dump / "checkpoint" / "AdamMini" / "step-2"))
    optimizer_steps = {float(v) for k, v in saved.items() if k.startswith("optimizer.state.") and k.endswith(".step")}
    assert optimizer_steps == {2.0}
    assert decode_plain(saved["train_state"].numpy().tobytes())["step"] == 2


@pytest.mark.parametrize("name", ["AdamMini", "Muon"])
def test_resume_from_another_optimizers_checkpoint_is_one_line(adamw_dump, monkeypatch, capsys, name):
    import train as train_module

    dump = adamw_dump
    before = sorted(p.name for p in (dump / "checkpoint" / "AdamW").iterdir())
    runs_before = len(metrics(dump, name))
    # An explicit folder keeps its meaning: here it is AdamW's.
    argv = [
        "train.py",
        *ARGS,
        "--job.dump_folder",
        str(dump),
        "--optimizer.name",
        name,
        "--checkpoint.folder",
        "checkpoint/AdamW",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(ROOT)
    assert train_module.run() == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and err.rstrip().endswith(lines[0]) and "Traceback" not in err, err[-3000:]
    path = str(dump / "checkpoint" / "AdamW" / "step-4")
    assert lines[0].startswith(f"error: checkpoint '{path}' was written by AdamW; this job uses {name}; ")
    assert f"--checkpoint.initial_load_path {path}" in lines[0] and "optimizer.state" not in lines[0]
    assert len(lines[0]) - 2 * len(path) < 300
    assert sorted(p.name for p in (dump / "checkpoint" / "AdamW").iterdir()) == before  # nothing lost or overwritten
    assert len(metrics(dump, name)) == runs_before
