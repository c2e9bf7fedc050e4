"""Adam-mini: Adam with one second moment per block of rows, about half of AdamW's optimizer memory.

Usable on its own, and a drop-in for the authors' ``Adam_mini`` (v1.1.1) constructor::

    from torchtitan.optim import AdamMini
    optimizer = AdamMini(model.named_parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                         dim=4096, n_heads=32, n_kv_heads=8)

The update for a parameter ``p`` with gradient ``g``, step ``t`` and blocks ``B`` (see ``partition.py``)::

    p <- p * (1 - lr * weight_decay)                          (matrices only; never norms, biases, vectors)
    m <- lerp(m, g, 1 - beta1)
    v[B] <- beta2 * v[B] + (1 - beta2) * mean(g[B] ** 2)
    p <- p - lr * (m / (1 - beta1**t)) / (sqrt(v[B] / (1 - beta2**t)) + eps)

Distributed training needs no code of its own: state is created like the parameter (a DTensor exactly when the
parameter is one), per-row statistics are local wherever rows are whole on a rank (FSDP2's ``Shard(0)``,
column-wise tensor parallelism), and the only communication is DTensor summing the tiny per-block sums of squares
over the mesh dimensions that split a block (heads cut by uneven FSDP shards, norms, row-wise TP): one all-reduce
per step under FSDP2 (plus, at the first step, a gather of where each rank's query/key rows sit). The state holds
``m`` (the parameter's shape), ``v`` (``(blocks, 1)``, or the parameter's shape for biases) and ``step``: nothing
that depends on the world size, so distributed checkpoints reshard exactly. The keys follow the authors' Adam-mini 1.1.1
(``m``; ``v``, which it calls ``vmean`` when blocked), not torch's ``exp_avg``/``exp_avg_sq``: ``v`` holds one entry
per block, not a per-element second moment.

The code is split by concern: ``adam_mini_layout`` (where a parameter's blocks live), ``adam_mini_statistics``
(block means, shared by the back ends), ``adam_mini_foreach`` and ``adam_mini_fused`` (the back ends); this module
holds the optimizer and the functional update that picks a back end.
"""

import logging
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch import Tensor

from torchtitan.distributed.utils import grad_like_param, local_tensor
from torchtitan.errors import UserError
from torchtitan.models.roles import ATTN_OUT, EMBEDDING, KEY, MLP, OUTPUT, QUERY, VALUE
from torchtitan.optim.adam_mini.foreach import foreach_update
from torchtitan.optim.adam_mini.fused import fused_update
from torchtitan.optim.adam_mini.layout import BlockLayout, layout_for, new_second_moment
from torchtitan.optim.adam_mini.partition import (
    PER_ROW,
    ROLE_RULE_CHOICES,
    BlockPlan,
    partition_summary,
    plan_blocks,
    unmatched_matrices,
)
from torchtitan.optim.adam_mini.statistics import Hyper
from torchtitan.optim.settings import check_adam_hyperparameters
from torchtitan.optim.state.storage import (
    BFLOAT16,
    FLOAT32,
    INT4,
    INT8,
    keep_state_dtypes_on_load,
    new_state,
)

logger = logging.getLogger(__name__)

__all__ = ["AdamMini", "BlockLayout", "adam_mini_update", "layout_for", "new_second_moment"]

FOREACH, FUSED = "foreach", "fused"
IMPLEMENTATIONS = (FOREACH, FUSED)
MOMENTUM_STORAGES = (FLOAT32, BFLOAT16, INT8, INT4)


