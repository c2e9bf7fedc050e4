"""Slicing an optimizer's parameter list so that compiled graphs are shared between layers."""

import json
import os

import pytest
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


# Two ranks of an FSDP shard, one after the other in one process (dynamo's memory cleared between them, as in another
# process) with one inductor cache folder: rank 1 compiles first, then rank 0 compiles the same step on the same
# global DTensor spec, with as many rows as argv says (of a parameter of 5 or 4). Each prints its rows after the step
# and how many graphs it loaded from AOT autograd's cache.
_TWO_SHARDS = """
import sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan.optim.compiled_slices import CompiledStep

def double_the_gradient_in(params, grads):
    for p, g in zip(params, grads):
        p.add_(g * 2)

rank_rows = {0: int(sys.argv[1]), 1: int(sys.argv[2])}
for rank in (1, 0):
    step = CompiledStep(double_the_gradient_in, "two_shards_test")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    shape = torch.Size([sum(rank_rows.values()), 4])
    p, g = (DTensor.from_local(torch.ones(rank_rows[rank], 4), mesh, [Shard(0)], run_check=False, shape=shape,
                               stride=(4, 1)) for _ in range(2))
    torch._dynamo.utils.counters.clear()
    step.run([[0]], lambda part: ([p], [g]), [p])
    print(rank, p.to_local().tolist(), torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"])
    torch._dynamo.reset()
    dist.destroy_process_group()
"""


def _two_shards(tmp_path, rows_0: int, rows_1: int) -> dict[str, tuple[list, int]]:
    """Each rank's rows after the step and its graphs loaded from AOT autograd's cache (see ``_TWO_SHARDS``)."""
    import sys

    from tests.processes import run

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    done = run([sys.executable, "-c", _TWO_SHARDS, str(rows_0), str(rows_1)], timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.rsplit(" ", 1) for line in done.stdout.splitlines() if line[:2] in ("0 ", "1 ")]
    return {rank_and_rows[:1]: (json.loads(rank_and_rows[2:]), int(hits)) for rank_and_rows, hits in lines}


def test_a_rank_with_another_shard_shape_compiles_its_own_step_from_a_shared_cache(tmp_path):
    """AOT autograd's on-disk cache keys a DTensor by its global spec, not its local shard: without the optimizers'
    own cache context, rank 0 here reuses rank 1's graph for 2 rows and leaves its third row unchanged."""
    ranks = _two_shards(tmp_path, 3, 2)
    assert ranks["1"] == ([[3.0] * 4] * 2, 0)
    assert ranks["0"] == ([[3.0] * 4] * 3, 0)  # its own graph, not rank 1's


def test_a_rank_with_the_same_shards_loads_the_graph_another_rank_traced(tmp_path):
    """Ranks of an even layout hold shards of the same shapes: the second loads the first's graph from AOT autograd's
    cache instead of tracing it again (the optimizers' cache context keeps that cache for shards it tells apart)."""
    ranks = _two_shards(tmp_path, 2, 2)
    assert ranks["1"] == ([[3.0] * 4] * 2, 0)
    assert ranks["0"] == ([[3.0] * 4] * 2, 1)


_COMPILING_RANK = """
import json, os, sys, time
from torchtitan.optim.compile_cache import optimizer_compile

go = sys.argv[1]
open(go + f".{os.getpid()}", "w").close()  # ready
while not os.path.exists(go):
    time.sleep(0.005)
entered = time.time()
with optimizer_compile("once_test", subclass_inputs=False, signature="a-slice"):
    started = time.time()
    marked = os.path.exists(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "compiled", "a-slice"))
    time.sleep(2.0)  # a compile
    ended = time.time()
print(json.dumps(dict(entered=entered, started=started, ended=ended, marked=marked)))
"""


def test_ranks_on_one_machine_compile_a_step_one_after_another_and_only_the_first_unmarked(tmp_path):
    """Two ranks reach the same first step at once: one compiles while the other waits, finds the mark, and loads
    (here: starts its block only after the first ended); a third arriving later does not wait at all."""
    import contextlib
    import json
    import subprocess
    import sys
    import time

    from tests.processes import run, started

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    go = tmp_path / "go"
    command = [sys.executable, "-c", _COMPILING_RANK, str(go)]
    with contextlib.ExitStack() as stack:  # both ranks ended whatever happens
        ranks = [stack.enter_context(started(command, env=env, stdout=subprocess.PIPE, text=True)) for _ in range(2)]
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("go.*"))) < 2:  # both imported and waiting: they reach the step together
            assert time.monotonic() < deadline and all(rank.poll() is None for rank in ranks), "a rank did not start"
            time.sleep(0.01)
        go.touch()
        outputs = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    first, second = sorted(outputs, key=lambda r: r["started"])
    assert not first["marked"] and second["marked"]
    assert second["started"] >= first["ended"]
    assert second["entered"] < first["ended"]  # it did wait
    done = run(command, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    late = json.loads(done.stdout)
    assert late["marked"] and late["started"] - late["entered"] < 0.5


def test_a_step_signature_tells_apart_quantized_states_that_only_their_blocks_or_sign_distinguish():
    """A quantized state's outer shape is its parameter's: its block size and signedness (the codes' and scales'
    layout) must be in the signature too, which names the folder of AOT autograd's cache its graphs live in."""
    pytest.importorskip("torchao.optim")
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    from torchtitan.optim.compile_cache import signature

    def state(cls, signed: bool, block_size: int):
        return cls.zeros((64, 256), signed=signed, block_size=block_size)

    names = [
        signature([state(OptimState8bit, True, 256)]),
        signature([state(OptimState8bit, True, 128)]),
        signature([state(OptimState8bit, False, 256)]),
        signature([state(OptimState4bit, True, 128)]),
    ]
    assert len(set(names)) == len(names)
    assert signature([state(OptimState8bit, True, 256)]) == names[0]  # and the same state, the same name


_STEP_ON_CPU = """
import torch
from torchtitan.optim.compiled_slices import CompiledStep

def add_the_gradient_to(params, grads):
    for p, g in zip(params, grads):
        p.add_(g)

step = CompiledStep(add_the_gradient_to, "probe_test")
p, g = torch.zeros(8), torch.ones(8)
step.run([[0]], lambda part: ([p], [g]), [p])
print(p.tolist())
"""


def test_the_cpu_probes_are_compiled_once_in_the_shared_cache_not_in_each_optimizers_folder(tmp_path):
    """Before its first CPU kernel, inductor compiles small programs that probe the CPU's vector instructions into the
    current cache folder (~7 CPU seconds): in the shared folder, where every optimizer and process finds them."""
    import sys

    from tests.processes import run

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = run([sys.executable, "-c", _STEP_ON_CPU], timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str([1.0] * 8)

    def probes(folder):
        return [path for path in folder.rglob("*.cpp") if "_chk_kernel" in path.read_text()]

    own = tmp_path / "optim_probe_test"
    assert list(own.rglob("*.cpp"))  # the step's kernel compiled in its own folder
    assert not probes(own)
    assert probes(tmp_path)
