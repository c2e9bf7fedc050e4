"""train.py with every optimizer name: loss falls, state bytes are logged, the run directory names the optimizer."""

import json
import shutil
from pathlib import Path

import pytest

from tests.test_train import event_tags, losses, run_dir, train

# The compiled low-bit step is covered by tests/test_optim_builder.py; here the low-bit optimizers run eagerly so the
# suite pays for no further compiles (TORCHDYNAMO_DISABLE is torch's own switch).
EAGER = {"TORCHDYNAMO_DISABLE": "1"}


def state_bytes(path):
    rows = [json.loads(line) for line in open(run_dir(path) / "metrics.jsonl")]
    return next(r["optimizer/state_bytes"] for r in rows if "optimizer/state_bytes" in r)


@pytest.mark.parametrize("name", ["AdamW", "Adam", "AdamMini", "AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_each_optimizer_trains(tmp_path, name, monkeypatch):
    for key, value in EAGER.items():
        monkeypatch.setenv(key, value)
    train(tmp_path, "--optimizer.name", name.lower(), "--training.steps", "5")
    values = losses(tmp_path)
    assert values[-1] < values[0]
    assert run_dir(tmp_path).name.endswith("_" + name)
    assert "optimizer/state_bytes" in event_tags(run_dir(tmp_path))
    assert state_bytes(tmp_path) > 0


def test_state_bytes_ratios(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    measured = {}
    for name in ["AdamW", "AdamMini", "AdamW8bit", "AdamW4bit"]:
        train(tmp_path / name, "--optimizer.name", name, "--training.steps", "1")
        measured[name] = state_bytes(tmp_path / name)
    assert measured["AdamMini"] <= 0.51 * measured["AdamW"]
    assert measured["AdamW8bit"] <= 0.35 * measured["AdamW"]
    assert measured["AdamW4bit"] <= 0.25 * measured["AdamW"]


@pytest.mark.parametrize("name", ["AdamW", "AdamMini"])
def test_two_fsdp_processes(tmp_path, name):
    train(tmp_path, "--optimizer.name", name, "--training.steps", "4", nproc=2)
    values = losses(tmp_path)
    assert values[-1] < values[0]
    assert run_dir(tmp_path).name.endswith("_" + name)


def resumed_vs_straight(tmp_path, name):
    """Losses of steps 5-8 of a straight 8-step run, and of the same steps resumed from its step-4 checkpoint."""
    common = ["--optimizer.name", name, "--training.steps", "8", "--checkpoint.enable_checkpoint",
              "--checkpoint.interval", "4"]
    train(tmp_path / "straight", *common)
    step_4 = Path("checkpoint", name, "step-4")  # each optimizer's default folder
    shutil.copytree(tmp_path / "straight" / step_4, tmp_path / "resumed" / step_4)
    train(tmp_path / "resumed", *common, "--checkpoint.load_step", "4")
    return losses(tmp_path / "straight")[4:], losses(tmp_path / "resumed")


def test_adam_mini_resume_equals_uninterrupted_run(tmp_path):
    straight, resumed = resumed_vs_straight(tmp_path, "AdamMini")
    assert len(resumed) == 4
    assert resumed == straight  # bit for bit


def test_low_bit_resume_within_quantization_noise(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    straight, resumed = resumed_vs_straight(tmp_path, "AdamW8bit")
    assert len(resumed) == 4
    assert resumed == pytest.approx(straight, rel=1e-3)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--optimizer.name", "Lion"], "AdamW"),
        (["--optimizer.beta1", "1.0"], "optimizer.beta1"),
        (["--optimizer.lr", "-0.1"], "optimizer.lr"),
        (["--optimizer.eps", "-1e-8"], "optimizer.eps"),
        (["--optimizer.value_blocks", "per_tensor"], "value_blocks"),
    ],
)
def test_bad_optimizer_input(tmp_path, args, message):
    proc = train(tmp_path, *args, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = [l for l in proc.stderr.splitlines() if l.strip()][-1]
    assert last.startswith("error: ") and message in last
    assert "Traceback" not in proc.stderr
