"""The model compiled (``training.compile``) and checkpointed (full activation checkpointing) under FSDP 2, with a
float32 optimizer step, against one process run eagerly: what the layout matrix (test_layout_matrix.py) does not
vary, since its cells compile only the optimizers' steps.

Row: Adam-mini, the float32 default (its fused back end: the one-pass operator, one call a step, so nothing of the
optimizer compiles and the model's graphs are the only ones); each optimizer's compiled step is in the matrix's
float32 grid in every layout. Tolerance: float32 in both, inductor's fused kernels against eager ones, reordered
sums magnified by Adam's normalised step on near-zero gradients: weights within lr x 0.05 (a step moves them ~lr),
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

ROW = Row("AdamMini", (), "float32")
VARIANTS = {"full_ac": ("--activation_checkpoint.mode", "full"), "compile": ("--training.compile",)}
COLUMN = "fsdp2"
_BASES: list[tempfile.TemporaryDirectory] = []


@functools.lru_cache(maxsize=None)
def _base() -> str:
    _BASES.append(tempfile.TemporaryDirectory(prefix="layout-matrix-compiled-"))
    return _BASES[-1].name


def _run(rank: int, world_size: int, base: str) -> dict:
    tokens = layout_matrix.sample_tokens(base)
    return {
        variant: layout_matrix.run_cell(ROW, COLUMN, os.path.join(base, variant), tokens, extra=extra)
        for variant, extra in VARIANTS.items()
    }


@functools.lru_cache(maxsize=None)
def _compiled() -> dict:
    layout_matrix.sample_tokens(_base())  # once, before the ranks read it
    return run_workers(_run, 2, (_base(),), timeout=900)[0]


@functools.lru_cache(maxsize=None)
def _eager_reference() -> dict:
    import torch

    with torch.compiler.set_stance("force_eager"):
        return layout_matrix.run_cell(
            ROW, "one_process", os.path.join(_base(), "eager"), layout_matrix.sample_tokens(_base())
        )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_and_checkpointed_model_in_fsdp2_equals_one_eager_process(variant):
    result, reference = _compiled()[variant], _eager_reference()
    assert "refused" not in result and "refused" not in reference
    if variant == "compile":
        assert result["compiled_graphs"] > 0, "the model did not compile"
    for step, loss in result["losses"].items():
        assert math.isfinite(loss)
        assert loss == pytest.approx(reference["losses"][step], rel=1e-4), f"loss at step {step}"
    assert all(result["health"][step] for step in result["health"])  # health measured (in a forward of its own)
    weights = {canonical_name(name): value for name, value in result["weights"].items()}  # without AC's wrapper
    assert weights.keys() == reference["weights"].keys()
    worst = max(abs(weights[n] - reference["weights"][n]).max() for n in reference["weights"])
    assert worst <= float(LR) * 0.05
