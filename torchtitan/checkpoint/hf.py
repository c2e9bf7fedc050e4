"""Hugging Face Llama weights in and out: ``checkpoint.initial_load_in_hf`` and ``checkpoint.last_save_in_hf``.

A Hugging Face Llama folder holds ``config.json`` and the weights as ``model.safetensors`` or as several files with a
``model.safetensors.index.json``. Three things differ from our model:

* names (``model.layers.0.self_attn.q_proj.weight`` for our ``layers.0.attention.wq.weight``): ``HF_NAMES``;
* the rows of the query and key projections. Our rotary embedding rotates consecutive pairs of a head's features
  (``apply_rope``), Hugging Face's rotates feature i with feature i + head_dim/2. The same model therefore stores
  each head's rows in another order: ours ``(pair, 2)``, theirs ``(2, pair)``. ``rows_from_hf`` is that reordering;
* Hugging Face may tie the output projection to the embedding (``tie_word_embeddings``, no ``lm_head.weight``):
  a model with ``enable_weight_tying`` loads it as its one tied parameter, an untied model takes a copy for its
  output projection. A tied model is exported tied.

RoPE scaling of type ``llama3`` (Llama 3.1 and later) maps to ``rope_scaling`` and its factors; any other type is
refused with one line naming it.

Loading: every rank reads only the slices of the files its shards need, whatever the layout (FSDP, TP, HSDP).
DCP's Hugging Face storage reader does this for all weights but the query, key and a tied output, whose rows
this rank holds are found by sharding a row index like the parameter; those rows are read from the safetensors
file directly. Exporting: each parameter is gathered whole (one at a time) and rank 0 writes the files.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan.checkpoint.folders import fsync_file
from torchtitan.distributed.utils import local_tensor
from torchtitan.errors import UserError
from torchtitan.models.llama.model import ModelArgs
from torchtitan.models.roles import canonical_name

CONFIG_FILE = "config.json"
SAFETENSORS_SUFFIX = ".safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Hugging Face's default largest file when a model is saved in several.
MAX_FILE_BYTES = 5 * 10**9

# Our parameter name (with "{}" for the layer) -> Hugging Face's.
HF_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
# Our rotated projections, and how many heads each has.
_ROTATED = {"attention.wq.weight": "n_heads", "attention.wk.weight": "kv_heads"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_name(name: str) -> str:
    """Hugging Face's name for our parameter ``name`` (wrapper segments ignored)."""
    name = canonical_name(name)
    match = _LAYER.match(name)
    if match is None:
        return HF_NAMES[name]
    return HF_NAMES["layers.{}." + match.group(2)].format(match.group(1))


def rotated_heads(name: str, args: ModelArgs) -> Optional[int]:
    """The head count of a query or key projection (whose rows Hugging Face orders differently); else None."""
    for suffix, heads in _ROTATED.items():
        if canonical_name(name).endswith(suffix):
            return getattr(args, heads)
    return None


def rows_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A query/key weight in Hugging Face's row order -> ours: per head, rows (2, pair) become (pair, 2)."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def rows_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Our query/key weight -> Hugging Face's row order (the inverse of ``rows_from_hf``)."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# ------------------------------------------------------------------------------------------------------------------
# config.json


# Hugging Face's RoPE types that mean what our model.rope_scaling does.
_ROPE_TYPES = {"default": "none", "llama3": "llama3"}


def _rope_parameters(args: ModelArgs) -> dict[str, Any]:
    """Hugging Face's ``rope_parameters`` of our model (transformers 5; earlier versions read ``rope_scaling``)."""
    if args.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": args.rope_theta}
    return {
        "rope_type": "llama3",
        "rope_theta": args.rope_theta,
        "factor": args.rope_scaling_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }


