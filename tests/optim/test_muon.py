"""Muon in one process: torch.optim.Muon + AdamW over the same split, Newton–Schulz, the lr scale, the split of
the weights, its options, bfloat16 momentum and its state across a load. (Across processes:
tests/optim/test_muon_distributed.py; checkpoints and names: tests/optim/test_optim_builder.py.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import SEQ_LEN, TINY, job_config, max_difference, tiny_model, weights
from torchtitan.errors import UserError
from torchtitan.optim import build_optimizers
from torchtitan.optim.lowbit.adamw import LowPrecisionAdam
from torchtitan.optim.muon.optimizer import (
    MATCH_RMS_ADAMW,
    ORIGINAL,
    Muon,
    lr_scale,
    newton_schulz,
    split_hidden_matrices,
)
from torchtitan.optim.state.storage import round_to_bfloat16_stochastically

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))
HIDDEN = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2")


def muon_job(*argv: str):
    return job_config("--optimizer.name", "Muon", "--optimizer.lr", "0.01", *argv)


def loss_steps(model: torch.nn.Module, step, steps: int = 4) -> None:
    device = next(model.parameters()).device
    for i in range(steps):
        tokens = torch.randint(0, TINY.vocab_size, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(i))
        tokens = tokens.to(device)
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        step()
        model.zero_grad()


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon to compare with")
@pytest.mark.parametrize("adjust_lr", [MATCH_RMS_ADAMW, ORIGINAL])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_one_process_equals_torch_muon_and_adamw(adjust_lr, device):
    """float32 weights, bfloat16 Newton–Schulz (torch's): the same operations, so the same bits (to 1e-5 at most)."""
    ours = tiny_model(dtype=torch.float32).to(device)
    reference = copy.deepcopy(ours)
    optimizers = build_optimizers([ours], muon_job("--optimizer.adjust_lr", adjust_lr))
    matrices, others = split_hidden_matrices(reference.named_parameters(), reference.named_param_roles())
    torch_muon = torch.optim.Muon(
        [p for _, p in matrices], lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=adjust_lr
    )
    torch_adamw = torch.optim.AdamW([p for _, p in others], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def reference_step():
        torch_muon.step()
        torch_adamw.step()

    before = weights(ours)
    loss_steps(ours, optimizers.step)
    loss_steps(reference, reference_step)
    after, expected = weights(ours), weights(reference)
    assert max_difference(after, before) > 1e-3
    for name, value in expected.items():
        assert (after[name] - value).abs().max() <= 1e-5 * value.abs().max(), name


def test_newton_schulz_makes_singular_values_near_one_whatever_the_orientation():
    update = torch.randn(48, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tall = newton_schulz(update, 5, torch.float64)
    singular = torch.linalg.svdvals(tall)
    assert tall.dtype == torch.float64 and tall.shape == update.shape
    assert 0.5 < singular.min() and singular.max() < 1.3  # the quintic's band, not exactly 1
    assert torch.equal(newton_schulz(update.T, 5, torch.float64), tall.T)
    # Same left and right singular vectors as the update: U^T O V is diagonal.
    u, _, vh = torch.linalg.svd(update, full_matrices=False)
    core = u.T @ tall @ vh.T
    assert (core - torch.diag(torch.diagonal(core))).abs().max() < 1e-12
    assert newton_schulz(update, 5, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(newton_schulz(torch.zeros(3, 4), 5, torch.float32), torch.zeros(3, 4))  # no division by 0


def test_lr_scale_matches_rms_of_adamw_or_the_original_rule():
    assert lr_scale((1024, 256), MATCH_RMS_ADAMW) == pytest.approx(0.2 * 32)
    assert lr_scale((256, 1024), MATCH_RMS_ADAMW) == pytest.approx(0.2 * 32)
    assert lr_scale((1024, 256), ORIGINAL) == pytest.approx(2.0)
    assert lr_scale((256, 1024), ORIGINAL) == 1.0


def test_hidden_matrices_go_to_muon_and_the_rest_to_adamw_as_adamw_has_it():
    model = tiny_model()
    optimizer = build_optimizers([model], muon_job()).optimizers[0]
    adamw = build_optimizers([tiny_model()], job_config("--optimizer.lr", "0.01")).optimizers[0]
    names = {id(p): name for name, p in model.named_parameters()}
    muon_group, adamw_group = optimizer.param_groups
    muon_names = sorted(names[id(p)] for p in muon_group["params"])
    assert len(muon_names) == 7 * TINY.n_layers and all(
        n.split(".", 2)[2].startswith(HIDDEN + ("feed_forward.w3",)) for n in muon_names
    )
    assert sorted(names[id(p)] for p in adamw_group["params"]) == sorted(
        n for n in names.values() if "norm" in n or n in ("tok_embeddings.weight", "output.weight")
    )
    assert isinstance(optimizer.others, torch.optim.AdamW)
    same = {key: value for key, value in adamw.param_groups[0].items() if key != "params"}
    assert {key: adamw_group[key] for key in same} == same  # lr, betas, eps, weight_decay, kernels: AdamW's
    assert (muon_group["momentum"], muon_group["nesterov"], muon_group["ns_steps"]) == (0.95, True, 5)
    assert (muon_group["ns_dtype"], muon_group["adjust_lr"], muon_group["weight_decay"]) == (
        "bfloat16",
        MATCH_RMS_ADAMW,
        0.1,
    )


def test_options_reach_muon_and_its_adamw_part():
    argv = ["--optimizer.momentum", "0.9", "--optimizer.nesterov", "false", "--optimizer.ns_steps", "3"]
    argv += [
        "--optimizer.ns_dtype",
        "float32",
        "--optimizer.adjust_lr",
        "original",
        "--optimizer.state_dtype",
        "bfloat16",
    ]
    model = tiny_model(dtype=torch.float32)
    optimizer = build_optimizers([model], muon_job(*argv)).optimizers[0]
    group = optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["ns_steps"], group["ns_dtype"], group["adjust_lr"]) == (
        0.9,
        False,
        3,
        "float32",
        ORIGINAL,
    )
    assert isinstance(optimizer.others, LowPrecisionAdam)
    with torch.compiler.set_stance("force_eager"):
        loss_steps(model, optimizer.step, steps=1)
    dtypes = {key: value.dtype for state in optimizer.state.values() for key, value in state.items() if key != "step"}
    assert dtypes == {"momentum_buffer": torch.bfloat16, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
    # A load keeps bfloat16 state (torch's load casts state to the parameter's dtype).
    state = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(state)
    assert all(v.dtype == torch.bfloat16 for s in optimizer.state.values() for k, v in s.items() if k != "step")
    with torch.compiler.set_stance("force_eager"):
        loss_steps(model, optimizer.step, steps=1)  # the AdamW part still steps on the loaded state


def test_bfloat16_momentum_is_the_stochastically_rounded_float32_momentum():
    model = tiny_model(dtype=torch.float32)
    plain = copy.deepcopy(model)
    rounded = Muon([model.layers["0"].attention.wq.weight], lr=0.01, state_dtype="bfloat16")
    exact = Muon([plain.layers["0"].attention.wq.weight], lr=0.01)
    gradient = torch.randn(TINY.dim, TINY.dim, generator=torch.Generator().manual_seed(3))
    for optimizer, net in ((rounded, model), (exact, plain)):
        net.layers["0"].attention.wq.weight.grad = gradient.clone()
        optimizer.step()
    m_rounded = rounded.state[model.layers["0"].attention.wq.weight]["momentum_buffer"]
    m_exact = exact.state[plain.layers["0"].attention.wq.weight]["momentum_buffer"]
    # bfloat16 state is rounded stochastically, salted by the step count (1 here), like every bfloat16 state.
    expected = round_to_bfloat16_stochastically(m_exact, torch.tensor(1))
    assert m_rounded.dtype == torch.bfloat16 and torch.equal(m_rounded, expected)
    assert not torch.equal(expected, m_exact.bfloat16())  # not round-to-nearest


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(momentum=1.0), "momentum must be in \\[0, 1\\)"),
        (dict(ns_steps=0), "ns_steps must be in 1..99"),
        (dict(ns_dtype="float16"), "ns_dtype must be one of"),
        (dict(adjust_lr="none"), "adjust_lr must be one of"),
        (dict(state_dtype="int8"), "state_dtype must be float32 or bfloat16"),
    ],
)
def test_wrong_arguments_are_user_errors(kwargs, fragment):
    with pytest.raises(UserError, match=fragment):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_vectors_are_refused_and_a_model_without_hidden_matrices_is_told_to_use_adamw():
    with pytest.raises(UserError, match="2-D matrices only"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(UserError, match="no hidden matrices in Linear.*use AdamW"):
        build_optimizers([torch.nn.Linear(4, 4)], muon_job())


def test_config_checks_muon_values():
    with pytest.raises(UserError, match="optimizer.momentum"):
        muon_job("--optimizer.momentum", "1.0")
    with pytest.raises(UserError, match="optimizer.ns_dtype"):
        muon_job("--optimizer.ns_dtype", "float16")
    assert math.isclose(muon_job("--optimizer.momentum", "0.9").optimizer.momentum, 0.9)
