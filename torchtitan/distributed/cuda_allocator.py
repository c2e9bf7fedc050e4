"""The CUDA caching allocator's settings, which ``train.py`` applies before torch is imported.

Expandable segments let the allocator grow a segment instead of reserving a new one, so memory freed between
steps of different shapes (FSDP's all-gathers, low-bit optimizer steps) is reused rather than fragmented: an 8B run
with a 4-bit optimizer otherwise reserves much of what it saves. The allocator reads its settings once, at the first
CUDA allocation, so they must be in the environment before anything touches CUDA; importing this module imports
no torch.
"""

from __future__ import annotations

from typing import Mapping

# The CUDA allocator reads PYTORCH_CUDA_ALLOC_CONF first, then the device-generic PYTORCH_ALLOC_CONF (torch >= 2.9).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def allocator_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to ``environ``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, or nothing when the user
    set either variable (kept as given)."""
    if any(name in environ for name in ALLOC_CONF_VARIABLES):
        return {}
    return {ALLOC_CONF_VARIABLES[0]: DEFAULT_ALLOC_CONF}


def alloc_conf_in_effect(environ: Mapping[str, str]) -> tuple[str, str]:
    """The allocator setting ``train.py`` runs with in ``environ``, and where it comes from."""
    name = next((name for name in ALLOC_CONF_VARIABLES if name in environ), None)
    if name:
        return environ[name], f"{name} in the environment"
    return DEFAULT_ALLOC_CONF, "train.py's default"


def allocator_setting(environ: Mapping[str, str]) -> str:
    """The allocator setting in effect, for the log."""
    name = next((name for name in ALLOC_CONF_VARIABLES if name in environ), None)
    return f"{name}={environ[name]}" if name else "CUDA allocator defaults"
