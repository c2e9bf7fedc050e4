"""Adam-mini's block partition: which entries of each weight share one second moment.

Every weight is viewed as 2-D, rows being output neurons (or tokens, for embeddings). A block is then a run of
rows, so every rule is a row grouping:

=============  =========================================================  ==========================
rule           weights                                                     blocks
=============  =========================================================  ==========================
per_row        embedding, output, value, attention output, MLP             one per row (token/neuron)
per_head       query, key                                                  one per ``head_dim`` rows
per_tensor     norms, every other 1-D parameter; value, attention output   one for the whole tensor
               and MLP (optional)
per_element    biases; embedding and output (optional)                     plain Adam
=============  =========================================================  ==========================

The defaults are adam-mini 1.1.1's partition. The optional rules (:data:`ROLE_RULE_CHOICES`) are those of
Adam-mini's first code release and its paper: Adam's per-element second moment for the embedding and output layers,
one value for each whole value, attention output and MLP matrix. Norms take weight decay only when asked
(``norm_weight_decay``; 1.1.1 decays neither norms nor biases).

A weight's role comes from the model when it declares one (our Llama's ``named_param_roles()``), otherwise from
exact name rules for torchtitan and Hugging Face spellings. A matrix no rule matches gets one block per row and
is reported, never silently blocked some other way. Norms, biases and every other 1-D parameter take no weight
decay. Everything here depends only on names and global shapes, so the partition is the same on every rank and
for every world size.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from torchtitan.errors import UserError
from torchtitan.models.roles import (
    ATTN_OUT,
    BIAS,
    EMBEDDING,
    KEY,
    MLP,
    NORM,
    OTHER,
    OUTPUT,
    QUERY,
    ROLES,
    VALUE,
    canonical_name,
)

# Block rules.
PER_ROW, PER_HEAD, PER_TENSOR, PER_ELEMENT = "per_row", "per_head", "per_tensor", "per_element"
VALUE_BLOCK_CHOICES = (PER_ROW, PER_TENSOR)
# The roles whose rule is a choice: the first of each is adam-mini 1.1.1's (the default).
ROLE_RULE_CHOICES: dict[str, tuple[str, ...]] = {
    EMBEDDING: (PER_ROW, PER_ELEMENT),
    OUTPUT: (PER_ROW, PER_ELEMENT),
    VALUE: VALUE_BLOCK_CHOICES,
    ATTN_OUT: (PER_ROW, PER_TENSOR),
    MLP: (PER_ROW, PER_TENSOR),
}
DEFAULT_ROLE_RULES = {role: choices[0] for role, choices in ROLE_RULE_CHOICES.items()}

# Module paths (as trailing name segments) whose ".weight" plays a role, in torchtitan and Hugging Face spelling.
_WEIGHT_RULES: dict[tuple[str, ...], str] = {
    ("tok_embeddings",): EMBEDDING,
    ("embed_tokens",): EMBEDDING,
    ("output",): OUTPUT,
    ("lm_head",): OUTPUT,
    ("attention", "wq"): QUERY,
    ("self_attn", "q_proj"): QUERY,
    ("attention", "wk"): KEY,
    ("self_attn", "k_proj"): KEY,
    ("attention", "wv"): VALUE,
    ("self_attn", "v_proj"): VALUE,
    ("attention", "wo"): ATTN_OUT,
    ("self_attn", "o_proj"): ATTN_OUT,
    ("feed_forward", "w1"): MLP,
    ("feed_forward", "w2"): MLP,
    ("feed_forward", "w3"): MLP,
    ("mlp", "gate_proj"): MLP,
    ("mlp", "up_proj"): MLP,
    ("mlp", "down_proj"): MLP,
}
_LONGEST_RULE = max(len(path) for path in _WEIGHT_RULES)


@dataclass(frozen=True)
class BlockPlan:
    """How one parameter's second moment is blocked; depends only on its name, role and global shape."""

    name: str
    role: str
    rule: str
    shape: tuple[int, ...]
    rows_per_block: int  # rows sharing one second moment (per_row: 1, per_head: head_dim, per_tensor: all rows)
    decay: bool  # whether weight decay applies

    @property
    def rows(self) -> int:
        """Rows of the 2-D view: the first dimension (a 0-D or 1-D parameter is one row)."""
        return self.shape[0] if len(self.shape) >= 2 else 1

    @property
    def row_numel(self) -> int:
        return self.numel // self.rows if self.rows else 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n_blocks(self) -> int:
        """Entries of the second moment ``v``: (n_blocks, 1), or the parameter's shape for per_element."""
        if self.rule == PER_ELEMENT:
            return self.numel
        if self.rule == PER_TENSOR:
            return 1
        return self.rows // self.rows_per_block

    @property
    def block_numel(self) -> int:
        """Parameter entries averaged into one second moment."""
        if self.rule == PER_ELEMENT:
            return 1
        if self.rule == PER_TENSOR:
            return self.numel
        return self.rows_per_block * self.row_numel


def role_from_name(name: str) -> str:
    """The role the exact name rules give a parameter; OTHER when none applies."""
    parts = canonical_name(name).split(".")
    if parts[-1] == "bias":
        return BIAS
    if parts[-1] != "weight" or len(parts) < 2:
        return OTHER
    module_path = parts[:-1]
    last = module_path[-1]
    if last == "norm" or last.endswith("_norm") or last.endswith("layernorm"):
        return NORM
    for length in range(min(_LONGEST_RULE, len(module_path)), 0, -1):
        role = _WEIGHT_RULES.get(tuple(module_path[-length:]))
        if role is not None:
            return role
    return OTHER


