"""NorMuon in one process: against a reference written from the NorMuon reference code (microsoft/dion's
``normuon.py``) over Muon's momentum and Newton–Schulz, the rows it evens out, its options, and its state across a
load. (Across processes: tests/optim/test_layout_matrix.py and tests/optim/test_muon_distributed.py; names, state
bytes and checkpoints: tests/optim/test_optim_builder.py.)"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import job_config, max_difference, set_synthetic_grads, tiny_model, weights
from tests.optim.test_muon import loss_steps
from torchtitan.errors import UserError
from torchtitan.optim import build_optimizers
from torchtitan.optim.muon.normuon import NEURON_SECOND_MOMENT, NorMuon
from torchtitan.optim.muon.optimizer import NS_DTYPES, lr_scale, newton_schulz, split_hidden_matrices

LR, WEIGHT_DECAY = 0.01, 0.1


def normuon_job(*argv: str):
    return job_config("--optimizer.name", "NorMuon", "--optimizer.lr", str(LR), *argv)


class ReferenceNorMuon:
    """One matrix at a time: Muon's momentum (torch.optim.Muon's lerp, Nesterov) and Newton–Schulz, then the
    reference's normalisation and update, operation for operation."""

    def __init__(self, params, momentum=0.95, beta2=0.95, ns_dtype="bfloat16", adjust_lr="match_rms_adamw"):
        self.params = list(params)
        self.momentum, self.beta2, self.ns_dtype, self.adjust_lr = momentum, beta2, NS_DTYPES[ns_dtype], adjust_lr
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p[..., 0:1]) for p in self.params]  # the reference's variance_neuron

    @torch.no_grad()
    def step(self):
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad
            m.lerp_(g, 1 - self.momentum)
            u = newton_schulz(g.lerp(m, self.momentum), 5, self.ns_dtype).to(v.dtype)
            norm_u = u.norm(p=2, dim=(-2, -1), keepdim=True)
            v.lerp_((u * u).mean(dim=-1, keepdim=True), 1 - self.beta2)
            normalized = u / (v.sqrt() + 1e-8)
            normalized = normalized * (norm_u / normalized.norm(p=2, dim=(-2, -1), keepdim=True).clamp(min=1e-8))
            p.mul_(1 - LR * WEIGHT_DECAY)
            p.sub_(normalized * (LR * lr_scale(p.shape, self.adjust_lr)))


def synthetic_steps(model, step, steps: int = 4) -> None:
    """``steps`` steps on fixed gradients: a rounding difference in one step is not fed back through the loss."""
    for i in range(steps):
        set_synthetic_grads(model, i)
        step()


def reference_run(model, **options):
    matrices, others = split_hidden_matrices(model.named_parameters(), model.named_param_roles())
    normuon = ReferenceNorMuon([p for _, p in matrices], **options)
    adamw = torch.optim.AdamW([p for _, p in others], lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WEIGHT_DECAY)

    def step():
        normuon.step()
        adamw.step()

    synthetic_steps(model, step)


@pytest.mark.parametrize(
    "argv, options",
    [
        ((), {}),
        (
            ("--optimizer.neuron_beta2", "0.9", "--optimizer.ns_dtype", "float32", "--optimizer.adjust_lr", "original"),
            dict(beta2=0.9, ns_dtype="float32", adjust_lr="original"),
        ),
    ],
)
def test_one_process_equals_the_reference_in_float32(argv, options):
    """float32 weights; bfloat16 (the default) and float32 Newton–Schulz: equal to float32 rounding, step by step."""
    ours = tiny_model(dtype=torch.float32)
    reference = copy.deepcopy(ours)
    muon = copy.deepcopy(ours)
    before = weights(ours)
    synthetic_steps(ours, build_optimizers([ours], normuon_job(*argv)).step)
    reference_run(reference, **options)
    after, expected = weights(ours), weights(reference)
    assert max_difference(after, before) > 1e-3
    for name, value in expected.items():
        assert (after[name] - value).abs().max() <= 1e-6 * value.abs().max(), name
    if not argv:  # the normalisation changes the hidden matrices: NorMuon is not Muon
        loss_steps(
            muon, build_optimizers([muon], job_config("--optimizer.name", "Muon", "--optimizer.lr", str(LR))).step
        )
        assert max_difference(weights(muon), after) > 1e-4


