"""End-to-end runs of train.py on the debug model: one process, FSDP x TP under torchrun, determinism and bad
input."""

import json
import sys

import pytest

from tests.distributed import memory_tag, uses_cuda
from tests.helpers import DEBUG_RUN, PER_STEP_TAGS, ROOT, event_tags, losses, run_dir, train

TAGS = {
    *PER_STEP_TAGS,
    "optimizer/state_bytes",
    "skipped_steps",
}


def test_one_process_trains_and_logs(debug_run):
    path, proc = debug_run
    values = losses(path)
    assert len(values) == 6
    assert values[-1] < values[0]
    assert "step:     6  loss:" in proc.stderr
    # torch's AdamW on the default norms compiles nothing: no line announces a compile (see test_train_step.py).
    assert "compiling" not in proc.stderr
    directory = run_dir(path)
    assert directory.name.endswith("_AdamW")
    assert TAGS | {memory_tag()} <= event_tags(directory)


def test_the_run_folder_keeps_the_resolved_config_it_ran_with(debug_run):
    from torchtitan.config.job_config import JobConfig

    path, _ = debug_run
    record = run_dir(path) / "job_config.toml"
    lines = record.read_text().splitlines()
    assert lines[1].startswith("# command: train.py --job.config_file ") and "--checkpoint.last_save_in_hf" in lines[1]
    assert lines[2].startswith("# 1 process(es) on ")
    fixture_args = ["--profiling.enable_profiling", "--profiling.profile_freq", "2", "--training.gc_freq", "3"]
    ran = JobConfig.parse_args(
        [*DEBUG_RUN, "--job.dump_folder", str(path), *fixture_args, "--checkpoint.last_save_in_hf"]
    )
    read_back = JobConfig.parse_args(["--job.config_file", str(record)])
    assert read_back.job.config_file == str(record)
    read_back.job.config_file = ran.job.config_file
    assert read_back == ran


def test_identical_runs_give_identical_losses_and_the_seed_matters(debug_run, tmp_path):
    # On a GPU, bit-identical runs need the deterministic kernels (the documented switch); on CPU they are the default.
    extra = ["--training.deterministic"] if uses_cuda() else []
    reference = debug_run[0]
    if extra:
        reference = tmp_path / "a"
        train(reference, *extra)
    train(tmp_path / "b", *extra)
    assert losses(tmp_path / "b") == losses(reference)
    # Another training.seed starts from other weights (the data are the same: tests/data/test_datasets.py).
    train(tmp_path / "c", "--training.steps", "1", "--training.seed", "1", *extra)
    assert losses(tmp_path / "c")[0] != losses(reference)[0]


# The 4-rank run and its one-process reference: 3 steps (one past the 2 warm-up steps) show the loss falling and every
# step matching; the 4 ranks' start-up is most of their cost, so more steps would prove no more. Adam-mini, the
# project's optimizer, in float64 (its per-tensor loop: the compiled float32 steps in every layout are
# tests/optim/test_layout_matrix_compiled.py).
LAYOUT_RUN = ("--training.steps", "3", "--training.param_dtype", "float64", "--optimizer.name", "AdamMini")


def test_fsdp_x_tp_under_torchrun_matches_one_process(tmp_path):
    """train.py under torchrun on 4 ranks (FSDP 2 x TP 2): the end-to-end run of FSDP, TP with loss parallel and
    Adam-mini's block sums across both, with the trainer's own data readers, timeouts and logging, against one
    process reading the same global batch. Every layout's step against one process through the trainer's build
    path, HSDP and DDP included, is tests/optim/test_layout_matrix.py; the model's layouts,
    tests/parallelisms/test_parallelisms.py."""
    # Each data-parallel rank reads its own share of the documents (one reader per rank and loader worker), so 2
    # data-parallel ranks of 2 sequences see what one process with 2 loader workers sees when it takes one
    # micro-batch of 2 from each worker in turn (the same mean over the same 4 sequences). float64 makes the only
    # difference the order of floating-point sums, far below rel 1e-9. On CPU everywhere: on a GPU, FSDP computes in
    # training.mixed_precision_param, which a float64 comparison cannot absorb. The training timeout (after the
    # first step) goes to every group and changes no number.
    layout = ["--training.tensor_parallel_degree", "2", "--training.batch_size", "2"]
    proc = train(tmp_path / "four", *LAYOUT_RUN, *layout, "--comm.train_timeout_seconds", "600", nproc=4, cpu=True)
    one_process = ["--training.batch_size", "2", "--training.gradient_accumulation_steps", "2"]
    train(tmp_path / "one", *LAYOUT_RUN, *one_process, "--training.data_workers", "2", cpu=True)
    # The start-up timeout covers the compiles up to the end of the first step, then the training one takes over.
    assert "collectives: timeout 1800 s until the first step ends" in proc.stderr
    assert "collectives: timeout 600 s from now on" in proc.stderr
    # Adam-mini's step may compile: one line (rank 0's) says so before the first step (see test_train_step.py).
    notice = "compiling the optimizer's step if it has a compiled one: first step only"
    assert proc.stderr.count(notice) == 1 and proc.stderr.index(notice) < proc.stderr.index("step:     1  loss:")
    four = losses(tmp_path / "four")
    assert len(four) == 3 and four[-1] < four[0]
    assert four == pytest.approx(losses(tmp_path / "one"), rel=1e-9)
    assert run_dir(tmp_path / "four").name.endswith("_AdamMini")


