"""The RoPE frequency scalings the model implements (``model.rope_scaling``). Torch-free, so that the config can
check the choice without importing the model."""

# "none": the frequencies of Llama 3; "llama3": those of Llama 3.1 and later (see model.rope_frequencies).
ROPE_SCALING_TYPES = ("none", "llama3")
