"""Adam-mini in one process: the partition, equality with the official adam-mini 1.1.1 and with a reference written
from the formulas, state dicts, bad input, and meta/fake tensors (the 8B state-size bound)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.helpers import (
    HYPER,
    TIED_TINY,
    TINY,
    adam_mini_for,
    default_dtype,
    fsdp,
    max_difference,
    meta_model,
    run_single_process,
    set_synthetic_grads,
    state_bytes,
    synthetic_grad,
    tiny_model,
)
from torchtitan.errors import UserError
from torchtitan.models.llama import Transformer, llama3_configs
from torchtitan.optim import AdamMini
from torchtitan.optim.adam_mini.layout import layout_for, new_second_moment
from torchtitan.optim.adam_mini.optimizer import adam_mini_update
from torchtitan.optim.adam_mini.partition import PER_ELEMENT, PER_HEAD, PER_ROW, PER_TENSOR, plan_blocks, role_from_name

# ------------------------------------------------------------------------------------------------------------
# A reference written from the formulas, one parameter at a time, blocks spelled out by hand.
# ------------------------------------------------------------------------------------------------------------


def reference_run(
    params: dict[str, torch.Tensor],
    blocks: dict[str, tuple[str, int]],
    steps: int,
    *,
    lr,
    betas,
    eps,
    weight_decay,
    decay: dict[str, bool],
) -> dict[str, torch.Tensor]:
    """``blocks[name]`` is (kind, rows per block) with kind 'row', 'head', 'tensor' or 'element'."""
    beta1, beta2 = betas
    params = {name: p.detach().clone() for name, p in params.items()}
    m = {name: torch.zeros_like(p) for name, p in params.items()}
    v = {name: None for name in params}
    for step in range(1, steps + 1):
        for name, p in params.items():
            g = synthetic_grad(name, tuple(p.shape), step - 1)
            kind, rows_per_block = blocks[name]
            if kind == "element":
                square_mean = g * g
            elif kind == "tensor":
                square_mean = (g * g).mean()
            else:
                rows = g.shape[0]
                square_mean = (g * g).reshape(rows // rows_per_block, -1).mean(dim=1, keepdim=True)
            v[name] = (1 - beta2) * square_mean if v[name] is None else beta2 * v[name] + (1 - beta2) * square_mean
            m[name] = beta1 * m[name] + (1 - beta1) * g
            denominator = (v[name] / (1 - beta2**step)).sqrt() + eps
            if kind == "head":
                denominator = denominator.repeat_interleave(rows_per_block, dim=0)
            if decay[name]:
                p.mul_(1 - lr * weight_decay)
            p.sub_(lr * (m[name] / (1 - beta1**step)) / denominator)
    return params


# Each optional partition rule (AdamMini's argument, its non-default value) and the weights it reblocks, by name.
PARTITION_OPTIONS = {
    "value_blocks": (PER_TENSOR, ("wv.weight",)),
    "embedding_blocks": (PER_ELEMENT, ("tok_embeddings.weight",)),
    "output_blocks": (PER_ELEMENT, ("output.weight",)),
    "attn_out_blocks": (PER_TENSOR, ("wo.weight",)),
    "mlp_blocks": (PER_TENSOR, ("w1.weight", "w2.weight", "w3.weight")),
}
REFERENCE_KIND = {PER_TENSOR: ("tensor", 0), PER_ELEMENT: ("element", 1)}


def reference_blocks(
    model: Transformer, value_blocks: str, norm_weight_decay: bool = False, **rules
) -> tuple[dict, dict]:
    """(blocks, decay) by name, written from the rules' descriptions: ``rules`` as AdamMini's partition arguments."""
    head_dim = model.args.head_dim
    rules = {"value_blocks": value_blocks, **rules}
    blocks, decay = {}, {}
    for name, p in model.named_parameters():
        chosen = [rule for option, rule in rules.items() if name.endswith(PARTITION_OPTIONS[option][1])]
        if p.dim() == 1:
            blocks[name], decay[name] = ("tensor", 0), norm_weight_decay and "norm" in name
        elif name.endswith(("wq.weight", "wk.weight")):
            blocks[name], decay[name] = ("head", head_dim), True
        elif chosen and chosen[0] != PER_ROW:
            blocks[name], decay[name] = REFERENCE_KIND[chosen[0]], True
        else:
            blocks[name], decay[name] = ("row", 1), True
    return blocks, decay


# ------------------------------------------------------------------------------------------------------------
# Equality with the official implementation and with the reference
# ------------------------------------------------------------------------------------------------------------


def official_run(steps: int, value_blocks: str) -> dict[str, torch.Tensor]:
    adam_mini = pytest.importorskip("adam_mini")
    model = tiny_model()
    # On a machine without GPUs the official class reads torch.cuda.device_count() == 0 and never communicates;
    # pin it to 0 so that a GPU machine behaves the same (no process group exists here).
    original = torch.cuda.device_count
    torch.cuda.device_count = lambda: 0
    try:
        optimizer = adam_mini.Adam_mini(
            model.named_parameters(),
            **HYPER,
            dim=TINY.dim,
            n_heads=TINY.n_heads,
            n_kv_heads=TINY.n_kv_heads,
            verbose=False,
        )
    finally:
        torch.cuda.device_count = original
    if value_blocks == PER_TENSOR:
        optimizer.wv_names = set()  # the official switch: value weights fall through to one block per tensor
    for step in range(steps):
        set_synthetic_grads(model, step)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("value_blocks", [PER_ROW, PER_TENSOR])
def test_matches_official_adam_mini_1_1_1(value_blocks):
    ours = run_single_process(10, value_blocks)
    official = official_run(10, value_blocks)
    assert max_difference(ours, official) < 1e-10
    # The runs moved the weights far more than the tolerance, so the comparison means something.
    assert max_difference(ours, {n: p.detach() for n, p in tiny_model().named_parameters()}) > 1e-2


def _tied_hf_llama() -> nn.Module:
    """A tiny Hugging Face Llama with tied embeddings, made by transformers (float64)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=TINY.dim,
        intermediate_size=TINY.ffn_hidden_dim,
        num_hidden_layers=TINY.n_layers,
        num_attention_heads=TINY.n_heads,
        num_key_value_heads=TINY.n_kv_heads,
        vocab_size=TINY.vocab_size,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def _official_steps(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    adam_mini = pytest.importorskip("adam_mini")
    original = torch.cuda.device_count
    torch.cuda.device_count = lambda: 0  # as in official_run: no communication on any machine
    try:
        optimizer = adam_mini.Adam_mini(
            model.named_parameters(), **HYPER, dim=TINY.dim, n_heads=TINY.n_heads, n_kv_heads=TINY.n_kv_heads
        )
    finally:
        torch.cuda.device_count = original
    for step in range(steps):
        set_synthetic_grads(model, step)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _our_steps(model: nn.Module, steps: int) -> dict[str, torch.Tensor]:
    roles = model.named_param_roles() if hasattr(model, "named_param_roles") else None
    optimizer = AdamMini(
        model.named_parameters(),
        **HYPER,
        dim=TINY.dim,
        n_heads=TINY.n_heads,
        n_kv_heads=TINY.n_kv_heads,
        param_roles=roles,
    )
    for step in range(steps):
        set_synthetic_grads(model, step)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("model", ["transformers", "ours"])
def test_a_tied_weight_is_blocked_as_official_adam_mini_1_1_1_blocks_it(model):
    """One parameter for embedding and output: the official class sees it once, by the embedding's name, and gives
    it one second moment per token row; so do we, on a tied Hugging Face Llama (name rules) and on our tied Llama
    (declared roles)."""
    import copy

    build = _tied_hf_llama if model == "transformers" else lambda: tiny_model(TIED_TINY)
    net = build()
    names = [name for name, _ in net.named_parameters()]
    assert not any("lm_head" in name or name.endswith("output.weight") for name in names)
    ours, official = _our_steps(copy.deepcopy(net), 10), _official_steps(copy.deepcopy(net), 10)
    assert max_difference(ours, official) < 1e-10
    embedding = next(name for name in names if "embed" in name)
    assert (ours[embedding] - dict(net.named_parameters())[embedding]).abs().max() > 1e-2


@pytest.mark.parametrize("value_blocks", [PER_ROW, PER_TENSOR])
def test_matches_reference_from_the_formulas(value_blocks):
    model = tiny_model()
    blocks, decay = reference_blocks(model, value_blocks)
    expected = reference_run(dict(model.named_parameters()), blocks, 10, **HYPER, decay=decay)
    assert max_difference(run_single_process(10, value_blocks), expected) < 1e-10


@pytest.mark.parametrize(
    "options",
    [
        *({option: rule} for option, (rule, _) in PARTITION_OPTIONS.items() if option != "value_blocks"),
        {"norm_weight_decay": True},
        # Adam-mini's first release: Adam for embedding and output, one value per V, O and MLP matrix.
        {option: rule for option, (rule, _) in PARTITION_OPTIONS.items()},
    ],
    ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()),
)
@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_each_partition_rule_matches_the_reference_from_the_formulas(options, implementation):
    model = tiny_model()
    value_blocks = options.get("value_blocks", PER_ROW)
    rules = {k: v for k, v in options.items() if k != "value_blocks"}
    blocks, decay = reference_blocks(model, value_blocks, **rules)
    assert blocks != reference_blocks(model, PER_ROW)[0] or decay != reference_blocks(model, PER_ROW)[1]
    expected = reference_run(dict(model.named_parameters()), blocks, 10, **HYPER, decay=decay)
    ours = run_single_process(10, value_blocks, implementation=implementation, **rules)
    assert max_difference(ours, expected) < 1e-10


