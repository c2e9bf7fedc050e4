"""Llama 3 model and its sizes (``llama3_configs``)."""

import dataclasses

import torch

from torchtitan.models.llama.model import ModelArgs, Transformer

__all__ = ["LADDER", "ModelArgs", "Transformer", "llama3_configs", "non_embedding_params"]

# The weights that hold one row per token of the vocabulary.
EMBEDDING_WEIGHTS = ("tok_embeddings.weight", "output.weight")

# Llama 3.1 / 3.2 / 3.3 scale RoPE the same way ("llama3" in their config.json); only the factor differs.
_LLAMA31_ROPE = dict(
    rope_scaling="llama3",
    rope_scaling_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_seq_len=8192,
)
_LLAMA32_ROPE = {**_LLAMA31_ROPE, "rope_scaling_factor": 32.0}

# Published Llama 3 shapes ("8B" ... : Llama 3, unscaled RoPE; "3.1-8B" ... and "3.2-1B", "3.2-3B": the models as
# published, with their RoPE scaling and, for 3.2, the tied output projection). The vocabulary size is replaced by
# the tokenizer's at train time, max_seq_len by training.seq_len.
llama3_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16, rope_theta=500000),
    "debugmodel_gqa": ModelArgs(dim=256, n_layers=8, n_heads=16, n_kv_heads=4, rope_theta=500000),
    # The smallest shape with every rule to bite on (grouped-query heads TP 2 splits, rows FSDP 3 splits unevenly, two
    # blocks): a smoke run in seconds.
    "debugmodel_tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64, rope_theta=500000),
    # Llama 3.2 1B shapes with an untied output projection (~1.5B parameters at the 128k vocabulary).
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
        max_seq_len=8192,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
        max_seq_len=8192,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
        max_seq_len=8192,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
        max_seq_len=8192,
    ),
}
llama3_configs.update(
    {
        "3.1-8B": dataclasses.replace(llama3_configs["8B"], max_seq_len=131072, **_LLAMA31_ROPE),
        # Llama 3.3 70B has the same config.json as Llama 3.1 70B.
        "3.1-70B": dataclasses.replace(llama3_configs["70B"], max_seq_len=131072, **_LLAMA31_ROPE),
        "3.1-405B": dataclasses.replace(llama3_configs["405B"], max_seq_len=131072, **_LLAMA31_ROPE),
        "3.2-1B": dataclasses.replace(
            llama3_configs["1B"], max_seq_len=131072, enable_weight_tying=True, **_LLAMA32_ROPE
        ),
        "3.2-3B": ModelArgs(
            dim=3072,
            n_layers=28,
            n_heads=24,
            n_kv_heads=8,
            vocab_size=128256,
            ffn_dim_multiplier=1.0,
            multiple_of=256,
            rope_theta=500000,
            max_seq_len=131072,
            enable_weight_tying=True,
            **_LLAMA32_ROPE,
        ),
    }
)

# The ladder: Llama 3 shapes (grouped-query attention, SwiGLU, head_dim 64 up to 300M and 128 above) for scaling
# studies on one node, named by their non-embedding parameters (``ModelArgs.non_embedding_params``: every weight but
# the embedding and the output projection, so the count does not depend on the tokenizer). docs/study-runs.md lists
# the exact counts.
LADDER = {
    "ladder-3M": ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2),  # the two smallest: studies on a CPU
    "ladder-9M": ModelArgs(dim=384, n_layers=6, n_heads=6, n_kv_heads=2),
    "ladder-30M": ModelArgs(dim=512, n_layers=10, n_heads=8, n_kv_heads=2),
    "ladder-60M": ModelArgs(dim=768, n_layers=10, n_heads=12, n_kv_heads=4),
    "ladder-130M": ModelArgs(dim=768, n_layers=20, n_heads=12, n_kv_heads=4),
    "ladder-300M": ModelArgs(dim=1024, n_layers=26, n_heads=16, n_kv_heads=4),
    "ladder-520M": ModelArgs(dim=1536, n_layers=20, n_heads=12, n_kv_heads=4),
    "ladder-1.2B": ModelArgs(dim=2048, n_layers=25, n_heads=16, n_kv_heads=8),
}
llama3_configs.update(LADDER)


def non_embedding_params(args: ModelArgs) -> int:
    """Parameters of the model other than the embedding and the output projection, counted on the meta device (no
    memory, any size, whatever the vocabulary)."""
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, vocab_size=1))
    return sum(p.numel() for name, p in model.named_parameters() if name not in EMBEDDING_WEIGHTS)
