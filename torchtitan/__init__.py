"""Llama 3 pre-training with memory-lean optimizers (Adam-mini first)."""
