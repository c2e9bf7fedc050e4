"""torchtitan's 2024 TOML keys that are spelled differently here, or whose feature this project does not have.

A config file from torchtitan (mid-2024) loads unchanged: each of its keys is either one of ours (same name, same
meaning; see ``torchtitan.config.job_config``), or listed below as

* a rename: the value is written to our key, converted if the sense is inverted;
* accepted at the value that describes what this project does (a pipeline degree of 1, float8 all-gather off ...);
  any other value is refused in one line naming the feature and what to use instead.

This module is torch-free, like ``torchtitan.config.job_config``, which calls :func:`translate` for every key it does
not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from torchtitan.errors import UserError


@dataclass(frozen=True)
class LegacyKey:
    """One 2024 key: where its value goes (``target``), or the values accepted as they are and why others are not."""

    target: Optional[str] = None  # our key that receives the (converted) value
    convert: Callable[[Any], Any] = lambda value: value
    accepted: tuple = ()  # values that describe what this project does; accepted without effect
    instead: str = ""  # for any other value: what is not available, and what to use instead
    takes_bool: bool = False  # the value must be a bool: ``convert`` would read any other by its truth

    def apply(self, key: str, value: Any) -> list[tuple[str, Any]]:
        if self.takes_bool and not isinstance(value, bool):
            raise UserError(
                f"{key} expects bool, got {type(value).__name__} {value!r}; set it to true or false (without quotes)"
            )
        if self.target is not None:
            return [(self.target, self.convert(value))]
        if value in self.accepted and type(value) is type(self.accepted[0]):
            return []
        raise UserError(f"{key} = {value!r}: {self.instead}")


_PIPELINE = "pipeline parallelism is not available here; remove the key (one stage, the whole model on each rank)"
_FLOAT8_ALL_GATHER = (
    "float8 all-gather for FSDP is not available here; float8.enable_float8_linear alone computes the linears in "
    "float8 and FSDP gathers the weights in the mixed-precision dtype"
)

LEGACY_KEYS: dict[str, LegacyKey] = {
    # [training], before the [float8] table existed (2024-07-30).
    "training.data_parallel_degree": LegacyKey("training.data_parallel_shard_degree"),
    "training.enable_loss_parallel": LegacyKey(
        "training.disable_loss_parallel", lambda enabled: not enabled, takes_bool=True
    ),
    "training.enable_float8_linear": LegacyKey("float8.enable_float8_linear"),
    "training.enable_fsdp_float8_all_gather": LegacyKey(accepted=(False,), instead=_FLOAT8_ALL_GATHER),
    "training.precompute_float8_dynamic_scale_for_fsdp": LegacyKey(accepted=(False,), instead=_FLOAT8_ALL_GATHER),
    # [float8]
    "float8.enable_fsdp_float8_all_gather": LegacyKey(accepted=(False,), instead=_FLOAT8_ALL_GATHER),
    "float8.precompute_float8_dynamic_scale_for_fsdp": LegacyKey(accepted=(False,), instead=_FLOAT8_ALL_GATHER),
    **{
        f"float8.scaling_type_{tensor}": LegacyKey(
            accepted=("dynamic",),
            instead="delayed float8 scaling is not available here (torchao dropped it); use 'dynamic', the scaling "
            "float8.enable_float8_linear uses",
        )
        for tensor in ("input", "weight", "grad_output")
    },
    # [optimizer]
    "optimizer.fused": LegacyKey("optimizer.implementation", lambda fused: "fused" if fused else None, takes_bool=True),
    # [experimental]
    "experimental.pipeline_parallel_degree": LegacyKey(accepted=(1,), instead=_PIPELINE),
    "experimental.pipeline_parallel_split_points": LegacyKey(accepted=([],), instead=_PIPELINE),
    "experimental.pipeline_parallel_schedule": LegacyKey(accepted=("1f1b",), instead=_PIPELINE),
    "experimental.pipeline_parallel_split_mode": LegacyKey(accepted=("manual",), instead=_PIPELINE),
    "experimental.pipeline_parallel_microbatches": LegacyKey(accepted=(None,), instead=_PIPELINE),
    "experimental.enable_async_tensor_parallel": LegacyKey(
        accepted=(False,),
        instead="asynchronous tensor parallelism is not available here; training.tensor_parallel_degree runs "
        "tensor parallelism with ordinary collectives",
    ),
    "experimental.enable_compiled_autograd": LegacyKey(
        accepted=(False,),
        instead="compiled autograd is not available here; training.compile = true compiles each block's forward "
        "and backward",
    ),
    # [memory_estimation]
    "memory_estimation.enabled": LegacyKey(
        accepted=(False,),
        instead="train.py does not estimate memory; run estimation.py with the same options "
        "(python estimation.py --job.config_file FILE)",
    ),
    "memory_estimation.disable_fake_mode": LegacyKey(
        accepted=(False,),
        instead="estimation.py always estimates on fake tensors; remove the key",
    ),
}
# Tables of the 2024 format that this project does not have (their keys are all in LEGACY_KEYS).
LEGACY_SECTIONS = frozenset(key.split(".", 1)[0] for key in LEGACY_KEYS)

# Values of our own keys that torchtitan accepted but that are not available here (why, and what to use instead) ...
LEGACY_VALUES: dict[tuple[str, Any], str] = {
    ("training.dataset", "c4_mini"): "torchtitan's bundled c4_mini is not shipped here; use 'sample' (bundled, "
    "offline) or 'c4' (streamed from the hub)",
    ("model.name", "llama2"): "this project trains Llama 3 only; use model.name = 'llama3'",
}
# ... and those spelled differently here.
LEGACY_ALIASES: dict[tuple[str, Any], Any] = {("model.name", "llama"): "llama3"}


def translate(key: str, value: Any) -> Optional[list[tuple[str, Any]]]:
    """The (our key, value) pairs a 2024 key means, [] when it is accepted without effect, None if not a 2024 key.

    Raises UserError for a 2024 key set to a value whose feature this project does not have.
    """
    legacy = LEGACY_KEYS.get(key)
    if legacy is not None:
        return legacy.apply(key, value)
    if not isinstance(value, (str, int, float, bool)):
        return None
    if (key, value) in LEGACY_ALIASES:
        return [(key, LEGACY_ALIASES[(key, value)])]
    if (key, value) in LEGACY_VALUES:
        raise UserError(f"{key} = {value!r}: {LEGACY_VALUES[(key, value)]}")
    return None


def refuse_both_names(keys: Iterable[str], where: str) -> None:
    """UserError if ``keys`` (those set in one place: a config file, or the command line) hold a 2024 key and the key
    it is written to: one of them would silently win by its position."""
    given = set(keys)
    for key in given:
        target = getattr(LEGACY_KEYS.get(key), "target", None)
        if target in given:
            raise UserError(
                f"{where} sets both {key} (torchtitan's 2024 name) and {target}, which it is written to; "
                f"keep only {target}"
            )
