"""Optimizer health (``torchtitan.telemetry.health``), loss spikes and the step-time split
(``torchtitan.telemetry.step_timing``).

Health values are checked against an independent computation in one float64 process (the gradients, the weights
before and after the step, the attention logits recomputed from q and k), then every parallel layout (FSDP2, TP,
HSDP, FSDP x TP on gloo) must log the one-process values of the same step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types

import pytest
import torch

from tests import helpers
from tests.distributed import run_workers
from tests.helpers import job_config, materialize, meta_model
from torchtitan.checkpoint.codec import decode_plain, encode_plain
from torchtitan.models.llama.model import apply_rope
from torchtitan.optim import build_optimizers
from torchtitan.parallelisms import ParallelDims, parallelize_llama
from torchtitan.telemetry.health import LossSpikes, OptimizerHealth, format_health_line, health_groups
from torchtitan.telemetry.step_timing import PARTS, StepTimer, tag
from torchtitan.training.guard import DivergenceGuard
from torchtitan.training.step import train_step

CPU = torch.device("cpu")
LR = 1e-2


def micro_batches(accumulation: int, dp_rank: int, dp_degree: int):
    """This rank's micro-batches of this file's global batch, in the data loader's order."""
    return helpers.micro_batches(accumulation, dp_rank, dp_degree, seed=7)


def health_step(degrees: tuple[int, int, int], world_size: int, accumulation: int = 2, max_layers: int = 16):
    """Two train_steps (AdamW, clipping on) with health measured at the second; its metrics and grad norm."""
    config = job_config(
        training={"gradient_accumulation_steps": accumulation, "max_norm": 0.5},
        optimizer={"name": "AdamW", "lr": LR},
    )
    dims = ParallelDims(*degrees, world_size)
    mesh = dims.build_mesh("cpu")
    model = materialize(parallelize_llama(meta_model(), mesh, dims, config))
    optimizers = build_optimizers([model], config)
    health = OptimizerHealth([model], freq=2, max_layers=max_layers, device=CPU)
    dp_rank, dp_degree = dims.dp_rank_and_degree(mesh)
    results = []
    for step in (1, 2):
        batches = micro_batches(accumulation, dp_rank, dp_degree)
        _, grad_norm, updated = train_step(model, optimizers, batches, dims, config, CPU, None, step, health)
        assert updated
        results.append((health.metrics(LR), float(grad_norm)))
    assert results[0][0] == {}  # step 1 is not due
    return results[1]


# ----------------------------------------------------------------------------------------------------------------
# One process: the values themselves


def test_groups_follow_the_declared_roles():
    assert health_groups("tok_embeddings.weight", "embedding", True) == ["embedding", "all"]
    assert health_groups("layers.3.attention.wq.weight", "query", True) == ["q", "layers.3.q", "all"]
    assert health_groups("layers.3.attention.wq.weight", "query", False) == ["q", "all"]
    assert health_groups("layers.0.feed_forward.w1.weight", "mlp", True) == ["mlp_in", "layers.0.mlp_in", "all"]
    assert health_groups("layers.0.feed_forward.w2.weight", "mlp", True) == ["mlp_out", "layers.0.mlp_out", "all"]
    assert health_groups("layers.0.ffn_norm.weight", "norm", True) == ["norm", "layers.0.norm", "all"]
    assert health_groups("norm.weight", "norm", True) == ["norm", "all"]
    assert health_groups("output.weight", "output", True) == ["output", "all"]


