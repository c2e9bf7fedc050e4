"""On a CUDA GPU: a one-GPU job computes in bf16 through CUDA autocast over float32 weights, memory metrics come
from the allocator, the device is in the MFU table, and the sweep hands out the GPUs torch sees. Skipped without
CUDA (scripts/gpu_check.sh runs it)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY, fake_sweep, job_config, one_error_line, status_of
from torchtitan.parallelisms import ParallelDims
from torchtitan.telemetry.metrics import memory_metrics, peak_flops
from torchtitan.training.step import build_model, init_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_one_gpu_job_computes_in_bf16_with_float32_weights():
    device = torch.device("cuda", torch.cuda.current_device())
    config = job_config()
    dims = ParallelDims(1, 1, 1, 1)
    model = init_model(build_model(config, TINY, dims, None, compute_device_type="cuda"), device, 0)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.max_seq_len), device=device)
    logits = model(tokens)
    logits.float().sum().backward()
    assert logits.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
    metrics = memory_metrics(device)
    assert 0 < metrics["memory/max_allocated(GiB)"] <= metrics["memory/max_reserved(GiB)"]
    assert 0 < metrics["memory/max_reserved(%)"] < 100


def test_this_gpu_has_an_mfu_peak():
    name = torch.cuda.get_device_name()
    assert peak_flops(torch.device("cuda")) is not None, f"add '{name}' to torchtitan/telemetry/metrics.py's peak table"


def test_the_sweep_gives_each_run_gpus_that_torch_sees_and_no_more(tmp_path, capsys):
    count = torch.cuda.device_count()
    assert fake_sweep(tmp_path / "ok", "--optimizers", "AdamW", "--lrs", "1e-3", "--parallel", "1") == 0
    environment = status_of(tmp_path / "ok" / "runs" / "AdamW_lr1e-3_seed0")["environment"]
    assert environment["CUDA_VISIBLE_DEVICES"] == "0" and environment["NGPU"] == "1"
    capsys.readouterr()
    assert fake_sweep(tmp_path / "no", "--optimizers", "AdamW", "--lrs", "1e-3", "--parallel", str(count + 1)) == 2
    assert f"need {count + 1} GPUs, but {count} are present" in one_error_line(capsys)
    assert not (tmp_path / "no").exists()
