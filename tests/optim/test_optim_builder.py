"""build_optimizers and OptimizersContainer: names, options, state size, LR scheduling and DCP checkpoints.

The low-bit optimizers compile their step on first use (tens of seconds on CPU, cached on disk afterwards), so only
two tests step one (AdamW8bit): one in this process and one on two FSDP ranks. Their model has a single weight
shape, so that each compiles as few graphs as possible.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from tests.distributed import run_workers
from tests.helpers import (
    SEQ_LEN,
    TINY,
    fsdp,
    full,
    initial_state_bytes,
    job_config,
    materialize,
    max_difference,
    max_over_ranks,
    meta_model,
    tiny_model,
    to_numpy,
    weights,
)
from torchtitan.errors import UserError
from torchtitan.models.llama import ModelArgs, Transformer, llama3_configs
from torchtitan.optim import AdamMini, AdEMAMix, OptimizersContainer, build_optimizers, compile_cache
from torchtitan.optim.container import tensor_bytes
from torchtitan.optim.lowbit import torchao_adapter
from torchtitan.optim.muon.normuon import NorMuon
from torchtitan.optim.muon.optimizer import Muon
from torchtitan.optim.soap.optimizer import SOAP
from torchtitan.optim.state.quantized_checkpoint import QuantizedStateSavePlanner, plain_values, read_in_groups
from torchtitan.optim.state.storage import is_quantized

try:
    import torchao.optim as torchao_optim  # the `lowbit` extra; part of the dev install
except ImportError:
    torchao_optim = None
# Only the tests of the low-bit optimizers need torchao; AdamW, Adam and AdamMini are tested without it.
needs_torchao = pytest.mark.skipif(
    torchao_optim is None, reason="needs torchao for the low-bit optimizers: pip install 'torchtitan[lowbit]'"
)

# Every matrix 256 x 256: one compiled shape, rows a whole number of 8-bit (256) and 4-bit (128) blocks, and at least
# torchao's 4096 values for quantized state (smaller tensors, and 1-D ones, keep plain state).
LOW_BIT = dataclasses.replace(
    TINY, dim=256, n_layers=1, n_kv_heads=None, vocab_size=128, multiple_of=256, ffn_dim_multiplier=0.375
)
LOW_BIT_NAMES = ("AdamW8bit", "AdamW4bit", "AdamWFp8")


def low_bit(*values):
    """A parametrize entry that needs torchao."""
    return pytest.param(*values, marks=needs_torchao)


def names_param(*names):
    """Optimizer names for parametrize; the low-bit ones skip without torchao."""
    return [low_bit(name) if name in LOW_BIT_NAMES else name for name in names]


def batch(step: int, vocab_size: int, rank: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1000 * rank + step))


def train(net: Transformer, optimizers: OptimizersContainer, steps: range, schedulers=(), rank: int = 0) -> None:
    for step in steps:
        tokens = batch(step, net.args.vocab_size, rank)
        logits = net(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizers.step()
        for scheduler in schedulers:
            scheduler.step()
        optimizers.zero_grad()


def halving_schedule(optimizer: torch.optim.Optimizer) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: 0.5 ** (step // 2))


# ----------------------------------------------------------------------------------------------------------------
# Names and options


@pytest.mark.parametrize(
    "given, canonical",
    [
        ("AdamW", "AdamW"),
        ("adamw", "AdamW"),
        ("ADAMW", "AdamW"),
        ("Adam", "Adam"),
        ("adam", "Adam"),
        ("AdamMini", "AdamMini"),
        ("adam_mini", "AdamMini"),
        ("Adam-mini", "AdamMini"),
        ("adammini", "AdamMini"),
        low_bit("AdamW8bit", "AdamW8bit"),
        low_bit("adamw_8bit", "AdamW8bit"),
        low_bit("AdamW4bit", "AdamW4bit"),
        low_bit("AdamWFp8", "AdamWFp8"),
        low_bit("adamw-fp8", "AdamWFp8"),
        low_bit("AdamMini8bit", "AdamMini8bit"),
        low_bit("adam_mini_8bit", "AdamMini8bit"),
        low_bit("Adam-mini-4bit", "AdamMini4bit"),
        ("Muon", "Muon"),
        ("muon", "Muon"),
        ("NorMuon", "NorMuon"),
        ("nor_muon", "NorMuon"),
        ("AdEMAMix", "AdEMAMix"),
        ("ademamix", "AdEMAMix"),
        ("SOAP", "SOAP"),
        ("soap", "SOAP"),
    ],
)
def test_every_name_and_alias_builds_its_optimizer(given, canonical):
    net = tiny_model()
    optimizers = build_optimizers([net], job_config("--optimizer.name", given))
    assert optimizers.name == canonical
    (optimizer,) = optimizers.optimizers
    expected = {
        "AdamW": torch.optim.AdamW,
        "Adam": torch.optim.Adam,
        "AdamMini": AdamMini,
        "AdamMini8bit": AdamMini,
        "AdamMini4bit": AdamMini,
        "Muon": Muon,
        "NorMuon": NorMuon,
        "AdEMAMix": AdEMAMix,
        "SOAP": SOAP,
    }.get(canonical)
    assert isinstance(optimizer, expected or getattr(torchao_optim, canonical))
    if canonical == "Adam":
        assert not isinstance(optimizer, torch.optim.AdamW)
    if canonical == "Muon":
        assert not isinstance(optimizer, NorMuon)
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert owned == {id(p) for p in net.parameters()}


def test_one_optimizer_per_model_part_stepped_together():
    parts = [tiny_model(seed=0), tiny_model(seed=1)]
    optimizers = build_optimizers(parts, job_config())
    assert len(optimizers.optimizers) == 2
    for part, optimizer in zip(parts, optimizers.optimizers):
        assert [p for p in optimizer.param_groups[0]["params"]] == list(part.parameters())
    before = [weights(part) for part in parts]
    for part in parts:
        part(batch(0, TINY.vocab_size)[:, :-1]).square().mean().backward()
    optimizers.step()
    optimizers.zero_grad()
    assert all(max_difference(b, weights(part)) > 0 for b, part in zip(before, parts))
    assert all(p.grad is None for part in parts for p in part.parameters())
    assert len(optimizers.param_groups) == 2


def test_unknown_name_is_one_line_listing_valid_names():
    with pytest.raises(UserError) as error:
        build_optimizers([tiny_model()], job_config("--optimizer.name", "Lion"))
    message = str(error.value)
    assert "\n" not in message and "'Lion'" in message
    for name in ("AdamW", "Adam", "AdamMini", "AdamW8bit", "AdamW4bit", "AdamWFp8"):
        assert name in message


@pytest.mark.parametrize("name", names_param("AdamW", "Adam", "AdamMini", *LOW_BIT_NAMES, "AdEMAMix"))
def test_hyperparameters_reach_every_optimizer(name):
    argv = [
        "--optimizer.lr",
        "0.003",
        "--optimizer.beta1",
        "0.8",
        "--optimizer.beta2",
        "0.9",
        "--optimizer.eps",
        "1e-6",
        "--optimizer.weight_decay",
        "0.05",
    ]
    (optimizer,) = build_optimizers([tiny_model()], job_config("--optimizer.name", name, *argv)).optimizers
    group = optimizer.param_groups[0]
    assert float(group["lr"]) == pytest.approx(0.003), name
    assert tuple(group["betas"]) == (0.8, 0.9), name
    assert (group["eps"], group["weight_decay"]) == (1e-6, 0.05), name


@needs_torchao
def test_low_bit_options_arrive():
    (optimizer,) = build_optimizers(
        [tiny_model()],
        job_config(
            "--optimizer.name",
            "AdamW4bit",
            "--optimizer.block_size",
            "64",
            "--optimizer.bf16_stochastic_round",
            "true",
            "--training.param_dtype",
            "bfloat16",
        ),
    ).optimizers
    assert (optimizer.block_size, optimizer.bf16_stochastic_round) == (64, True)
    (default,) = build_optimizers([tiny_model()], job_config("--optimizer.name", "AdamW8bit")).optimizers
    assert (default.block_size, default.bf16_stochastic_round) == (256, False)  # torchao's own defaults


@pytest.mark.parametrize("value_blocks, rule", [("per_row", "per_row"), ("per_tensor", "per_tensor")])
def test_adam_mini_gets_value_blocks_and_the_models_shape(value_blocks, rule):
    (optimizer,) = build_optimizers(
        [tiny_model()], job_config("--optimizer.name", "AdamMini", "--optimizer.value_blocks", value_blocks)
    ).optimizers
    plans = {plan.name: plan for plan in optimizer.partition}
    assert plans["layers.0.attention.wv.weight"].rule == rule
    # Heads come from the model's own arguments: 4 query heads and 2 key/value heads of head_dim 8.
    assert plans["layers.0.attention.wq.weight"].n_blocks == TINY.n_heads
    assert plans["layers.0.attention.wk.weight"].n_blocks == TINY.kv_heads
    assert plans["layers.0.attention.wk.weight"].rows_per_block == TINY.head_dim


@pytest.mark.parametrize(
    "implementation, flags",
    [
        (None, None),
        ("for-loop", (False, False)),
        ("foreach", (True, False)),
        ("fused", (False, True)),
    ],
)
@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_implementation_sets_torch_flags(name, implementation, flags):
    argv = ["--optimizer.name", name] + (["--optimizer.implementation", implementation] if implementation else [])
    optimizers = build_optimizers([tiny_model()], job_config(*argv))
    group = optimizers.optimizers[0].param_groups[0]
    if flags is None:
        assert (group["foreach"], group["fused"]) == (None, None)  # torch picks
    else:
        assert (bool(group["foreach"]), bool(group["fused"])) == flags
    # Every implementation actually steps.
    net = optimizers.model_parts[0]
    net(batch(0, TINY.vocab_size)[:, :-1]).square().mean().backward()
    optimizers.step()


@pytest.mark.parametrize(
    "name, argv, fragment",
    [
        ("AdamW", ["--optimizer.value_blocks", "per_tensor"], "optimizer.value_blocks does not apply to AdamW"),
        ("Adam", ["--optimizer.block_size", "128"], "optimizer.block_size does not apply to Adam"),
        ("AdamMini", ["--optimizer.block_size", "128"], "optimizer.block_size does not apply to AdamMini"),
        ("AdamMini", ["--optimizer.implementation", "for-loop"], "implementation for AdamMini is foreach or fused"),
        (
            "AdamMini8bit",
            ["--optimizer.state_dtype", "bfloat16"],
            "optimizer.state_dtype does not apply to AdamMini8bit",
        ),
        ("AdamW8bit", ["--optimizer.state_dtype", "bfloat16"], "optimizer.state_dtype does not apply to AdamW8bit"),
        ("AdamW4bit", ["--optimizer.state_dtype", "bfloat16"], "optimizer.state_dtype does not apply to AdamW4bit"),
        (
            "AdamMini4bit",
            ["--optimizer.state_dtype", "bfloat16"],
            "optimizer.state_dtype does not apply to AdamMini4bit",
        ),
        ("AdamMini4bit", ["--optimizer.block_size", "63"], "block_size must be even for AdamMini4bit"),
        (
            "AdamW",
            ["--optimizer.bf16_stochastic_round", "true", "--training.param_dtype", "bfloat16"],
            "bf16_stochastic_round does not apply to AdamW",
        ),
        low_bit(
            "AdamW8bit", ["--optimizer.implementation", "fused"], "optimizer.implementation does not apply to AdamW8bit"
        ),
        low_bit(
            "AdamWFp8", ["--optimizer.value_blocks", "per_row"], "optimizer.value_blocks does not apply to AdamWFp8"
        ),
        low_bit("AdamW4bit", ["--optimizer.block_size", "63"], "block_size must be even for AdamW4bit"),
        (
            "AdamW",
            ["--optimizer.momentum", "0.9"],
            "optimizer.momentum does not apply to AdamW \\(only to Muon, NorMuon\\)",
        ),
        ("AdamMini", ["--optimizer.ns_dtype", "float64"], "optimizer.ns_dtype does not apply to AdamMini"),
        ("Adam", ["--optimizer.nesterov", "false"], "optimizer.nesterov does not apply to Adam"),
        ("AdamW", ["--optimizer.ns_steps", "3"], "optimizer.ns_steps does not apply to AdamW"),
        ("AdamW", ["--optimizer.adjust_lr", "original"], "optimizer.adjust_lr does not apply to AdamW"),
        ("Muon", ["--optimizer.value_blocks", "per_row"], "optimizer.value_blocks does not apply to Muon"),
        ("Muon", ["--optimizer.block_size", "128"], "optimizer.block_size does not apply to Muon"),
        (
            "Muon",
            ["--optimizer.neuron_beta2", "0.9"],
            "optimizer.neuron_beta2 does not apply to Muon \\(only to NorMuon\\)",
        ),
        (
            "AdamW",
            ["--optimizer.neuron_eps", "1e-6"],
            "optimizer.neuron_eps does not apply to AdamW \\(only to NorMuon\\)",
        ),
        ("AdamMini", ["--optimizer.neuron_beta2", "0.9"], "optimizer.neuron_beta2 does not apply to AdamMini"),
        ("NorMuon", ["--optimizer.value_blocks", "per_row"], "optimizer.value_blocks does not apply to NorMuon"),
    ],
)
def test_options_that_do_not_apply_are_rejected(name, argv, fragment):
    with pytest.raises(UserError, match=fragment) as error:
        build_optimizers([tiny_model()], job_config("--optimizer.name", name, *argv))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("beta1", 1.0, "optimizer.beta1 must be in \\[0, 1\\)"),
        ("beta2", 1.5, "optimizer.beta2 must be in \\[0, 1\\)"),
        ("lr", -1e-3, "optimizer.lr must be at least 0"),
        ("eps", -1e-8, "optimizer.eps must be at least 0"),
        ("weight_decay", -0.1, "optimizer.weight_decay must be at least 0"),
    ],
)
@pytest.mark.parametrize("name", names_param("AdamW", "AdamMini", "AdamW8bit"))
def test_invalid_values_are_user_errors(name, field, value, fragment):
    job = job_config("--optimizer.name", name)
    # Set after parsing: the builder must not rely on the config parser having checked (tools build configs too).
    setattr(job.optimizer, field, value)
    with pytest.raises(UserError, match=fragment):
        build_optimizers([tiny_model()], job)


def test_config_parser_rejects_beta1_of_one_clearly():
    with pytest.raises(UserError, match="optimizer.beta1 must be in \\[0, 1\\)"):
        job_config("--optimizer.beta1", "1.0")


def test_missing_torchao_explains_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    monkeypatch.setattr(torchao_adapter, "_low_bit_classes", {})
    with pytest.raises(UserError, match=r"pip install 'torchtitan\[lowbit\]'") as error:
        build_optimizers([tiny_model()], job_config("--optimizer.name", "AdamW4bit"))
    assert "\n" not in str(error.value)
    assert build_optimizers([tiny_model()], job_config("--optimizer.name", "AdamMini")).name == "AdamMini"


def test_adam_mini_needs_a_model_that_knows_its_shape():
    with pytest.raises(UserError, match="AdamMini needs the model's shape"):
        build_optimizers([torch.nn.Linear(4, 4)], job_config("--optimizer.name", "AdamMini"))


# ----------------------------------------------------------------------------------------------------------------
# LR scheduling


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("name", names_param("AdamW", "AdamMini", "AdamW8bit", "Muon", "NorMuon", "AdEMAMix", "SOAP"))
def test_lambda_lr_drives_every_optimizer_including_tensor_lr(name):
    optimizers = build_optimizers(
        [tiny_model(), tiny_model(seed=1)], job_config("--optimizer.name", name, "--optimizer.lr", "0.2")
    )
    schedulers = [halving_schedule(optimizer) for optimizer in optimizers.optimizers]
    lr_objects = [group["lr"] for group in optimizers.param_groups]
    seen = []
    for _ in range(5):
        seen.extend(float(group["lr"]) for group in optimizers.param_groups)
        for scheduler in schedulers:
            scheduler.step()
    per_step = len(optimizers.param_groups)  # Muon: its group and its AdamW part's, per model part
    expected = [0.2] * 2 * per_step + [0.1] * 2 * per_step + [0.05] * per_step
    assert seen == pytest.approx(expected, rel=1e-6)
    if name == "AdamW8bit":
        # torchao refuses a float lr; the scheduler must update its tensor in place.
        assert all(group["lr"] is obj for group, obj in zip(optimizers.param_groups, lr_objects))
        assert all(isinstance(group["lr"], torch.Tensor) for group in optimizers.param_groups)


# ----------------------------------------------------------------------------------------------------------------
# State size


def meta_state_bytes(names) -> dict[str, int]:
    """State bytes of each optimizer on the debug model's shape, on the meta device (nothing allocated)."""
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=2048)
    sizes = {}
    for name in names:
        net = meta_model(args, torch.float32)
        sizes[name] = initial_state_bytes(build_optimizers([net], job_config("--optimizer.name", name)))
        assert all(p.device.type == "meta" and p.grad is None for p in net.parameters())
    return sizes


