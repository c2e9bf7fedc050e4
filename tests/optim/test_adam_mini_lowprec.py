"""Adam-mini's momentum storage (bfloat16, 8-bit, 4-bit) and its fused back end, in one process: the one update
path against float32 references rounded the same way, fused against foreach, no recompiles in steady state,
portable state dicts, and the Llama 3 8B state bounds on meta tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import (
    TINY,
    adam_mini_for,
    initial_state_bytes,
    job_config,
    max_difference,
    meta_model,
    set_synthetic_grads,
    state_bytes,
    tiny_model,
    weights,
)
from torchtitan.errors import UserError
from torchtitan.models.llama import Transformer, llama3_configs
from torchtitan.optim import AdamMini
from torchtitan.optim.adam_mini.one_pass import compiled_graphs_only
from torchtitan.optim.lowbit.torchao_adapter import portable_quantized_state
from torchtitan.optim.state.initialise import initialise_state
from torchtitan.optim.state.storage import is_quantized, round_to_bfloat16_stochastically

# Wide enough that matrices are quantized: at least 4096 entries and rows of whole 256-entry blocks.
WIDE = dataclasses.replace(TINY, dim=256, vocab_size=96)
STEPS = 4


def float32_model(seed: int = 0) -> Transformer:
    return tiny_model(WIDE, torch.float32, seed)


def _train(model, optimizer, steps: int, after_step=None, lrs=None) -> dict[str, torch.Tensor]:
    for step in range(steps):
        set_synthetic_grads(model, step)
        if lrs is not None:
            for group in optimizer.param_groups:
                group["lr"] = lrs[step]
        optimizer.step()
        if after_step is not None:
            after_step(optimizer)
    return weights(model)


def _round_to_bfloat16(optimizer, keys: tuple[str, ...]) -> None:
    """Round a float32 reference's state as bfloat16 storage does: stochastically, salted by the step count."""
    for state in optimizer.state.values():
        for key in keys:
            rounded = round_to_bfloat16_stochastically(state[key], state["step"].to(torch.int64))
            state[key].copy_(rounded)


def _round_momentum_to_bfloat16(optimizer: AdamMini) -> None:
    _round_to_bfloat16(optimizer, ("m",))


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_bfloat16_momentum_equals_float32_update_with_m_rounded_stochastically_each_step(implementation):
    model = float32_model()
    optimizer = adam_mini_for(model, momentum_storage="bfloat16", implementation=implementation)
    got = _train(model, optimizer, STEPS)
    assert all(state["m"].dtype == torch.bfloat16 for state in optimizer.state.values())
    assert all(state["v"].dtype == torch.float32 for state in optimizer.state.values())

    reference = float32_model()
    reference_optimizer = adam_mini_for(reference, implementation=implementation)
    with compiled_graphs_only():  # the fused back end's graphs, as bfloat16 momentum takes (not the operator)
        expected = _train(reference, reference_optimizer, STEPS, after_step=_round_momentum_to_bfloat16)
    assert max_difference(got, expected) == 0.0
    unrounded = _train(float32_model(), adam_mini_for(float32_model(), implementation=implementation), STEPS)
    assert max_difference(got, unrounded) > 0.0  # the rounding really happened


def _quantize_momentum_like(live: AdamMini):
    """After each reference step, replace its float32 m by m quantized as the live optimizer stores it."""

    def quantize(reference: AdamMini) -> None:
        for (_, ref_state), (_, live_state) in zip(reference.state.items(), live.state.items()):
            stored = live_state["m"]
            if is_quantized(stored):
                scratch = type(stored).zeros(stored.shape, signed=True, block_size=stored.block_size)
                scratch.copy_(ref_state["m"])
                ref_state["m"].copy_(scratch.dequantize(torch.float32))

    return quantize


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_quantized_momentum_equals_float32_update_with_m_quantized_each_step(storage):
    model = float32_model()
    optimizer = adam_mini_for(model, momentum_storage=storage, implementation="foreach")
    got = _train(model, optimizer, STEPS)
    quantized = [name for name, p in model.named_parameters() if is_quantized(optimizer.state[p]["m"])]
    assert "tok_embeddings.weight" in quantized and "norm.weight" not in quantized  # small tensors stay float32

    reference = float32_model()
    expected = _train(
        reference,
        adam_mini_for(reference, implementation="foreach"),
        STEPS,
        after_step=_quantize_momentum_like(optimizer),
    )
    assert max_difference(got, expected) < 1e-6
    plain = _train(float32_model(), adam_mini_for(float32_model(), implementation="foreach"), STEPS)
    assert max_difference(got, plain) > 1e-6  # the quantization really happened


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
def test_fused_equals_foreach(storage):
    results = {}
    for implementation in ("foreach", "fused"):
        model = float32_model()
        results[implementation] = _train(
            model, adam_mini_for(model, momentum_storage=storage, implementation=implementation), STEPS
        )
    relative = max(
        ((results["fused"][n] - results["foreach"][n]).abs().max() / results["foreach"][n].abs().max()).item()
        for n in results["fused"]
    )
    # float32 agrees to rounding; rounded storage may round one entry of m differently, so it gets the storage's step.
    assert relative < {"float32": 1e-6, "bfloat16": 1e-2, "int8": 1e-2}[storage], relative


