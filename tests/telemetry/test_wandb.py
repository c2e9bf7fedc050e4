"""Weights & Biases logging (``metrics.enable_wandb``): a debug-model run in offline mode (no network) is read back
from its offline run folder, then resumed from its checkpoint into a new W&B run of the same group, linked to the
first (tests/telemetry/test_wandb_resume.py: when a resumed run continues the kept one)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from tests import processes
from tests.distributed import launch_env
from tests.helpers import DEBUG_RUN, ROOT, event_tags, job_config, metric_rows, run_dirs, train_command
from torchtitan.config.tables.metrics import WANDB_INSTALL
from torchtitan.errors import UserError

# A .wandb file: a 7-byte header (":W&B", a magic number, a version), then LevelDB log records in 32 KiB blocks,
# each a header (crc32c, length, type) and a piece of one serialized wandb Record protobuf.
WANDB_HEADER = 7
BLOCK = 32 * 1024
RECORD_HEADER = 7
FULL, LAST = 1, 4


def wandb_records(path: Path) -> list:
    """The Record protobufs of an offline run's .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pieces, pos = [], b"", WANDB_HEADER
    while pos + RECORD_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD_HEADER:  # the block's zero-filled trailer
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER])
        if length == 0 and kind == 0:
            pos += left_in_block
            continue
        pieces += data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def offline_run(run_dir: Path) -> dict:
    """An offline W&B run's id, name, group, config and history (step -> {key: value}) from its run folder."""
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    run, history = None, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row.pop("_step"), {}).update(row)
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    return {"id": run.run_id, "name": run.display_name, "group": run.run_group, "config": config, "history": history}


def train_offline(dump: Path, *args: str):
    command = train_command([*DEBUG_RUN, "--job.dump_folder", str(dump), *args])
    env = launch_env(1, True, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", WANDB_MODE="offline", WANDB_SILENT="true")
    proc = processes.run(command, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


WANDB_RUN = [
    "--training.steps",
    "4",
    "--metrics.log_freq",
    "2",
    "--metrics.health_freq",
    "2",
    "--metrics.enable_wandb",
    "true",
    "--metrics.wandb_group",
    "study-a",
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    "2",
]
INTERNAL = {"_runtime", "_timestamp"}


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory) -> tuple[Path, Path]:
    dump = tmp_path_factory.mktemp("wandb")
    train_offline(dump, *WANDB_RUN)
    train_offline(dump, *WANDB_RUN[:1], "6", *WANDB_RUN[2:])  # resumes from step 4
    first, second = run_dirs(dump)
    return first, second


def test_wandb_logs_the_same_scalars_as_tensorboard_and_the_resolved_config(resumed_runs):
    run_dir = resumed_runs[0]
    run = offline_run(run_dir)
    assert run["name"] == run_dir.name and run["group"] == "study-a"
    assert run["config"]["training"]["steps"] == 4 and run["config"]["metrics"]["health_freq"] == 2
    expected: dict[int, dict] = {}
    for row in metric_rows(run_dir):
        expected.setdefault(row.pop("step"), {}).update(row)
    assert sorted(run["history"]) == sorted(expected) == [0, 2, 4]
    for step, row in expected.items():
        got = {k: v for k, v in run["history"][step].items() if k not in INTERNAL}
        assert got.keys() == row.keys(), step
        for key, value in row.items():
            assert got[key] == pytest.approx(value, rel=1e-12), (step, key)
    assert "health/update_rms/embedding" in run["history"][2]
    assert {"time/data(s)", "time/forward_backward(s)", "time/optimizer(s)", "time/checkpoint(s)"} <= set(expected[2])
    assert expected[4]["time/checkpoint(s)"] > 0  # step 2's save, counted in the window that logs at step 4
    tags = set().union(*(set(row) for row in expected.values()))
    assert event_tags(run_dir) == tags


def test_a_resumed_offline_run_is_a_new_wandb_run_in_the_group_linked_to_the_first(resumed_runs):
    first, second = (offline_run(run_dir) for run_dir in resumed_runs)
    # Offline, each attempt is a run of its own (wandb sync uploads each); the second names where it resumed.
    assert second["id"] != first["id"] and second["group"] == first["group"] == "study-a"
    assert second["config"]["resumed_from"] == {"run_id": first["id"], "step": 4}
    assert second["name"] == f"{resumed_runs[1].name}-from-step4"
    # The second process starts from step 4's checkpoint: its state bytes at step 4, then step 6; nothing replayed.
    assert sorted(second["history"]) == [4, 6]
    assert "loss_metrics/global_avg_loss" in second["history"][6]


def test_wandb_missing_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"^metrics.enable_wandb needs the wandb package: ") as error:
        job_config("--metrics.enable_wandb", "true")
    assert WANDB_INSTALL in str(error.value) and "\n" not in str(error.value)


def test_options_that_would_change_nothing_are_refused():
    with pytest.raises(UserError, match="metrics.wandb_run_name is set but metrics.enable_wandb is off"):
        job_config("--metrics.wandb_run_name", "x")
    with pytest.raises(UserError, match="metrics.wandb_project is set but metrics.enable_wandb is off"):
        job_config("--metrics.wandb_project", "x")
    with pytest.raises(UserError, match="metrics.loss_spike_factor applies to optimizer health, which metrics.h"):
        job_config("--metrics.health_freq", "0", "--metrics.loss_spike_factor", "3")
    job_config("--metrics.health_freq", "0")  # off alone is fine


def test_wandb_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    import wandb

    from torchtitan.telemetry.metrics import build_metric_logger

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.\nmore detail")

    monkeypatch.setattr(wandb, "init", refuse)
    job = job_config("--job.dump_folder", str(tmp_path), "--metrics.enable_wandb", "true")
    with pytest.raises(UserError, match=r"^metrics.enable_wandb: W&B could not start \(UsageError: No API key") as e:
        build_metric_logger(job, "AdamW", 0)
    assert "\n" not in str(e.value) and "WANDB_MODE=offline" in str(e.value)