def test_state_bytes_on_the_debug_model_shape_without_allocating():
    sizes = meta_state_bytes(("AdamW", "AdamMini"))
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=2048)
    param_bytes = sum(p.numel() * 4 for p in meta_model(args, torch.float32).parameters())
    assert param_bytes * 2 <= sizes["AdamW"] <= param_bytes * 2.01  # m and v, plus step counters
    assert sizes["AdamMini"] <= 0.51 * sizes["AdamW"]


def test_muon_state_bytes_are_one_momentum_per_hidden_matrix_and_adamw_for_the_rest():
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=2048)
    net = meta_model(args, torch.float32)
    hidden = sum(p.numel() for name, p in net.named_parameters() if ".attention.w" in name or ".feed_forward." in name)
    rest = sum(p.numel() for p in net.parameters()) - hidden
    steps = 4 * len(list(net.parameters()))  # a float32 step count per tensor, Muon's and AdamW's alike
    assert meta_state_bytes(("Muon",))["Muon"] == 4 * hidden + 8 * rest + steps


def test_normuon_state_bytes_are_muons_plus_one_float32_value_per_output_row():
    args = dataclasses.replace(llama3_configs["debugmodel"], vocab_size=2048)
    net = meta_model(args, torch.float32)
    rows = sum(p.shape[0] for name, p in net.named_parameters() if ".attention.w" in name or ".feed_forward." in name)
    sizes = meta_state_bytes(("Muon", "NorMuon"))
    assert sizes["NorMuon"] == sizes["Muon"] + 4 * rows


