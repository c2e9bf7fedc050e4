"""Optimizer health: what each group of weights did at a step, and how often the loss spiked.

Every ``metrics.health_freq`` steps (0: off, and then nothing here runs: no collective, no copy of the weights),
for each group of weights (the model's declared roles: embedding, q/k/v/o, MLP in and out, norms, output; per
layer as well when the model has at most ``metrics.health_max_layers`` layers; and ``all``) the step logs:

* ``health/grad_norm/<group>``: the norm of the gradient the optimizer received, before clipping (the groups'
  squares add up to the global ``grad_norm``'s);
* ``health/update_rms/<group>``: the root mean square of the change of the weights over the step (after minus
  before), and ``health/update_rms_per_lr/<group>`` the same divided by the step's lr;
* ``health/update_to_weight/<group>``: the norm of that change over the norm of the weights before the step;
* ``health/weight_norm/<group>``: the norm of the weights after the step;
* ``health/attn_logit_max`` (and ``health/attn_logit_max/layers.N``): the largest pre-softmax attention logit
  (q·k/√d over the step's micro-batches, causal positions only); a compiled model, or one with activation
  checkpointing, gets them from one more forward of each micro-batch without gradients, run eagerly, before its
  training forward (the same weights and inputs, so the same logits).

Each rank sums squares over its own shards (norms in the weights' dtype, at least float32, without a widened
copy; added up in float64), each counted once (a shard replicated over a mesh dimension
is weighted by one over that dimension's size), and one all-reduce of the stacked sums (plus one max for the logits)
completes them, so the values are those of one process whatever FSDP, TP or HSDP layout. A step whose update the
divergence guard skips logs no health (nothing was updated); gradients are read once, after the last
micro-batch of gradient accumulation. The weights before the step wait in host memory (pinned, from a GPU), so the
device never holds a second copy of them; at most ``metrics.health_snapshot_gib`` per rank: a rank whose weights are
larger measures no update (its update metrics are not logged, said once), so the host memory the health holds is
bounded in any layout (:func:`snapshot_bytes` counts it, for estimation.py).

:class:`LossSpikes` counts steps whose loss (the data-parallel mean) exceeds ``metrics.loss_spike_factor`` times
the median of the previous ``metrics.loss_spike_window`` steps' losses; skipped steps are left out. Losses stay on
the device between log steps and are reduced in one all-reduce per log step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.distributed.collectives import all_reduce_max_, all_reduce_sum_
from torchtitan.distributed.utils import grad_like_param, local_tensor
from torchtitan.logging import logger
from torchtitan.models.roles import (
    ATTN_OUT,
    BIAS,
    EMBEDDING,
    KEY,
    MLP,
    NORM,
    OUTPUT,
    QUERY,
    VALUE,
    canonical_name,
)

# The most weights of one tensor the update's measurement compares at once (float32: 64 MiB of the device's memory).
CHUNK_ELEMENTS = 2**24

# The group of each declared role; MLP splits into its input projections (w1, w3) and its output one (w2).
GROUP_OF_ROLE = {
    EMBEDDING: "embedding",
    OUTPUT: "output",
    QUERY: "q",
    KEY: "k",
    VALUE: "v",
    ATTN_OUT: "o",
    NORM: "norm",
    BIAS: "bias",
}
MLP_OUT_SUFFIX = "w2.weight"


ALL = "all"


def health_groups(name: str, role: Optional[str], per_layer: bool) -> list[str]:
    """The groups a weight named ``name`` (its canonical name) with ``role`` counts in: its role's group (over all
    layers), with ``per_layer`` its layer's group of that role (``layers.N.q``), and ``all``."""
    if role == MLP:
        group = "mlp_out" if name.endswith(MLP_OUT_SUFFIX) else "mlp_in"
    else:
        group = GROUP_OF_ROLE.get(role, "other")
    parts = name.split(".")
    if per_layer and len(parts) > 2 and parts[0] == "layers":
        return [group, f"layers.{parts[1]}.{group}", ALL]
    return [group, ALL]