def plan_blocks(
    named_shapes: Iterable[tuple[str, tuple[int, ...]]],
    *,
    head_dim: int,
    value_blocks: str = PER_ROW,
    param_roles: Optional[Mapping[str, str]] = None,
    role_rules: Optional[Mapping[str, str]] = None,
    norm_weight_decay: bool = False,
) -> list[BlockPlan]:
    """A BlockPlan for every (name, global shape), in order.

    ``param_roles`` (name -> role, names as given or without wrapper segments) takes precedence over the name
    rules. ``role_rules`` chooses the rule of the roles in :data:`ROLE_RULE_CHOICES` (``value_blocks`` is VALUE's;
    roles left out keep 1.1.1's). Raises UserError for an unknown role, a rule a role does not offer, or a
    query/key weight whose rows ``head_dim`` does not divide.
    """
    rules = check_role_rules({**DEFAULT_ROLE_RULES, VALUE: value_blocks, **(role_rules or {})})
    roles = _canonical_roles(param_roles or {})
    plans = []
    for name, shape in named_shapes:
        role = roles.get(name) or roles.get(canonical_name(name)) or role_from_name(name)
        plans.append(_plan_one(name, tuple(shape), role, head_dim, rules, norm_weight_decay))
    return plans


def check_role_rules(rules: Mapping[str, str]) -> dict[str, str]:
    """``rules`` (role -> rule), each checked against the role's choices; UserError naming the role otherwise."""
    for role, rule in rules.items():
        choices = ROLE_RULE_CHOICES.get(role)
        if choices is None:
            raise UserError(
                f"Adam-mini's {role} weights have no choice of blocks; choose among {', '.join(ROLE_RULE_CHOICES)}"
            )
        if rule not in choices:
            raise UserError(f"Adam-mini {role} blocks must be one of {', '.join(choices)}, not {rule!r}")
    return dict(rules)


def _canonical_roles(param_roles: Mapping[str, str]) -> dict[str, str]:
    roles = {}
    for name, role in param_roles.items():
        if role not in ROLES:
            raise UserError(f"unknown Adam-mini role {role!r} for parameter {name}; choose one of {', '.join(ROLES)}")
        roles[name] = role
        roles.setdefault(canonical_name(name), role)
    return roles


def _plan_one(
    name: str, shape: tuple[int, ...], role: str, head_dim: int, rules: Mapping[str, str], norm_weight_decay: bool
) -> BlockPlan:
    rows = shape[0] if len(shape) >= 2 else 1
    if len(shape) < 2:
        # Vectors (norm scales, biases, anything else) never take per-row or per-head blocks, whatever their name.
        rule = PER_ELEMENT if role == BIAS else PER_TENSOR
        return BlockPlan(name, role, rule, shape, rows, decay=norm_weight_decay and role == NORM)
    if role in (QUERY, KEY):
        if rows % head_dim:
            raise UserError(
                f"head size {head_dim} does not divide the {rows} rows of {role} weight {name}; "
                "pass AdamMini the model's head_dim= (or the right dim=/n_heads=)"
            )
        return BlockPlan(name, role, PER_HEAD, shape, head_dim, decay=True)
    if role == BIAS:
        return BlockPlan(name, role, PER_ELEMENT, shape, 1, decay=False)
    if role == NORM:
        return BlockPlan(name, role, PER_TENSOR, shape, rows, decay=norm_weight_decay)
    rule = rules.get(role, PER_ROW)
    if rule == PER_TENSOR:
        return BlockPlan(name, role, PER_TENSOR, shape, rows, decay=True)
    if rule == PER_ELEMENT:
        return BlockPlan(name, role, PER_ELEMENT, shape, 1, decay=True)
    # embedding, output, value, attn_out, mlp, and matrices no rule matched (reported by the summary).
    return BlockPlan(name, role, PER_ROW, shape, 1, decay=True)


def partition_summary(plans: list[BlockPlan]) -> str:
    """A short table: per role and rule, how many tensors, parameters and second-moment entries."""
    rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for plan in plans:
        entry = rows[(plan.role, plan.rule)]
        entry[0] += 1
        entry[1] += plan.numel
        entry[2] += plan.n_blocks
    total_params = sum(plan.numel for plan in plans)
    total_blocks = sum(plan.n_blocks for plan in plans)
    lines = [
        f"Adam-mini partition: {len(plans)} tensors, {total_params:,} parameters, "
        f"{total_blocks:,} second-moment entries ({total_blocks / max(total_params, 1):.4%} of Adam's)"
    ]
    lines.append(f"  {'role':<10} {'rule':<12} {'tensors':>7} {'parameters':>15} {'v entries':>12}")
    for (role, rule), (count, numel, blocks) in sorted(rows.items()):
        lines.append(f"  {role:<10} {rule:<12} {count:>7} {numel:>15,} {blocks:>12,}")
    return "\n".join(lines)


def unmatched_matrices(plans: list[BlockPlan]) -> list[str]:
    """Names of parameters with two or more dimensions that neither the model nor a name rule gave a role."""
    return [plan.name for plan in plans if plan.role == OTHER and len(plan.shape) >= 2]
