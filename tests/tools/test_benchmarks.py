"""The benchmark scripts measure what they say: the optimizer selection is honoured, a peak is of a steady step,
a timed size is large enough that a call's fixed cost does not decide a ratio, and a checkpoint's allowed memory
rise is derived from the optimizer's largest state tensor."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks import bench_loss, bench_optimizers, bf16_momentum_rounding
from scripts import checkpoint_memory
from tests.helpers import DEBUG_CONFIG, job_config
from torchtitan.errors import UserError
from torchtitan.gpu_check import context
from torchtitan.gpu_check import steps as plan


def test_bench_optimizers_times_only_the_chosen_optimizers(capsys):
    bench_optimizers.main(
        ["--device", "cpu", "--shapes", "tiny", "--steps", "1", "--warmup", "0", "--optimizers", "Muon"]
    )
    timed = [line.split("  ")[0].strip() for line in capsys.readouterr().out.splitlines()[2:]]
    assert timed == ["AdamW (fused)", "Muon (bf16 NS)", "Muon (fp32 NS)"]  # the baseline, then Muon's variants
    with pytest.raises(UserError, match="--optimizers: AdamW8bit not timed here"):
        bench_optimizers.selected_families("Muon,AdamW8bit")


def test_bench_optimizers_cpu_clock_counts_only_the_steps_threads(monkeypatch):
    monkeypatch.setattr(bench_optimizers.torch, "get_num_threads", lambda: 1)
    assert bench_optimizers.cpu_clock() is time.thread_time  # one thread: nothing else runs the step
    monkeypatch.setattr(bench_optimizers.torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(UserError, match="set OMP_WAIT_POLICY=PASSIVE"):
        bench_optimizers.cpu_clock()  # spinning idle threads would be counted
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert bench_optimizers.cpu_clock() is time.process_time
    with pytest.raises(UserError, match="--clock cpu times CPU steps only"):
        bench_optimizers.main(["--device", "cuda", "--clock", "cpu"])


def test_gpu_check_passes_its_optimizers_to_the_benchmark():
    ctx = context.Context(sizes=context.Sizes.for_run(True), out=None, dry_run=True, optimizers=["Muon", "AdamW8bit"])
    ctx.found = {"torchao": "0.17.0"}
    assert plan.bench_optimizer_names(ctx) == ["Muon"]
    ctx.optimizers, ctx.found = None, {"torchao": None}  # without torchao the low-bit variants are left out
    assert plan.bench_optimizer_names(ctx) == ["AdamW", "AdamMini", "Muon", "NorMuon", "AdEMAMix", "SOAP"]


def test_bench_loss_peaks_are_of_a_steady_step():
    job = job_config(
        "--job.config_file", DEBUG_CONFIG, "--memory_estimation.vocab_size", "256",
        "--training.batch_size", "2", "--training.seq_len", "256",
    )  # fmt: skip
    fresh = bench_loss.Trainer(job, 1, torch.device("cpu"))
    first_step = fresh.peak_bytes(1)  # AdamW's state appears only in its optimizer step, after backward's peak
    trainer = bench_loss.Trainer(job, 1, torch.device("cpu"))
    peaks = bench_loss.measure_peaks(trainer, [1, 4])
    assert peaks[1] == trainer.peak_bytes(1) and peaks[4] == trainer.peak_bytes(4)
    assert first_step < peaks[1]  # a steady step's backward holds the state too


def test_rounding_speed_is_timed_where_fixed_costs_do_not_decide():
    def seconds_at(n: int) -> float:  # 10 us per call plus 1 ns per entry
        return 10e-6 + n * 1e-9

    n, fixed_share = bf16_momentum_rounding.speed_size(seconds_at)
    assert n == 1 << 20 and fixed_share <= bf16_momentum_rounding.OVERHEAD_FRACTION
    assert seconds_at(n // 4) < seconds_at(1) / bf16_momentum_rounding.OVERHEAD_FRACTION  # the smallest such size
    # A call whose cost never outgrows its fixed part stops at the largest size, and says how much it weighs.
    assert bf16_momentum_rounding.speed_size(lambda n: 1.0) == (bf16_momentum_rounding.LARGEST, 1.0)


def test_checkpoint_memory_allows_adamw_one_largest_state_tensor():
    args = checkpoint_memory.DRY_RUN_MODEL
    measured = checkpoint_memory.measure("AdamW", args, torch.device("cpu"), async_save=False)
    model = checkpoint_memory.Transformer(args)
    largest = max(p.numel() for p in model.parameters()) * 4  # float32 moments shaped like the weights
    assert measured["largest plain"] == largest
    assert checkpoint_memory.rise_limit(measured) == largest + checkpoint_memory.ALLOCATOR_SLACK
    quantized = {"largest": 10 * 2**20, "largest plain": 0}
    assert checkpoint_memory.rise_limit(quantized) == int(2.5 * 10 * 2**20) + checkpoint_memory.ALLOCATOR_SLACK
