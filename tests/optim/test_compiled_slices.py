"""Slicing an optimizer's parameter list so that compiled graphs are shared between layers."""

import os

import torch

from torchtitan.optim.compiled_slices import CompiledStep, repeating_slices

LAYER = ["attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"]
# Signatures as a Llama's parameters have them: both norms of a layer and the final norm share one shape, and so
# do the embedding and the output projection (tied shapes, not tied weights).
SHAPE = {"attention_norm": "norm", "ffn_norm": "norm", "norm": "norm", "tok_embeddings": "vocab", "output": "vocab"}


def _llama(n_layers: int) -> list[str]:
    return ["tok_embeddings"] + [name for _ in range(n_layers) for name in LAYER] + ["norm", "output"]


def test_every_parameter_lands_in_exactly_one_slice_and_most_slices_repeat():
    for n_layers in (1, 2, 8, 48):
        names = _llama(n_layers)
        signatures = [SHAPE.get(name, name) for name in names]
        slices = repeating_slices(list(range(len(names))), signatures)
        assert sorted(i for part in slices for i in part) == list(range(len(names)))
        assert len(slices) == n_layers  # one compiled call per layer
        distinct = {tuple(signatures[i] for i in part) for part in slices}
        assert len(distinct) <= 3, (n_layers, distinct)  # graphs to compile, whatever the depth


def test_unrelated_shapes_get_one_slice_and_nothing_gives_none():
    assert repeating_slices([4, 7, 9], ["a", "b", "c"]) == [[4, 7, 9]]
    assert repeating_slices([], []) == []


def test_compiled_step_runs_meta_tensors_eagerly_slice_by_slice():
    calls = []

    def add_one(tensors):
        calls.append(len(tensors))
        for t in tensors:
            t.add_(1)

    step = CompiledStep(add_one, "test")
    tensors = [torch.empty(2, device="meta") for _ in range(3)]
    torch._dynamo.utils.counters.clear()
    step.run([[0, 1], [2]], lambda part: ([tensors[i] for i in part],), tensors)
    assert calls == [2, 1]  # Python ran it (a compiled graph would not append), once per slice
    assert not dict(torch._dynamo.utils.counters["stats"]).get("unique_graphs")


# Two ranks of an uneven FSDP shard, one after the other in one process (dynamo's memory cleared between them) with one
# inductor cache folder: rank 1 (2 rows of the parameter's 5) compiles first, then rank 0 (3 rows) compiles the same
# step on the same global DTensor spec.
_UNEVEN_SHARDS = """
import sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan.optim.compiled_slices import CompiledStep

def double_the_gradient_in(params, grads):
    for p, g in zip(params, grads):
        p.add_(g * 2)

step = CompiledStep(double_the_gradient_in, "uneven_test")
for rank in (1, 0):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    rows = 3 if rank == 0 else 2
    p, g = (DTensor.from_local(torch.ones(rows, 4), mesh, [Shard(0)], run_check=False, shape=torch.Size([5, 4]),
                               stride=(4, 1)) for _ in range(2))
    step.run([[0]], lambda part: ([p], [g]), [p])
    print(rank, p.to_local().tolist())
    torch._dynamo.reset()
    dist.destroy_process_group()
"""


def test_a_rank_with_another_shard_shape_compiles_its_own_step_from_a_shared_cache(tmp_path):
    """AOT autograd's on-disk cache keys a DTensor by its global spec, not its local shard: without the optimizers'
    own cache context, rank 0 here reuses rank 1's graph for 2 rows and leaves its third row unchanged."""
    import sys

    from tests.processes import run

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    done = run([sys.executable, "-c", _UNEVEN_SHARDS], timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line[:2] in ("0 ", "1 "))
    assert lines["1"] == str([[3.0] * 4] * 2)
    assert lines["0"] == str([[3.0] * 4] * 3)
