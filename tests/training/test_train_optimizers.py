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


@pytest.fixture(scope="module")
def trained(tmp_path_factory, debug_run):
    """A 3-step run per optimizer name (two updates after the first loss, enough to see it fall; the low-bit steps run
    eagerly, seconds each), started on first use and shared by the tests below; its dump folder. AdamW, the debug
    config's optimizer, is the suite's shared 6-step run."""
    folders = {"AdamW": debug_run[0]}

    def get(name):
        if name not in folders:
            folders[name] = tmp_path_factory.mktemp(name)
            with pytest.MonkeyPatch.context() as patch:
                for key, value in EAGER.items():
                    patch.setenv(key, value)
                train(folders[name], "--optimizer.name", name.lower(), "--training.steps", "3")
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


@pytest.mark.parametrize("name", ["AdamMini"])
def test_two_fsdp_processes(tmp_path, name):
    """Adam-mini through train.py under torchrun with FSDP (the layouts' step against one process in float64 is
    tests/optim/test_adam_mini_distributed.py; this is the launched trainer, float32, with its data readers)."""
    # 2 ranks of 2 sequences see the global batch one process sees when it takes 2 micro-batches of 2 sequences from
    # 2 loader workers (each rank, like each worker, reads its own share of the documents): the same losses, up to
    # float32 summation order on CPU, or FSDP's bf16 compute (training.mixed_precision_param) on GPUs. (AdamW's FSDP
    # run against one process, in float64, is tests/training/test_train.py's fsdp2_x_tp2 layout.)
    train(tmp_path / "two", "--optimizer.name", name, "--training.steps", "4", nproc=2)
    on_gpus = uses_cuda(2)
    train(
        tmp_path / "one",
        "--optimizer.name",
        name,
        "--training.steps",
        "4",
        "--training.batch_size",
        "2",
        "--training.gradient_accumulation_steps",
        "2",
        "--training.data_workers",
        "2",
        cpu=not on_gpus,
    )
    values = losses(tmp_path / "two")
    assert len(values) == 4 and values[-1] < values[0]
    assert values == pytest.approx(losses(tmp_path / "one"), rel=2e-2 if on_gpus else 1e-5)
    assert run_dir(tmp_path / "two").name.endswith("_" + name)


# A checkpoint after the warm-up (step 2 of 4). The first resumed loss reads the restored weights, the second the
# first update made from the restored moments and the lr schedule's position; more steps would prove no more.
SAVED_AT, STEPS = 2, 4


def resume_args(name):
    """4 steps with a checkpoint every 2; on a GPU with deterministic kernels, so that runs can agree bit for bit."""
    return [
        "--optimizer.name",
        name,
        "--training.steps",
        str(STEPS),
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        str(SAVED_AT),
        *(["--training.deterministic"] if uses_cuda() else []),
    ]


def resumed_vs_straight(tmp_path, name):
    """Losses of the steps after SAVED_AT of a straight run, and of the same steps resumed from its checkpoint."""
    common = resume_args(name)
    train(tmp_path / "straight", *common)
    saved = Path("checkpoint", name, f"step-{SAVED_AT}")  # each optimizer's default folder
    shutil.copytree(tmp_path / "straight" / saved, tmp_path / "resumed" / saved)
    train(tmp_path / "resumed", *common, "--checkpoint.load_step", str(SAVED_AT))
    return losses(tmp_path / "straight")[SAVED_AT:], losses(tmp_path / "resumed")


def test_adam_mini_resume_equals_uninterrupted_run(tmp_path):
    straight, resumed = resumed_vs_straight(tmp_path, "AdamMini")
    assert len(resumed) == STEPS - SAVED_AT
    assert resumed == straight  # bit for bit


def test_low_bit_resume_equals_uninterrupted_run(tmp_path, monkeypatch):
    """train.py's own resume of quantized state (the checkpoint holds each quantized state's block scales beside its
    values, tests/checkpoint/test_lowprec_checkpoints.py): a resumed 8-bit run continues bit for bit."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    straight, resumed = resumed_vs_straight(tmp_path, "AdamW8bit")
    assert len(resumed) == STEPS - SAVED_AT
    assert resumed == straight  # bit for bit


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
