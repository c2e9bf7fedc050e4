"""SOAP in one process: exact against pytorch_optimizer.SOAP (the reference code's algorithm) in float32 over 20
steps with three eigenbasis refreshes, a side above max_precondition_dim left unrotated; the pure functions; the
arguments checked."""

from __future__ import annotations

import copy

import pytest
import torch

from torchtitan.errors import UserError
from torchtitan.optim.soap import update
from torchtitan.optim.soap.optimizer import SOAP
from torchtitan.optim.soap.update import (
    BASES,
    EXP_AVG_SQ,
    GRAMS,
    matrix_state_numel,
    new_matrix_state,
    project,
    project_back,
    refresh_eigenbases,
)

STEPS, FREQUENCY = 20, 6  # refreshes after updates 6, 12 and 18
# 12 x 8: both sides rotated; 6 x 20: only the rows' side (20 > max_precondition_dim); 24 x 18: neither.
SHAPES = ((12, 8), (6, 20), (24, 18))
MAX_DIM = 16
OPTIONS = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, precondition_frequency=FREQUENCY)


def _matrices(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=dtype)) for shape in SHAPES]


def _gradient(shape: tuple[int, int], step: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different scales, so that the statistics have distinct eigenvalues."""
    generator = torch.Generator().manual_seed(1000 * index + step)
    scales = torch.linspace(0.2, 3.0, shape[0], dtype=dtype).view(-1, 1)
    return torch.randn(shape, generator=generator, dtype=dtype) * scales


def _run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> list[list[torch.Tensor]]:
    trajectory = []
    for step in range(steps):
        for index, p in enumerate(params):
            p.grad = _gradient(tuple(p.shape), step, index, p.dtype)
        optimizer.step()
        trajectory.append([p.detach().clone() for p in params])
    return trajectory


@pytest.mark.parametrize("shampoo_beta", [None, 0.8])
def test_equals_pytorch_optimizer_soap_in_float32_over_20_steps_with_three_refreshes(shampoo_beta, monkeypatch):
    from pytorch_optimizer import SOAP as ReferenceSOAP

    ours_params, reference_params = _matrices(), _matrices()
    ours = SOAP(ours_params, shampoo_beta=shampoo_beta, max_precondition_dim=MAX_DIM, **OPTIONS)
    refreshes = []  # the steps at which the first matrix's bases were refreshed
    refresh = update.refresh_eigenbases

    def counted(state):
        if state is ours.state[ours_params[0]]:
            refreshes.append(int(state["step"]))
        refresh(state)

    monkeypatch.setattr(update, "refresh_eigenbases", counted)
    reference = ReferenceSOAP(
        reference_params, shampoo_beta=shampoo_beta, max_precondition_dim=MAX_DIM, correct_bias=True, **OPTIONS
    )
    ours_trajectory = _run(ours, ours_params, STEPS)
    reference_trajectory = _run(reference, reference_params, STEPS)
    for step, (mine, theirs) in enumerate(zip(ours_trajectory, reference_trajectory)):
        for index, (a, b) in enumerate(zip(mine, theirs)):
            assert (a - b).abs().max().item() < 1e-6, f"step {step + 1}, matrix {SHAPES[index]}"
    start = _matrices()
    assert all((a - b).abs().max() > 0.1 for a, b in zip(ours_trajectory[-1], start))  # it trained
    # The sides it rotates, as the reference: both, the rows' only, none.
    rotated = [[key in ours.state[p] for key in BASES] for p in ours_params]
    assert rotated == [[True, True], [True, False], [False, False]]
    # Refreshed three times: after updates 6, 12 and 18 (steps 7, 13, 19; the first step makes no update).
    assert refreshes == [7, 13, 19]


def test_the_first_step_only_sets_the_bases_and_the_refresh_keeps_them_orthonormal():
    (p,) = _matrices(torch.float64)[:1]
    optimizer = SOAP([p], max_precondition_dim=MAX_DIM, **OPTIONS)
    before = p.detach().clone()
    p.grad = _gradient(tuple(p.shape), 0, 0, torch.float64)
    optimizer.step()
    assert torch.equal(p, before)
    state = optimizer.state[p]
    for side in (0, 1):
        basis, gram = state[BASES[side]], state[GRAMS[side]]
        diagonal = basis.T @ gram @ basis
        # Eigenvectors by decreasing eigenvalue.
        assert torch.allclose(diagonal, torch.diag(torch.diagonal(diagonal)), atol=1e-10)
        assert (torch.diagonal(diagonal).diff() <= 1e-12).all()
    state[EXP_AVG_SQ].copy_(torch.rand(state[EXP_AVG_SQ].shape, dtype=torch.float64))
    refresh_eigenbases(state)
    for side in (0, 1):
        basis = state[BASES[side]]
        assert torch.allclose(basis.T @ basis, torch.eye(basis.shape[0], dtype=torch.float64), atol=1e-12)


def test_projection_and_its_inverse_round_trip_and_a_missing_side_is_the_identity():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    left = torch.linalg.qr(torch.randn(5, 5, generator=generator, dtype=torch.float64)).Q
    right = torch.linalg.qr(torch.randn(7, 7, generator=generator, dtype=torch.float64)).Q
    assert torch.allclose(project_back(project(x, left, right), left, right), x, atol=1e-12)
    assert torch.allclose(project(x, left, None), left.T @ x)
    assert torch.equal(project(x, None, None), x)


@pytest.mark.parametrize("shape", SHAPES)
def test_state_size_is_two_moments_and_a_statistic_and_basis_per_rotated_side(shape):
    state = new_matrix_state(shape, torch.float32, torch.device("cpu"), MAX_DIM)
    assert sum(t.numel() for t in state.values()) == matrix_state_numel(shape, MAX_DIM)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(precondition_frequency=0), "precondition_frequency"),
        (dict(precondition_frequency=2.5), "precondition_frequency"),
        (dict(max_precondition_dim=0), "max_precondition_dim"),
        (dict(shampoo_beta=1.0), "shampoo_beta"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(eps=-1.0), "eps"),
    ],
)
def test_wrong_arguments_are_user_errors(kwargs, fragment):
    with pytest.raises(UserError, match=fragment):
        SOAP(_matrices(), **kwargs)


def test_vectors_are_refused():
    with pytest.raises(UserError, match="2-D"):
        SOAP([torch.nn.Parameter(torch.zeros(3))])


# ----------------------------------------------------------------------------------------------------------------
# As the builder makes it


def test_builder_gives_hidden_matrices_to_soap_and_the_rest_to_adamw_with_the_options():
    from tests.helpers import job_config, tiny_model
    from torchtitan.optim import build_optimizers
    from torchtitan.optim.muon.optimizer import split_hidden_matrices

    model = tiny_model()
    argv = ["--optimizer.name", "soap", "--optimizer.precondition_frequency", "3"]
    argv += ["--optimizer.max_precondition_dim", "40", "--optimizer.shampoo_beta", "0.9", "--optimizer.beta1", "0.8"]
    optimizer = build_optimizers([model], job_config(*argv)).optimizers[0]
    assert isinstance(optimizer, SOAP)
    soap_group, *adamw_groups = optimizer.param_groups
    matrices, others = split_hidden_matrices(model.named_parameters(), model.named_param_roles())
    assert soap_group["params"] == [p for _, p in matrices]
    assert [p for group in adamw_groups for p in group["params"]] == [p for _, p in others]
    assert isinstance(optimizer.others, torch.optim.AdamW)
    assert soap_group["precondition_frequency"] == 3 and soap_group["max_precondition_dim"] == 40
    assert soap_group["shampoo_beta"] == 0.9 and soap_group["betas"] == (0.8, 0.95)
    assert adamw_groups[0]["betas"] == (0.8, 0.95)
    defaults = build_optimizers([model], job_config("--optimizer.name", "SOAP")).optimizers[0].param_groups[0]
    assert (defaults["precondition_frequency"], defaults["max_precondition_dim"]) == (10, 10000)
    assert defaults["shampoo_beta"] == defaults["betas"][1]


def test_unset_max_precondition_dim_means_the_optimizer_default():
    from torchtitan.optim.settings import MAX_PRECONDITION_DIM, OPTION_RULES
    from torchtitan.optim.soap.optimizer import DEFAULT_MAX_PRECONDITION_DIM

    assert OPTION_RULES[MAX_PRECONDITION_DIM].unset_means == DEFAULT_MAX_PRECONDITION_DIM


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--optimizer.name", "AdamW", "--optimizer.precondition_frequency", "5"], "only to SOAP"),
        (["--optimizer.name", "Muon", "--optimizer.shampoo_beta", "0.9"], "only to SOAP"),
        (["--optimizer.name", "AdamMini", "--optimizer.max_precondition_dim", "100"], "only to SOAP"),
        (["--optimizer.name", "SOAP", "--optimizer.momentum", "0.9"], "does not apply to SOAP"),
        (["--optimizer.name", "SOAP", "--optimizer.state_dtype", "bfloat16"], "does not apply to SOAP"),
    ],
)
def test_soap_options_are_refused_elsewhere_and_other_options_by_soap(argv, fragment):
    from tests.helpers import job_config, tiny_model
    from torchtitan.optim import build_optimizers

    with pytest.raises(UserError, match=fragment):
        build_optimizers([tiny_model()], job_config(*argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["--optimizer.precondition_frequency", "0"],
        ["--optimizer.max_precondition_dim", "0"],
        ["--optimizer.shampoo_beta", "1.0"],
    ],
)
def test_config_checks_soap_values(argv):
    from tests.helpers import job_config

    with pytest.raises(UserError, match=argv[0].removeprefix("--")):
        job_config("--optimizer.name", "SOAP", *argv)


def test_state_of_bfloat16_weights_is_float32_and_stays_so_across_a_load():
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in _matrices()]
    optimizer = SOAP(params, max_precondition_dim=MAX_DIM, **OPTIONS)
    _run(optimizer, params, 3)
    saved = copy.deepcopy(optimizer.state_dict())  # a copy, as from a checkpoint: the load must not alias it
    fresh = SOAP(params, max_precondition_dim=MAX_DIM, **OPTIONS)
    fresh.load_state_dict(saved)
    for p in params:
        state = fresh.state[p]
        assert {key: t.dtype for key, t in state.items() if key != "step"} == {
            key: torch.float32 for key in optimizer.state[p] if key != "step"
        }
        assert all(state[key] is not optimizer.state[p][key] for key in state if key != "step")
        assert all(torch.equal(state[key], optimizer.state[p][key]) for key in state)


def test_the_gpu_check_runs_soap_in_its_only_groups_not_the_quick_profile_and_benchmarks_it():
    from benchmarks.bench_optimizers import FAMILIES
    from torchtitan.gpu_check import steps as plan

    # Its first eigendecompositions at 1B would not fit the quick profile's eight minutes cold.
    assert "SOAP" not in plan.QUICK_OPTIMIZERS and all(not s.startswith("SOAP") for s in plan.QUICK_8B)
    assert "SOAP" in plan.optimizers_1b_variant_specs() and "SOAP" in plan.llama3_8b_more_specs()
    assert "SOAP" in FAMILIES


def test_eigenbasis_falls_back_to_float64_where_the_solver_fails(monkeypatch):
    gram = torch.diag(torch.tensor([1.0, 3.0, 2.0]))
    eigh = torch.linalg.eigh
    calls = []

    def failing_in_float32(matrix):
        calls.append(matrix.dtype)
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return eigh(matrix)

    monkeypatch.setattr(torch.linalg, "eigh", failing_in_float32)
    basis = update.eigenbasis(gram)
    assert calls == [torch.float32, torch.float64] and basis.dtype == torch.float32
    assert torch.equal(basis.abs(), torch.eye(3)[:, [1, 2, 0]])  # by decreasing eigenvalue: 3, 2, 1


def test_max_precondition_dim_shapes_the_state_and_the_other_options_do_not():
    from tests.helpers import job_config
    from torchtitan.optim.settings import state_label

    assert state_label(job_config("--optimizer.name", "SOAP")) == "SOAP"
    assert state_label(job_config("--optimizer.name", "SOAP", "--optimizer.max_precondition_dim", "10000")) == "SOAP"
    assert state_label(job_config("--optimizer.name", "SOAP", "--optimizer.max_precondition_dim", "64")) == (
        "SOAP-max_precondition_dim=64"
    )
    argv = ["--optimizer.precondition_frequency", "50", "--optimizer.shampoo_beta", "0.9"]
    assert state_label(job_config("--optimizer.name", "SOAP", *argv)) == "SOAP"
