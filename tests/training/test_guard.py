"""The divergence guard: non-finite steps are skipped on every rank alike, a diverging run stops with exit code 3
before writing a broken checkpoint, and the last finite checkpoint survives ``keep_latest_k``."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import train as train_module
from tests.distributed import run_workers
from tests.helpers import DEBUG_RUN, ROOT, Trainer, checkpoint_job, event_tags, metric_rows, run_dir, train
from torchtitan.training import job as job_module
from torchtitan.training import step as step_module
from torchtitan.training.guard import DivergenceError, DivergenceGuard, resume_hint, tensors_are_finite
from torchtitan.training.preemption import Preemption
from torchtitan.training.step import train_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

NAN, INF = float("nan"), float("inf")
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------------------------
# Pure pieces


def test_finiteness_check_finds_nan_and_inf_in_any_float_dtype_only():
    big = torch.full((3,), 3e38)  # near float32's max: its square would overflow, its max-abs does not
    assert tensors_are_finite([big, torch.ones(2, dtype=torch.bfloat16), torch.empty(0), torch.arange(3), 1.5, None])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for bad in (NAN, INF, -INF):
            poisoned = torch.zeros(4, 5, dtype=dtype)
            poisoned[3, 1] = bad
            assert not tensors_are_finite([torch.ones(2), poisoned]), (dtype, bad)


def decisions(guard: DivergenceGuard, values: list[float]) -> list[bool]:
    return [guard.should_update(torch.tensor(v), torch.tensor(1.0), step) for step, v in enumerate(values, 1)]


def test_guard_skips_non_finite_steps_and_stops_after_the_allowed_streak():
    guard = DivergenceGuard(max_skipped_steps=2, device=CPU)
    assert decisions(guard, [1.0, NAN, INF, 2.0, NAN, NAN]) == [True, False, False, True, False, False]
    assert guard.stopped_at is None  # a finite step reset the count: never more than 2 in a row
    assert not guard.should_update(torch.tensor(1.0), torch.tensor(NAN), 7)  # a non-finite grad norm counts too
    assert guard.stopped_at == 7 and guard.first_skipped == 5
    message = str(guard.error(resume_hint(4, "ckpt")))
    assert "non-finite at step 5 and stayed so through step 7" in message and "step-4 in ckpt" in message


def test_zero_allowed_skips_stops_at_the_first_and_says_when_there_is_no_checkpoint():
    guard = DivergenceGuard(max_skipped_steps=0, device=CPU)
    assert decisions(guard, [1.0, NAN]) == [True, False]
    assert guard.stopped_at == 2
    message = str(guard.error(resume_hint(None, "ckpt")))
    assert "non-finite at step 2 (" in message and "no checkpoint was written in ckpt" in message
    assert "checkpointing is off" in resume_hint(None, None)


# ------------------------------------------------------------------------------------------------------------------
# Two ranks: one rank's NaN is every rank's decision; one rank's non-finite shard refuses the save everywhere


def _two_ranks(rank, world_size, folder):
    guard = DivergenceGuard(max_skipped_steps=1, device=CPU)
    local_loss = [1.0, NAN if rank == 1 else 1.0, 1.0, NAN if rank == 0 else 1.0, NAN if rank == 1 else 1.0]
    updates = decisions(guard, local_loss)

    trainer = Trainer(checkpoint_job(folder, steps=4, interval=2, keep_latest_k=1))
    trainer.run(2)  # saves step-2
    refusals = []
    param = next(trainer.model.parameters())
    optimizer_state = trainer.optimizers.optimizer.state[param]["exp_avg"]
    for tensor, poisoned_rank in ((param, 1), (optimizer_state, 0)):
        local = tensor.to_local()
        kept = local.detach().clone()
        with torch.no_grad():
            if rank == poisoned_rank:
                local.view(-1)[0] = NAN
            try:
                trainer.checkpoint.save(4, force=True)
                refusals.append(None)
            except DivergenceError as e:
                refusals.append(str(e))
            local.copy_(kept)
    listing_after_refusals = sorted(os.listdir(os.path.join(folder, "checkpoint")))
    trainer.checkpoint.save(4, force=True)  # finite again: saved, and keep_latest_k=1 prunes step-2
    listing_after_save = sorted(os.listdir(os.path.join(folder, "checkpoint")))
    return updates, guard.stopped_at, refusals, listing_after_refusals, listing_after_save, _stop_flag(rank)


def _stop_flag(rank: int) -> tuple[list[bool], int, int]:
    """Rank 1 is signalled from step 3 on: what each rank's guard says of a stop per step, the all-reduces they
    took, and the process groups the preemption handler made."""
    groups = dist.distributed_c10d._world.group_count
    preemption = Preemption()
    preemption.restore()
    step = 0
    guard = DivergenceGuard(1, CPU, stop_signal=lambda: rank == 1 and step >= 3)
    real, reductions, stops = dist.all_reduce, [], []

    def counted(*args, **kwargs):
        reductions.append(None)
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        for step in range(1, 5):
            guard.should_update(torch.tensor(1.0), torch.tensor(1.0), step)
            stops.append(guard.stop_requested)
    finally:
        dist.all_reduce = real
    return stops, len(reductions), dist.distributed_c10d._world.group_count - groups


def test_two_ranks_decide_together_and_refuse_non_finite_state(tmp_path):
    results = run_workers(_two_ranks, world_size=2, args=(str(tmp_path),))
    for updates, stopped_at, refusals, after_refusals, after_save, stop_flag in results:
        # A stop signal on one rank reaches every rank through the guard's all-reduce: no collective of its own.
        assert stop_flag == ([False, False, True, True], 4, 0)
        assert updates == [True, False, True, False, False]
        assert stopped_at == 5
        assert len(refusals) == 2
        for message in refusals:
            assert message is not None and "non-finite at step 4" in message and "step-2" in message
        assert after_refusals == ["step-2"]  # nothing written, not even a temporary folder
        assert after_save == ["step-4"]


# ------------------------------------------------------------------------------------------------------------------
# train.py in this process: one injected non-finite gradient skips exactly that step


def in_process_run(tmp_path, monkeypatch, nan_at_step=None, *extra):
    """train.run() on the tiny debug job; per step: (updated, params and optimizer state unchanged by the step),
    and the metrics.jsonl rows."""
    real_step, real_clip = train_step, step_module.clip_grad_norm_
    record, calls = {}, []

    def clip_with_injection(parameters, max_norm):
        parameters = list(parameters)
        calls.append(None)
        if len(calls) == nan_at_step:
            with torch.no_grad():
                parameters[len(parameters) // 2].grad.view(-1)[0] = NAN
        return real_clip(parameters, max_norm)

    def observed_step(model, optimizers, *args):
        before = [t.detach().clone() for t in _state(model, optimizers)]
        loss, grad_norm, updated = real_step(model, optimizers, *args)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, _state(model, optimizers), strict=True))
        record[len(record) + 1] = (updated, unchanged)
        return loss, grad_norm, updated

    monkeypatch.setattr(job_module, "train_step", observed_step)  # the step train.py's loop runs (Job.step)
    monkeypatch.setattr(step_module, "clip_grad_norm_", clip_with_injection)
    monkeypatch.setattr(sys, "argv", ["train.py", *DEBUG_RUN, "--job.dump_folder", str(tmp_path), *extra])
    monkeypatch.chdir(ROOT)
    code = train_module.run()
    rows = metric_rows(run_dir(tmp_path))
    return code, record, [r for r in rows if "loss_metrics/global_avg_loss" in r]


def _state(model, optimizers):
    state = list(model.parameters())
    for per_param in optimizers.optimizers[0].state.values():
        state += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    return state


def test_one_transient_non_finite_gradient_skips_exactly_one_step(tmp_path, monkeypatch):
    every_step = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]
    code, record, rows = in_process_run(tmp_path / "nan", monkeypatch, 3, *every_step)
    assert code == 0
    assert record == {
        1: (True, False),
        2: (True, False),
        3: (False, True),
        4: (True, False),
        5: (True, False),
        6: (True, False),
    }
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert math.isnan(rows[2]["grad_norm"]) and all(math.isfinite(r["grad_norm"]) for i, r in enumerate(rows) if i != 2)
    assert sorted(os.listdir(tmp_path / "nan" / "checkpoint" / "AdamW")) == [
        "step-1",
        "step-2",
        "step-4",
        "step-5",
        "step-6",
    ]

    _, _, clean = in_process_run(tmp_path / "clean", monkeypatch)
    # The skipped step consumed its batch and advanced the schedule: the same lr at every step, the same loss up
    # to step 3 (its loss was computed before the update was dropped), other losses afterwards.
    assert [r["lr"] for r in rows] == [r["lr"] for r in clean]
    loss = "loss_metrics/global_avg_loss"
    assert [r[loss] for r in rows[:3]] == [r[loss] for r in clean[:3]]
    assert rows[3][loss] != clean[3][loss]


# ------------------------------------------------------------------------------------------------------------------
# A diverging run, as a user starts it


def test_the_diverging_run_stops_with_code_3_and_keeps_its_last_finite_checkpoint(tmp_path):
    # optimizer.lr 1e6 makes the loss NaN from step 3 on; a checkpoint every 2 steps keeping only the newest one
    # would, unguarded, let NaN checkpoints push out step-2.
    result = train(
        tmp_path,
        "--optimizer.lr",
        "1e6",
        "--training.max_norm",
        "1e9",
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "1",
        check=False,
    )
    assert result.returncode == 3, result.stderr[-4000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(
        "error: training diverged: the loss or gradients became non-finite at step 3 and stayed so through step 6"
    ), lines[-1]
    assert "step-2 in " in lines[-1] and "--checkpoint.load_step 2" in lines[-1]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in result.stderr
    for step in (3, 4, 5):
        assert any(f"WARNING step {step}: loss or gradient norm is non-finite" in line for line in lines), step
    assert os.listdir(tmp_path / "checkpoint" / "AdamW") == ["step-2"]
    rows = metric_rows(run_dir(tmp_path))
    assert [r["skipped_steps"] for r in rows if "skipped_steps" in r] == [0, 0, 1, 2, 3, 4]
    assert "skipped_steps" in event_tags(run_dir(tmp_path))