def hf_config(args: ModelArgs, dtype: torch.dtype, token_ids: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with our model's shape (and ``bos_token_id`` / ``eos_token_id``
    from ``token_ids``: transformers' defaults are not Llama 3's)."""
    rope = _rope_parameters(args)
    scaling = None if args.rope_scaling == "none" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        **(token_ids or {}),
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": scaling,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.enable_weight_tying,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _shape_facts(config: dict[str, Any]) -> dict[str, Any]:
    heads = config.get("num_attention_heads")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return {
        "dim": config.get("hidden_size"),
        "layers": config.get("num_hidden_layers"),
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or (config["hidden_size"] // heads if heads else None),
        "ffn": config.get("intermediate_size"),
        "vocab": config.get("vocab_size"),
        "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "rope_scaling": _rope_type(rope),
        "rope_scaling_factors": _llama3_factors(rope) if _rope_type(rope) == "llama3" else None,
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "biases": bool(config.get("attention_bias") or config.get("mlp_bias")),
        "activation": config.get("hidden_act", "silu"),
    }


def _rope_type(rope: dict[str, Any]) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _llama3_factors(rope: dict[str, Any]) -> tuple:
    """(factor, low_freq_factor, high_freq_factor, original context) of a llama3 RoPE scaling."""
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return tuple(float(rope[key]) if key in rope else None for key in keys)


def _describe(facts: dict[str, Any]) -> str:
    text = (
        f"dim {facts['dim']}, {facts['layers']} layers, {facts['heads']} heads ({facts['kv_heads']} key/value, "
        f"head_dim {facts['head_dim']}), ffn {facts['ffn']}, vocab {facts['vocab']}, rope theta {facts['rope_theta']:g}"
        f", norm eps {facts['norm_eps']:g}"
    )
    if facts["rope_scaling"] != "default":
        text += f", rope scaling {facts['rope_scaling']}"
    if facts["rope_scaling_factors"] is not None:
        factor, low, high, context = (
            f"{value:g}" if value is not None else "unset" for value in facts["rope_scaling_factors"]
        )
        text += f" (factor {factor}, low/high frequency factors {low}/{high}, original context {context})"
    if facts["biases"]:
        text += ", biases"
    if facts["activation"] != "silu":
        text += f", activation {facts['activation']}"
    return text


def check_hf_config(path: str, args: ModelArgs) -> None:
    """Raise UserError (one line naming both) unless ``path/config.json`` describes a Llama of ``args``' shape."""
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot read {config_path} ({e}); point checkpoint.initial_load_path at a Hugging Face folder"
        ) from None
    if config.get("model_type") != "llama":
        raise UserError(
            f"{config_path} describes a {config.get('model_type')!r} model, not a Llama; point "
            "checkpoint.initial_load_path at a Hugging Face Llama folder"
        )
    theirs, ours = _shape_facts(config), _shape_facts(hf_config(args, torch.float32))
    if theirs["rope_scaling"] not in _ROPE_TYPES:
        raise UserError(
            f"{config_path} uses RoPE scaling {theirs['rope_scaling']!r}, which this project does not implement "
            f"(it implements {' and '.join(_ROPE_TYPES)}); those weights cannot be trained here"
        )
    if theirs != ours:
        raise UserError(
            f"{config_path} describes a Llama with {_describe(theirs)}; this job's model (model.flavor and "
            f"model.rope_* options, vocabulary from the tokenizer) has {_describe(ours)}; pick the flavor and "
            "tokenizer of those weights"
        )
    if args.enable_weight_tying and not config.get("tie_word_embeddings", False):
        raise UserError(
            f"{config_path} describes a Llama with its own output projection (tie_word_embeddings false); this "
            "job's model ties it to the embedding; set --model.enable_weight_tying false"
        )


# ------------------------------------------------------------------------------------------------------------------
# Loading


def _tensor_files(path: str) -> dict[str, str]:
    """Each tensor in the folder's safetensors files -> its file (headers only are read)."""
    from safetensors import safe_open

    files = sorted(name for name in os.listdir(path) if name.endswith(SAFETENSORS_SUFFIX))
    if not files:
        raise UserError(f"checkpoint.initial_load_path '{path}' holds no *.safetensors file; it needs the weights too")
    located = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                located[key] = os.path.join(path, name)
    return located


def _local_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Global indices of the rows of ``tensor`` this rank holds, in local order (any row sharding of a DTensor)."""
    if not isinstance(tensor, DTensor):
        return torch.arange(tensor.shape[0])
    if any(isinstance(p, Shard) and p.dim != 0 for p in tensor.placements):
        raise RuntimeError(f"expected a row-sharded tensor, got placements {tensor.placements}")
    index = torch.arange(tensor.shape[0], device=tensor.to_local().device).unsqueeze(1)
    # Every rank holds the whole index, so each keeps its shard without communicating (like init_weights).
    local = distribute_tensor(index, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
    return local.squeeze(1).cpu()


def _read_rows(file: str, name: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (any order) of tensor ``name`` in a safetensors ``file``, reading only runs of needed rows."""
    from safetensors import safe_open

    wanted = sorted(set(rows.tolist()))
    runs: list[list[int]] = []
    for row in wanted:
        if runs and runs[-1][1] == row:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1])
    with safe_open(file, framework="pt") as f:
        reader = f.get_slice(name)
        block = torch.cat([reader[start:stop] for start, stop in runs])
    position = {row: k for k, row in enumerate(wanted)}
    return block[torch.tensor([position[row] for row in rows.tolist()], dtype=torch.long)]


