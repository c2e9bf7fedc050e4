"""What a GPU run does that a CPU run does not, applied on CPU: the model under FSDP2's bf16 policy (the policy
train.py gives a CUDA job, over gloo here) computes as the one-GPU autocast path does."""

from __future__ import annotations

import dataclasses

import torch

from tests.distributed import run_workers
from tests.helpers import TINY, job_config, materialize, meta_model
from torchtitan.distributed.utils import set_float32_matmul_precision
from torchtitan.parallelisms import ParallelDims, parallelize_llama

# Positions far enough apart that a bfloat16 rotary table would round their angles.
LONG = dataclasses.replace(TINY, max_seq_len=64)


def _bf16_policy_keeps_a_float32_rope(rank: int, world_size: int) -> dict:
    config = job_config("--training.mixed_precision_param", "bfloat16")
    dims = ParallelDims(1, world_size, 1, world_size)
    mesh = dims.build_mesh("cpu")
    # compute_device_type="cuda": the mixed precision a GPU job gets (FSDP2's bf16 policy), on CPU tensors.
    sharded = materialize(
        parallelize_llama(
            meta_model(LONG, torch.float32), mesh, dims, config, compute_device_type="cuda", tensor_device_type="cpu"
        )
    )
    one_gpu_config = job_config("--training.mixed_precision_param", "bfloat16")
    single = materialize(
        parallelize_llama(
            meta_model(LONG, torch.float32),
            None,
            ParallelDims(1, 1, 1, 1),
            one_gpu_config,
            compute_device_type="cuda",
            tensor_device_type="cpu",
        )
    )
    seen = []
    for block in sharded.layers.values():
        block.attention.register_forward_pre_hook(lambda module, args: seen.append(args[1].dtype))
    tokens = torch.randint(0, LONG.vocab_size, (2, LONG.max_seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = sharded(tokens).float()
        reference = single(tokens).float()
    return {"rope": seen, "difference": (logits - reference).abs().max().item(), "scale": reference.abs().max().item()}


def test_the_blocks_see_a_float32_rotary_table_under_the_gpus_bf16_fsdp_policy():
    for result in run_workers(_bf16_policy_keeps_a_float32_rope, world_size=2):
        assert result["rope"] == [torch.float32] * LONG.n_layers
        # The one-GPU path (autocast) to bf16's precision.
        assert result["difference"] <= 2**-6 * result["scale"]


def test_float32_matmuls_use_tf32_on_gpus_that_have_it_unless_turned_off(monkeypatch):
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    gpu, previous = torch.device("cuda", 0), torch.get_float32_matmul_precision()
    try:
        cases = [((9, 0), True, "high"), ((8, 0), True, "high"), ((7, 5), True, "highest"), ((9, 0), False, "highest")]
        for capability[0], tf32, expected in cases:
            assert set_float32_matmul_precision(tf32, gpu) == expected == torch.get_float32_matmul_precision()
        assert set_float32_matmul_precision(True, torch.device("cpu")) == "highest"  # CPU results stay exact
    finally:
        torch.set_float32_matmul_precision(previous)
    assert job_config().training.tf32 and not job_config("--training.tf32", "false").training.tf32
