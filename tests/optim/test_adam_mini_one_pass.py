"""Adam-mini's one-pass operator (``torchtitan::adam_mini_step_``) in one process: its CPU kernel equals the foreach
back end to a few float32 ulp for every partition kind and option, in one call a step for every tensor; the state it
leaves resumes in the foreach back end; bf16 and quantized momentum keep their paths; fake tensors and torch.compile
see the operator; without a C++ compiler one line says so and the compiled graphs step instead.

The CPU kernel is built once (``cpu_kernel``, into the shared cache of built kernels); the multi-process layouts are
in ``test_adam_mini_distributed.py``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.helpers import adam_mini_for, set_synthetic_grads, tiny_model
from torchtitan.optim.adam_mini import cpu_build, one_pass
from torchtitan.optim.adam_mini.layout import layout_for, new_second_moment
from torchtitan.optim.adam_mini.partition import PER_ROW, plan_blocks
from torchtitan.optim.adam_mini.statistics import Hyper
from torchtitan.optim.state.storage import BFLOAT16, new_state

ULPS = 8  # of each tensor's largest entry, after STEPS steps
STEPS = 3
OTHER_PARTITION = {
    "value_blocks": "per_tensor",
    "embedding_blocks": "per_element",
    "output_blocks": "per_element",
    "attn_out_blocks": "per_tensor",
    "mlp_blocks": "per_tensor",
    "norm_weight_decay": True,
}


@pytest.fixture(scope="module")
def cpu_kernel():
    assert cpu_build.load_cpu_kernel(), "the CPU kernel did not build"


@pytest.fixture
def operator_calls(monkeypatch) -> list[int]:
    """The number of tensors each call of the operator steps."""
    calls: list[int] = []
    operator = one_pass.adam_mini_step_

    def counted(params, *rest):
        calls.append(len(params))
        return operator(params, *rest)

    monkeypatch.setattr(one_pass, "adam_mini_step_", counted)
    return calls


def _run(implementation: str, steps: int = STEPS, **options) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_model(dtype=torch.float32)
    optimizer = adam_mini_for(model, implementation=implementation, **options)
    _steps(model, optimizer, range(steps))
    return model, optimizer


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps) -> None:
    for step in steps:
        set_synthetic_grads(model, step)
        optimizer.step()


def _ulps(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference in float32 ulps of the tensor's largest entry."""
    scale = expected.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return ((actual - expected).abs().max() / (scale * torch.finfo(torch.float32).eps)).item()


def _assert_same_run(model, optimizer, reference_model, reference_optimizer) -> None:
    references = dict(reference_model.named_parameters())
    for name, p in model.named_parameters():
        reference = references[name]
        state, reference_state = optimizer.state[p], reference_optimizer.state[reference]
        assert _ulps(p.detach(), reference.detach()) <= ULPS, name
        for key in ("m", "v"):
            assert state[key].dtype == reference_state[key].dtype == torch.float32
            assert _ulps(state[key], reference_state[key]) <= ULPS, (name, key)
        assert state["step"] == reference_state["step"]


@pytest.mark.parametrize(
    "options",
    [{}, OTHER_PARTITION, {"betas": (0.3, 0.9), "lr": torch.tensor(3e-3)}],
    ids=["per_head_q_k,per_row,per_token_embedding,norms", "every_other_rule", "small_beta1,tensor_lr"],
)
def test_one_call_a_step_equals_foreach_within_a_few_ulp(cpu_kernel, operator_calls, options):
    model, optimizer = _run("fused", **options)
    assert operator_calls == [len(list(model.parameters()))] * STEPS
    _assert_same_run(model, optimizer, *_run("foreach", **options))


def test_state_left_by_the_operator_resumes_in_the_foreach_back_end(cpu_kernel, operator_calls):
    model, optimizer = _run("fused", steps=2)
    resumed = adam_mini_for(model, implementation="foreach")
    resumed.load_state_dict(optimizer.state_dict())
    _steps(model, resumed, range(2, 4))
    assert operator_calls  # the first two steps were the operator's
    _assert_same_run(model, resumed, *_run("foreach", steps=4))


def _update_lists(momentum_storage: str) -> tuple:
    model = tiny_model(dtype=torch.float32)
    named = list(model.named_parameters())
    plans = plan_blocks(((n, tuple(p.shape)) for n, p in named), head_dim=model.args.head_dim)
    params = [p.detach() for _, p in named]
    layouts = [layout_for(p, plan) for p, plan in zip(params, plans)]
    exp_avgs = [new_state(p, momentum_storage, None) for p in params]
    second_moments = [new_second_moment(p, layout) for p, layout in zip(params, layouts)]
    grads = [torch.ones_like(p) for p in params]
    return params, grads, exp_avgs, second_moments, layouts


def test_bfloat16_momentum_keeps_its_compiled_path(cpu_kernel, operator_calls):
    params, grads, exp_avgs, second_moments, layouts = _update_lists(BFLOAT16)
    none, counts = [None] * len(params), [1.0] * len(params)
    hyper = Hyper(1e-3, 0.9, 0.95, 1e-8, 0)
    left = one_pass.one_pass_update(params, grads, exp_avgs, second_moments, none, none, layouts, counts, hyper)
    assert left == list(range(len(params))) and operator_calls == []


