"""Checkpoint options of torchtitan's 2024 format: time-based saving, pinned async staging, seed checkpoints; and
the loop's garbage collection and log-line options."""

from __future__ import annotations

import gc
import os

import pytest

from tests.helpers import Trainer, assert_same_snapshot, job_config, train
from tests.helpers import checkpoint_job as job
from torchtitan.errors import UserError
from torchtitan.telemetry import metrics
from torchtitan.telemetry.metrics import build_metric_logger, format_log_line
from torchtitan.training.garbage_collection import GarbageCollection

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
    pytest.mark.filterwarnings("ignore:Ignoring pin_memory flag"),
]


def test_interval_in_seconds_saves_by_wall_time(tmp_path):
    trainer = Trainer(job(str(tmp_path), steps=6, interval=10, interval_type="seconds"))
    # Read when steps 1-5 decide and after each save: due at 11 (>= 0 + 10) and 25 (>= 11 + 10); 6 is the last step.
    times = iter([3.0, 11.0, 11.0, 15.0, 25.0, 25.0, 26.0, 30.0])
    trainer.checkpoint.clock = lambda: next(times)
    trainer.checkpoint._last_save_time = 0.0
    trainer.run(6)
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4", "step-6"]


def test_async_saves_every_second_on_two_ranks_finish_and_publish(tmp_path):
    """The seconds decision of each step and the background save in flight talk on groups of their own: on one
    group the two threads' collectives would meet in another order on each rank and stop the run."""
    proc = train(
        tmp_path,
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval_type",
        "seconds",
        "--checkpoint.interval",
        "1",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.keep_latest_k",
        "0",
        "--comm.init_timeout_seconds",
        "60",  # a deadlock fails in a minute, not torch's default
        "--metrics.enable_tensorboard",
        "false",
        nproc=2,
        cpu=True,
    )
    folder = tmp_path / "checkpoint" / "AdamW"
    published = [line for line in (proc.stdout + proc.stderr).splitlines() if "checkpoint: published" in line]
    names = sorted(os.listdir(folder))
    assert len(published) >= 2 and all(name.startswith("step-") for name in names), names
    assert len(names) == len(published) and "step-6" in names


def test_async_with_pinned_memory_keeps_the_values_at_save_time(tmp_path):
    trainer = Trainer(job(str(tmp_path), steps=4, interval=2, async_mode="async_with_pinned_mem"))
    trainer.run(2)
    at_step_2 = trainer.snapshot()
    trainer.run(4)
    trainer.checkpoint.close()
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4"]
    resumed = Trainer(job(str(tmp_path), steps=4, load_step=2))
    assert resumed.checkpoint.load()
    assert_same_snapshot(resumed.snapshot(), at_step_2)


def test_an_async_save_is_noted_by_ranks_that_do_not_publish_it(tmp_path):
    trainer = Trainer(job(str(tmp_path), steps=2, interval=2, async_mode="async"))
    trainer.checkpoint.rank = 1  # as on a rank other than 0, which leaves publishing to rank 0
    trainer.run(2)
    assert trainer.checkpoint.last_finite_step() == 2
    assert trainer.checkpoint.resume_hint().startswith("the last finite checkpoint is step-2 ")


def test_resuming_reads_the_saved_names_without_asking_for_state(tmp_path, monkeypatch):
    Trainer(job(str(tmp_path), steps=2, interval=2)).run(2)
    resumed = Trainer(job(str(tmp_path), steps=2))

    def state_dict():
        raise AssertionError("the data loader's state_dict() is a collective that starts its workers")

    monkeypatch.setattr(resumed.loader, "state_dict", state_dict)
    assert resumed.checkpoint.load() and resumed.train_state.step == 2


def test_seed_checkpoint_is_the_initial_state_and_needs_an_empty_folder(tmp_path):
    seeded = Trainer(job(str(tmp_path), create_seed_checkpoint=True))
    initial = seeded.snapshot()
    assert seeded.checkpoint.create_seed_checkpoint().endswith("step-0")
    resumed = Trainer(job(str(tmp_path)))
    assert resumed.checkpoint.load() and resumed.train_state.step == 0
    assert_same_snapshot(resumed.snapshot(), initial)
    with pytest.raises(UserError, match="already holds checkpoints"):
        Trainer(job(str(tmp_path), create_seed_checkpoint=True)).checkpoint.create_seed_checkpoint()
    with pytest.raises(UserError, match="enable_checkpoint"):
        job_config("--checkpoint.create_seed_checkpoint")


def test_gc_freq_collects_on_chosen_steps_only(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    with pytest.raises(RuntimeError, match="a run that fails"):
        with GarbageCollection(3) as collection:
            assert not gc.isenabled()
            for step in range(1, 8):
                collection.run(step)
            raise RuntimeError("a run that fails still gives automatic collection back")
    assert gc.isenabled() and collected == [1, 1, 1]  # at start, then steps 3 and 6
    GarbageCollection(0).run(3)
    assert len(collected) == 3


def test_color_printing_colours_the_log_line():
    metrics = {
        "loss_metrics/global_avg_loss": 2.5,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "throughput/tps": 100.0,
        "memory/rss(GiB)": 1.0,
    }
    plain, coloured = format_log_line(3, metrics), format_log_line(3, metrics, color=True)
    assert "\033[" not in plain and "\033[" in coloured
    assert coloured.replace("\033[39m", "").count("step:") == 1


def test_metrics_of_every_rank_when_not_rank_0_only(tmp_path, monkeypatch):
    config = job_config("--job.dump_folder", str(tmp_path), "--metrics.rank_0_only", "false")
    first = build_metric_logger(config, "AdamW", 0)
    second = build_metric_logger(config, "AdamW", 0)  # the same second: a folder of its own
    assert second.run_dir == first.run_dir + "-2"
    # Rank 1 takes the folder rank 0 chose (what the gather over the world group returns), never its own guess.
    monkeypatch.setattr(metrics, "all_gather_objects", lambda value, group: [second.run_dir, value])
    loggers = [second, build_metric_logger(config, "AdamW", 1)]
    assert loggers[1].run_dir == os.path.join(second.run_dir, "rank_1")
    first.close()
    for logger in loggers:
        logger.log({"loss": 1.0}, 1)
        logger.close()
    assert os.path.isfile(os.path.join(loggers[1].run_dir, "metrics.jsonl"))
    only_0 = job_config("--job.dump_folder", str(tmp_path / "b"))
    assert build_metric_logger(only_0, "AdamW", 1).run_dir is None