@needs_torchao
def test_low_bit_state_bytes_on_the_debug_model_shape_without_allocating():
    sizes = meta_state_bytes(("AdamW", *LOW_BIT_NAMES))
    assert sizes["AdamW8bit"] <= 0.27 * sizes["AdamW"]  # 1 byte per value + a scale per 256 values
    assert sizes["AdamWFp8"] <= 0.27 * sizes["AdamW"]
    assert sizes["AdamW4bit"] <= 0.14 * sizes["AdamW"]  # half a byte per value + a scale per 128 values


# Every optimizer family: plain, Adam-mini (also quantized), Muon, and the torchao low-bit ones.
TIED_NAMES = (
    "AdamW",
    "AdamMini",
    "Muon",
    "AdEMAMix",
    "SOAP",
    low_bit("AdamMini8bit"),
    *(low_bit(name) for name in LOW_BIT_NAMES),
)


@pytest.mark.parametrize("name", TIED_NAMES)
def test_a_tied_weight_is_one_parameter_with_one_state_for_every_optimizer(name):
    """The tied model is the untied one less the output projection: in the optimizer's parameters, its state, the
    state-bytes metric, and after a step (the tied weight updated once, by both gradients). Which parameters and
    states exist is the optimizer's bookkeeping, the same eager or compiled: the steps run eagerly here (the
    compiled steps are the layout matrix's)."""
    with torch.compiler.set_stance("force_eager"):
        _tied_weight_is_one_parameter_with_one_state(name)