def test_fake_tensors_and_torch_compile_see_the_operator(cpu_kernel):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def step(p, g, m, v, scalars):
        one_pass.adam_mini_step_([p], [g], [m], [v], [None], [None], [1], scalars, 0.9, 0.95, 1e-8)
        return p * 2

    scalars = [1e-3, 0.1, 0.05, 1 - 1e-4]
    with FakeTensorMode():
        fake = [torch.randn(4, 8), torch.randn(4, 8), torch.zeros(4, 8), torch.zeros(4, 1)]
        assert step(*fake, torch.tensor(scalars, dtype=torch.float64)).shape == (4, 8)
    scalars = torch.tensor(scalars, dtype=torch.float64)
    eager = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)] + [
        torch.zeros(4, 8),
        torch.zeros(4, 1),
    ]
    compiled = [t.clone() for t in eager]
    # Dynamo and AOT autograd trace it through its fake kernel and functionalize its writes; inductor only adds
    # minutes of C++ compile around the same call.
    doubled = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled, scalars)
    step(*eager, scalars)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)  # p, g, m and v, changed in place as eagerly
    assert torch.equal(doubled, eager[0] * 2)


def test_without_a_compiler_one_line_says_so_and_the_compiled_graphs_step(monkeypatch, caplog, operator_calls):
    monkeypatch.setattr(cpu_build, "_loaded", None)
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not cpu_build.load_cpu_kernel()
        model, optimizer = _run("fused", steps=2, value_blocks=PER_ROW)
    lines = [r.getMessage() for r in caplog.records if r.name == cpu_build.__name__]
    assert len(lines) == 1 and "no C++ compiler (no-such-c++-compiler)" in lines[0]
    assert operator_calls == []
    _assert_same_run(model, optimizer, *_run("foreach", steps=2))


def test_a_kernel_that_cannot_be_built_is_one_line_and_the_compiled_graphs_step(
    monkeypatch, caplog, operator_calls, tmp_path
):
    """A cache that cannot be written (here a file where its folder should be): a training run goes on."""
    monkeypatch.setattr(cpu_build, "_loaded", None)
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("TORCHTITAN_CACHE", str(tmp_path / "not-a-folder"))
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not cpu_build.load_cpu_kernel()
        _run("fused", steps=1, value_blocks=PER_ROW)
    lines = [r.getMessage() for r in caplog.records if r.name == cpu_build.__name__]
    assert len(lines) == 1 and "could not be built in" in lines[0] and "TORCHTITAN_CACHE" in lines[0], lines
    assert operator_calls == []


def test_a_lock_file_left_by_a_killed_build_is_removed_not_waited_on(monkeypatch, caplog, tmp_path):
    """torch's loader waits for its own lock file to vanish; one left by a build killed half-way (a job's process tree
    ended mid-compile) would stall every later run of the machine, so the holder of the file lock removes it first."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_build, "_loaded", None)
    monkeypatch.setenv("TORCHTITAN_CACHE", str(tmp_path))
    folder = cpu_build.cache_root() / "extensions" / cpu_build.build_name()
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")
    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: seen.append((folder / "lock").exists()))
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert cpu_build.load_cpu_kernel()
    assert seen == [False]
    lines = [r.getMessage() for r in caplog.records if r.name == cpu_build.__name__]
    assert len(lines) == 1 and "left by a build that was stopped" in lines[0], lines


def test_every_checkout_builds_the_kernel_from_the_cache_folders_own_copy_of_the_source(monkeypatch, tmp_path):
    """Two checkouts of the same source (the package's, and a copy as another clone or worktree holds it) hand torch's
    builder the same source path and folder, so the second loads what the first built: ninja rebuilds whenever its
    build file names another source path. A damaged copy in the cache is written whole again."""
    from torch.utils import cpp_extension

    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **options: built.append((name, sources, options)))
    monkeypatch.setenv("TORCHTITAN_CACHE", str(tmp_path / "cache"))
    elsewhere = tmp_path / "another-checkout" / cpu_build.SOURCE.name
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(cpu_build.SOURCE.read_bytes())
    for source in (cpu_build.SOURCE, elsewhere):
        monkeypatch.setattr(cpu_build, "SOURCE", source)
        monkeypatch.setattr(cpu_build, "_loaded", None)
        assert cpu_build.load_cpu_kernel()
    first, second = built
    assert first == second
    compiled = Path(*first[1])
    assert str(compiled.parent) == first[2]["build_directory"]
    assert compiled.read_bytes() == elsewhere.read_bytes()
    compiled.write_text("// cut short")
    monkeypatch.setattr(cpu_build, "_loaded", None)
    assert cpu_build.load_cpu_kernel() and built[-1] == first
    assert compiled.read_bytes() == elsewhere.read_bytes()


def test_each_torch_installation_builds_the_kernel_in_a_folder_of_its_own(monkeypatch):
    """torch's build file names the headers and libraries of the torch that builds: two environments sharing a folder
    would rewrite it in turn, and ninja would rebuild (and relink under the other's running processes) at each switch.
    The same installation keeps its name."""
    import torch

    here = cpu_build.build_name()
    assert cpu_build.build_name() == here
    monkeypatch.setattr(torch, "__file__", "/another/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpu_build.build_name() != here