def adam_mini_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    second_moments: list[Tensor],
    steps: list[Tensor],
    layouts: list[BlockLayout],
    *,
    lr: Union[float, Tensor],
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    implementation: str = FOREACH,
) -> None:
    """One Adam-mini step, in place, for parameters (plain tensors or DTensors) and their state.

    ``second_moments[i]`` is ``v`` as made by :func:`new_second_moment`; ``steps`` are 0-D float tensors;
    ``exp_avgs`` may be stored in any of ``state_storage``'s forms (float32, bfloat16, 8-/4-bit). Block statistics
    that are partial on this rank (split blocks, see :class:`BlockLayout`) are completed first, in one batched
    DTensor all-reduce; everything else is local and runs as foreach kernels or as compiled code
    (``implementation``), where block means, ``v`` and the update of a parameter are one graph.
    """
    params, grads = [local_tensor(p) for p in params], [local_tensor(g) for g in grads]
    exp_avgs, second_moments = [local_tensor(m) for m in exp_avgs], [local_tensor(v) for v in second_moments]
    if isinstance(lr, Tensor) and params and lr.device != params[0].device:
        lr = lr.to(params[0].device)  # foreach kernels take a tensor factor only on the tensors' device
    torch._foreach_add_(steps, 1)
    # Steps are CPU scalars: reading them costs no device synchronisation.
    step_counts = [step.item() for step in steps]
    hyper = Hyper(lr, beta1, beta2, eps, weight_decay)
    if implementation == FUSED:
        fused_update(params, grads, exp_avgs, second_moments, step_counts, layouts, hyper)
    else:
        foreach_update(params, grads, exp_avgs, second_moments, step_counts, layouts, hyper)


# ----------------------------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------------------------


