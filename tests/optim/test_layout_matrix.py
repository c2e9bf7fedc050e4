"""The layout matrix's float64 grid (the rows tests/optim/matrix_checks.py gives it), and the matrix's own rules.

The matrix is in three files that run side by side: this one, test_layout_matrix_float32.py (the project's compiled
float32 steps) and test_layout_matrix_torchao.py (torchao's); what it proves and its tolerances:
tests/optim/matrix_checks.py.
"""

from tests.optim import layout_matrix
from tests.optim.matrix_checks import PARTS, define, part_of

results = define(globals(), "float64")


def test_tp2_hands_optimizers_gradients_laid_out_unlike_their_weights():
    """The TP 2 column exercises the rule every optimizer must keep (read gradients through grad_like_param): the
    embedding's gradient comes back replicated while its weight is sharded, the norms' as partial sums."""
    mismatched = results(2)[("AdamW-float64", "tp2")]["mismatched"]
    assert "tok_embeddings.weight" in mismatched
    assert any(name.endswith("norm.weight") for name in mismatched)
    assert results(2)[("AdamW-float64", "fsdp2")]["mismatched"] == []


def test_rows_come_from_the_registry_and_each_runs_in_one_file():
    from torchtitan.optim.builder import OPTIMIZERS

    assert {row.name for row in layout_matrix.rows()} == set(OPTIMIZERS)
    assert {part_of(row) for row in layout_matrix.rows()} == set(PARTS)
