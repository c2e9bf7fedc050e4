"""Parameter-name facts shared by models and optimizers: the roles a weight can play, and its canonical name.

A model declares the role of each of its weights (our Llama's ``param_roles``); Adam-mini's partition maps each
role to a block rule. Wrappers insert segments into parameter names (activation checkpointing, torch.compile, FSDP1,
and DDP's leading ``module``); ``canonical_name`` removes them, so that a name means the same weight however the
model is wrapped. This module imports nothing, so that models and optimizers can both depend on it.
"""

# Roles a model declares (our Llama declares the first eight); BIAS and OTHER are also given by Adam-mini's name rules.
EMBEDDING, OUTPUT, QUERY, KEY, VALUE, ATTN_OUT, MLP, NORM = (
    "embedding",
    "output",
    "query",
    "key",
    "value",
    "attn_out",
    "mlp",
    "norm",
)
BIAS, OTHER = "bias", "other"
# The roles a model may declare (OTHER means "no role" and is never declared).
ROLES = (EMBEDDING, OUTPUT, QUERY, KEY, VALUE, ATTN_OUT, MLP, NORM, BIAS)

# Name segments that activation checkpointing, torch.compile and FSDP1 insert anywhere in a parameter's name.
WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
# The segment DDP puts in front of every name.
DDP_PREFIX = "module"


def canonical_name(name: str) -> str:
    """``name`` without the segments that wrappers insert (whole segments only, so ``my_orig_mod`` stays).

    A leading ``module`` (DDP) is dropped too, unless it is the whole name.
    """
    parts = [part for part in name.split(".") if part not in WRAPPER_SEGMENTS]
    if len(parts) > 1 and parts[0] == DDP_PREFIX:
        parts = parts[1:]
    return ".".join(parts)