class AdamMini(torch.optim.Optimizer):
    """Adam-mini over ``named_parameters`` (``(name, parameter)`` pairs, e.g. ``model.named_parameters()``).

    Args:
        lr, betas, eps, weight_decay: as for AdamW; ``lr`` may be a float or a 0-D tensor. Weight decay is
            decoupled and applies to matrices only (norms, biases and other vectors never decay).
        dim, n_heads: the model's hidden size and query heads (required); n_kv_heads: key/value heads (default
            n_heads).
        head_dim: rows per query/key head, when it is not ``dim // n_heads``.
        value_blocks: ``"per_row"`` (default) or ``"per_tensor"`` (one block for each value weight; the authors'
            advice for runs shorter than about 10k steps).
        embedding_blocks, output_blocks: ``"per_row"`` (default: one second moment per token, adam-mini 1.1.1's) or
            ``"per_element"`` (Adam's, as Adam-mini's first release had it).
        attn_out_blocks, mlp_blocks: ``"per_row"`` (default: one per output neuron, 1.1.1's) or ``"per_tensor"``
            (one for the whole matrix, as the first release had it).
        norm_weight_decay: decay the norms' scales too (default False: 1.1.1 decays neither norms nor biases).
        param_roles: ``{name: role}`` from the model (our Llama's ``named_param_roles()``); roles are embedding,
            output, query, key, value, attn_out, mlp, norm and bias. Names it lacks fall back to name rules.
        momentum_storage: how ``m`` is stored: ``"float32"`` (default; float64 for float64 parameters),
            ``"bfloat16"`` (stochastically rounded at every step), ``"int8"`` or ``"int4"`` (torchao's
            block-quantized state, one scale per ``block_size`` entries; tensors under 4096 entries stay float32).
            ``v`` is float32 (float64 for float64 parameters) whatever the parameters' dtype, and never rounded.
        implementation: ``"fused"`` (one operator call a step for float32 parameters with float32 momentum, a C++
            kernel on the CPU and a Triton one on CUDA; compiled graphs for the other storages) or
            ``"foreach"``; unset picks fused, except for float64 parameters, which run foreach (the reference
            precision of our tests, where compile time buys nothing).
        model_sharding, verbose: accepted for compatibility with the official constructor; sharding is always
            handled, and ``verbose`` also logs one line per parameter.

    The partition is logged once at construction and available as ``self.partition`` (one BlockPlan per
    parameter, in order).
    """

    def __init__(
        self,
        named_parameters: Union[Iterable[tuple[str, Tensor]], Mapping[str, Tensor]],
        lr: Union[float, Tensor] = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        dim: Optional[int] = None,
        n_heads: Optional[int] = None,
        n_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        value_blocks: str = PER_ROW,
        embedding_blocks: str = PER_ROW,
        output_blocks: str = PER_ROW,
        attn_out_blocks: str = PER_ROW,
        mlp_blocks: str = PER_ROW,
        norm_weight_decay: bool = False,
        param_roles: Optional[Mapping[str, str]] = None,
        momentum_storage: str = FLOAT32,
        block_size: Optional[int] = None,
        implementation: Optional[str] = None,
        model_sharding: Optional[bool] = None,
        verbose: bool = False,
    ):
        del model_sharding  # always handled
        if momentum_storage not in MOMENTUM_STORAGES:
            raise UserError(
                f"AdamMini momentum_storage must be one of {', '.join(MOMENTUM_STORAGES)}, not {momentum_storage!r}"
            )
        if implementation not in (None,) + IMPLEMENTATIONS:
            raise UserError(
                f"AdamMini implementation must be one of {', '.join(IMPLEMENTATIONS)}, not {implementation!r}"
            )
        if block_size is not None and (
            momentum_storage not in (INT8, INT4) or block_size <= 0 or (momentum_storage == INT4 and block_size % 2)
        ):
            raise UserError(
                f"AdamMini block_size must be a positive (for int4: even) number and applies to int8/int4 "
                f"momentum only; got {block_size} with {momentum_storage}"
            )
        _check_hyperparameters(lr, betas, eps, weight_decay)
        head_dim, n_kv_heads = _check_heads(dim, n_heads, n_kv_heads, head_dim)
        role_rules = {
            role: _checked_rule(argument, rule, role)
            for role, argument, rule in (
                (VALUE, "value_blocks", value_blocks),
                (EMBEDDING, "embedding_blocks", embedding_blocks),
                (OUTPUT, "output_blocks", output_blocks),
                (ATTN_OUT, "attn_out_blocks", attn_out_blocks),
                (MLP, "mlp_blocks", mlp_blocks),
            )
        }
        named = _named_trainable(named_parameters)
        plans = plan_blocks(
            ((name, tuple(p.shape)) for name, p in named),
            head_dim=head_dim,
            param_roles=param_roles,
            role_rules=role_rules,
            norm_weight_decay=bool(norm_weight_decay),
        )
        params = [p for _, p in named]
        super().__init__(
            params, dict(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, weight_decay=weight_decay)
        )
        self.partition: list[BlockPlan] = plans
        # Decoupled (scales with lr): state initialisation keeps it on at lr 0, so its step compiles the same graphs.
        self.decoupled_weight_decay = True
        self.momentum_storage, self.block_size, self.implementation = momentum_storage, block_size, implementation
        # v is float32 always; quantized m is restored by its own hooks (torchao_adapter.portable_quantized_state).
        kept = {"v": FLOAT32} if momentum_storage in (INT8, INT4) else {"m": momentum_storage, "v": FLOAT32}
        keep_state_dtypes_on_load(self, kept)
        self._layouts: dict[Tensor, BlockLayout] = {p: layout_for(p, plan) for p, plan in zip(params, plans)}
        _log_partition(plans, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, verbose=verbose)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, second_moments, steps, layouts = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                layout = self._layouts[p]
                if not state:
                    self._init_state(p, state, layout)
                params.append(p)
                grads.append(grad_like_param(p, "AdamMini"))
                exp_avgs.append(state["m"])
                second_moments.append(state["v"])
                steps.append(state["step"])
                layouts.append(layout)
            if params:
                beta1, beta2 = group["betas"]
                adam_mini_update(
                    params,
                    grads,
                    exp_avgs,
                    second_moments,
                    steps,
                    layouts,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    implementation=self._implementation_for(params),
                )
        return loss

    def _implementation_for(self, params: list[Tensor]) -> str:
        if self.implementation is not None:
            return self.implementation
        return FOREACH if params[0].dtype == torch.float64 else FUSED

    def _init_state(self, p: Tensor, state: dict, layout: BlockLayout) -> None:
        # A CPU scalar like AdamW's: its value stays readable on meta and fake parameters.
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
        state["m"] = new_state(p, self.momentum_storage, self.block_size)
        state["v"] = new_second_moment(p, layout)