def snapshot_bytes(params, limit_gib: float) -> int:
    """Host bytes this rank's health holds for the weights before a measured step: their local size when it is
    within ``limit_gib``, else 0 (no update is measured)."""
    size = sum(local_tensor(p).numel() * p.element_size() for p in params if p.requires_grad)
    return size if size <= limit_gib * 2**30 else 0


def _copies(tensor: torch.Tensor) -> int:
    """How many ranks hold the same values as this rank's part of ``tensor``: the product of the mesh sizes over
    which a DTensor is replicated; every rank for a plain tensor in a process group (a replicated model)."""
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        return math.prod(mesh.size(dim) for dim, p in enumerate(tensor.placements) if p.is_replicate())
    return dist.get_world_size() if dist.is_initialized() else 1


class OptimizerHealth:
    """Measures the per-group health at the steps it is due; see the module docstring.

    The training step calls :meth:`start` (before the forward), :meth:`record_attention` (for each micro-batch),
    :meth:`record_gradients` (before clipping), :meth:`snapshot_weights` and :meth:`record_update` (around the
    optimizer step), or :meth:`discard` when the guard skips the update; the loop then reads :meth:`metrics`.
    """

    def __init__(
        self,
        model_parts: list[torch.nn.Module],
        freq: int,
        max_layers: int,
        device: torch.device,
        separate_forward: bool = False,
        snapshot_gib: float = 1.0,
    ):
        self.freq = freq
        self.device = device
        self.separate_forward = separate_forward  # the logits from a forward of their own (see ``build``)
        self.attention = [
            (name, module)
            for part in model_parts
            for name, module in part.named_modules()
            if hasattr(module, "record_logit_max")
        ]
        names = [canonical_name(name) for part in model_parts for name, _ in part.named_parameters()]
        layers = {name.split(".")[1] for name in names if name.startswith("layers.")}
        per_layer = len(layers) <= max_layers
        self.per_layer = per_layer
        self.params: list[torch.Tensor] = []
        numel: dict[str, int] = {}  # group -> its number of weights, in order of first appearance
        members: list[tuple[int, str]] = []  # (parameter index, group) for every group a parameter counts in
        for part in model_parts:
            roles = {canonical_name(n): r for n, r in getattr(part, "named_param_roles", dict)().items()}
            for raw_name, param in part.named_parameters():
                if not param.requires_grad:
                    continue
                name = canonical_name(raw_name)
                for group in health_groups(name, roles.get(name), per_layer):
                    numel[group] = numel.get(group, 0) + param.numel()
                    members.append((len(self.params), group))
                self.params.append(param)
        self.groups = list(numel)
        self.member_param = torch.tensor([i for i, _ in members], dtype=torch.long, device=device)
        self.member_group = torch.tensor([self.groups.index(g) for _, g in members], dtype=torch.long, device=device)
        self.group_numel = [float(numel[g]) for g in self.groups]
        self._host: Optional[list[torch.Tensor]] = None  # pinned host buffers of the weights before a step
        # The largest rank's weights decide for all (the update's sums are all-reduced together).
        local = float(sum(local_tensor(p).numel() * p.element_size() for p in self.params))
        largest = all_reduce_max_(torch.tensor([local], dtype=torch.float64, device=device), _world()).item()
        self.measures_update = largest <= snapshot_gib * 2**30
        if not self.measures_update:
            logger.warning(
                f"health: a rank's weights take {largest / 2**30:.2f} GiB, above metrics.health_snapshot_gib "
                f"{snapshot_gib:g}: no update metrics (update RMS, update/weight) are logged; raise it to measure "
                "them, with that much more host memory per rank"
            )
        self.weights = torch.tensor([1.0 / _copies(p) for p in self.params], dtype=torch.float64, device=device)
        self._reset()

    @classmethod
    def build(cls, model_parts, job_config, device: torch.device) -> Optional["OptimizerHealth"]:
        m = job_config.metrics
        if m.health_freq == 0:
            return None
        # Compiled graphs cannot keep the logits (a side effect), and activation checkpointing would see the
        # measurement's ops (selective checkpointing saves and replays by op count): both measure in a forward of
        # their own.
        separate = job_config.training.compile or job_config.activation_checkpoint.mode != "none"
        return cls(model_parts, m.health_freq, m.health_max_layers, device, separate, m.health_snapshot_gib)

    def _reset(self) -> None:
        self.measuring = False
        self._snapshot: Optional[list[torch.Tensor]] = None
        self._sums: Optional[dict[str, torch.Tensor]] = None
        for _, module in self.attention:
            module.record_logit_max = False
            module.logit_max = None

    def due(self, step: int) -> bool:
        return self.freq > 0 and step % self.freq == 0

    def _group_sums(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return self._sums_by_group(sums_of_squares(tensors))

    def _sums_by_group(self, squares: torch.Tensor) -> torch.Tensor:
        """Per-parameter sums of squares (each weighted by one over its copies) added up per group."""
        squares = squares.to(self.device) * self.weights
        sums = torch.zeros(len(self.groups), dtype=torch.float64, device=self.device)
        return sums.index_add_(0, self.member_group, squares[self.member_param])

    def start(self, step: int) -> bool:
        """Begin measuring ``step`` if it is due (attention layers keep their largest logit); whether it is."""
        self._reset()
        self.measuring = self.due(step)
        self._keep_logits(self.measuring and not self.separate_forward)
        return self.measuring

    def _keep_logits(self, keep: bool) -> None:
        for _, module in self.attention:
            module.record_logit_max = keep

    def record_attention(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, chunks: int) -> None:
        """With ``separate_forward`` (a compiled or checkpointed model), run the micro-batch's forward (with its loss
        over ``chunks``) once more, without gradients and eagerly, with the attention layers keeping their largest
        logit: the compiled graphs and checkpointing's saved and recomputed ops never see the measurement. Otherwise
        the training forward itself keeps them."""
        if not (self.measuring and self.separate_forward):
            return
        self._keep_logits(True)
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                model(inputs, labels=labels, loss_chunks=chunks)
        finally:
            self._keep_logits(False)

    def record_gradients(self) -> None:
        if not self.measuring:
            return
        self._keep_logits(False)  # the forwards and backwards of the step are done
        grads = [local_tensor(_grad_like_param(p)) for p in self.params]
        self._sums = {"grad": self._group_sums([g.detach() for g in grads])}

    def snapshot_weights(self) -> None:
        """This rank's weight shards before the optimizer step, copied to host memory (from a GPU into pinned buffers
        kept from one measured step to the next), so that the device never holds a second copy of the weights."""
        if not self.measuring:
            return
        weights = [local_tensor(p).detach() for p in self.params]
        if not self.measures_update:  # the norms before the step, on the device: no copy
            self._sums["before"] = self._group_sums(weights)
            return
        if self._host is None or any(h.shape != w.shape or h.dtype != w.dtype for h, w in zip(self._host, weights)):
            self._host = [torch.empty_like(w, device="cpu", pin_memory=w.is_cuda) for w in weights]
        for host, weight in zip(self._host, weights):
            host.copy_(weight, non_blocking=True)  # queued before the step's kernels on the same stream
        self._snapshot = self._host

    def record_update(self) -> None:
        """Sums of squares of the change, the weights before and after; one parameter at a time on the device."""
        if self.measuring and not self.measures_update and self._sums is not None:
            self._sums["after"] = self._group_sums([local_tensor(p).detach() for p in self.params])
            return
        if not self.measuring or self._snapshot is None:
            return
        update, before, after = [], [], []
        for param, host in zip(self.params, self._snapshot):
            now = local_tensor(param).detach().reshape(-1)
            wide = torch.promote_types(now.dtype, torch.float32)  # the difference of two bf16 values is exact here
            chunks = []  # (change, before, after) norms of each chunk: the device holds a chunk of the weights at most
            for start in range(0, max(1, now.numel()), CHUNK_ELEMENTS):
                now_part = now[start : start + CHUNK_ELEMENTS]
                then_part = host.reshape(-1)[start : start + CHUNK_ELEMENTS].to(now.device, non_blocking=True)
                chunks.append(
                    torch.stack(
                        [
                            torch.linalg.vector_norm(now_part.to(wide) - then_part.to(wide)),
                            torch.linalg.vector_norm(then_part, dtype=wide),
                            torch.linalg.vector_norm(now_part, dtype=wide),
                        ]
                    )
                )
            squares = torch.stack(chunks).to(torch.float64).square().sum(dim=0)
            update.append(squares[0])
            before.append(squares[1])
            after.append(squares[2])
        self._sums["update"] = self._sums_by_group(torch.stack(update))
        self._sums["before"] = self._sums_by_group(torch.stack(before))
        self._sums["after"] = self._sums_by_group(torch.stack(after))
        self._snapshot = None
        if not any(h.is_pinned() for h in self._host):  # plain host memory is cheap to get again: not kept
            self._host = None

    def discard(self) -> None:
        """The guard skipped the update: nothing of this step is logged."""
        self._reset()

    def metrics(self, lr: float) -> dict[str, float]:
        """The measured step's values (one all-reduce of the sums, one max of the logits), or {} when it was not
        measured or its update was skipped."""
        keys = ("grad", "update", "before", "after") if self.measures_update else ("grad", "before", "after")
        if not self.measuring or self._sums is None or any(k not in self._sums for k in keys):
            self._reset()
            return {}
        stacked = all_reduce_sum_(torch.stack([self._sums[k] for k in keys]), _world())
        sums = dict(zip(keys, stacked.tolist()))
        numel = self.group_numel
        out: dict[str, float] = {}
        for i, group in enumerate(self.groups):
            out[f"health/grad_norm/{group}"] = math.sqrt(sums["grad"][i])
            if self.measures_update:
                update_rms = math.sqrt(sums["update"][i] / numel[i])
                out[f"health/update_rms/{group}"] = update_rms
                out[f"health/update_rms_per_lr/{group}"] = update_rms / lr if lr > 0 else 0.0
                before = math.sqrt(sums["before"][i])
                out[f"health/update_to_weight/{group}"] = math.sqrt(sums["update"][i]) / before if before > 0 else 0.0
            out[f"health/weight_norm/{group}"] = math.sqrt(sums["after"][i])
        out.update(self._logit_metrics())
        self._reset()
        return out

    def _logit_metrics(self) -> dict[str, float]:
        if not self.attention:
            return {}
        maxima = torch.stack(
            [
                m.logit_max.to(self.device, torch.float64) if m.logit_max is not None else _minus_inf(self.device)
                for _, m in self.attention
            ]
        )
        values = all_reduce_max_(maxima, _world()).tolist()
        out = {"health/attn_logit_max": max(values)}
        if self.per_layer:
            for (name, _), value in zip(self.attention, values):
                layer = canonical_name(name).removesuffix(".attention")
                out[f"health/attn_logit_max/{layer}"] = value
        return out


def format_health_line(step: int, metrics: dict[str, float]) -> str:
    """One log line of a measured step: the whole model's update/weight, the group whose update/weight is largest
    (the first place to look when a run goes wrong), and the largest attention logit."""
    prefix = "health/update_to_weight/"
    groups = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix) and not k.endswith(ALL)}
    top = max(groups, key=groups.get) if groups else None
    parts = [f"health at step {step}: update/weight {metrics.get(prefix + ALL, float('nan')):.3e}"]
    if top is not None:
        parts.append(f"largest {groups[top]:.3e} ({top})")
    if "health/attn_logit_max" in metrics:
        parts.append(f"attention logit max {metrics['health/attn_logit_max']:.2f}")
    return ", ".join(parts)


