"""The layout matrix's float32 rows of torchao's compiled low-bit AdamW steps (see tests/optim/matrix_checks.py)."""

from tests.optim.matrix_checks import define

define(globals(), "torchao")