def _named_trainable(named_parameters: Any) -> list[tuple[str, Tensor]]:
    items = list(named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters)
    for item in items:
        if not (
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Tensor)
        ):
            raise UserError("AdamMini takes (name, parameter) pairs: pass model.named_parameters()")
    named = [(name, p) for name, p in items if p.requires_grad]
    if not named:
        raise UserError("AdamMini got no trainable parameters")
    return named


def _checked_rule(argument: str, rule: str, role: str) -> str:
    choices = ROLE_RULE_CHOICES[role]
    if rule not in choices:
        raise UserError(f"{argument} must be one of {', '.join(choices)}, not {rule!r}")
    return rule


def _check_hyperparameters(lr: Any, betas: Any, eps: float, weight_decay: float) -> None:
    check_adam_hyperparameters(_scalar_value(lr), betas, eps, weight_decay, keys=_ARGUMENT_NAMES)


# How AdamMini's errors name its constructor arguments.
_ARGUMENT_NAMES = {
    "lr": "AdamMini lr",
    "betas": "AdamMini betas",
    "beta1": "AdamMini betas[0]",
    "beta2": "AdamMini betas[1]",
    "eps": "AdamMini eps",
    "weight_decay": "AdamMini weight_decay",
}


def _scalar_value(value: Any) -> Optional[float]:
    """A float for a number or a real 1-element tensor; None where the value cannot be read (meta, fake)."""
    if not isinstance(value, Tensor):
        return float(value)
    if value.numel() != 1:
        raise UserError(f"AdamMini lr must be a number or a 1-element tensor, not shape {tuple(value.shape)}")
    try:
        return float(value)
    except Exception:  # noqa: BLE001 - meta or fake tensors have no value to check
        return None


def _check_heads(dim: Any, n_heads: Any, n_kv_heads: Any, head_dim: Any) -> tuple[int, int]:
    """(head_dim, n_kv_heads) after checking the model shape arguments."""
    if dim is None or n_heads is None:
        raise UserError("AdamMini needs the model's dim= and n_heads= (they size the query/key blocks)")
    for label, value in (("dim", dim), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if value is not None and (isinstance(value, bool) or int(value) != value or value <= 0):
            raise UserError(f"AdamMini {label} must be a positive integer, got {value!r}")
    n_kv_heads = n_heads if n_kv_heads is None else int(n_kv_heads)
    if n_heads % n_kv_heads:
        raise UserError(f"AdamMini: n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}")
    if head_dim is None:
        if dim % n_heads:
            raise UserError(f"AdamMini: dim {dim} is not divisible by n_heads {n_heads}; pass head_dim=")
        head_dim = dim // n_heads
    return int(head_dim), n_kv_heads


def _log_partition(plans: list[BlockPlan], *, n_heads: int, n_kv_heads: int, head_dim: int, verbose: bool) -> None:
    logger.info(partition_summary(plans))
    if verbose:
        for plan in plans:
            logger.info("  %s %s: %s, %d blocks", plan.name, plan.shape, plan.rule, plan.n_blocks)
    unmatched = unmatched_matrices(plans)
    if unmatched:
        logger.warning(
            "AdamMini: no role for %d matrices (%s); they get one block per row. Pass param_roles={name: role} "
            "to choose.",
            len(unmatched),
            ", ".join(unmatched[:5]) + (" ..." if len(unmatched) > 5 else ""),
        )
    expected = {QUERY: n_heads * head_dim, KEY: n_kv_heads * head_dim}
    for plan in plans:
        if plan.role in expected and plan.rows != expected[plan.role]:
            logger.warning(
                "AdamMini: %s has %d rows, not %d heads x %d; check n_heads/n_kv_heads/head_dim",
                plan.name,
                plan.rows,
                expected[plan.role] // head_dim,
                head_dim,
            )
