"""``AdEMAMix``: a thin ``torch.optim.Optimizer`` front over :func:`~torchtitan.optim.ademamix.update.ademamix_update`.

The state has three moments shaped like the parameter (``exp_avg``, ``exp_avg_slow``, ``exp_avg_sq``: a DTensor
with the parameter's layout under FSDP or TP) and a step count, nothing that depends on the world size, so
checkpoints reshard exactly. The moments are stored as float32 (float64 for float64 weights) or bfloat16
(``state_dtype``), whatever the weights' dtype.

The step is compiled (``torch.compile``, one graph per layer's worth of parameters, reused by every layer), except
for float64 weights (the reference precision of tests, where compile time buys nothing), which step eagerly; both
run the same function.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor

from torchtitan.distributed.utils import grad_like_param, local_tensor
from torchtitan.optim.ademamix.update import StepFactors, ademamix_update, alpha_schedule, beta3_schedule
from torchtitan.optim.compiled_slices import CompiledStep, repeating_slices
from torchtitan.optim.state.storage import FLOAT32, STATE_DTYPES, at_least_float32, keep_state_dtypes_on_load, new_state

MOMENTS = ("exp_avg", "exp_avg_slow", "exp_avg_sq")


def _update_slice(params, grads, exp_avgs, exp_avg_slows, exp_avg_sqs, factors, beta1, beta2, eps) -> None:
    ademamix_update(params, grads, exp_avgs, exp_avg_slows, exp_avg_sqs, factors, beta1=beta1, beta2=beta2, eps=eps)


# One compiled graph per distinct slice of a model's parameters (a layer's worth), reused by every layer.
_COMPILED_STEP = CompiledStep(_update_slice, "AdEMAMix", realize_opcount_threshold=4)


class AdEMAMix(torch.optim.Optimizer):
    """AdEMAMix with decoupled weight decay (scaled by lr, as AdamW's) on every parameter it is given.

    ``betas`` are the fast momentum's and the second moment's decays; ``beta3`` and ``alpha`` the slow momentum's
    decay and weight, reached after ``warmup_steps`` (0: from the first step).
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Union[float, Tensor] = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        alpha: float = 5.0,
        beta3: float = 0.9999,
        warmup_steps: int = 0,
        state_dtype: str = FLOAT32,
    ):
        if not alpha >= 0.0:
            raise ValueError(f"AdEMAMix alpha must be at least 0; got {alpha}")
        if not 0.0 < beta3 < 1.0:
            raise ValueError(f"AdEMAMix beta3 must be in (0, 1); got {beta3}")
        if warmup_steps < 0:
            raise ValueError(f"AdEMAMix warmup_steps must be at least 0; got {warmup_steps}")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"AdEMAMix state_dtype must be one of {', '.join(STATE_DTYPES)}; got {state_dtype!r}")
        defaults = dict(
            lr=lr,
            betas=(float(betas[0]), float(betas[1])),
            eps=eps,
            weight_decay=weight_decay,
            alpha=float(alpha),
            beta3=float(beta3),
            warmup_steps=int(warmup_steps),
        )
        super().__init__(params, defaults)
        self.decoupled_weight_decay = True  # read by state initialisation
        self.state_dtype = state_dtype
        keep_state_dtypes_on_load(self, dict.fromkeys(MOMENTS, state_dtype))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict, params: list[Tensor]) -> None:
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
                for key in MOMENTS:
                    state[key] = new_state(p, self.state_dtype)
        states = [self.state[p] for p in params]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)
        local = [local_tensor(p) for p in params]
        columns = (
            [p.detach() for p in local],
            [local_tensor(grad_like_param(p, "AdEMAMix")) for p in params],
            *([local_tensor(state[key]) for state in states] for key in MOMENTS),
            self._factors(group, torch.stack(steps).to(torch.float64), local),
        )
        beta1, beta2 = group["betas"]
        if all(t.dtype == torch.float64 for t in local):
            _update_slice(*columns, beta1, beta2, group["eps"])
            return

        def arguments(part: list[int]) -> tuple:
            return (*([column[i] for i in part] for column in columns), beta1, beta2, group["eps"])

        signatures = [(t.dtype, tuple(t.shape), t.stride()) for t in local]
        _COMPILED_STEP.run(repeating_slices(range(len(local)), signatures), arguments, local)

    @staticmethod
    def _factors(group: dict, counts: Tensor, local: list[Tensor]) -> list[StepFactors]:
        """Each parameter's step factors, computed in float64 on the CPU from its step count ``counts[i]``, then
        moved to its device in its math dtype."""
        beta1, beta2 = group["betas"]
        lr = torch.as_tensor(group["lr"], dtype=torch.float64).cpu().expand_as(counts)
        table = torch.stack(
            [
                lr,
                1 - lr * group["weight_decay"],
                1 - beta1**counts,
                (1 - beta2**counts).sqrt(),
                alpha_schedule(counts, group["alpha"], group["warmup_steps"]),
                1 - beta3_schedule(counts, beta1, group["beta3"], group["warmup_steps"]),
            ]
        )
        moved: dict[tuple, tuple[Tensor, Tensor]] = {}  # one transfer per (dtype, device), not one per parameter
        factors = []
        for i, t in enumerate(local):
            key = (at_least_float32(t.dtype), t.device)
            if key not in moved:
                moved[key] = (table.to(dtype=key[0], device=key[1]), counts.to(dtype=torch.int64, device=key[1]))
            values, salts = moved[key]
            factors.append(StepFactors(*values[:, i].unbind(), salt=salts[i]))
        return factors
