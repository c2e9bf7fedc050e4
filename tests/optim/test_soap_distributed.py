"""SOAP across processes (gloo, float64), in one launch of 4 ranks: FSDP2 on 4 ranks (uneven shards: 85 hidden
neurons), tensor parallel on 2 (each TP pair one copy of the model), FSDP x TP and HSDP on 2 x 2 all equal the
one-process run, with two eigenbasis refreshes and a side left unrotated; each matrix's SOAP state lives on exactly
one rank of the ranks that split it; a step's collectives are Muon's owner rounds."""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed import run_workers
from tests.helpers import HYPER, TINY, fsdp, max_difference, tiny_model, weights
from tests.optim.parallel_worlds import CollectiveSizes, attempt, set_grads, tensor_parallel
from torchtitan.models.roles import canonical_name
from torchtitan.optim.container import OptimizersContainer
from torchtitan.optim.muon.optimizer import split_hidden_matrices
from torchtitan.optim.soap.optimizer import SOAP
from torchtitan.optim.soap.update import BASES, EXP_AVG, matrix_state_numel

WORLD = 4
STEPS = 6
SAVE_AT = 3  # between the refreshes after updates 2 and 4
# Refreshes after updates 2 and 4; the MLP's 85-neuron side is longer than 40 and stays unrotated.
OPTIONS = dict(precondition_frequency=2, max_precondition_dim=40)
# 85 hidden neurons: the MLP's matrices are cut 22, 21, 21, 21 by FSDP on 4 ranks, 43, 42 by TP (rows of w1 and w3,
# columns of w2), and unevenly again by FSDP within a TP shard.
ARGS = dataclasses.replace(TINY, multiple_of=5)
pytestmark = pytest.mark.timeout(600)


def soap_for(model: torch.nn.Module) -> SOAP:
    """SOAP with HYPER on the hidden matrices and torch's AdamW on the rest, as the builder splits them."""
    matrices, others = split_hidden_matrices(model.named_parameters(), model.named_param_roles())
    adamw = torch.optim.AdamW([p for _, p in others], foreach=False, **HYPER)
    return SOAP([p for _, p in matrices], **HYPER, **OPTIONS, others=adamw)