def test_fused_float64_equals_foreach_and_compiles_once():
    foreach_model = tiny_model()
    foreach = _train(
        foreach_model, adam_mini_for(foreach_model, implementation="foreach"), STEPS, lrs=[1e-2, 5e-3, 2e-3, 1e-3]
    )
    model = tiny_model()
    optimizer = adam_mini_for(model, implementation="fused", lr=torch.tensor(1e-2, dtype=torch.float64))
    # Forget graphs that earlier tests of this process compiled for the same shapes, so this one is compiled here.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counts = []
    for step in range(STEPS):
        set_synthetic_grads(model, step)
        optimizer.param_groups[0]["lr"] = torch.tensor([1e-2, 5e-3, 2e-3, 1e-3][step], dtype=torch.float64)
        with compiled_graphs_only():  # the graphs, not the one-pass operator that plain float64 state takes
            optimizer.step()
        counts.append(dict(torch._dynamo.utils.counters["stats"]).get("unique_graphs", 0))
    # Compiled at the first step only (one graph per distinct slice of parameters: the first layer's, with the
    # embedding, output and final norm, and every other layer's); no recompile when the lr changes.
    assert 1 <= counts[0] <= 3 and counts[-1] == counts[0], counts
    assert max_difference(weights(model), foreach) < 1e-14


def _unique_graphs() -> int:
    return dict(torch._dynamo.utils.counters["stats"]).get("unique_graphs", 0)


@pytest.mark.parametrize(
    "argv",
    [
        ("--optimizer.name", "AdamMini"),
        ("--optimizer.name", "Adam", "--optimizer.state_dtype", "bfloat16"),
        ("--optimizer.name", "AdamW8bit"),
    ],
    ids=["AdamMini", "Adam bf16", "AdamW8bit"],
)
def test_compiled_step_compiles_once_through_state_creation_steps_and_a_load(argv):
    """State creation (weight decay on at lr 0), steps and a load all run the first graphs (state_bytes() runs none)."""
    from torchtitan.optim import build_optimizers

    job = job_config(*argv, "--optimizer.lr", "0.01", "--optimizer.weight_decay", "0.1")
    optimizers = build_optimizers([float32_model()], job)
    torch._dynamo.reset()  # graphs that earlier tests compiled for the same shapes are compiled here again
    torch._dynamo.utils.counters.clear()
    with compiled_graphs_only():  # Adam-mini's graphs, not the one-pass operator its float32 state takes
        optimizers.initialise_state()
        compiled = _unique_graphs()
        assert compiled >= 1 and optimizers.state_bytes() > 0
        _train(optimizers.model_parts[0], optimizers, 2)
        saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizers.state_dict().items()}
        resumed = build_optimizers([float32_model(seed=3)], job)
        resumed.load_state_dict(saved)
        _train(resumed.model_parts[0], resumed, 1)
    assert _unique_graphs() == compiled


def test_bfloat16_state_dict_round_trip_continues_bit_exactly():
    uninterrupted_model = float32_model()
    uninterrupted = _train(
        uninterrupted_model,
        adam_mini_for(uninterrupted_model, momentum_storage="bfloat16", implementation="foreach"),
        2 * STEPS,
    )
    model = float32_model()
    optimizer = adam_mini_for(model, momentum_storage="bfloat16", implementation="foreach")
    _train(model, optimizer, STEPS)
    saved = optimizer.state_dict()
    assert all(state["m"].dtype == torch.bfloat16 for state in saved["state"].values())

    resumed = float32_model(seed=1)
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer = adam_mini_for(resumed, momentum_storage="bfloat16", implementation="foreach")
    resumed_optimizer.load_state_dict(saved)
    assert all(state["m"].dtype == torch.bfloat16 for state in resumed_optimizer.state.values())
    for step in range(STEPS, 2 * STEPS):
        set_synthetic_grads(resumed, step)
        resumed_optimizer.step()
    assert max_difference(weights(resumed), uninterrupted) == 0.0