def _reference(accumulation: int = 2) -> dict[str, float]:
    """The second step's health computed by hand from the plain tensors of one process."""
    config = job_config(
        training={"gradient_accumulation_steps": accumulation, "max_norm": 0.5},
        optimizer={"name": "AdamW", "lr": LR},
    )
    dims = ParallelDims(1, 1, 1, 1)
    model = materialize(parallelize_llama(meta_model(), dims.build_mesh("cpu"), dims, config))
    optimizers = build_optimizers([model], config)
    train_step(model, optimizers, micro_batches(accumulation, 0, 1), dims, config, CPU)
    # Step 2 by hand: gradients of the accumulated micro-batches, then the step; q and k of each layer kept.
    logits = {}

    def keep_logits(name):
        def hook(module, args, out):
            x, rope = args
            batch, seq, _ = x.shape
            q = apply_rope(module.wq(x).view(batch, seq, -1, module.head_dim), rope)
            k = apply_rope(module.wk(x).view(batch, seq, -1, module.head_dim), rope)
            k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(module.head_dim)
            causal = torch.ones(seq, seq, dtype=torch.bool).tril()
            best = float(scores.detach().masked_fill(~causal, -math.inf).max())
            logits[name] = max(logits.get(name, -math.inf), best)

        return hook

    for name, layer in model.layers.items():
        layer.attention.register_forward_hook(keep_logits(f"layers.{name}"))
    optimizers.zero_grad()
    for inputs, labels in micro_batches(accumulation, 0, 1):
        (model(inputs, labels=labels) / accumulation).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizers.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    roles = model.named_param_roles()
    sums: dict[str, dict[str, float]] = {}
    for name in grads:
        for g in health_groups(name, roles.get(name), True):
            s = sums.setdefault(g, {"grad": 0.0, "update": 0.0, "before": 0.0, "after": 0.0, "numel": 0})
            s["grad"] += float(grads[name].square().sum())
            s["update"] += float((after[name] - before[name]).square().sum())
            s["before"] += float(before[name].square().sum())
            s["after"] += float(after[name].square().sum())
            s["numel"] += grads[name].numel()
    want = {}
    for group, s in sums.items():
        want[f"health/grad_norm/{group}"] = math.sqrt(s["grad"])
        want[f"health/update_rms/{group}"] = math.sqrt(s["update"] / s["numel"])
        want[f"health/update_rms_per_lr/{group}"] = math.sqrt(s["update"] / s["numel"]) / LR
        want[f"health/update_to_weight/{group}"] = math.sqrt(s["update"] / s["before"])
        want[f"health/weight_norm/{group}"] = math.sqrt(s["after"])
    for layer, value in logits.items():
        want[f"health/attn_logit_max/{layer}"] = value
    want["health/attn_logit_max"] = max(logits.values())
    return want


@pytest.fixture(scope="module")
def one_process() -> dict[str, float]:
    metrics, _ = health_step((1, 1, 1), 1)
    return metrics


def test_one_process_equals_the_values_computed_by_hand(one_process):
    want = _reference()
    assert one_process.keys() == want.keys()
    for key, value in want.items():
        assert one_process[key] == pytest.approx(value, rel=1e-10, abs=1e-14), key


def test_the_groups_gradient_norms_add_up_to_the_logged_grad_norm():
    metrics, grad_norm = health_step((1, 1, 1), 1, accumulation=1)
    roles = ["embedding", "q", "k", "v", "o", "mlp_in", "mlp_out", "norm", "output"]
    layers = [f"layers.{i}.{g}" for i in range(2) for g in roles[1:-1]]
    groups = {k.removeprefix("health/grad_norm/") for k in metrics if k.startswith("health/grad_norm/")}
    assert groups == {*roles, *layers, "all"}
    assert math.sqrt(sum(metrics[f"health/grad_norm/{g}"] ** 2 for g in roles)) == pytest.approx(grad_norm, rel=1e-10)
    layer_norms = sum(metrics[f"health/grad_norm/{g}"] ** 2 for g in layers if g.startswith("layers.1."))
    assert layer_norms < metrics["health/grad_norm/all"] ** 2  # one layer's share of the whole
    assert metrics["health/grad_norm/all"] == pytest.approx(grad_norm, rel=1e-10)


def test_above_the_layer_cap_groups_are_per_role():
    metrics, _ = health_step((1, 1, 1), 1, max_layers=1)
    groups = {k.removeprefix("health/weight_norm/") for k in metrics if k.startswith("health/weight_norm/")}
    assert groups == {"embedding", "q", "k", "v", "o", "mlp_in", "mlp_out", "norm", "output", "all"}
    assert not any(k.startswith("health/attn_logit_max/") for k in metrics)


