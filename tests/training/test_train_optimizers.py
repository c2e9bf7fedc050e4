"""train.py with every optimizer name: loss falls, state bytes are logged, the run directory names the optimizer."""

import shutil
import sys
from pathlib import Path

import pytest

from tests.distributed import uses_cuda
from tests.helpers import DEBUG_RUN, ROOT, event_tags, losses, metric_rows, run_dir, train

# The compiled low-bit step is covered by tests/optim/test_optim_builder.py; here the low-bit optimizers run eagerly so
# the suite pays for no further compiles (TORCHDYNAMO_DISABLE is torch's own switch).
EAGER = {"TORCHDYNAMO_DISABLE": "1"}


def state_bytes(path):
    return next(r["optimizer/state_bytes"] for r in metric_rows(run_dir(path)) if "optimizer/state_bytes" in r)


# The runs resumed below: each saves a checkpoint at every step, so that the step after the first (the end of the
# warm-up) is resumed. The first resumed loss reads the restored weights, the second the first update made from the
# restored moments and the lr schedule's position; more steps would prove no more.
RESUMED = ("AdamMini", "AdamW8bit")
SAVED_AT, STEPS = 1, 3


def deterministic():
    """On a GPU, deterministic kernels, so that runs can agree bit for bit (on CPU they are the default)."""
    return ["--training.deterministic"] if uses_cuda() else []


def checkpointed(name):
    every_step = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]
    return [*every_step, *deterministic()] if name in RESUMED else []


@pytest.fixture(scope="module")
def trained(tmp_path_factory, debug_run):
    """A 3-step run per optimizer name (two updates after the first loss, enough to see it fall; the low-bit steps run
    eagerly, seconds each), started on first use and shared by the tests below; its dump folder. AdamW, the debug
    config's optimizer, is the suite's shared 6-step run. The runs of ``RESUMED`` save a checkpoint at every step."""
    folders = {"AdamW": debug_run[0]}

    def get(name):
        if name not in folders:
            folders[name] = tmp_path_factory.mktemp(name)
            with pytest.MonkeyPatch.context() as patch:
                for key, value in EAGER.items():
                    patch.setenv(key, value)
                train(
                    folders[name], "--optimizer.name", name.lower(), "--training.steps", str(STEPS), *checkpointed(name)
                )
        return folders[name]

    return get


@pytest.mark.parametrize(
    "name", ["AdamW", "Adam", "AdamMini", "AdamW8bit", "AdamW4bit", "AdamWFp8", "Muon", "AdEMAMix", "SOAP"]
)
def test_each_optimizer_trains(trained, name):
    path = trained(name)
    values = losses(path)
    assert values[-1] < values[0]
    assert run_dir(path).name.endswith("_" + name)
    assert "optimizer/state_bytes" in event_tags(run_dir(path))
    assert state_bytes(path) > 0


def test_state_bytes_ratios(trained):
    names = ["AdamW", "AdamMini", "AdamW8bit", "AdamW4bit", "Muon", "AdEMAMix", "SOAP"]
    measured = {name: state_bytes(trained(name)) for name in names}
    assert measured["AdamMini"] <= 0.51 * measured["AdamW"]
    # Muon: one moment for the hidden matrices, AdamW's two for the embedding, output and norms.
    assert 0.5 * measured["AdamW"] < measured["Muon"] <= 0.75 * measured["AdamW"]
    assert measured["AdamW8bit"] <= 0.35 * measured["AdamW"]
    assert measured["AdamW4bit"] <= 0.25 * measured["AdamW"]
    # AdEMAMix: three moments where AdamW has two, and the same step counters.
    assert 1.49 * measured["AdamW"] < measured["AdEMAMix"] < 1.5 * measured["AdamW"]
    # SOAP: AdamW's two moments, plus a statistic and a basis per side of each hidden matrix (every side of the debug
    # model's is rotated: 2 rows^2 + 2 cols^2 more per matrix).
    assert 3.4 * measured["AdamW"] < measured["SOAP"] < 3.6 * measured["AdamW"]


@pytest.mark.parametrize("name", RESUMED)
def test_resume_equals_uninterrupted_run(trained, tmp_path, monkeypatch, name):
    """train.py's own resume, bit for bit, of Adam-mini's state and of quantized state (the checkpoint holds each
    quantized state's block scales beside its values, tests/checkpoint/test_lowprec_checkpoints.py)."""
    straight = trained(name)
    saved = Path("checkpoint", name, f"step-{SAVED_AT}")  # each optimizer's default folder
    shutil.copytree(straight / saved, tmp_path / saved)
    for key, value in EAGER.items():
        monkeypatch.setenv(key, value)
    args = ["--optimizer.name", name, "--training.steps", str(STEPS), *checkpointed(name)]
    train(tmp_path, *args, "--checkpoint.load_step", str(SAVED_AT))
    resumed = losses(tmp_path)
    assert len(resumed) == STEPS - SAVED_AT
    assert resumed == losses(straight)[SAVED_AT:]  # bit for bit


@pytest.mark.parametrize(
    "args, message",
    [
        (["--optimizer.name", "Lion"], "AdamW"),
        (["--optimizer.beta1", "1.0"], "optimizer.beta1"),
        (["--optimizer.lr", "-0.1"], "optimizer.lr"),
        (["--optimizer.eps", "-1e-8"], "optimizer.eps"),
        (["--optimizer.value_blocks", "per_tensor"], "value_blocks"),
        (["--optimizer.ns_steps", "3"], "optimizer.ns_steps does not apply to AdamW (only to Muon, NorMuon)"),
    ],
)
def test_bad_optimizer_input(tmp_path, args, message, monkeypatch, capsys):
    # In this process (a real process's exit code and output are checked by tests/training/test_train.py).
    import train as train_module

    monkeypatch.setattr(sys, "argv", ["train.py", *DEBUG_RUN, "--job.dump_folder", str(tmp_path), *args])
    monkeypatch.chdir(ROOT)
    assert train_module.run() == 2
    last = [line for line in capsys.readouterr().err.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and message in last


def test_compare_runs_tables_soap_beside_adamw_with_its_logged_state_bytes(trained, tmp_path):
    from torchtitan.tools.compare_runs import compare

    runs = [run_dir(trained("AdamW")), run_dir(trained("SOAP"))]
    summaries = compare([str(r) for r in runs] + ["--out", str(tmp_path / "compare.png"), "--last-k", "2"])
    by_name = {s["name"]: s for s in summaries}
    soap = next(s for name, s in by_name.items() if name.endswith("_SOAP"))
    assert soap["optimizer_state_bytes"] == state_bytes(trained("SOAP"))
    # The debug model's hidden matrices are all rotated on both sides: far more state than AdamW's.
    adamw = next(s for name, s in by_name.items() if name.endswith("_AdamW"))
    assert soap["optimizer_state_bytes"] > 2 * adamw["optimizer_state_bytes"]
