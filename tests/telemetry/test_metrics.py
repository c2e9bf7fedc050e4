"""What a GPU run reports about memory and speed, checked on CPU: the MFU peak per device name, peak allocated and
reserved memory as GiB and % of the device, and the allocator setting train.py applies before torch starts."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.helpers import ROOT, TRAIN
from torchtitan.distributed.cuda_allocator import DEFAULT_ALLOC_CONF, allocator_environ, allocator_setting
from torchtitan.models.llama import ModelArgs
from torchtitan.telemetry.metrics import cuda_memory_metrics, format_log_line, model_flops_per_token, peak_flops_for


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),  # SXM
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA GeForce RTX 4090", None),  # not in the table: no MFU rather than a wrong one
    ],
)
def test_mfu_peak_by_device_name(name, tflops):
    peak = peak_flops_for(name)
    assert (peak if peak is None else round(peak / 1e12)) == tflops


def test_model_flops_count_every_parameter_but_the_embedding():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=256)  # head_dim 8
    # 6 x the 1000 non-embedding parameters, plus 12 x layers x heads x head_dim x sequence length for attention
    assert model_flops_per_token(256 * 32 + 1000, args, seq_len=16) == 6 * 1000 + 12 * 2 * 4 * 8 * 16


def test_model_flops_of_a_tied_model_keep_the_output_projection():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=256, enable_weight_tying=True)
    # The 256 x 32 tied weight, counted once among the parameters, is the output projection's matmul.
    assert model_flops_per_token(256 * 32 + 1000, args, seq_len=16) == 6 * (256 * 32 + 1000) + 12 * 2 * 4 * 8 * 16


def test_memory_metrics_report_allocated_and_reserved_peaks():
    gib = 2**30
    stats = {"allocated_bytes.all.peak": 30 * gib, "reserved_bytes.all.peak": 45 * gib, "active_bytes.all.peak": 1}
    metrics = cuda_memory_metrics(stats, device_bytes=80 * gib)
    assert metrics == {
        "memory/max_allocated(GiB)": 30.0,
        "memory/max_allocated(%)": 37.5,
        "memory/max_reserved(GiB)": 45.0,
        "memory/max_reserved(%)": 56.25,
    }
    line = format_log_line(
        7, {"loss_metrics/global_avg_loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "throughput/tps": 10.0, **metrics}
    )
    assert "memory: 30.00GiB(37.5%) allocated 45.00GiB(56.2%) reserved" in line


def test_expandable_segments_unless_the_user_set_the_allocator():
    assert allocator_environ({}) == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_ALLOC_CONF}
    assert allocator_environ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == {}
    assert allocator_environ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}
    assert allocator_setting({"PYTORCH_ALLOC_CONF": "x:1"}) == "PYTORCH_ALLOC_CONF=x:1"
    assert allocator_setting({}) == "CUDA allocator defaults"


def test_train_py_sets_the_allocator_before_importing_torch():
    """Launched as ``torchrun train.py``, the setting must be in the environment before torch (or any module that
    imports it) is imported; the allocator module itself imports no torch."""
    body = ast.parse(open(TRAIN).read()).body
    setting = next(i for i, node in enumerate(body) if "allocator_environ(os.environ)" in ast.unparse(node))
    imports = [
        i
        for i, node in enumerate(body)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and "cuda_allocator" not in ast.unparse(node)
    ]
    late = [ast.unparse(body[i]) for i in imports if i < setting and not _standard_library(body[i])]
    assert late == []
    code = "import sys, torchtitan.distributed.cuda_allocator; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _standard_library(node: ast.stmt) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return all(n.split(".")[0] in sys.stdlib_module_names or n == "__future__" for n in names)