def test_a_skipped_step_logs_no_health_and_keeps_the_weights():
    config = job_config(training={"max_norm": 0.0, "max_skipped_steps": 3}, optimizer={"name": "AdamW", "lr": LR})
    dims = ParallelDims(1, 1, 1, 1)
    model = materialize(parallelize_llama(meta_model(), dims.build_mesh("cpu"), dims, config))
    optimizers = build_optimizers([model], config)
    health = OptimizerHealth([model], freq=1, max_layers=16, device=CPU)
    with torch.no_grad():
        model.tok_embeddings.weight[0, 0] = math.inf
    guard = DivergenceGuard(3, CPU)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, _, updated = train_step(model, optimizers, micro_batches(1, 0, 1), dims, config, CPU, guard, 1, health)
    assert not updated
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert health.metrics(LR) == {}
    assert all(not m.record_logit_max and m.logit_max is None for _, m in health.attention)


@pytest.mark.parametrize("budget", [2**26, 40, 7, 1], ids=["whole", "blocks-of-rows", "few-rows", "one-score"])
def test_the_largest_logit_is_the_same_whatever_block_it_is_found_in(budget, monkeypatch):
    from torchtitan.models.llama import model as llama

    monkeypatch.setattr(llama, "LOGIT_BLOCK_ELEMENTS", budget)
    generator = torch.Generator().manual_seed(2)
    batch, seq_len, heads, head_dim = 2, 9, 3, 4
    q, k = (torch.randn(batch, seq_len, heads, head_dim, generator=generator, dtype=torch.float64) for _ in "qk")
    k[:, 1:, 0, :] *= 50  # later keys far larger: seen by a query only where the mask lets it
    scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / math.sqrt(head_dim)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    want = scores.masked_fill(~causal, -math.inf).amax()
    attention = types.SimpleNamespace(head_dim=head_dim, logit_max=None)
    llama.Attention._keep_logit_max(attention, q, k)
    llama.Attention._keep_logit_max(attention, q * 0.5, k)  # a second micro-batch: the larger one stays
    assert attention.logit_max == want and want < scores.amax()


def test_off_builds_nothing():
    assert OptimizerHealth.build([], job_config("--metrics.health_freq", "0"), CPU) is None
    assert LossSpikes.build(job_config("--metrics.health_freq", "0"), CPU) is None


# ----------------------------------------------------------------------------------------------------------------
# Parallel layouts: the one-process values


def _layouts(rank: int, world_size: int, layouts: dict) -> dict:
    return {name: health_step(degrees, world_size)[0] for name, degrees in layouts.items()}


TWO_RANK_LAYOUTS = {"fsdp2": (1, 2, 1), "tp2": (1, 1, 2), "hsdp2": (2, 1, 1)}


@pytest.mark.parametrize(
    "world_size, layouts", [(2, TWO_RANK_LAYOUTS), (4, {"fsdp2_tp2": (1, 2, 2)})], ids=["2 ranks", "4 ranks"]
)
def test_every_layout_logs_the_one_process_values(one_process, world_size, layouts):
    ranks = run_workers(_layouts, world_size, args=(layouts,))
    for name in layouts:
        for rank, results in enumerate(ranks):
            got = results[name]
            assert got.keys() == one_process.keys(), (name, rank)
            for key, value in one_process.items():
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-13), (name, rank, key)


# ----------------------------------------------------------------------------------------------------------------
# Loss spikes and step time


def test_loss_spikes_count_losses_above_k_times_the_running_median():
    spikes = LossSpikes(factor=2.0, window=3, device=CPU)
    assert [spikes.observe(x) for x in (4.0, 3.0, 2.0, 9.0, 2.5, 2.0, 5.5)] == [
        False,  # nothing to compare with yet
        False,
        False,
        True,  # 9 > 2 x median(4, 3, 2)
        False,
        False,
        True,  # 5.5 > 2 x median(9.0, 2.5, 2.0): the window of 3 forgot 4, 3 and 2
    ]
    assert spikes.count == 2


