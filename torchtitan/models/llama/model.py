"""Llama 3: RoPE, grouped-query attention, SwiGLU feed-forward and RMSNorm, readable in one sitting.

Parameter names follow torchtitan's (``tok_embeddings``, ``layers.N.attention.wq`` ...), and every module declares
the role of each of its weights (``param_roles``) so that optimizers such as Adam-mini can block the second moment by
structure rather than by guessing from names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.distributed.utils import local_tensor
from torchtitan.models.norm_types import NORM_TYPES
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
from torchtitan.models.rope_types import ROPE_SCALING_TYPES
from torchtitan.training.loss import chunked_cross_entropy, cross_entropy

# The most attention scores optimizer health builds at once to find the largest logit (float32: 256 MiB).
LOGIT_BLOCK_ELEMENTS = 2**26


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1  # set from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    depth_init: bool = True  # scale output-projection init by layer depth instead of by total depth
    norm_type: str = "rmsnorm"  # one of NORM_TYPES
    # RoPE frequency scaling (Llama 3.1 and later: "llama3"); the factors apply to "llama3" only.
    rope_scaling: str = "none"  # one of ROPE_SCALING_TYPES
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # One parameter for the embedding and the output projection (Llama 3.2 1B and 3B).
    enable_weight_tying: bool = False

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def check(self) -> None:
        """Raise ValueError for shapes the model cannot build."""
        if self.vocab_size <= 0:
            raise ValueError("vocab_size must be positive (it is normally taken from the tokenizer)")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type {self.norm_type!r} is not one of {', '.join(NORM_TYPES)}")
        if self.rope_scaling not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_scaling {self.rope_scaling!r} is not one of {', '.join(ROPE_SCALING_TYPES)}")
        if self.rope_scaling == "llama3":
            if self.rope_scaling_factor < 1:
                raise ValueError(f"rope_scaling_factor {self.rope_scaling_factor:g} must be at least 1")
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ValueError(
                    f"rope_low_freq_factor {self.rope_low_freq_factor:g} and rope_high_freq_factor "
                    f"{self.rope_high_freq_factor:g} must satisfy 0 < low < high"
                )
            if self.rope_original_max_seq_len <= 0:
                raise ValueError(f"rope_original_max_seq_len {self.rope_original_max_seq_len} must be positive")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 for precision-sensitive steps; float64 stays float64 (exact comparisons in tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rope_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """The rotation frequency of each feature pair of a head (head_dim // 2 of them), float32, scaled by
    ``args.rope_scaling``.

    "llama3" scaling (Llama 3.1 and later) keeps the high frequencies (wavelength below
    ``original_max_seq_len / high_freq_factor``), divides the low ones (wavelength above ``original_max_seq_len /
    low_freq_factor``) by ``factor``, and blends the two linearly in between; computed in float32 in the same
    order of operations as transformers, so that both give the same angles.
    """
    head_dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if args.rope_scaling == "none":
        return inv_freq
    factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    context = args.rope_original_max_seq_len
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, blended, scaled)


def rope_table(args: ModelArgs, device=None) -> torch.Tensor:
    """cos and sin of every (position, frequency) pair: shape (args.max_seq_len, head_dim // 2, 2), float32."""
    inv_freq = rope_frequencies(args, device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` (batch, seq, heads, head_dim) by their position's angles."""
    seq_len = x.shape[1]
    pairs = _upcast(x).unflatten(-1, (-1, 2))
    cos = table[:seq_len, None, :, 0]
    sin = table[:seq_len, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    wide = _upcast(x)
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


_compiled_rms_norm: Optional[Callable] = None


def compiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` compiled once for every norm (compiling each module's forward would recompile per instance)."""
    global _compiled_rms_norm
    if _compiled_rms_norm is None:
        _compiled_rms_norm = torch.compile(rms_norm)
    return _compiled_rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    param_roles = {"weight": NORM}

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FusedRMSNorm(RMSNorm):
    """RMSNorm through ``F.rms_norm``, which dispatches to a single fused kernel where torch has one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As RMSNorm: normalised in at least float32, scaled in the input's dtype (so both give the same values).
        wide = _upcast(x)
        return F.rms_norm(wide, (wide.shape[-1],), eps=self.eps).type_as(x) * self.weight


class CompiledRMSNorm(RMSNorm):
    """RMSNorm computed by a compiled kernel (useful when the blocks are not compiled: ``training.compile`` off)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return compiled_rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """LayerNorm with a learnable scale and shift (``elementwise_affine=False``: no parameters at all)."""

    param_roles = {"weight": NORM, "bias": BIAS}

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine)


# One builder per name of norm_types.NORM_TYPES.
NORM_BUILDERS: dict[str, Callable[[int, float], nn.Module]] = {
    "rmsnorm": RMSNorm,
    "compiled_rmsnorm": CompiledRMSNorm,
    "fused_rmsnorm": FusedRMSNorm,
    "layernorm": LayerNorm,
    "np_layernorm": lambda dim, eps: LayerNorm(dim, eps, elementwise_affine=False),
}


def build_norm(norm_type: str, dim: int, eps: float) -> nn.Module:
    return NORM_BUILDERS[norm_type](dim, eps)


class Attention(nn.Module):
    param_roles = {"wq.weight": QUERY, "wk.weight": KEY, "wv.weight": VALUE, "wo.weight": ATTN_OUT}
    # Set by torchtitan.telemetry.health on the steps it measures: each forward then keeps the largest pre-softmax
    # logit in ``logit_max`` (a 0-d tensor on the device, the max over this rank's heads and micro-batches).
    record_logit_max = False
    logit_max: Optional[torch.Tensor] = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 rather than the configured head counts: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        group = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        if self.record_logit_max:
            self._keep_logit_max(q, k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    @torch.no_grad()
    def _keep_logit_max(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """The largest causal logit q·k/√d of this forward, folded into ``logit_max``. The scores are built a block
        of (batch × head) rows and query positions at a time, each block at most ``LOGIT_BLOCK_ELEMENTS`` scores
        and its causal mask (the attention itself never builds them), against only the keys its queries see."""
        batch, seq_len, heads, head_dim = q.shape
        dtype = torch.promote_types(q.dtype, torch.float32)
        qs = q.transpose(1, 2).reshape(batch * heads, seq_len, head_dim)
        ks = k.transpose(1, 2).reshape(batch * heads, seq_len, head_dim)
        rows = max(1, min(seq_len, LOGIT_BLOCK_ELEMENTS // seq_len))  # query positions per block
        pairs = max(1, LOGIT_BLOCK_ELEMENTS // (rows * seq_len))  # (batch, head) pairs per block
        positions = torch.arange(seq_len, device=q.device)
        largest = torch.full((), -math.inf, dtype=dtype, device=q.device)
        # Outside autocast (one GPU, TP only), which would run the scores' matmul in bf16 despite the casts.
        with torch.autocast(q.device.type, enabled=False):
            for first in range(0, batch * heads, pairs):
                for top in range(0, seq_len, rows):
                    end = min(seq_len, top + rows)
                    block_q = qs[first : first + pairs, top:end].to(dtype)
                    block_k = ks[first : first + pairs, :end].to(dtype)  # later keys are masked for these queries
                    scores = block_q @ block_k.transpose(-1, -2)
                    scores.masked_fill_(positions[:end] > positions[top:end, None], -math.inf)
                    largest = torch.maximum(largest, scores.amax() / math.sqrt(self.head_dim))
        self.logit_max = largest if self.logit_max is None else torch.maximum(self.logit_max, largest)


class FeedForward(nn.Module):
    param_roles = {"w1.weight": MLP, "w2.weight": MLP, "w3.weight": MLP}

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_init_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    param_roles = {"tok_embeddings.weight": EMBEDDING, "output.weight": OUTPUT}
    # Set by the tensor-parallel plan when the logits stay vocabulary-sharded for a vocabulary-parallel loss.
    loss_parallel = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        args.check()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keeps layer names stable ("layers.3") when stages or wrappers drop some layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.enable_weight_tying:
            # One parameter: named_parameters() and optimizers see it once, as "tok_embeddings.weight".
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_table(args), persistent=False)

    def forward(
        self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None, loss_chunks: int = 1
    ) -> torch.Tensor:
        """Logits of ``tokens`` (batch, seq); with ``labels``, the mean cross-entropy instead, its output
        projection run ``loss_chunks`` chunks of tokens at a time (see ``torchtitan.training.loss``).

        The loss is part of the forward so that FSDP2 gathers the output weight for it like any other weight.
        """
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h)
        if labels is None:
            return self.output(h)
        if loss_chunks == 1:
            return cross_entropy(self.output(h), labels)
        return chunked_cross_entropy(h, self.output.weight, labels, loss_chunks, loss_parallel=self.loss_parallel)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every weight from ``seed`` alone, identically for any sharding or world size.

        Each parameter is drawn whole from its own seeded generator on its device and each rank keeps its shard,
        so a 1-process and an N-process run start from the same model.
        """
        args = self.args
        self.rope = rope_table(args, device=self.rope.device)
        final_std = args.dim**-0.5
        output_rule = _trunc_normal(final_std, 3 * final_std)
        rules: dict[str, Callable[[torch.Tensor, torch.Generator], None]] = {
            # A tied weight is drawn as the output projection: an embedding's std of 1 would make huge logits.
            "tok_embeddings.weight": output_rule if args.enable_weight_tying else _normal(1.0),
            "output.weight": output_rule,
        }
        for name, layer in self.layers.items():
            prefix = f"layers.{name}."
            for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
                rules[prefix + w + ".weight"] = _trunc_normal(0.02, 0.04)
            for w in ("attention.wo", "feed_forward.w2", "feed_forward.w3"):
                rules[prefix + w + ".weight"] = _trunc_normal(layer.out_init_std, 2 * layer.out_init_std)
        for index, (name, param) in enumerate(self.named_parameters()):
            name = canonical_name(name)
            rule = rules.get(name, _NORM_INIT.get(name.rsplit(".", 1)[-1]) if _is_norm(name) else None)
            if rule is None:
                raise RuntimeError(f"no initialiser for parameter {name}")
            _init_whole(param, rule, seed * 1_000_003 + index)

    def _apply(self, fn, recurse: bool = True):
        # Moving a plain model off the meta device (to_empty) gives each module a new tensor: tie them again.
        # Sharded (DTensor) parameters are swapped in place, so they stay one parameter.
        result = super()._apply(fn, recurse)
        if self.args.enable_weight_tying and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return result

    def tied_weights(self) -> dict[str, str]:
        """State-dict entries that repeat another entry's tensor -> that entry: ``{"output.weight":
        "tok_embeddings.weight"}`` when tied. Checkpoints and exports store the tensor once, under the embedding."""
        return {"output.weight": "tok_embeddings.weight"} if self.args.enable_weight_tying else {}

    def named_param_roles(self) -> dict[str, str]:
        """Role of every weight, keyed by its name in ``self.named_parameters()`` (wrappers included)."""
        roles = {}
        for module_name, module in self.named_modules():
            for suffix, role in getattr(type(module), "param_roles", {}).items():
                roles[f"{module_name}.{suffix}" if module_name else suffix] = role
        names = {name for name, _ in self.named_parameters()}
        return {name: role for name, role in roles.items() if name in names}


def _normal(std: float):
    return lambda t, g: t.normal_(0.0, std, generator=g)


def _trunc_normal(std: float, cutoff: float):
    return lambda t, g: nn.init.trunc_normal_(t, 0.0, std, -cutoff, cutoff, generator=g)


def _ones(t: torch.Tensor, g: torch.Generator) -> None:
    t.fill_(1.0)


def _zeros(t: torch.Tensor, g: torch.Generator) -> None:
    t.zero_()


# A norm's scale starts at one and its shift (LayerNorm's bias) at zero.
_NORM_INIT = {"weight": _ones, "bias": _zeros}


def _is_norm(name: str) -> bool:
    module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
    return module == "norm" or module.endswith("_norm")


def _init_whole(param: torch.Tensor, rule, seed: int) -> None:
    if param.device.type == "meta":
        return
    local = local_tensor(param)
    generator = torch.Generator(device=local.device).manual_seed(seed)
    # Draw in float32 whatever the storage dtype, so float64 and float32 runs start from the same values.
    whole = torch.empty(param.shape, device=local.device, dtype=torch.float32)
    rule(whole, generator)
    whole = whole.to(param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank drew the same tensor, so each keeps its shard without communicating.
        whole = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(whole)