def test_quantized_momentum_saves_plain_float32_and_reloads_quantized():
    model = float32_model()
    optimizer = adam_mini_for(model, momentum_storage="int8", implementation="foreach")
    portable_quantized_state(optimizer)
    _train(model, optimizer, STEPS)
    saved = optimizer.state_dict()
    assert all(
        type(state["m"]) is torch.Tensor and state["m"].dtype == torch.float32 for state in saved["state"].values()
    )
    fresh = adam_mini_for(model, momentum_storage="int8", implementation="foreach")
    portable_quantized_state(fresh)
    initialise_state(fresh)
    fresh.load_state_dict(saved)
    wq = model.layers["0"].attention.wq.weight
    live, before = fresh.state[wq]["m"], optimizer.state[wq]["m"]
    assert is_quantized(live)
    assert torch.allclose(live.dequantize(), before.dequantize(), atol=before.dequantize().abs().max().item() / 50)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"momentum_storage": "float16"}, "momentum_storage must be one of"),
        ({"implementation": "for-loop"}, "implementation must be one of"),
        ({"momentum_storage": "bfloat16", "block_size": 128}, "block_size"),
        ({"momentum_storage": "int4", "block_size": 33}, "block_size"),
    ],
)
def test_bad_storage_options_raise_user_errors(kwargs, message):
    with pytest.raises(UserError, match=message):
        adam_mini_for(float32_model(), **kwargs)


def _8b_state_bytes(**options) -> int:
    model = meta_model(llama3_configs["8B"], torch.float32)
    optimizer = AdamMini(
        model.named_parameters(),
        lr=3e-4,
        weight_decay=0.1,
        dim=model.args.dim,
        n_heads=model.args.n_heads,
        n_kv_heads=model.args.n_kv_heads,
        param_roles=model.named_param_roles(),
        **options,
    )
    for p, layout in optimizer._layouts.items():  # the state the first step creates, without stepping
        optimizer._init_state(p, optimizer.state[p], layout)
    return state_bytes(optimizer)


def test_8b_state_bounds_relative_to_float32_adamw_on_meta():
    model = meta_model(llama3_configs["8B"], torch.float32)
    adamw_bytes = 2 * 4 * sum(p.numel() for p in model.parameters()) + 4 * len(list(model.parameters()))
    ratios = {
        storage: _8b_state_bytes(momentum_storage=storage) / adamw_bytes for storage in ("bfloat16", "int8", "int4")
    }
    from torchtitan.optim.lowbit.adamw import LowPrecisionAdam

    adamw_bf16 = LowPrecisionAdam(model.parameters(), lr=3e-4, weight_decay=0.1)
    for p in model.parameters():  # the state its first step creates, without stepping
        adamw_bf16._init_state(p, adamw_bf16.state[p])
    ratios["AdamW bfloat16"] = state_bytes(adamw_bf16) / adamw_bytes
    print(f"8B optimizer state relative to float32 AdamW: {ratios}")
    assert ratios["bfloat16"] <= 0.2503 and ratios["int8"] <= 0.135 and ratios["int4"] < ratios["int8"]
    assert ratios["AdamW bfloat16"] <= 0.5001


# ------------------------------------------------------------------------------------------------------------
# AdamW and Adam with bfloat16 moments (our compiled step)
# ------------------------------------------------------------------------------------------------------------


