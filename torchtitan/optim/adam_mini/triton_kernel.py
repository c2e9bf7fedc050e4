"""The Triton kernel of ``torchtitan::adam_mini_step_`` (``triton_step.py`` lists its programs and tensors).

A module of its own that imports Triton at the top: Triton's interpreter (``TRITON_INTERPRET=1``, read when the
kernel is made, at import) runs a kernel's ``tl`` calls on CPU tensors through the module's globals.
"""

import triton
import triton.language as tl


@triton.jit
def _step_entries(p, m, at, mask, gj, weight, scale, decay, decays, SMALL: tl.constexpr):
    """The momentum and weight of the entries ``at`` (``mask``), their gradient ``gj`` and step size ``scale`` given."""
    mj = tl.load(m + at, mask=mask, other=0.0)
    if SMALL:
        momentum = mj + weight * (gj - mj)
    else:
        momentum = gj - (gj - mj) * (1 - weight)
    tl.store(m + at, momentum, mask=mask)
    pj = tl.load(p + at, mask=mask, other=0.0)
    if decays != 0:
        pj = pj * decay
    tl.store(p + at, pj - momentum * scale, mask=mask)


@triton.jit
def adam_mini_step_kernel(
    programs, tensors, scalars, FIELDS: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr, SMALL: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    index = tl.load(programs + 2 * pid)
    row = tl.load(programs + 2 * pid + 1)
    facts = tensors + FIELDS * index
    p = tl.load(facts).to(tl.pointer_type(DTYPE))
    g = tl.load(facts + 1).to(tl.pointer_type(DTYPE))
    m = tl.load(facts + 2).to(tl.pointer_type(DTYPE))
    v = tl.load(facts + 3).to(tl.pointer_type(DTYPE))
    row_blocks = tl.load(facts + 4)
    width = tl.load(facts + 5)
    kind = tl.load(facts + 6)
    decays = tl.load(facts + 7)
    lr = tl.load(scalars).to(DTYPE)
    bc1 = tl.load(scalars + 1).to(DTYPE)
    bc2 = tl.load(scalars + 2).to(DTYPE)
    decay = tl.load(scalars + 3).to(DTYPE)
    beta2 = tl.load(scalars + 4).to(DTYPE)
    one_minus_beta2 = tl.load(scalars + 5).to(DTYPE)
    weight = tl.load(scalars + 6).to(DTYPE)
    eps = tl.load(scalars + 7).to(DTYPE)
    offsets = tl.arange(0, BLOCK)
    if kind == 2:  # ELEMENTS: entries [row * BLOCK, ...) of a tensor of `width` entries
        at = row * BLOCK + offsets
        mask = at < width
        gj = tl.load(g + at, mask=mask, other=0.0)
        second = tl.load(v + at, mask=mask, other=0.0) * beta2
        second = second + one_minus_beta2 * (gj * gj)
        tl.store(v + at, second, mask=mask)
        scale = lr * (1.0 / ((tl.sqrt(second / bc2) + eps) * bc1))
        _step_entries(p, m, at, mask, gj, weight, scale, decay, decays, SMALL)
    else:
        start = row * width
        if kind == 0:  # BLOCK_MEANS: row `row` is block `row`; its mean of g**2 first
            total = tl.full([BLOCK], 0, dtype=DTYPE)
            for first in range(0, width, BLOCK):
                at = first + offsets
                gj = tl.load(g + start + at, mask=at < width, other=0.0)
                total += gj * gj
            mean = tl.sum(total, axis=0) / width.to(DTYPE)
            second = tl.load(v + row) * beta2 + one_minus_beta2 * mean
            tl.store(v + row, second)
        else:  # GIVEN_MEANS: v is up to date; the row's block is row_blocks[row] or the row itself
            block = row
            if row_blocks != 0:
                block = tl.load(row_blocks.to(tl.pointer_type(tl.int64)) + row)
            second = tl.load(v + block)
        scale = lr * (1.0 / ((tl.sqrt(second / bc2) + eps) * bc1))
        for first in range(0, width, BLOCK):
            at = start + first + offsets
            mask = first + offsets < width
            gj = tl.load(g + at, mask=mask, other=0.0)
            _step_entries(p, m, at, mask, gj, weight, scale, decay, decays, SMALL)
