"""AdamW and Adam with both moments stored in bfloat16: half of float32 AdamW's optimizer state.

torch's fused and foreach AdamW kernels require the moments to have the parameter's dtype (a float32 parameter
with bfloat16 moments fails with "expected scalar type Float but found BFloat16" on torch 2.11-2.14), so this step
is our own: compiled elementwise graphs over slices of the parameters (torch.compile, like Adam-mini's fused back end),
math in the parameter's dtype, moments read from and written back to their storage (round-to-nearest). The state
has torch's keys (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints look like AdamW's, in bfloat16.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from torchtitan.optim.compiled_slices import repeating_slices
from torchtitan.optim.state_storage import BFLOAT16, keep_bfloat16_on_load, new_state
from torchtitan.utils import local_tensor


def _local_adam_steps(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step_sizes: list[Tensor],
    bias_correction2_sqrts: list[Tensor],
    decay: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    l2: float,
) -> None:
    """Adam's elementwise update for a list of local tensors; ``step_sizes[i]`` is lr / (1 - beta1**t)."""
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if l2:
            g = g + l2 * p
        m_new = m.to(p.dtype).lerp(g, 1 - beta1)
        v_new = v.to(p.dtype) * beta2 + (1 - beta2) * g * g
        m.copy_(m_new)
        v.copy_(v_new)
        denominator = v_new.sqrt() / bias_correction2_sqrts[i] + eps
        p.copy_(p * decay - step_sizes[i] * m_new / denominator)


_compiled_local_adam_steps = torch.compile(
    _local_adam_steps, fullgraph=True, dynamic=False, options={"size_asserts": False}
)  # static shapes: nothing to check


class LowPrecisionAdam(torch.optim.Optimizer):
    """Adam (``decoupled=False``, L2 weight decay) or AdamW (``decoupled=True``) with bfloat16 moments."""

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
        self.is_adamw = decoupled  # read by the builder's state initialisation
        self.state_dtype = state_dtype
        keep_bfloat16_on_load(self, ("exp_avg", "exp_avg_sq"))

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
        dtype, device = local[0].dtype, local[0].device
        # Steps are CPU scalars; the per-parameter factors travel to the device as one tensor each.
        counts = torch.stack(steps).to(torch.float64)
        lr = torch.as_tensor(group["lr"], dtype=torch.float64).cpu()
        step_sizes = (lr / (1 - beta1**counts)).to(dtype=dtype, device=device)
        bias_correction2_sqrts = (1 - beta2**counts).sqrt().to(dtype=dtype, device=device)
        decoupled = self.is_adamw
        decay = 1 - lr * group["weight_decay"] if decoupled else torch.ones((), dtype=torch.float64)
        dataless = any(t.is_meta or isinstance(t, FakeTensor) for t in local)
        run = _local_adam_steps if dataless or _get_current_dispatch_mode() is not None else _compiled_local_adam_steps
        from torchtitan.optim.torchao_adapter import separate_compile_cache

        grads = [local_tensor(p.grad) for p in params]
        exp_avgs, exp_avg_sqs = (
            [local_tensor(s["exp_avg"]) for s in states],
            [local_tensor(s["exp_avg_sq"]) for s in states],
        )
        step_sizes, bias_correction2_sqrts = step_sizes.unbind(), bias_correction2_sqrts.unbind()
        decay = decay.to(dtype=dtype, device=device)
        l2 = 0.0 if decoupled else group["weight_decay"]
        signatures = [(tuple(t.shape), t.stride()) for t in local]
        with torch._dynamo.utils.disable_cache_limit(), separate_compile_cache("AdamW_bf16"):
            for part in repeating_slices(range(len(local)), signatures):  # a layer's graph, reused by every layer
                run(
                    [local[i].detach() for i in part],
                    [grads[i] for i in part],
                    [exp_avgs[i] for i in part],
                    [exp_avg_sqs[i] for i in part],
                    [step_sizes[i] for i in part],
                    [bias_correction2_sqrts[i] for i in part],
                    decay,
                    beta1,
                    beta2,
                    group["eps"],
                    l2,
                )