def _adam_run(decoupled: bool, state_dtype: str, steps: int = STEPS, after_step=None) -> dict[str, torch.Tensor]:
    from torchtitan.optim.lowbit.adamw import LowPrecisionAdam

    model = float32_model()
    if state_dtype == "torch":
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        optimizer = cls(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    else:
        optimizer = LowPrecisionAdam(
            model.parameters(),
            lr=1e-2,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            decoupled=decoupled,
            state_dtype=state_dtype,
        )
    return _train(model, optimizer, steps, after_step=after_step)


def _round_moments_to_bfloat16(optimizer) -> None:
    _round_to_bfloat16(optimizer, ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("decoupled", [True, False], ids=["AdamW", "Adam"])
def test_low_precision_adam_step_equals_torch_and_rounds_moments_stochastically(decoupled):
    torch_run = _adam_run(decoupled, "torch")
    ours_float32 = _adam_run(decoupled, "float32")
    relative = max(((ours_float32[n] - torch_run[n]).abs().max() / torch_run[n].abs().max()).item() for n in torch_run)
    assert relative < 1e-6, relative  # the same algorithm as torch's kernels
    rounded_reference = _adam_run(decoupled, "float32", after_step=_round_moments_to_bfloat16)
    assert max_difference(_adam_run(decoupled, "bfloat16"), rounded_reference) == 0.0


def _decaying_gradients(optimizer, param: torch.nn.Parameter) -> torch.Tensor:
    """300 steps of gradients of about 1, then 2500 of about 0.01 (per-entry scales in [0.5, 2]): a moment that
    fails to decay ends far above float32's. Returns the per-entry scales."""
    scale = torch.exp(torch.empty(param.shape).uniform_(-0.69, 0.69, generator=torch.Generator().manual_seed(0)))
    for step in range(2800):
        param.grad = scale * (1.0 if step < 300 else 0.01)
        optimizer.step()
    return scale


def _median_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() / b.float()).median().item()


def test_bfloat16_second_moment_decays_like_float32():
    """AdamW/Adam's update function (what their compiled step runs), eagerly: bfloat16 v against float32 v."""
    from torchtitan.optim.lowbit.adamw import _local_adam_steps

    scale = torch.exp(torch.empty(16, 16).uniform_(-0.69, 0.69, generator=torch.Generator().manual_seed(0)))
    moments = {dtype: (torch.zeros(16, 16, dtype=dtype), torch.zeros(16, 16, dtype=dtype)) for dtype in BOTH}
    zero, one = torch.tensor(0.0), torch.tensor(1.0)
    for step in range(1, 2801):
        g = scale * (1.0 if step <= 300 else 0.01)
        for m, v in moments.values():
            _local_adam_steps([torch.zeros(16, 16)], [g], [m], [v], [zero], [one], [torch.tensor(step)], one,
                              0.9, 0.999, 1e-8, None)  # fmt: skip
    # Rounded to nearest, v * 0.999 rounds back to v: it would end 12x too large.
    assert 0.8 <= _median_ratio(moments[torch.bfloat16][1], moments[torch.float32][1]) <= 1.25


BOTH = (torch.float32, torch.bfloat16)


def test_adam_mini_bfloat16_momentum_decays_like_float32_at_beta1_0_99():
    param = torch.nn.Parameter(torch.zeros(16, 16))
    optimizer = AdamMini(
        [("layers.0.feed_forward.w1.weight", param)],
        lr=0.0,
        betas=(0.99, 0.95),
        dim=16,
        n_heads=2,
        momentum_storage="bfloat16",
        implementation="foreach",
    )
    scale = _decaying_gradients(optimizer, param)
    # Exact m (an exponential average of two constant stretches), in float64.
    kept = 0.99**2500
    exact = scale.double() * ((1 - 0.99**300) * kept + 0.01 * (1 - kept))
    # Rounded to nearest, m stops moving once 1% of its distance to g is under half a bfloat16 step: 1.44x.
    assert 0.8 <= _median_ratio(optimizer.state[param]["m"], exact) <= 1.25


def test_stochastic_rounding_is_unbiased_and_repeatable():
    value = torch.linspace(0.1, 10.0, 4096)
    rounded = [round_to_bfloat16_stochastically(value, torch.tensor(step)).float() for step in range(256)]
    mean = torch.stack(rounded).mean(0)
    assert ((mean - value).abs() / value).max() < 2e-3  # a bfloat16 step is 4e-3 to 8e-3 of the value
    assert ((mean - value) / value).mean().abs() < 1e-4
    assert not torch.equal(rounded[0], rounded[1])  # the step salts the rounding ...
    assert torch.equal(rounded[3], round_to_bfloat16_stochastically(value, torch.tensor(3)).float())  # ... only it


@pytest.mark.parametrize(
    "name, state_dtype, keys, dtype",
    [
        ("AdamW", None, ("exp_avg", "exp_avg_sq"), torch.float32),
        ("Adam", "float32", ("exp_avg", "exp_avg_sq"), torch.float32),
        ("AdamW", "bfloat16", ("exp_avg", "exp_avg_sq"), torch.bfloat16),
        ("AdamMini", None, ("m", "v"), torch.float32),
        ("AdamMini", "bfloat16", ("m",), torch.bfloat16),
        ("Muon", None, ("momentum_buffer", "exp_avg", "exp_avg_sq"), torch.float32),
        ("Muon", "bfloat16", ("momentum_buffer", "exp_avg", "exp_avg_sq"), torch.bfloat16),
        ("NorMuon", "bfloat16", ("momentum_buffer", "exp_avg", "exp_avg_sq"), torch.bfloat16),
    ],
)
def test_state_dtype_holds_for_bfloat16_weights(name, state_dtype, keys, dtype):
    """bfloat16 weights get float32 state unless state_dtype says otherwise (and AdamMini's v is always float32),
    also after a load (torch's load casts state to the weights' dtype). Eager: the same math, without compiling."""
    with torch.compiler.set_stance("force_eager"):
        _check_state_dtypes_for_bfloat16_weights(name, state_dtype, keys, dtype)


def _check_state_dtypes_for_bfloat16_weights(name, state_dtype, keys, dtype):
    from torchtitan.optim import build_optimizers

    argv = ("--optimizer.name", name) + (("--optimizer.state_dtype", state_dtype) if state_dtype else ())
    model = tiny_model(TINY, torch.bfloat16)
    optimizers_job = job_config(*argv, *(("--optimizer.implementation", "foreach") if name == "AdamMini" else ()))
    optimizers = build_optimizers([model], optimizers_job)
    set_synthetic_grads(model, 0)
    before = weights(model)
    optimizers.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert max_difference(weights(model), before) > 0.0
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizers.state_dict().items()}
    tensors = [k for k, v in saved.items() if isinstance(v, torch.Tensor)]
    resumed = build_optimizers([tiny_model(TINY, torch.bfloat16, seed=3)], optimizers_job)
    resumed.load_state_dict(saved)  # torch's load casts state to the weights' dtype; ours keeps its own
    for optimizer in (optimizers.optimizers[0], resumed.optimizers[0]):
        for state in optimizer.state.values():
            assert any(key in state for key in keys)
            assert all(state[key].dtype == dtype for key in keys if key in state)
            assert "v" not in state or state["v"].dtype == torch.float32
            assert "neuron_second_moment" not in state or state["neuron_second_moment"].dtype == torch.float32
    if dtype == torch.float32:  # computed in float32 too: values bfloat16 cannot hold
        kept = [state[key] for state in optimizers.optimizers[0].state.values() for key in keys if key in state]
        assert any(not torch.equal(value, value.bfloat16().float()) for value in kept)
    loaded = resumed.state_dict()
    assert max_difference({k: loaded[k] for k in tensors}, {k: saved[k] for k in tensors}) == 0.0