def test_update_function_on_plain_tensors_matches_the_optimizer():
    """The math is a function over lists of tensors; the class only gathers them."""
    model = tiny_model()
    names = [name for name, _ in model.named_parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    plans = plan_blocks(
        ((n, tuple(p.shape)) for n, p in zip(names, params)),
        head_dim=TINY.head_dim,
        param_roles=model.named_param_roles(),
    )
    layouts = [layout_for(p, plan) for p, plan in zip(params, plans)]
    exp_avgs = [torch.zeros_like(p) for p in params]
    second_moments = [new_second_moment(p, layout) for p, layout in zip(params, layouts)]
    steps = [torch.tensor(0.0) for _ in params]
    (beta1, beta2), hyper = HYPER["betas"], {k: v for k, v in HYPER.items() if k != "betas"}
    for step in range(4):
        grads = [synthetic_grad(name, tuple(p.shape), step) for name, p in zip(names, params)]
        adam_mini_update(params, grads, exp_avgs, second_moments, steps, layouts, beta1=beta1, beta2=beta2, **hyper)
    assert max_difference(dict(zip(names, params)), run_single_process(4)) == 0.0


class HeadsModel(nn.Module):
    """Hugging Face spellings, a head size that is not dim // n_heads, biases, and 1-D weights with misleading
    names (which the official 1.1.1 crashes on)."""

    def __init__(self, dim=24, n_heads=4, n_kv_heads=2, head_dim=10):
        super().__init__()
        self.embed_tokens = nn.Embedding(19, dim)
        attn = nn.Module()
        attn.q_proj = nn.Linear(dim, n_heads * head_dim, bias=True)
        attn.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        attn.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        attn.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(dim, 40, bias=False)
        mlp.down_proj = nn.Linear(40, dim, bias=False)
        layer = nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm = nn.LayerNorm(dim, bias=False)
        self.layers = nn.ModuleList([layer])
        self.output_scale = nn.Parameter(torch.ones(dim))  # 1-D with "output" in its name
        self.mlp_gain = nn.Parameter(torch.ones(3))  # 1-D with "mlp" in its name
        self.lm_head = nn.Linear(dim, 19, bias=False)


def test_head_size_other_than_dim_over_heads_matches_reference():
    with default_dtype(torch.float64):
        torch.manual_seed(0)
        model = HeadsModel()
    optimizer = AdamMini(model.named_parameters(), **HYPER, dim=24, n_heads=4, n_kv_heads=2, head_dim=10)
    rules = {plan.name: (plan.rule, plan.rows_per_block) for plan in optimizer.partition}
    assert rules["layers.0.self_attn.q_proj.weight"] == (PER_HEAD, 10)
    assert rules["layers.0.self_attn.k_proj.weight"] == (PER_HEAD, 10)
    assert rules["layers.0.self_attn.q_proj.bias"][0] == PER_ELEMENT
    assert rules["output_scale"][0] == rules["mlp_gain"][0] == PER_TENSOR
    assert rules["embed_tokens.weight"][0] == rules["lm_head.weight"][0] == PER_ROW
    kind = {PER_ROW: "row", PER_HEAD: "head", PER_TENSOR: "tensor", PER_ELEMENT: "element"}
    blocks = {plan.name: (kind[plan.rule], plan.rows_per_block) for plan in optimizer.partition}
    decay = {name: p.dim() >= 2 for name, p in model.named_parameters()}
    expected = reference_run(dict(model.named_parameters()), blocks, 6, **HYPER, decay=decay)
    for step in range(6):
        set_synthetic_grads(model, step)
        optimizer.step()
    assert max_difference({n: p.detach() for n, p in model.named_parameters()}, expected) < 1e-10


# ------------------------------------------------------------------------------------------------------------
# The partition
# ------------------------------------------------------------------------------------------------------------


def test_model_roles_and_name_rules_agree_on_our_llama():
    model = tiny_model()
    by_role = plan_blocks(
        ((n, tuple(p.shape)) for n, p in model.named_parameters()), head_dim=8, param_roles=model.named_param_roles()
    )
    by_name = plan_blocks(((n, tuple(p.shape)) for n, p in model.named_parameters()), head_dim=8)
    assert by_role == by_name
    rules = {plan.name: (plan.role, plan.rule, plan.n_blocks, plan.decay) for plan in by_role}
    assert rules["tok_embeddings.weight"] == ("embedding", PER_ROW, 67, True)
    assert rules["output.weight"] == ("output", PER_ROW, 67, True)
    assert rules["layers.0.attention.wq.weight"] == ("query", PER_HEAD, 4, True)
    assert rules["layers.0.attention.wk.weight"] == ("key", PER_HEAD, 2, True)
    assert rules["layers.0.attention.wv.weight"] == ("value", PER_ROW, 16, True)
    assert rules["layers.1.attention.wo.weight"] == ("attn_out", PER_ROW, 32, True)
    assert rules["layers.1.feed_forward.w2.weight"] == ("mlp", PER_ROW, 32, True)
    assert rules["layers.1.ffn_norm.weight"] == ("norm", PER_TENSOR, 1, False)
    assert rules["norm.weight"] == ("norm", PER_TENSOR, 1, False)


@pytest.mark.parametrize(
    "name, role",
    [
        ("layers.3._checkpoint_wrapped_module.attention.wq.weight", "query"),
        ("_orig_mod.layers.3.attention.wk.weight", "key"),
        ("module.model.layers.0.self_attn.v_proj.weight", "value"),
        ("model.layers.0.self_attn.o_proj.weight", "attn_out"),
        ("model.layers.0.mlp.up_proj.weight", "mlp"),
        ("model.embed_tokens.weight", "embedding"),
        ("lm_head.weight", "output"),
        ("model.layers.0.post_attention_layernorm.weight", "norm"),
        ("model.norm.weight", "norm"),
        ("layers.0.self_attn.q_proj.bias", "bias"),
        ("encoder.output_projection.weight", "other"),  # "output" as a substring is not the output layer
        ("blocks.0.mlp_fc.weight", "other"),
    ],
)
def test_name_rules_are_exact(name, role):
    assert role_from_name(name) == role


def test_unmatched_matrix_is_reported_and_gets_per_row_blocks(caplog):
    layer = nn.Linear(6, 5)
    with caplog.at_level(logging.INFO):
        optimizer = AdamMini([("proj.weight", layer.weight), ("proj.bias", layer.bias)], dim=6, n_heads=2)
    assert [(plan.rule, plan.n_blocks) for plan in optimizer.partition] == [(PER_ROW, 5), (PER_ELEMENT, 5)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("proj.weight" in message for message in warnings)
    assert any("Adam-mini partition" in r.getMessage() for r in caplog.records)


def test_explicit_roles_override_names():
    layer = nn.Linear(8, 8, bias=False)
    optimizer = AdamMini([("proj.weight", layer.weight)], dim=8, n_heads=2, param_roles={"proj.weight": "query"})
    assert (optimizer.partition[0].rule, optimizer.partition[0].n_blocks) == (PER_HEAD, 2)
    with pytest.raises(UserError, match="unknown Adam-mini role"):
        AdamMini([("proj.weight", layer.weight)], dim=8, n_heads=2, param_roles={"proj.weight": "queries"})


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_heads=4), "dim= and n_heads="),
        (dict(dim=32), "dim= and n_heads="),
        (dict(dim=32, n_heads=4, n_kv_heads=3), "not divisible by n_kv_heads"),
        (dict(dim=30, n_heads=4), "not divisible by n_heads"),
        (dict(dim=32, n_heads=4, head_dim=5), "does not divide"),
        (dict(dim=32, n_heads=4, lr=-1e-3), "AdamMini lr must be at least 0"),
        (dict(dim=32, n_heads=4, lr=torch.tensor(-1e-3)), "AdamMini lr must be at least 0"),
        (dict(dim=32, n_heads=4, betas=(1.0, 0.9)), "betas"),
        (dict(dim=32, n_heads=4, betas=(0.9, -0.1)), "betas"),
        (dict(dim=32, n_heads=4, weight_decay=-0.1), "weight_decay"),
        (dict(dim=32, n_heads=4, value_blocks="per_head"), "value_blocks"),
    ],
)
def test_bad_input_raises_a_clear_value_error(kwargs, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message) as error:
        AdamMini(model.named_parameters(), **kwargs)
    assert isinstance(error.value, UserError)