def _parallel_model(layout: str) -> torch.nn.Module:
    model = tiny_model(ARGS)
    if layout == "fsdp":
        fsdp(model, init_device_mesh("cpu", (WORLD,)))
    elif layout == "tp":
        tensor_parallel(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("copy", "tp"))["tp"])
    elif layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        fsdp(model, mesh["dp"])
    elif layout == "hsdp":
        fsdp(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")))
    elif layout != "single":
        raise ValueError(layout)
    return model


def _train(layout: str) -> dict[str, Any]:
    model = _parallel_model(layout)
    optimizer = soap_for(model)
    for step in range(STEPS):
        set_grads(model, step)
        optimizer.step()
    holds = {}
    matrices = optimizer.param_groups[0]["params"]
    names = {p: canonical_name(name) for name, p in model.named_parameters()}
    for p in matrices:
        state = optimizer.state[p]
        holds[names[p]] = sum(t.numel() for key, t in state.items() if key != "step") if EXP_AVG in state else 0
    return {"weights": weights(model), "holds": holds}


def _collectives(layout: str) -> dict[str, Any]:
    model = _parallel_model(layout)
    optimizer = soap_for(model)
    for step in range(2):
        set_grads(model, step)
        if step == 1:
            with CollectiveSizes() as comm:
                optimizer.step()
        else:
            optimizer.step()
    return {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items() if n}


def _train_steps(model: torch.nn.Module, optimizer: SOAP, steps: range) -> dict[str, torch.Tensor]:
    for step in steps:
        set_grads(model, step)
        optimizer.step()
    return weights(model)


def _save(layout: str, path: str) -> dict[str, torch.Tensor]:
    """Train SAVE_AT steps and save as the trainer does (the optimizers container's flat state dict)."""
    model = _parallel_model(layout)
    optimizers = OptimizersContainer([model], [soap_for(model)], "SOAP")
    trained = _train_steps(model, optimizers.optimizers[0], range(SAVE_AT))
    dcp.save({"model": get_model_state_dict(model), "optim": optimizers.state_dict()}, checkpoint_id=path)
    return trained


def _resume(layout: str, path: str) -> dict[str, torch.Tensor]:
    """A fresh model and optimizer loaded from ``path`` as the trainer loads them; then the remaining steps."""
    model = _parallel_model(layout)
    optimizers = OptimizersContainer([model], [soap_for(model)], "SOAP")
    state = {"model": get_model_state_dict(model), "optim": optimizers.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=not torch.distributed.is_initialized())
    set_model_state_dict(model, state["model"])
    optimizers.load_state_dict(state["optim"])
    return _train_steps(model, optimizers.optimizers[0], range(SAVE_AT, STEPS))


def _runs(rank: int, world_size: int, checkpoint_dir: str) -> bytes:
    runs = {layout: attempt(_train, layout) for layout in ("fsdp", "tp", "fsdp_tp", "hsdp")}
    runs["comm_fsdp"] = attempt(_collectives, "fsdp")
    runs["comm_fsdp_tp"] = attempt(_collectives, "fsdp_tp")
    runs["save"] = attempt(_save, "fsdp", checkpoint_dir)
    runs["resume_hsdp"] = attempt(_resume, "hsdp", checkpoint_dir)
    buffer = io.BytesIO()
    torch.save(runs, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("soap_dcp"))


@pytest.fixture(scope="module")
def world(checkpoint_dir):
    return [torch.load(io.BytesIO(data), weights_only=False) for data in run_workers(_runs, WORLD, (checkpoint_dir,))]


@pytest.fixture(scope="module")
def single_process():
    return _train("single")


def _result(world: list[dict[str, Any]], name: str) -> list[Any]:
    for rank, runs in enumerate(world):
        ok, value = runs[name]
        if not ok:
            pytest.fail(f"{name} failed on rank {rank}:\n{value}")
    return [runs[name][1] for runs in world]


@pytest.mark.parametrize("layout", ["fsdp", "tp", "fsdp_tp", "hsdp"])
def test_parallel_run_equals_single_process(world, single_process, layout):
    results = _result(world, layout)
    for result in results:
        assert max_difference(result["weights"], single_process["weights"]) < 1e-10
    assert max_difference(single_process["weights"], weights(tiny_model(ARGS))) > 1e-3  # it trained


# Ranks that hold one copy of every matrix between them: all 4 (FSDP, FSDP x TP), each TP pair, each HSDP replica.
COPIES = {"fsdp": [[0, 1, 2, 3]], "tp": [[0, 1], [2, 3]], "fsdp_tp": [[0, 1, 2, 3]], "hsdp": [[0, 1], [2, 3]]}


@pytest.mark.parametrize("layout", ["fsdp", "tp", "fsdp_tp", "hsdp"])
def test_each_matrix_state_lives_whole_on_one_rank_of_those_that_split_it(world, single_process, layout):
    results = _result(world, layout)
    whole = single_process["holds"]
    shapes = {name: tuple(p.shape) for name, p in tiny_model(ARGS).named_parameters()}
    assert set(whole) == {name for name in shapes if name.startswith("layers.") and len(shapes[name]) == 2}
    for name, entries in whole.items():
        assert entries == matrix_state_numel(shapes[name], OPTIONS["max_precondition_dim"])
        for ranks in COPIES[layout]:
            holders = [rank for rank in ranks if results[rank]["holds"][name]]
            assert len(holders) == 1, f"{name}: held by ranks {holders} of {ranks}"
            assert results[holders[0]]["holds"][name] == entries
    # Round-robin: the ranks of a group own matrices in turn.
    owners = [next(r for r in COPIES[layout][0] if results[r]["holds"][name]) for name in whole]
    assert len(set(owners)) == len(COPIES[layout][0])


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_a_step_is_owner_rounds_only(world, layout):
    """Every matrix is split over all 4 ranks: one group, rounds of 4 matrices, two all-to-alls each."""
    matrices = len(split_hidden_matrices(tiny_model(ARGS).named_parameters())[0])
    for counts in _result(world, f"comm_{layout}"):
        assert counts == {"alltoall_base_": 2 * math.ceil(matrices / WORLD)}


def test_bases_are_kept_where_the_side_is_short_enough():
    model = tiny_model(ARGS)
    optimizer = soap_for(model)
    set_grads(model, 0)
    optimizer.step()
    for p in optimizer.param_groups[0]["params"]:
        assert [key in optimizer.state[p] for key in BASES] == [s <= OPTIONS["max_precondition_dim"] for s in p.shape]


def test_checkpoint_saved_under_fsdp_on_4_ranks_resumes_exactly_in_one_process_and_under_hsdp(
    world, single_process, checkpoint_dir
):
    """Each matrix's state, saved whole by its owner, loads where the new layout's owner (or one process) wants it."""
    _result(world, "save")
    assert max_difference(_resume("single", checkpoint_dir), single_process["weights"]) < 1e-10
    for resumed in _result(world, "resume_hsdp"):
        assert max_difference(resumed, single_process["weights"]) < 1e-10