def test_loss_spikes_leave_skipped_steps_out():
    spikes = LossSpikes(factor=2.0, window=10, device=CPU)
    for loss, updated in ((3.0, True), (float("nan"), False), (7.0, True)):
        spikes.record(torch.tensor(loss, dtype=torch.float64), updated)
    metrics = spikes.metrics()
    assert metrics["health/loss_spikes"] == 1.0
    assert metrics["health/loss_to_median"] == pytest.approx(7.0 / 3.0)
    assert list(spikes.history) == [3.0, 7.0]


def test_loss_spikes_state_goes_on_where_it_stopped():
    spikes = LossSpikes(factor=2.0, window=3, device=CPU)
    fresh = LossSpikes(factor=2.0, window=3, device=CPU)
    fresh.load_state_dict(fresh.state_dict())  # no median yet: no ratio, and none after the round trip
    assert "health/loss_to_median" not in fresh.metrics() and fresh.count == 0
    for loss in (4.0, 3.0, 2.0, 9.0):
        spikes.record(torch.tensor(loss, dtype=torch.float64), True)
    state = encode_plain(spikes.state_dict())  # counts what was recorded since the last log step first
    assert spikes.count == 1 and not spikes.pending
    resumed = LossSpikes(factor=2.0, window=3, device=CPU)
    resumed.load_state_dict(decode_plain(state))
    assert [resumed.observe(x) for x in (2.5, 2.0, 5.5)] == [spikes.observe(x) for x in (2.5, 2.0, 5.5)]
    assert resumed.count == spikes.count == 2 and resumed.last_ratio == spikes.last_ratio
    shorter = LossSpikes(factor=2.0, window=2, device=CPU)  # a resumed run with a shorter window: the latest ones
    shorter.load_state_dict(decode_plain(state))
    assert list(shorter.history) == [2.0, 9.0]


def test_step_time_is_split_into_its_parts_per_step():
    timer = StepTimer(CPU)
    for _ in range(2):
        with timer.part("data"):
            pass
        with timer.part("optimizer"):
            sum(range(200_000))
        timer.step_done()
    metrics = timer.metrics()
    assert set(metrics) == {tag(part) for part in PARTS}
    assert metrics[tag("optimizer")] > metrics[tag("data")] >= 0
    assert metrics[tag("checkpoint")] == 0.0
    assert timer.metrics()[tag("optimizer")] == 0.0  # a new window
    with pytest.raises(ValueError):
        with timer.part("backward"):
            pass


def _measured_step(compile: bool, checkpointing: dict) -> dict[str, float]:
    """Two float32 steps of the tiny model, health at the second."""
    config = job_config(
        training={"max_norm": 0.5, "compile": compile},
        optimizer={"name": "AdamW", "lr": LR},
        activation_checkpoint=checkpointing,
        metrics={"health_freq": 2},
    )
    dims = ParallelDims(1, 1, 1, 1)
    model = materialize(parallelize_llama(meta_model(dtype=torch.float32), dims.build_mesh("cpu"), dims, config))
    optimizers = build_optimizers([model], config)
    health = OptimizerHealth.build([model], config, CPU)
    assert health.separate_forward == (compile or checkpointing["mode"] != "none")
    for step in (1, 2):
        train_step(model, optimizers, micro_batches(1, 0, 1), dims, config, CPU, None, step, health)
    return health.metrics(LR)