def test_plain_parameters_without_names_are_refused():
    with pytest.raises(UserError, match="named_parameters"):
        AdamMini(tiny_model().parameters(), dim=32, n_heads=4)


# ------------------------------------------------------------------------------------------------------------
# State, state dicts, learning-rate tensors and schedulers
# ------------------------------------------------------------------------------------------------------------


def test_state_is_m_v_and_step_only():
    model = tiny_model()
    optimizer = adam_mini_for(model)
    set_synthetic_grads(model, 0)
    optimizer.step()
    shapes = {
        name: {key: tuple(value.shape) for key, value in optimizer.state[p].items()}
        for name, p in model.named_parameters()
    }
    assert shapes["layers.0.attention.wq.weight"] == {"step": (), "m": (32, 32), "v": (4, 1)}
    assert shapes["layers.0.attention.wk.weight"] == {"step": (), "m": (16, 32), "v": (2, 1)}
    assert shapes["tok_embeddings.weight"] == {"step": (), "m": (67, 32), "v": (67, 1)}
    assert shapes["norm.weight"] == {"step": (), "m": (32,), "v": (1, 1)}


def test_state_dict_round_trip_continues_identically():
    uninterrupted = run_single_process(6)
    model = tiny_model()
    optimizer = adam_mini_for(model)
    for step in range(3):
        set_synthetic_grads(model, step)
        optimizer.step()
    saved_optimizer = optimizer.state_dict()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}

    resumed = tiny_model(seed=1)  # different weights, overwritten by the load
    resumed.load_state_dict(saved_model)
    resumed_optimizer = adam_mini_for(resumed)
    resumed_optimizer.load_state_dict(saved_optimizer)
    for step in range(3, 6):
        set_synthetic_grads(resumed, step)
        resumed_optimizer.step()
    assert max_difference({n: p.detach() for n, p in resumed.named_parameters()}, uninterrupted) == 0.0


