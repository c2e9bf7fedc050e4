"""Preflight finds what a layout rules out for an optimizer before any worker starts: every registered optimizer at
tensor parallel degree 2 on the debug model either passes preflight or is refused in one line naming the option and
the fix (exit 2); through run_llama_train.sh a refused one starts no worker, and one that passes trains; launched
with torchrun directly, train.py's first rank refuses it before any process group, compile or run folder.

Which optimizers train at TP 2 once preflight passes them is the layout matrix's TP 2 column
(tests/optim/test_layout_matrix.py).
"""

from __future__ import annotations

import os

import pytest

from tests import processes
from tests.distributed import launch_env
from tests.helpers import DEBUG_CONFIG, ROOT, one_error_line, train_command
from torchtitan.errors import exit_code
from torchtitan.optim.builder import OPTIMIZERS

TP2 = ["--job.config_file", DEBUG_CONFIG, "--training.tensor_parallel_degree", "2"]
# Their quantized state's blocks (256 values) are longer than the 128 columns TP 2 leaves each rank of the debug
# model's attention output projection (256 x 256, split by columns).
REFUSED_AT_TP2 = {"AdamMini8bit", "AdamW8bit", "AdamWFp8"}


def _preflight(*argv: str) -> int:
    from torchtitan.config.preflight import main

    return main(["--nproc", "2", *TP2, *argv])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_at_tp2_passes_preflight_or_is_refused_in_one_line(name, capsys, monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # nothing here needs a compiled step
    code = _preflight("--optimizer.name", name)
    if name not in REFUSED_AT_TP2:
        assert code == 0, capsys.readouterr().err
        return
    assert code == 2
    line = one_error_line(capsys)
    assert f"optimizer.name {name}" in line and "training.tensor_parallel_degree 2" in line
    assert "--optimizer.block_size that divides 128" in line  # the fix


def test_the_fix_it_names_passes(capsys, monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert _preflight("--optimizer.name", "AdamW8bit", "--optimizer.block_size", "128") == 0, capsys.readouterr().err


def test_one_process_needs_no_layout_check(monkeypatch):
    """The check starts no fake world for a job that splits nothing (and a job in a process group, train.py's
    workers, meets the optimizer's own refusal when it builds its state)."""
    from torchtitan.estimation import layout_check

    def fail(*args):
        raise AssertionError("no layout to check")

    monkeypatch.setattr("torchtitan.estimation.fake.fake_world", fail)
    from torchtitan.config.job_config import JobConfig
    from torchtitan.parallelisms import ParallelDims

    job = JobConfig.parse_args(["--job.config_file", DEBUG_CONFIG, "--optimizer.name", "AdamW8bit"])
    assert exit_code(lambda: layout_check.check_optimizer_layout(job, ParallelDims(1, 1, 1, 1), None)) == 0


def _run_llama_train(tmp_path, *argv: str):
    env = launch_env(2, cpu=True, NGPU="2", PYTHONPATH=str(ROOT), TORCHDYNAMO_DISABLE="1")
    command = [os.path.join(ROOT, "run_llama_train.sh"), *argv, "--job.dump_folder", str(tmp_path)]
    return processes.run(command, timeout=300, env=env, cwd=ROOT)


def test_run_llama_train_refuses_a_quantized_optimizer_at_tp2_before_torchrun(tmp_path):
    proc = _run_llama_train(tmp_path, "--training.tensor_parallel_degree", "2", "--optimizer.name", "AdamMini8bit")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "optimizer.name AdamMini8bit" in lines[0], proc.stderr
    assert "torchrun" not in proc.stderr and "Traceback" not in proc.stderr
    assert "job: " not in proc.stdout + proc.stderr  # no worker logged its start
    assert not os.listdir(tmp_path)


def test_train_py_under_torchrun_refuses_a_quantized_optimizer_at_tp2_before_it_builds_anything(tmp_path):
    """As a user launches it without run_llama_train.sh: the first rank prints preflight's one line and exits 2,
    before its process group, its compile or its TensorBoard folder; torchrun ends the other rank."""
    argv = [*TP2, "--optimizer.name", "AdamW8bit", "--job.dump_folder", str(tmp_path)]
    env = launch_env(2, cpu=True, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = processes.run(train_command(argv, nproc=2), timeout=300, env=env, cwd=ROOT)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, output
    assert "optimizer.name AdamW8bit cannot run at training.tensor_parallel_degree 2" in lines[0]
    assert "exitcode  : 2" in output  # the first rank's own code, as torchrun reports it
    # No frame of a worker's traceback (torchrun's own report of the failed rank is torchrun's).
    assert f'File "{ROOT / "train.py"}"' not in output and f'File "{ROOT / "torchtitan"}' not in output
    assert "job: " not in output  # no rank logged its start: no process group, model or compile
    assert os.listdir(tmp_path) == ["exit.json"]  # the run's ending, for a sweep; no TensorBoard folder


def test_run_llama_train_trains_ademamix_at_tp2(tmp_path):
    """The run that stopped at its first step (its embedding's gradient replicated, its weight sharded by rows)."""
    steps = [
        "--training.steps",
        "2",
        "--training.seq_len",
        "32",
        "--training.batch_size",
        "2",
        "--metrics.log_freq",
        "1",
    ]
    proc = _run_llama_train(tmp_path, "--training.tensor_parallel_degree", "2", "--optimizer.name", "AdEMAMix", *steps)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "training done" in proc.stdout + proc.stderr


def test_the_layout_check_logs_nothing_of_what_it_builds(monkeypatch):
    """The run logs its Adam-mini partition; preflight's fake build of the same optimizer says nothing of it."""
    import logging

    from torchtitan.logging import logger

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    try:
        assert _preflight("--optimizer.name", "AdamMini") == 0
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno < logging.WARNING] == []
    assert logger.level == logging.INFO


def test_the_launchers_digest_is_the_one_train_py_computes(tmp_path):
    """run_llama_train.sh marks the job preflight passed (printf | sha256sum); train.py's first rank skips the layout
    check only for that very job: same world size, same arguments, byte for byte."""
    from torchtitan.config.preflight import CHECKED_VARIABLE, checked_by_launcher, job_digest

    argv = ["--job.config_file", "a b.toml", "--job.description", "naïve 'quoted' $HOME\\n", "--x", ""]
    script = "printf '%s\\0' \"$@\" | sha256sum | cut -d' ' -f1"
    digest = processes.run(["bash", "-c", script, "bash", "4", *argv], timeout=30).stdout.strip()
    assert digest == job_digest(4, argv)
    assert checked_by_launcher(4, argv, {CHECKED_VARIABLE: digest})
    assert not checked_by_launcher(2, argv, {CHECKED_VARIABLE: digest})  # another world size
    assert not checked_by_launcher(4, argv[:-1], {CHECKED_VARIABLE: digest})  # other arguments
    assert not checked_by_launcher(4, argv, {})