@pytest.mark.parametrize("name", ["AdamW", "Muon"])  # Muon: its AdamW part
def test_torch_kernels_for_bfloat16_weights_are_refused(name):
    # torch's kernels would keep bfloat16 moments, not the float32 that state_dtype (unset) promises.
    from torchtitan.optim import build_optimizers
    from torchtitan.optim.settings import optimizer_settings

    job = job_config("--optimizer.name", name, "--optimizer.implementation", "fused")
    with pytest.raises(UserError, match="optimizer.implementation"):
        build_optimizers([tiny_model(TINY, torch.bfloat16)], job)
    optimizer_settings(job)  # float32 weights in the config: torch's kernels keep float32 moments
    job.training.param_dtype = "bfloat16"
    with pytest.raises(UserError, match="optimizer.implementation"):  # preflight's check, before any worker
        optimizer_settings(job)


def test_adamw_bfloat16_state_from_the_config_is_half_and_resumes_exactly():
    from torchtitan.optim import build_optimizers

    job = job_config("--optimizer.name", "AdamW", "--optimizer.state_dtype", "bfloat16", "--optimizer.lr", "0.01")
    plain = initial_state_bytes(build_optimizers([float32_model()], job_config("--optimizer.name", "AdamW")))
    optimizers = build_optimizers([float32_model()], job)
    assert initial_state_bytes(optimizers) <= 0.51 * plain
    model = optimizers.model_parts[0]
    _train(model, optimizers, STEPS)
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizers.state_dict().items()}
    saved_weights = weights(model)
    assert saved["state.layers.0.attention.wq.weight.exp_avg"].dtype == torch.bfloat16
    uninterrupted = _train(model, optimizers, STEPS)  # the same gradients again, from the saved point

    resumed = build_optimizers([float32_model(seed=3)], job)
    resumed_model = resumed.model_parts[0]
    resumed_model.load_state_dict(saved_weights)
    resumed.load_state_dict(saved)
    assert resumed.optimizers[0].state[resumed_model.output.weight]["exp_avg"].dtype == torch.bfloat16
    assert max_difference(_train(resumed_model, resumed, STEPS), uninterrupted) == 0.0
