"""estimation.py counts SOAP's state exactly: in one process against a real step, and on 2 FSDP ranks against
rank 0 of a real two-process step (each hidden matrix's state whole on its owner, round-robin); on 8 simulated FSDP
ranks rank 0 holds the state of every eighth hidden matrix whole, its AdamW part's shard and a step per parameter."""

from __future__ import annotations

import math

import torch

from tests.distributed import run_workers
from tests.estimation.test_estimation import VOCAB, _job, _measure_real_steps
from torchtitan.estimation import estimate_memory
from torchtitan.optim.muon.optimizer import split_hidden_matrices
from torchtitan.optim.soap.update import matrix_state_numel

# The debug model (dim 256, 768 hidden neurons): attention matrices rotated on both sides, MLP ones on one.
MAX_DIM = "256"


def _soap_job(world_size: int):
    return _job(
        "--memory_estimation.world_size",
        str(world_size),
        "--memory_estimation.optimizers",
        f"AdamW,SOAP:max_precondition_dim={MAX_DIM}",
        "--optimizer.max_precondition_dim",
        MAX_DIM,
    )


def test_one_process_estimate_counts_the_state_of_a_real_step():
    job = _soap_job(1)
    adamw, soap = estimate_memory(job).optimizers
    measured = _measure_real_steps(job, 1, None, ["SOAP"], seed=0)
    assert soap.optimizer_state == measured["SOAP"]["state"]
    # AdamW's two moments (and step) per parameter, plus a statistic and a basis per rotated side of each matrix.
    extra = sum(matrix_state_numel(tuple(p.shape), int(MAX_DIM)) - 2 * p.numel() for p in _split(job)[0])
    assert soap.optimizer_state == adamw.optimizer_state + 4 * extra


def _split(job) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The job's model (on the meta device): its hidden matrices and its other parameters."""
    from torchtitan.config.preflight import model_args_for
    from torchtitan.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(model_args_for(job, VOCAB))
    matrices, others = split_hidden_matrices(model.named_parameters(), model.named_param_roles())
    return [p for _, p in matrices], [p for _, p in others]


def _real_rank(rank: int, world_size: int) -> dict:
    from torchtitan.parallelisms import ParallelDims

    job = _soap_job(world_size)
    mesh = ParallelDims.from_job_config(job, world_size).build_mesh("cpu")
    return _measure_real_steps(job, world_size, mesh, ["SOAP"], seed=rank)["SOAP"]["state"]


def test_two_rank_estimate_counts_the_state_of_rank_0_of_a_real_step():
    _, soap = estimate_memory(_soap_job(2)).optimizers
    real = run_workers(_real_rank, world_size=2)
    assert soap.optimizer_state == real[0]
    # Between them the two ranks hold each matrix's state once, AdamW's moments once, and a step per parameter each.
    job = _soap_job(2)
    matrices, others = _split(job)
    whole = 4 * sum(matrix_state_numel(tuple(p.shape), int(MAX_DIM)) for p in matrices)
    assert sum(real) == whole + 2 * 4 * sum(p.numel() for p in others) + 2 * 4 * (len(matrices) + len(others))


def test_state_on_8_fsdp_ranks_is_every_eighth_matrix_whole_on_rank_0():
    job = _soap_job(8)
    adamw, soap = estimate_memory(job).optimizers
    matrices, others = _split(job)
    owned = matrices[::8]  # one group (FSDP's ranks): matrix j is owned by rank j mod 8
    matrix_state = 4 * sum(matrix_state_numel(tuple(p.shape), int(MAX_DIM)) for p in owned)
    # FSDP2 gives rank 0 the first ceil(rows / 8) rows of every parameter: AdamW's two float32 moments of those.
    adamw_part = 2 * 4 * sum(math.ceil(p.shape[0] / 8) * (p.numel() // p.shape[0]) for p in others)
    steps = 4 * (len(matrices) + len(others))  # a float32 step counter per parameter
    assert soap.optimizer_state == matrix_state + adamw_part + steps
    print(f"SOAP state on rank 0 of FSDP 8: {soap.optimizer_state / adamw.optimizer_state:.2f}x AdamW's")


def test_the_simulated_step_of_soaps_adamw_part_is_named_as_muons():
    from tests.helpers import job_config
    from torchtitan.estimation.simulate import simulated_implementation

    job = job_config("--optimizer.name", "SOAP")
    assert simulated_implementation(job, "cuda") == "AdamW part: foreach (torch's default on CUDA)"
    job = job_config("--optimizer.name", "SOAP", "--optimizer.implementation", "fused")
    assert simulated_implementation(job, "cpu") == "AdamW part: fused"