@pytest.mark.parametrize(
    "compile, checkpointing",
    [
        (True, {"mode": "full"}),
        (False, {"mode": "full"}),
        (False, {"mode": "selective", "selective_ac_option": "op"}),  # replays saved ops by count: none may be added
        (False, {"mode": "selective", "selective_ac_option": "1"}),
    ],
    ids=["compiled-full", "full", "selective-op", "selective-layer"],
)
def test_a_compiled_or_checkpointed_model_measures_what_the_plain_eager_one_does(compile, checkpointing):
    # Its logits come from an eager forward of their own (fullgraph compile refuses the side effect in its graphs;
    # checkpointing would save or recompute the measurement's ops); the plain eager model's from its training
    # forward.
    measured, eager = _measured_step(compile, checkpointing), _measured_step(False, {"mode": "none"})
    assert measured.keys() == eager.keys() and "health/attn_logit_max/layers.1" in measured
    for key, value in eager.items():
        assert measured[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def test_the_health_log_line_names_the_group_with_the_largest_relative_update(one_process):
    line = format_health_line(2, one_process)
    groups = {k: v for k, v in one_process.items() if k.startswith("health/update_to_weight/") and "/all" not in k}
    top = max(groups, key=groups.get).removeprefix("health/update_to_weight/")
    assert line.startswith("health at step 2: update/weight ") and f"({top})" in line
    assert f"attention logit max {one_process['health/attn_logit_max']:.2f}" in line


# ----------------------------------------------------------------------------------------------------------------
# What a GPU would see: the memory a measured step takes, the precision of the logit probe under autocast


def allocator_peak(fn) -> int:
    """The most bytes the CPU allocator held above its level at the start while ``fn`` ran (kernels' internal
    buffers included, which a dispatch-level count would miss)."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    peak, events = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            peak = max(peak, event.typed[1].total_allocated)
    return peak


def test_a_measured_step_takes_no_more_memory_than_an_unmeasured_one_but_its_host_snapshot(monkeypatch):
    from torchtitan.telemetry import health as health_module

    # Chunks of the update's comparison scaled to this model as the default is to a large one's weights.
    monkeypatch.setattr(health_module, "CHUNK_ELEMENTS", 4096)
    args = dataclasses.replace(helpers.TINY, dim=64, vocab_size=4096, multiple_of=64, max_seq_len=32)
    # Few activations and an optimizer step without temporaries (Adam-mini's foreach one): a large model's step,
    # whose peak is its weights, gradients and state, where a copy of its largest weight would show.
    config = job_config(
        "--optimizer.name",
        "AdamMini",
        "--optimizer.implementation",
        "foreach",
        "--optimizer.lr",
        str(LR),
        training={"seq_len": 8, "batch_size": 1},
    )
    dims = ParallelDims(1, 1, 1, 1)
    model = materialize(parallelize_llama(meta_model(args, torch.float32), None, dims, config))
    optimizers = build_optimizers([model], config)
    optimizers.initialise_state()
    health = OptimizerHealth([model], freq=2, max_layers=16, device=CPU)
    generator = torch.Generator().manual_seed(3)
    peaks = []
    for step in (1, 2, 3):
        tokens = torch.randint(0, args.vocab_size, (1, 8), generator=generator)
        run = functools.partial(train_step, model, optimizers, iter([(tokens, tokens)]), dims, config, CPU, None, step)
        peaks.append(allocator_peak(functools.partial(run, health)))
        assert bool(health.metrics(LR)) == (step == 2)
    snapshot = sum(p.numel() * p.element_size() for p in model.parameters())  # host memory on a GPU
    measured, unmeasured = peaks[1] - snapshot, peaks[2]
    assert measured <= 1.05 * unmeasured, (peaks, snapshot)


def test_the_logit_probe_computes_in_float32_under_autocast():
    from torchtitan.models.llama import model as llama

    generator = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 16, 3, 8, generator=generator) for _ in "qk")
    exact = types.SimpleNamespace(head_dim=8, logit_max=None)
    llama.Attention._keep_logit_max(exact, q.double(), k.double())
    probe = types.SimpleNamespace(head_dim=8, logit_max=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the one-GPU path's autocast, on CPU
        llama.Attention._keep_logit_max(probe, q, k)
    assert probe.logit_max.dtype == torch.float32
    assert abs(probe.logit_max.item() - exact.logit_max.item()) <= 1e-5 * abs(exact.logit_max.item())