def test_tensor_learning_rate_and_scheduler_match_float():
    with_float = run_single_process(4)
    model = tiny_model()
    optimizer = adam_mini_for(model, lr=torch.tensor(HYPER["lr"], dtype=torch.float64))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for step in range(4):
        set_synthetic_grads(model, step)
        optimizer.step()
        scheduler.step()
    assert max_difference({n: p.detach() for n, p in model.named_parameters()}, with_float) < 1e-15


def test_parameters_without_gradients_are_left_alone():
    model = tiny_model()
    before = model.output.weight.detach().clone()
    optimizer = adam_mini_for(model)
    for name, p in model.named_parameters():
        if name != "output.weight":
            p.grad = synthetic_grad(name, tuple(p.shape), 0)
    optimizer.step()
    assert torch.equal(model.output.weight, before) and model.output.weight not in optimizer.state


# ------------------------------------------------------------------------------------------------------------
# Meta and fake tensors: building the real state without memory
# ------------------------------------------------------------------------------------------------------------


def _step_with_zero_grads(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()


def test_8b_state_is_at_most_half_of_adamw_on_meta():
    model = meta_model(llama3_configs["8B"], torch.float32)
    args = model.args
    adam_mini = AdamMini(
        model.named_parameters(),
        lr=3e-4,
        weight_decay=0.1,
        dim=args.dim,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        param_roles=model.named_param_roles(),
    )
    _step_with_zero_grads(model, adam_mini)
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    _step_with_zero_grads(model, adamw)
    ratio = state_bytes(adam_mini) / state_bytes(adamw)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 7.5e9 and all(p.device.type == "meta" for p in model.parameters())
    assert 0.5 <= ratio <= 0.5005, ratio
    print(f"8B optimizer state: AdamMini / AdamW = {ratio:.6f}")


def test_construction_and_step_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        with default_dtype(torch.float32):
            model = Transformer(TINY)
        optimizer = adam_mini_for(model, lr=torch.tensor(1e-3))
        _step_with_zero_grads(model, optimizer)
        state = optimizer.state[model.layers["0"].attention.wk.weight]
        assert tuple(state["v"].shape) == (2, 1) and tuple(state["m"].shape) == (16, 32)


def _shapes_in_a_fake_world() -> list[dict[str, tuple]]:
    """Shard a meta model, then a fake one, over a fake world of 3 (as rank 1) and step AdamMini on each."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=3)
    mesh = init_device_mesh("cpu", (3,))
    shapes = []
    for context in (torch.device("meta"), FakeTensorMode()):
        with context:
            model = fsdp(Transformer(TINY), mesh)
            optimizer = adam_mini_for(model)
            _step_with_zero_grads(model, optimizer)
        wk = optimizer.state[model.layers["0"].attention.wk.weight]
        output = optimizer.state[model.output.weight]
        shapes.append(
            {
                "wk m": tuple(wk["m"].to_local().shape),
                "wk v": tuple(wk["v"].shape),
                "wk v local": tuple(wk["v"].to_local().shape),
                "output v local": tuple(output["v"].to_local().shape),
            }
        )
    dist.destroy_process_group()
    return shapes


def test_fsdp_state_on_meta_and_fake_tensors_with_a_fake_process_group():
    """What memory estimation does: real state shapes for one rank of a sharded model, without memory."""
    import concurrent.futures
    import multiprocessing

    # A process of its own: the fake process group is global state.
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        meta, fake = pool.submit(_shapes_in_a_fake_world).result(timeout=300)
    # wk has 16 rows over 3 ranks (rank 1 holds 6); its v has one entry per KV head on every rank; the output's
    # 67 rows split 23/23/21.
    expected = {"wk m": (6, 32), "wk v": (2, 1), "wk v local": (2, 1), "output v local": (23, 1)}
    assert meta == expected and fake == expected
