"""AdamW and Adam with moments stored apart from the weights' dtype: bfloat16 moments (half of float32 AdamW's
optimizer state), or float32 moments for bfloat16 weights.

torch's fused and foreach AdamW kernels require the moments to have the parameter's dtype (a float32 parameter
with bfloat16 moments fails with "expected scalar type Float but found BFloat16" on torch 2.11-2.14), so this step
is our own: compiled elementwise graphs over slices of the parameters (``CompiledStep``, like Adam-mini's fused
back end), math in at least float32, moments read from and written back to their storage (``write_state``:
bfloat16 rounds stochastically, so that ``v * beta2`` still decays at beta2 = 0.999). The state has torch's keys
(``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints look like AdamW's.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor

from torchtitan.distributed.utils import grad_like_param, local_tensor
from torchtitan.optim.compiled_slices import CompiledStep, repeating_slices
from torchtitan.optim.state.storage import BFLOAT16, at_least_float32, keep_state_dtypes_on_load, new_state, write_state


def _local_adam_steps(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step_sizes: list[Tensor],
    bias_correction2_sqrts: list[Tensor],
    steps: list[Tensor],
    decay: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    l2: Optional[Tensor],
) -> None:
    """Adam's elementwise update for a list of local tensors; ``step_sizes[i]`` is lr / (1 - beta1**t).

    The math runs in ``decay``'s dtype (at least float32); the new moments are used unrounded and written back
    rounded by their storage, the rounding salted by the step count ``steps[i]``. ``l2`` is Adam's weight decay
    (added to the gradient; a tensor, so that state creation's zero compiles the same graph), None for AdamW.
    """
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        weights = p.to(decay.dtype)
        g = g.to(decay.dtype)
        if l2 is not None:
            g = g + l2 * weights
        m_new = m.to(decay.dtype).lerp(g, 1 - beta1)
        v_new = v.to(decay.dtype) * beta2 + (1 - beta2) * g * g
        write_state(m, m_new, steps[i])
        write_state(v, v_new, steps[i])
        denominator = v_new.sqrt() / bias_correction2_sqrts[i] + eps
        p.copy_(weights * decay - step_sizes[i] * m_new / denominator)


_ADAM_STEP = CompiledStep(_local_adam_steps, "AdamW_bf16", realize_opcount_threshold=4)


class LowPrecisionAdam(torch.optim.Optimizer):
    """Adam (``decoupled=False``, L2 weight decay) or AdamW (``decoupled=True``) with moments stored as
    ``state_dtype`` ("bfloat16", or "float32": float32 even for bfloat16 weights)."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: Union[float, Tensor] = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled: bool = True,
        state_dtype: str = BFLOAT16,
    ):
        super().__init__(
            params, dict(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, weight_decay=weight_decay)
        )
        self.decoupled_weight_decay = decoupled  # read by state initialisation
        self.state_dtype = state_dtype
        keep_state_dtypes_on_load(self, {"exp_avg": state_dtype, "exp_avg_sq": state_dtype})

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

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
        state["exp_avg"] = new_state(p, self.state_dtype)
        state["exp_avg_sq"] = new_state(p, self.state_dtype)

    def _step_group(self, group: dict, params: list[Tensor]) -> None:
        for p in params:
            if not self.state[p]:
                self._init_state(p, self.state[p])
        states = [self.state[p] for p in params]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        local = [local_tensor(p) for p in params]
        dtype, device = at_least_float32(local[0].dtype), local[0].device
        # Steps are CPU scalars; the per-parameter factors travel to the device as one tensor each.
        counts = torch.stack(steps).to(torch.float64)
        lr = torch.as_tensor(group["lr"], dtype=torch.float64).cpu()
        step_sizes = (lr / (1 - beta1**counts)).to(dtype=dtype, device=device).unbind()
        bias_correction2_sqrts = (1 - beta2**counts).sqrt().to(dtype=dtype, device=device).unbind()
        salts = counts.to(dtype=torch.int64, device=device).unbind()
        decoupled = self.decoupled_weight_decay
        decay = (1 - lr * group["weight_decay"] if decoupled else torch.ones((), dtype=torch.float64)).to(
            dtype=dtype, device=device
        )
        l2 = None if decoupled else torch.tensor(group["weight_decay"], dtype=dtype).to(device)
        name = "AdamW" if decoupled else "Adam"
        grads = [local_tensor(grad_like_param(p, name)) for p in params]
        exp_avgs, exp_avg_sqs = (
            [local_tensor(s["exp_avg"]) for s in states],
            [local_tensor(s["exp_avg_sq"]) for s in states],
        )

        def arguments(part: list[int]) -> tuple:
            return (
                [local[i].detach() for i in part],
                [grads[i] for i in part],
                [exp_avgs[i] for i in part],
                [exp_avg_sqs[i] for i in part],
                [step_sizes[i] for i in part],
                [bias_correction2_sqrts[i] for i in part],
                [salts[i] for i in part],
                decay,
                beta1,
                beta2,
                group["eps"],
                l2,
            )

        signatures = [(t.dtype, tuple(t.shape), t.stride()) for t in local]
        _ADAM_STEP.run(repeating_slices(range(len(local)), signatures), arguments, local)  # a layer's graph, reused
