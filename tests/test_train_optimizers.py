"""train.py with every optimizer name: loss falls, state bytes are logged, the run directory names the optimizer."""

import json
import shutil
import sys

import pytest

from tests.test_train import ROOT, TINY, event_tags, losses, run_dir, train

# The compiled low-bit step is covered by tests/test_optim_builder.py; here the low-bit optimizers run eagerly so the
# suite pays for no further compiles (TORCHDYNAMO_DISABLE is torch's own switch).
EAGER = {"TORCHDYNAMO_DISABLE": "1"}


def state_bytes(path):
    rows = [json.loads(line) for line in open(run_dir(path) / "metrics.jsonl")]
    return next(r["optimizer/state_bytes"] for r in rows if "optimizer/state_bytes" in r)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 5-step run per optimizer name, started on first use and shared by the tests below; its dump folder."""
    folders = {}

    def get(name):
        if name not in folders:
            folders[name] = tmp_path_factory.mktemp(name)
            with pytest.MonkeyPatch.context() as patch:
                for key, value in EAGER.items():
                    patch.setenv(key, value)
                train(folders[name], "--optimizer.name", name.lower(), "--training.steps", "5")
        return folders[name]

    return get


@pytest.mark.parametrize("name", ["AdamW", "Adam", "AdamMini", "AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_each_optimizer_trains(trained, name):
    path = trained(name)
    values = losses(path)
    assert values[-1] < values[0]
    assert run_dir(path).name.endswith("_" + name)
    assert "optimizer/state_bytes" in event_tags(run_dir(path))
    assert state_bytes(path) > 0


def test_state_bytes_ratios(trained):
    measured = {name: state_bytes(trained(name)) for name in ["AdamW", "AdamMini", "AdamW8bit", "AdamW4bit"]}
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
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-4", tmp_path / "resumed" / "checkpoint" / "step-4")
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
def test_bad_optimizer_input(tmp_path, args, message, monkeypatch, capsys):
    # In this process (a real process's exit code and output are checked by tests/test_train.py).
    import train as train_module

    monkeypatch.setattr(sys, "argv", ["train.py", *TINY, "--job.dump_folder", str(tmp_path), *args])
    monkeypatch.chdir(ROOT)
    assert train_module.run() == 2
    last = [line for line in capsys.readouterr().err.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and message in last