def load_hf_weights(model_state: dict[str, torch.Tensor], path: str, args: ModelArgs, process_group=None) -> None:
    """Fill ``model_state`` (our names -> plain tensors or DTensors, any layout) from the Hugging Face folder."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    located = _tensor_files(path)
    tied = "lm_head.weight" not in located
    by_dcp: dict[str, torch.Tensor] = {}
    by_rows: list[tuple[torch.Tensor, str, Optional[int]]] = []  # (our tensor, HF name, heads to reorder)
    for name, tensor in model_state.items():
        source = hf_name(name)
        if tied and source == "lm_head.weight":
            source = "model.embed_tokens.weight"
            by_rows.append((tensor, source, None))
        elif rotated_heads(name, args) is not None:
            by_rows.append((tensor, source, rotated_heads(name, args)))
        else:
            by_dcp[source] = tensor
    missing = [name for name in list(by_dcp) + [source for _, source, _ in by_rows] if name not in located]
    if missing:
        raise UserError(
            f"Hugging Face folder '{path}' lacks {len(missing)} weight(s) of this model, e.g. {missing[0]}; "
            "point checkpoint.initial_load_path at a complete Llama checkpoint"
        )
    dcp.load(by_dcp, storage_reader=HuggingFaceStorageReader(path), process_group=process_group)
    for tensor, source, heads in by_rows:
        rows = _local_rows(tensor)
        if heads is not None:
            # Our row r of the weight is Hugging Face's row hf_row[r].
            hf_row = rows_from_hf(torch.arange(tensor.shape[0]).unsqueeze(1), heads).squeeze(1)
            rows = hf_row[rows]
        local = local_tensor(tensor)
        with torch.no_grad():
            local.copy_(_read_rows(located[source], source, rows).view(local.shape))


# ------------------------------------------------------------------------------------------------------------------
# Exporting


def _file_plan(model_state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[str]:
    """The file each tensor goes to, in order: at most MAX_FILE_BYTES per file (Hugging Face's naming)."""
    indices, index, size = [], 0, 0
    for tensor in model_state.values():
        nbytes = tensor.numel() * (dtype.itemsize if tensor.is_floating_point() else tensor.element_size())
        if size and size + nbytes > MAX_FILE_BYTES:
            index, size = index + 1, 0
        indices.append(index)
        size += nbytes
    count = index + 1
    if count == 1:
        return ["model" + SAFETENSORS_SUFFIX] * len(indices)
    return [f"model-{i + 1:05d}-of-{count:05d}{SAFETENSORS_SUFFIX}" for i in indices]


def write_hf_weights(
    model_state: dict[str, torch.Tensor],
    folder: str,
    args: ModelArgs,
    dtype: torch.dtype,
    rank: int,
    token_ids: Optional[dict[str, int]] = None,
) -> None:
    """Write ``model_state`` (any layout; every rank calls this) as a Hugging Face Llama folder; rank 0 writes.

    Tensors are gathered whole one at a time, so rank 0 holds at most one file's worth of weights. Every file is
    fsynced once written, so that the folder, once published (``folders.publish`` fsyncs it before its rename),
    holds complete files after a crash.
    """
    from safetensors.torch import save_file

    files = _file_plan(model_state, dtype)
    pending: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for position, (name, tensor) in enumerate(model_state.items()):
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank != 0:
            continue
        whole = whole.detach().to(device="cpu", dtype=dtype if whole.is_floating_point() else whole.dtype)
        heads = rotated_heads(name, args)
        if heads is not None:
            whole = rows_to_hf(whole, heads)
        target = hf_name(name)
        pending[target] = whole.contiguous()
        weight_map[target] = files[position]
        total_bytes += whole.numel() * whole.element_size()
        last_of_file = position + 1 == len(files) or files[position + 1] != files[position]
        if last_of_file:
            save_file(pending, os.path.join(folder, files[position]), metadata={"format": "pt"})
            fsync_file(os.path.join(folder, files[position]))
            pending = {}
    if rank != 0:
        return
    _write_json(os.path.join(folder, CONFIG_FILE), hf_config(args, dtype, token_ids))
    if len(set(files)) > 1:
        _write_json(
            os.path.join(folder, INDEX_FILE), {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        )


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
