"""The normalisation layers a model can use (``model.norm_type``), by torchtitan's names. Torch-free, so that the
config can check the choice without importing the model."""

RMSNORM_TYPES = ("rmsnorm", "compiled_rmsnorm", "fused_rmsnorm")  # the same function, computed three ways
NORM_TYPES = (*RMSNORM_TYPES, "layernorm", "np_layernorm")