BAD_INPUT = [
    (["--training.stpes", "3"], "error: unknown config key 'training.stpes' (did you mean 'training.steps'?)"),
    (["--training.steps", "x"], "error: training.steps expects int, got 'x'"),
    (["--job.config_file", "missing.toml"], "error: config file 'missing.toml' not found"),
    (["--model.tokenizer_path", "no/tokenizer.model"], "no/tokenizer.model"),
    (["--training.dataset", "text", "--training.dataset_path", "no/such/dir"], "no/such/dir"),
    (["--training.dataset", "text"], "training.dataset_path"),
    (["--model.flavor", "9B"], "model.flavor '9B' is unknown"),
    (["--training.tensor_parallel_degree", "2"], "tensor_parallel"),
    (["--float8.enable_float8_linear"], "float8"),
    (
        ["--optimizer.name", "AdamW4bit", "--optimizer.state_dtype", "bfloat16"],
        "state_dtype does not apply to AdamW4bit",
    ),
    (["--checkpoint.enable_checkpoint", "--checkpoint.load_step", "7"], "load_step"),
    (["--checkpoint.initial_load_path", "no/such/step-3"], "checkpoint.initial_load_path 'no/such/step-3' is not"),
    (
        ["--checkpoint.initial_load_path", "assets"],
        "checkpoint.initial_load_path 'assets' holds no complete checkpoint",
    ),
]


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message, monkeypatch, capsys):
    # In-process for speed; the subprocess test below checks the same path end to end.
    import train as train_module

    argv = ["train.py"] + DEBUG_RUN + ["--job.dump_folder", str(tmp_path)] + args
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(ROOT)
    assert train_module.run() == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[titan]")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("args, message", [BAD_INPUT[0], BAD_INPUT[3]])
def test_bad_input_from_a_real_process(tmp_path, args, message):
    proc = train(tmp_path, *args, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "tb").exists()
    if args == BAD_INPUT[0][0]:  # a mistake in the options is the only thing said: nothing is logged before it
        assert proc.stderr.strip() == message


def test_unwritable_checkpoint_folder_is_reported_before_training(tmp_path, monkeypatch, capsys):
    import train as train_module

    blocker = tmp_path / "a_file"
    blocker.write_text("keep me")
    argv = (
        ["train.py"]
        + DEBUG_RUN
        + [
            "--job.dump_folder",
            str(tmp_path),
            "--checkpoint.enable_checkpoint",
            "--checkpoint.folder",
            str(blocker / "checkpoints"),
        ]
    )
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(ROOT)
    assert train_module.run() == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("[titan]")]
    assert len(err) == 1 and err[0].startswith("error: ") and "checkpoint" in err[0]
    assert blocker.read_text() == "keep me"
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize(
    "nproc, args, message",
    [
        (4, ["--training.tensor_parallel_degree", "3"], "4"),
        (3, ["--training.tensor_parallel_degree", "3"], "3"),
        (4, ["--training.data_parallel_replicate_degree", "3"], "3"),
    ],
)
def test_preflight_rejects_layouts(nproc, args, message, capsys, monkeypatch):
    from torchtitan.config.preflight import main as preflight_main

    monkeypatch.chdir(ROOT)
    assert preflight_main(["--nproc", str(nproc), "--job.config_file", "train_configs/debug_model.toml", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamMini8bit", "AdamMini4bit"])
def test_preflight_rejects_state_dtype_for_low_bit_optimizers(name, capsys, monkeypatch):
    from torchtitan.config.preflight import main as preflight_main

    monkeypatch.chdir(ROOT)
    args = ["--optimizer.name", name, "--optimizer.state_dtype", "bfloat16"]
    assert preflight_main(["--nproc", "2", "--job.config_file", "train_configs/debug_model.toml", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: optimizer.state_dtype does not apply to {name} "), err


def test_preflight_accepts_a_good_layout(monkeypatch):
    from torchtitan.config.preflight import main as preflight_main

    monkeypatch.chdir(ROOT)
    assert (
        preflight_main(
            [
                "--nproc",
                "4",
                "--job.config_file",
                "train_configs/debug_model.toml",
                "--training.tensor_parallel_degree",
                "2",
            ]
        )
        == 0
    )


def test_profiler_traces_are_written(debug_run):
    traces = sorted((debug_run[0] / "profile_traces").glob("step*/rank0_trace.json"))
    assert [t.parent.name for t in traces] == ["step2", "step4", "step6"]
    assert json.loads(traces[0].read_text())["traceEvents"]
