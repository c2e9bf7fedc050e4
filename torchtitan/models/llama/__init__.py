"""Llama 3 model and its sizes (``llama3_configs``)."""

from torchtitan.models.llama.model import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer", "llama3_configs"]

# Published Llama 3 / 3.1 shapes. The vocabulary size is replaced by the tokenizer's at train time.
llama3_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16, rope_theta=500000),
    "debugmodel_gqa": ModelArgs(dim=256, n_layers=8, n_heads=16, n_kv_heads=4, rope_theta=500000),
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