def _tied_weight_is_one_parameter_with_one_state(name: str) -> None:
    # LOW_BIT's shapes: the embedding is large enough for torchao to quantize its state.
    tied_args = dataclasses.replace(LOW_BIT, enable_weight_tying=True)
    tied, untied = tiny_model(tied_args, torch.float32), tiny_model(LOW_BIT, torch.float32)
    config = job_config("--optimizer.name", name)
    tied_opts, untied_opts = build_optimizers([tied], config), build_optimizers([untied], config)
    params = [p for opt in tied_opts.optimizers for group in opt.param_groups for p in group["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(tied.parameters()))
    assert any(p is tied.output.weight for p in params)
    output_state = initial_state_bytes(untied_opts) - initial_state_bytes(tied_opts)
    untied_state = {id(p): state for opt in untied_opts.optimizers for p, state in opt.state.items()}
    assert output_state == sum(tensor_bytes(v) for v in untied_state[id(untied.output.weight)].values()) > 0
    tokens = torch.randint(0, LOW_BIT.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    before = tied.tok_embeddings.weight.detach().clone()
    tied(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    tied_opts.step()
    assert tied.output.weight is tied.tok_embeddings.weight
    assert not torch.equal(tied.tok_embeddings.weight, before)
    assert sum(len(opt.state) for opt in tied_opts.optimizers) == len(params)


def test_adam_mini_blocks_a_tied_weight_per_row_as_an_embedding_and_muon_gives_it_to_adamw():
    from torchtitan.models.roles import EMBEDDING
    from torchtitan.optim.adam_mini.partition import PER_ROW, plan_blocks
    from torchtitan.optim.muon.optimizer import split_hidden_matrices

    tied = tiny_model(dataclasses.replace(TINY, enable_weight_tying=True))
    roles = tied.named_param_roles()
    assert roles["tok_embeddings.weight"] == EMBEDDING and "output.weight" not in roles
    shapes = [(n, tuple(p.shape)) for n, p in tied.named_parameters()]
    (plan,) = [p for p in plan_blocks(shapes, head_dim=TINY.head_dim, param_roles=roles) if "tok_emb" in p.name]
    assert (plan.rule, plan.n_blocks) == (PER_ROW, TINY.vocab_size)
    matrices, others = split_hidden_matrices(tied.named_parameters(), roles)
    assert [n for n, _ in others if "tok_embeddings" in n] == ["tok_embeddings.weight"]
    assert not any("tok_embeddings" in n or "output" in n for n, _ in matrices)


def test_tensor_bytes_counts_local_shards():
    assert tensor_bytes(torch.empty(10, 3, device="meta")) == 120
    assert tensor_bytes(3.0) == 0


@needs_torchao
def test_tensor_bytes_counts_quantized_parts():
    quantized = torchao_optim.subclass_8bit.OptimState8bit.zeros((64, 64), signed=True, block_size=256)
    assert tensor_bytes(quantized) == 64 * 64 + 16 * 4 + 256 * 4  # codes, scales, code table


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints (one process)


@pytest.mark.parametrize(
    "name",
    ["AdamW", "Adam", "AdamMini", "Muon", "Muon:bfloat16", "NorMuon", "AdEMAMix", "AdEMAMix:bfloat16", "SOAP"],
)
def test_creating_state_early_does_not_change_training(name):
    """initialise_state() and state_dict() before the first step create the state; training must not notice (bf16
    state too: its stochastic rounding is salted by step counts, which the zero step must leave at 0)."""
    name, _, state_dtype = name.partition(":")
    extra = ("--optimizer.state_dtype", state_dtype) if state_dtype else ()
    job = job_config("--optimizer.name", name, "--optimizer.lr", "0.01", "--optimizer.weight_decay", "0.1", *extra)
    plain_net, early_net = tiny_model(), tiny_model()
    plain, early = build_optimizers([plain_net], job), build_optimizers([early_net], job)
    assert initial_state_bytes(early) > 0 and early.state_dict()
    assert max_difference(weights(plain_net), weights(early_net)) == 0.0  # creating state moved nothing
    train(plain_net, plain, range(3))
    train(early_net, early, range(3))
    assert max_difference(weights(plain_net), weights(early_net)) == 0.0


def save(state: dict, path) -> None:
    dcp.save(state, checkpoint_id=str(path), planner=QuantizedStateSavePlanner())


def load_into(net: Transformer, optimizers: OptimizersContainer, path) -> None:
    state = {"model": net.state_dict(), "optimizer": optimizers.state_dict()}
    read_in_groups(state, lambda part: dcp.load(part, checkpoint_id=str(path)), agree_on_count=max_over_ranks)
    net.load_state_dict(state["model"])
    optimizers.load_state_dict(state["optimizer"])


def resume_run(name: str, args: ModelArgs, dtype: torch.dtype, path) -> tuple[dict, dict, dict, OptimizersContainer]:
    """(uninterrupted weights, resumed weights, weights resumed with a fresh optimizer, resumed container)."""
    job = job_config("--optimizer.name", name, "--optimizer.lr", "0.01")
    net = tiny_model(args, dtype)
    optimizers = build_optimizers([net], job)
    schedulers = [halving_schedule(o) for o in optimizers.optimizers]
    train(net, optimizers, range(3), schedulers)
    save({"model": net.state_dict(), "optimizer": optimizers.state_dict()}, path)
    scheduler_states = [s.state_dict() for s in schedulers]
    train(net, optimizers, range(3, 6), schedulers)

    def resumed(load_optimizer: bool):
        fresh_net = tiny_model(args, dtype, seed=7)  # different weights, so loading must overwrite them
        fresh = build_optimizers([fresh_net], job)
        fresh_schedulers = [halving_schedule(o) for o in fresh.optimizers]
        if load_optimizer:
            load_into(fresh_net, fresh, path)
        else:
            state = {"model": fresh_net.state_dict()}
            dcp.load(state, checkpoint_id=str(path))
            for group in fresh.param_groups:  # same lr as the checkpoint, only the moments are lost
                group["lr"].fill_(0.005) if isinstance(group["lr"], torch.Tensor) else group.update(lr=0.005)
        for scheduler, state in zip(fresh_schedulers, scheduler_states):
            scheduler.load_state_dict(state)
        train(fresh_net, fresh, range(3, 6), fresh_schedulers)
        return weights(fresh_net), fresh

    resumed_weights, container = resumed(True)
    return weights(net), resumed_weights, resumed(False)[0], container


@pytest.mark.parametrize("name", ["AdamW", "Adam", "AdamMini", "Muon", "NorMuon", "AdEMAMix", "SOAP"])
def test_dcp_resume_equals_uninterrupted_run(name, tmp_path):
    uninterrupted, resumed, without_state, _ = resume_run(name, TINY, torch.float64, tmp_path)
    assert max_difference(uninterrupted, resumed) == 0.0
    assert max_difference(uninterrupted, without_state) > 1e-4  # the optimizer state matters to this check


@needs_torchao
def test_low_bit_dcp_round_trip_and_resume(tmp_path):
    """AdamW8bit: quantized state is saved as plain tensors, quantized again on load, and training resumes."""
    inductor_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    uninterrupted, resumed, without_state, optimizers = resume_run("AdamW8bit", LOW_BIT, torch.float32, tmp_path)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == inductor_dir  # the per-optimizer cache folder was scoped
    cache_base = inductor_dir or compile_cache._default_inductor_cache_dir()
    assert os.listdir(os.path.join(cache_base, "optim_AdamW8bit"))

    # The live state is quantized again; the checkpoint holds only plain tensors.
    (optimizer,) = optimizers.optimizers
    wq = dict(optimizers.model_parts[0].named_parameters())["layers.0.attention.wq.weight"]
    assert is_quantized(optimizer.state[wq]["exp_avg"]) and is_quantized(optimizer.state[wq]["exp_avg_sq"])
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    saved = metadata["optimizer.state.layers.0.attention.wq.weight.exp_avg"]
    assert type(saved).__name__ == "TensorStorageMetadata" and saved.properties.dtype == torch.float32
    assert tuple(saved.size) == (256, 256)

    # Within 8-bit noise of the uninterrupted run, and far closer than a resume that lost the moments.
    resumed_error = max_difference(uninterrupted, resumed)
    assert resumed_error < 0.05 * max_difference(uninterrupted, without_state)
    typical = sum((uninterrupted[k] - resumed[k]).abs().mean().item() for k in resumed) / len(resumed)
    assert typical < 0.01 * 0.01  # mean drift under a hundredth of one step (lr 0.01) after 3 steps

    # Saved state reloads to the same values (quantizing a dequantized state again is lossless up to rounding).
    state = plain_values(optimizers.state_dict())
    again = build_optimizers([tiny_model(LOW_BIT, torch.float32)], job_config("--optimizer.name", "AdamW8bit"))
    again.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    reloaded = plain_values(again.state_dict())
    for key in (k for k in state if k.endswith(("exp_avg", "exp_avg_sq"))):
        scale = state[key].abs().max().clamp(min=1e-12)
        assert (reloaded[key] - state[key]).abs().max() <= 0.01 * scale, key

    # Real (not meta) 8-bit state is about a quarter of AdamW's on the same model.
    adamw = initial_state_bytes(
        build_optimizers([tiny_model(LOW_BIT, torch.float32)], job_config("--optimizer.name", "AdamW"))
    )
    assert optimizers.state_bytes() < 0.4 * adamw


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints (two FSDP ranks)


def _fsdp_model(args: ModelArgs, dtype: torch.dtype, seed: int) -> Transformer:
    from torch.distributed.device_mesh import init_device_mesh

    return materialize(fsdp(meta_model(args, dtype), init_device_mesh("cpu", (2,))), seed)


def _run_argv(label: str) -> list[str]:
    """``"AdamMini:bfloat16"`` is AdamMini with state_dtype bfloat16."""
    name, _, variant = label.partition(":")
    option = {"": [], "bfloat16": ["--optimizer.state_dtype", "bfloat16"]}[variant]
    return ["--optimizer.name", name, *option]


def _fsdp_resume_worker(rank: int, world_size: int, name: str, args: ModelArgs, dtype: torch.dtype, path: str):
    job = job_config(*_run_argv(name), "--optimizer.lr", "0.01")
    net = _fsdp_model(args, dtype, seed=0)
    optimizers = build_optimizers([net], job)
    state_bytes = initial_state_bytes(optimizers)
    train(net, optimizers, range(3), rank=rank)
    state = optimizers.state_dict()
    save({"model": net.state_dict(), "optimizer": state}, path)
    saved = {k: full(v).clone() for k, v in plain_values(state).items() if isinstance(v, torch.Tensor)}
    train(net, optimizers, range(3, 5), rank=rank)
    uninterrupted = weights(net)

    fresh_net = _fsdp_model(args, dtype, seed=7)
    fresh = build_optimizers([fresh_net], job)
    load_into(fresh_net, fresh, path)
    train(fresh_net, fresh, range(3, 5), rank=rank)
    resumed = weights(fresh_net)

    # The same resume without the optimizer state: how far off a lost state puts the run.
    forgetful_net = _fsdp_model(args, dtype, seed=7)
    forgetful = build_optimizers([forgetful_net], job)
    model_only = {"model": forgetful_net.state_dict()}
    dcp.load(model_only, checkpoint_id=path)
    train(forgetful_net, forgetful, range(3, 5), rank=rank)
    result = {
        "saved": saved,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "without_state": weights(forgetful_net),
    }
    return {"state_bytes": state_bytes, **to_numpy(result)}


def _from_numpy(result: dict) -> dict:
    return {
        part: {k: torch.from_numpy(v) for k, v in arrays.items()} if isinstance(arrays, dict) else arrays
        for part, arrays in result.items()
    }


def _single_process_state(name: str, args: ModelArgs, dtype: torch.dtype, path) -> dict[str, torch.Tensor]:
    """The optimizer state of a two-rank checkpoint loaded into one unsharded process."""
    net = tiny_model(args, dtype, seed=7)
    optimizers = build_optimizers([net], job_config(*_run_argv(name), "--optimizer.lr", "0.01"))
    load_into(net, optimizers, path)
    return plain_values(optimizers.state_dict())


EXACT_NAMES = ("AdamW", "AdamMini", "AdamMini:bfloat16", "Muon", "NorMuon", "AdEMAMix", "SOAP")


def _fsdp_resume_workers(
    rank: int, world_size: int, folder: str, names: tuple[str, ...], args: ModelArgs, dtype: torch.dtype
) -> dict[str, dict]:
    return {
        name: _fsdp_resume_worker(rank, world_size, name, args, dtype, os.path.join(folder, name)) for name in names
    }


def _fsdp_runs(
    tmp_path_factory, names: tuple[str, ...], args: ModelArgs, dtype: torch.dtype
) -> tuple[str, list[dict[str, dict]]]:
    """Two-rank runs of the optimizers ``names`` in one pair of processes (starting processes is the slow part)."""
    folder = str(tmp_path_factory.mktemp("fsdp_checkpoints"))
    ranks = run_workers(_fsdp_resume_workers, 2, args=(folder, names, args, dtype))
    return folder, [{name: _from_numpy(result) for name, result in rank.items()} for rank in ranks]


@pytest.fixture(scope="module")
def fsdp_exact_runs(tmp_path_factory) -> tuple[str, list[dict[str, dict]]]:
    return _fsdp_runs(tmp_path_factory, EXACT_NAMES, TINY, torch.float64)


@pytest.mark.parametrize("name", EXACT_NAMES)
def test_fsdp_two_ranks_resume_exactly_and_reshard_to_one(name, fsdp_exact_runs):
    folder, runs = fsdp_exact_runs
    ranks = [run[name] for run in runs]
    for result in ranks:
        assert max_difference(result["uninterrupted"], result["resumed"]) == 0.0
    single = initial_state_bytes(build_optimizers([tiny_model()], job_config(*_run_argv(name))))
    # Each rank holds about half the state (AdamMini keeps a few per-tensor numbers on every rank).
    assert all(0.45 * single <= r["state_bytes"] <= 0.55 * single for r in ranks)
    loaded = _single_process_state(name, TINY, torch.float64, os.path.join(folder, name))
    saved = ranks[0]["saved"]
    assert saved.keys() <= loaded.keys()
    for key, value in saved.items():
        assert torch.equal(torch.as_tensor(loaded[key]).to(value.dtype), value), key


LOW_BIT_RESUME_NAMES = ("AdamW8bit",)  # AdamMini's quantized momentum: tests/checkpoint/test_lowprec_checkpoints.py


@pytest.fixture(scope="module")
def fsdp_low_bit_runs(tmp_path_factory) -> tuple[str, list[dict[str, dict]]]:
    # torchao's step run eagerly (torch's own switch): the same functions, without a cold compile in each rank; its
    # compiled step under FSDP2 is tests/optim/test_layout_matrix_compiled.py's.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHDYNAMO_DISABLE", "1")
        return _fsdp_runs(tmp_path_factory, LOW_BIT_RESUME_NAMES, LOW_BIT, torch.float32)


@needs_torchao
@pytest.mark.parametrize("name", LOW_BIT_RESUME_NAMES)
def test_fsdp_two_ranks_low_bit_resume_and_reshard(name, fsdp_low_bit_runs):
    folder, runs = fsdp_low_bit_runs
    ranks = [run[name] for run in runs]
    for result in ranks:
        resumed_error = max_difference(result["uninterrupted"], result["resumed"])
        assert resumed_error < 0.1 * max_difference(result["uninterrupted"], result["without_state"])
        drift = [(result["uninterrupted"][k] - result["resumed"][k]).abs().mean().item() for k in result["resumed"]]
        assert sum(drift) / len(drift) < 0.01 * 0.01  # mean drift under a hundredth of one step (lr 0.01)
    single = initial_state_bytes(
        build_optimizers([tiny_model(LOW_BIT, torch.float32)], job_config("--optimizer.name", "AdamW"))
    )
    assert all(r["state_bytes"] < 0.2 * single for r in ranks)  # 8-bit and half the parameters
    loaded = _single_process_state(name, LOW_BIT, torch.float32, os.path.join(folder, name))
    for key, value in ranks[0]["saved"].items():
        if key.endswith(("exp_avg", "exp_avg_sq")):  # the quantized moments
            scale = value.abs().max().clamp(min=1e-12)
            assert (loaded[key] - value).abs().max() <= 0.01 * scale, key
        else:
            assert torch.equal(torch.as_tensor(loaded[key]), value), key