def sums_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum of squares (float64), from norms taken in the tensor's dtype, at least float32: no widened
    copy of any tensor (a float64 one would double a float32 weight's memory at every measured step). One foreach
    norm per dtype (the weights' and gradients' dtypes: one or two)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), members in by_kind.items():
        wide = torch.promote_types(dtype, torch.float32)
        norms = torch._foreach_norm([tensors[i] for i in members], 2, wide)
        for i, norm in zip(members, norms):
            out[i] = norm.to(torch.float64).square()
    return torch.stack(out)


def _grad_like_param(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient laid out as ``p`` (so that the parameter's weight counts it once), or zeros without one."""
    return local_tensor(p).new_zeros(()) if p.grad is None else grad_like_param(p, "optimizer health")


def _minus_inf(device: torch.device) -> torch.Tensor:
    return torch.tensor(-math.inf, dtype=torch.float64, device=device)


def _world():
    return dist.group.WORLD if dist.is_initialized() else None


class LossSpikes:
    """Counts loss spikes (see the module docstring); :meth:`record` every step, :meth:`metrics` at log steps."""

    def __init__(self, factor: float, window: int, device: torch.device, group=None):
        self.factor = factor
        self.device = device
        self.group = group  # the data-parallel group the loss is averaged over (None: no data parallelism)
        self.history: deque[float] = deque(maxlen=window)
        self.pending: list[torch.Tensor] = []
        self.count = 0
        self.last_ratio = float("nan")

    @classmethod
    def build(cls, job_config, device: torch.device, group=None) -> Optional["LossSpikes"]:
        m = job_config.metrics
        return cls(m.loss_spike_factor, m.loss_spike_window, device, group) if m.health_freq > 0 else None

    def record(self, loss: torch.Tensor, updated: bool) -> None:
        """This step's local loss, kept on the device; a skipped step's loss is left out."""
        if updated:
            self.pending.append(loss.detach().reshape(()).to(torch.float64))

    def flush(self) -> None:
        """Count the losses recorded since the last call (one all-reduce over the data-parallel group: every rank
        calls it at the same step)."""
        if self.pending:
            losses = all_reduce_sum_(torch.stack(self.pending).to(self.device), self.group)
            if self.group is not None and dist.is_initialized():
                losses /= dist.get_world_size(self.group)
            self.pending = []
            for loss in losses.tolist():
                self.observe(loss)

    def metrics(self) -> dict[str, float]:
        self.flush()
        metrics = {"health/loss_spikes": float(self.count)}
        if not math.isnan(self.last_ratio):  # none before a median exists
            metrics["health/loss_to_median"] = self.last_ratio
        return metrics

    def state_dict(self) -> dict:
        """The count and the median's window, saved with the run's position so that a resumed run goes on counting
        as if it had never stopped (the losses recorded since the last log step are counted first)."""
        self.flush()
        ratio = None if math.isnan(self.last_ratio) else self.last_ratio
        return {"count": self.count, "history": list(self.history), "last_ratio": ratio}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])
        self.history.clear()
        self.history.extend(float(x) for x in state["history"])  # a shorter window keeps the latest losses
        self.last_ratio = float("nan") if state["last_ratio"] is None else float(state["last_ratio"])

    def observe(self, loss: float) -> bool:
        """Count ``loss`` against the running median of the losses before it; whether it is a spike."""
        spike = False
        if self.history:
            median = statistics.median(self.history)
            self.last_ratio = loss / median if median > 0 else float("nan")
            spike = loss > self.factor * median
        self.count += spike
        self.history.append(loss)
        return spike