def test_first_update_has_equal_row_norms_and_the_orthogonalised_momentums_frobenius_norm():
    """From a zero second moment every row is divided by its own RMS: the rows of the update come out equally long,
    and the whole update keeps the Newton–Schulz output's Frobenius norm."""
    p = torch.nn.Parameter(torch.zeros(24, 40, dtype=torch.float64))
    grad = torch.randn(24, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grad[:6] *= 30.0  # rows of very different sizes
    p.grad = grad
    NorMuon([p], lr=1.0, weight_decay=0.0, ns_dtype="float64", adjust_lr="original").step()
    update = -p.detach()  # lr 1, scale sqrt(max(1, 24/40)) = 1
    rows = update.norm(dim=1)
    assert (rows.max() - rows.min()) / rows.mean() < 1e-6
    orthogonal = newton_schulz(grad, 5, torch.float64)  # the momentum is a multiple of grad; NS is scale-free
    assert torch.isclose(update.norm(), orthogonal.norm(), rtol=1e-10)
    assert (orthogonal.norm(dim=1).max() - orthogonal.norm(dim=1).min()) / rows.mean() > 1e-2  # Muon's were not


def test_state_is_muons_plus_a_float32_second_moment_per_row_that_survives_a_load():
    model = tiny_model(dtype=torch.bfloat16)
    optimizer = build_optimizers([model], normuon_job()).optimizers[0]
    with torch.compiler.set_stance("force_eager"):
        loss_steps(model, optimizer.step, steps=1)
    for p in optimizer.param_groups[0]["params"]:
        state = optimizer.state[p]
        assert set(state) == {"step", "momentum_buffer", NEURON_SECOND_MOMENT}
        assert state[NEURON_SECOND_MOMENT].shape == (p.shape[0], 1)
        assert state[NEURON_SECOND_MOMENT].dtype == torch.float32  # not the weights' bfloat16
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(saved)
    moments = [optimizer.state[p][NEURON_SECOND_MOMENT] for p in optimizer.param_groups[0]["params"]]
    assert all(v.dtype == torch.float32 for v in moments)
    assert optimizer.param_groups[0]["neuron_beta2"] == 0.95 and optimizer.param_groups[0]["neuron_eps"] == 1e-8


def test_options_reach_normuon():
    job = normuon_job(
        "--optimizer.neuron_beta2", "0.8", "--optimizer.neuron_eps", "1e-6", "--optimizer.momentum", "0.9"
    )
    group = build_optimizers([tiny_model()], job).optimizers[0].param_groups[0]
    assert (group["neuron_beta2"], group["neuron_eps"], group["momentum"]) == (0.8, 1e-6, 0.9)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(neuron_beta2=1.0), "NorMuon neuron_beta2 must be in \\[0, 1\\)"),
        (dict(neuron_eps=-1.0), "NorMuon neuron_eps must be at least 0"),
        (dict(momentum=1.0), "momentum must be in \\[0, 1\\)"),
    ],
)
def test_wrong_arguments_are_user_errors(kwargs, fragment):
    with pytest.raises(UserError, match=fragment):
        NorMuon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_config_checks_normuon_values_and_a_model_without_hidden_matrices_is_told_to_use_adamw():
    with pytest.raises(UserError, match="optimizer.neuron_beta2"):
        normuon_job("--optimizer.neuron_beta2", "1.0")
    with pytest.raises(UserError, match="optimizer.neuron_eps"):
        normuon_job("--optimizer.neuron_eps", "-1")
    with pytest.raises(UserError, match="NorMuon found no hidden matrices in Linear.*use AdamW"):
        build_optimizers([torch.nn.Linear(4, 4)], normuon_job())


def one_step_update(grad: torch.Tensor, lr: float, *, step_size: str, adjust_lr: str = "match_rms_adamw"):
    """The update of one NorMuon step (no weight decay, float64 Newton–Schulz) on a zero matrix with ``grad``."""
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    optimizer = NorMuon([p], lr=lr, weight_decay=0.0, ns_dtype="float64", adjust_lr=adjust_lr, step_size=step_size)
    optimizer.step()
    return -p.detach()


def rms(t: torch.Tensor) -> float:
    return t.square().mean().sqrt().item()


@pytest.mark.parametrize("shape", [(24, 40), (64, 16)])
def test_rms_step_size_gives_an_update_rms_of_exactly_a_fifth_of_lr(shape):
    generator = torch.Generator().manual_seed(0)
    gaussian = torch.randn(shape, generator=generator, dtype=torch.float64)
    rank4 = torch.randn(shape[0], 4, generator=generator, dtype=torch.float64) @ torch.randn(
        4, shape[1], generator=generator, dtype=torch.float64
    )
    lr = 0.03
    ratios = {}
    for name, grad in (("gaussian", gaussian), ("rank 4", rank4)):
        assert rms(one_step_update(grad, lr, step_size="rms")) == pytest.approx(0.2 * lr, rel=1e-12), name
        # The reference's step reaches 0.2 lr only for an orthogonal o: short of it for a Gaussian update, far short
        # for a rank-4 one (Newton–Schulz keeps its zero singular values).
        ratios[name] = rms(one_step_update(grad, lr, step_size="reference")) / (0.2 * lr)
    print(f"{shape}: reference step's update RMS over 0.2 lr: {ratios}")
    assert 0.8 < ratios["gaussian"] < 1.0 and ratios["rank 4"] < 0.5


def test_rms_step_size_reaches_normuon_from_the_config_and_replaces_adjust_lr():
    settings_argv = ("--optimizer.normuon_step_size", "rms")
    (optimizer,) = build_optimizers([tiny_model()], normuon_job(*settings_argv)).optimizers
    assert optimizer.param_groups[0]["step_size"] == "rms"
    (default,) = build_optimizers([tiny_model()], normuon_job()).optimizers
    assert default.param_groups[0]["step_size"] == "reference"
    with pytest.raises(UserError) as error:
        build_optimizers([tiny_model()], normuon_job(*settings_argv, "--optimizer.adjust_lr", "original"))
    assert str(error.value).startswith("optimizer.adjust_lr does nothing with optimizer.normuon_step_size rms")
    with pytest.raises(UserError, match="NorMuon step_size must be one of reference, rms"):
        NorMuon([torch.nn.Parameter(torch.zeros(4, 4))], step_size="paper")
