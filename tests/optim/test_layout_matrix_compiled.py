"""The layout matrix's compiled rows: the optimizers whose steps are compiled, with the model compiled
(``training.compile``) and with full activation checkpointing, under FSDP 2, against one process run eagerly.

The main matrix (test_layout_matrix.py) runs every step eagerly (torch's own switch, TORCHDYNAMO_DISABLE) and in
float64, where these steps run eagerly anyway. Here the steps really compile: float32 weights, dynamo on (Adam-mini's
float32 step is its one-pass operator, one call a step, not a compiled graph). Rows:
Adam-mini's fused back end, AdEMAMix, and torchao's AdamW8bit (the representative of torchao's compiled step: its
4-bit and fp8 forms compile the same function over another state class, 15-45 s each cold on a CPU, and run eagerly
in the main matrix). The bfloat16-state AdamW's step is a CompiledStep like fused Adam-mini's and AdEMAMix's; it runs
eagerly in every layout of the main matrix, and compiled, in one process, in tests/optim/test_adam_mini_lowprec.py.

Tolerance: float32 in both, compiled kernels against eager ones: the layouts and the kernels agree to float32
rounding, which Adam's normalised step magnifies on entries with near-zero gradients (~lr x 2e-3 after a few
steps); torchao's quantized moments may round one code apart. Weights within lr x 0.05 (a step moves them ~lr),
losses within 1e-4.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile

import pytest

from tests.distributed import run_workers
from tests.optim import layout_matrix
from tests.optim.layout_matrix import LR, Row
from torchtitan.models.roles import canonical_name

ROWS = [
    Row("AdamMini", (("implementation", "fused"),)),
    Row("AdEMAMix"),
    Row("AdamW8bit"),
]
FLOAT32 = ("--training.param_dtype", "float32")
# Activation checkpointing first: each optimizer's step is compiled there, in a process that has compiled nothing of
# it yet (the compile row then reuses that graph and compiles the model's).
VARIANTS = {
    "full_ac": (*FLOAT32, "--activation_checkpoint.mode", "full"),
    "compile": (*FLOAT32, "--training.compile"),
}
COLUMN = "fsdp2"
# Each row's compiled step compiles into an inductor cache folder of its own, optim_<tag> (CompiledStep's tag, or
# torchao's optimizer name).
CACHE_TAGS = {
    "AdamMini-implementation=fused": "AdamMini",
    "AdEMAMix": "AdEMAMix",
    "AdamW8bit": "AdamW8bit",
}

# Rows whose float32 step is Adam-mini's one-pass operator (its compiled graphs run for other storages).
ONE_PASS_ROWS = ("AdamMini-implementation=fused",)

_BASES: list[tempfile.TemporaryDirectory] = []


@functools.lru_cache(maxsize=None)
def _base() -> str:
    _BASES.append(tempfile.TemporaryDirectory(prefix="layout-matrix-compiled-"))
    return _BASES[-1].name


def _run(rank: int, world_size: int, base: str) -> dict:
    # A compile cache of this test's own (torchao's step keeps a folder per optimizer kind inside it).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, "inductor")
    results = {}
    for row in ROWS:
        for variant, extra in VARIANTS.items():
            results[(row.label, variant)] = layout_matrix.run_cell(
                row, COLUMN, os.path.join(base, variant), extra=extra
            )
    # What each optimizer's compiled step left in its own inductor cache folder (none: it never compiled).
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    results["compiled"] = {tag: _files_under(os.path.join(cache, f"optim_{tag}")) for tag in CACHE_TAGS.values()}
    return results


def _files_under(folder: str) -> int:
    return sum(len(files) for _, _, files in os.walk(folder))


@functools.lru_cache(maxsize=None)
def _compiled() -> dict:
    return run_workers(_run, 2, (_base(),), timeout=900)[0]


@functools.lru_cache(maxsize=None)
def _eager_reference(label: str) -> dict:
    row = next(row for row in ROWS if row.label == label)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHDYNAMO_DISABLE", "1")
        return layout_matrix.run_cell(row, "one_process", os.path.join(_base(), "eager"), extra=FLOAT32)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("label", [row.label for row in ROWS])
def test_compiled_step_in_fsdp2_equals_one_eager_process(label, variant):
    result = _compiled()[(label, variant)]
    reference = _eager_reference(label)
    assert "refused" not in result and "refused" not in reference
    for step, loss in result["losses"].items():
        assert math.isfinite(loss)
        assert loss == pytest.approx(reference["losses"][step], rel=1e-4), f"loss at step {step}"
    assert all(result["health"][step] for step in result["health"])  # health measured (in a forward of its own)
    if label in ONE_PASS_ROWS:  # its float32 step is one operator call, nothing compiled
        assert _compiled()["compiled"][CACHE_TAGS[label]] == 0, "Adam-mini's float32 step compiled graphs"
    else:
        assert _compiled()["compiled"][CACHE_TAGS[label]] > 0, "the optimizer's step was not compiled"
    weights = {canonical_name(name): value for name, value in result["weights"].items()}  # without AC's wrapper
    assert weights.keys() == reference["weights"].keys()
    worst = max(abs(weights[n] - reference["weights"][n]).max() for n in reference["weights"])
    assert worst <= float(LR) * 0.05
