"""[model]: the architecture, its size and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torchtitan.config.options import opt
from torchtitan.models.norm_types import NORM_TYPES
from torchtitan.models.rope_types import ROPE_SCALING_TYPES


@dataclass
class Model:
    name: str = opt("llama3", "model family", choices=("llama3",))
    flavor: str = opt(
        "debugmodel",
        "model size from llama3_configs (debugmodel, 8B, 70B, 405B: Llama 3; 3.1-8B, 3.1-70B, 3.1-405B, 3.2-1B, "
        "3.2-3B: as published, scaled RoPE and 3.2's tied output)",
    )
    tokenizer_path: str = opt(
        "./assets/tokenizer/tiktoken_test.model",
        "tokenizer: a tiktoken BPE or sentencepiece file, a Hugging Face tokenizer.json, or a Hugging Face model "
        "folder holding one",
    )
    tokenizer_type: str = opt(
        "auto",
        "tokenizer format; auto: huggingface for a folder or *.json file, else tiktoken or sentencepiece by content",
        choices=("auto", "tiktoken", "sentencepiece", "huggingface"),
    )
    # The names are torchtitan's; the three RMSNorm variants compute the same function.
    norm_type: str = opt(
        "rmsnorm",
        "normalisation layers: rmsnorm, compiled_rmsnorm (each norm compiled), fused_rmsnorm (F.rms_norm), "
        "layernorm (scale and shift), np_layernorm (LayerNorm without parameters)",
        choices=NORM_TYPES,
    )
    # Unset: the flavor's. The factors apply to llama3 scaling only (set with "none", they are refused).
    # A plain string ("none" means no scaling here, not an unset option).
    rope_scaling: str = opt(
        "flavor",
        "RoPE frequency scaling: none, llama3 (Llama 3.1 and later), or flavor (the flavor's)",
        choices=("flavor", *ROPE_SCALING_TYPES),
    )
    rope_scaling_factor: Optional[float] = opt(
        None, "llama3 RoPE scaling: divisor of the low frequencies (unset: the flavor's, else 8)", ge=1.0
    )
    rope_low_freq_factor: Optional[float] = opt(
        None,
        "llama3 RoPE scaling: wavelengths above original_max_seq_len / this are scaled (unset: flavor's, else 1)",
        gt=0.0,
    )
    rope_high_freq_factor: Optional[float] = opt(
        None,
        "llama3 RoPE scaling: wavelengths below original_max_seq_len / this are kept (unset: flavor's, else 4)",
        gt=0.0,
    )
    rope_original_max_seq_len: Optional[int] = opt(
        None,
        "llama3 RoPE scaling: the context length the model was first trained at (unset: flavor's, else 8192)",
        gt=0,
    )
    enable_weight_tying: Optional[bool] = opt(
        None, "one parameter for the embedding and the output projection (unset: the flavor's; 3.2-1B/3B: true)"
    )
