"""Collectives only on tensors their group's backend can take (NCCL reduces CUDA tensors only).

No GPU runs in CI, so the rule is checked over the source: collectives are called in
``torchtitan/distributed/collectives.py`` (whose helpers put their tensor on the device the caller names) or on the
checkpoint manager's own gloo group, and
every call of those helpers names a device. The helpers reduce over gloo in every multi-process train.py test.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT
from torchtitan.distributed import collectives

COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
}
HOME = ROOT / "torchtitan" / "distributed" / "collectives.py"
# Groups created with an explicit CPU backend, where CPU tensors are right: (file, the group expression).
CPU_GROUPS = {(ROOT / "torchtitan" / "checkpoint" / "manager.py", "self._group")}
# Helper name -> the number of positional arguments that include the device.
HELPERS = {"all_reduce_scalar": 4, "any_rank": 2}


def project_sources() -> list[Path]:
    files = [ROOT / "train.py", ROOT / "estimation.py"]
    for folder in ("torchtitan", "benchmarks", "scripts"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if f.exists()]


def _is_dist(node: ast.expr) -> bool:
    """``dist`` or ``torch.distributed``."""
    if isinstance(node, ast.Name):
        return node.id == "dist"
    return isinstance(node, ast.Attribute) and node.attr == "distributed" and _is_dist_root(node.value)


def _is_dist_root(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "torch"


def _group_expr(call: ast.Call) -> str | None:
    for keyword in call.keywords:
        if keyword.arg in ("group", "process_group"):
            return ast.unparse(keyword.value)
    return None


def _where(path: Path, node: ast.Call) -> str:
    return f"{os.path.relpath(path, ROOT)}:{node.lineno} {ast.unparse(node)}"


def collective_calls_outside_home(path: Path) -> list[str]:
    """``file:line call`` for every torch.distributed collective not in the home module nor on a CPU group."""
    if path == HOME:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES or not _is_dist(node.func.value):
            continue
        if (path, _group_expr(node)) in CPU_GROUPS:
            continue
        found.append(_where(path, node))
    return found


def helper_calls_without_device(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name not in HELPERS:
            continue
        names_device = any(k.arg == "device" for k in node.keywords)
        if len(node.args) < HELPERS[name] and not names_device:
            found.append(_where(path, node))
    return found


def test_collectives_run_only_in_their_home_or_on_cpu_groups():
    offenders = [line for path in project_sources() for line in collective_calls_outside_home(path)]
    assert offenders == [], (
        "call torchtitan.distributed.collectives (which puts the tensor on the group's device) instead"
    )


def test_every_collective_helper_call_names_its_device():
    offenders = [line for path in project_sources() for line in helper_calls_without_device(path)]
    assert offenders == []


def test_cpu_groups_are_created_with_a_cpu_backend():
    for path, expression in CPU_GROUPS:
        creations = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Assign)
            and any(ast.unparse(t) == expression for t in node.targets)
            and isinstance(node.value, ast.Call)
        ]
        assert creations, f"{expression} is never created in {path}"
        for node in creations:
            backends = [k.value for k in node.value.keywords if k.arg == "backend"]
            assert [ast.literal_eval(b) for b in backends] == ["gloo"], ast.unparse(node)


def test_the_source_check_sees_a_cpu_tensor_collective(tmp_path):
    """The check itself: the world all-reduce of a CPU tensor that once stopped every multi-GPU run is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nimport torch.distributed as dist\n"
        "dist.all_reduce(torch.tensor(1.0))\ntorch.distributed.broadcast(x, 0)\n"
        "all_reduce_scalar(torch.tensor(1.0), 'sum', None)\n"
    )
    assert len(collective_calls_outside_home(bad)) == 2
    assert len(helper_calls_without_device(bad)) == 1


def test_helpers_without_a_process_group_return_the_value():
    cpu = torch.device("cpu")
    assert collectives.all_reduce_scalar(2.5, "mean", None, cpu) == 2.5
    assert collectives.all_reduce_scalar(torch.tensor(3), "sum", None, cpu) == 3.0
    # Python numbers keep float64 precision: a time stamp (the run folder's name) and a large byte count.
    assert collectives.all_reduce_scalar(1796142047.25, "max", None, cpu) == 1796142047.25
    assert collectives.all_reduce_scalar(123_456_789_012, "sum", None, cpu) == 123_456_789_012
    assert collectives.any_rank(torch.tensor(True), cpu) is True
    assert collectives.any_rank(False, cpu) is False
    with pytest.raises(ValueError, match="unknown reduction"):
        collectives.all_reduce_scalar(1.0, "min", None, cpu)


# ----------------------------------------------------------------------------------------------------------------
# Start-up: ranks compile for different times before their first collectives


def _first_step_with_compile_delays(rank: int, world_size: int, delays: list[float]) -> int:
    import time

    import torch.distributed as dist

    from tests.helpers import job_config

    comm = job_config("--comm.init_timeout_seconds", "1", "--comm.first_step_timeout_seconds", "60").comm
    collectives.set_collective_timeout(comm.init_timeout_seconds, None)  # the group as init_distributed leaves it
    collectives.first_step_timeouts(comm, None)  # as train.py, before compiling
    time.sleep(delays[rank])  # this rank's compile: from a warm cache, or cold
    total = torch.ones(1)
    dist.all_reduce(total)  # the first step's first collective waits for the slowest rank
    return collectives.training_timeouts(comm, None)


def test_the_first_step_outwaits_a_cold_compile_on_one_rank_and_training_goes_back_to_its_timeout():
    from tests.distributed import run_workers

    # Rank 1 compiles 3 s longer than rank 0, three times the 1 s start-up timeout.
    assert run_workers(_first_step_with_compile_delays, world_size=2, args=([0.0, 3.0],)) == [1, 1]
