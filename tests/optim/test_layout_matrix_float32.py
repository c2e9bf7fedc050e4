"""The layout matrix's float32 rows of the project's compiled float32 steps (see tests/optim/matrix_checks.py)."""

from tests.optim.matrix_checks import define

define(globals(), "float32")
