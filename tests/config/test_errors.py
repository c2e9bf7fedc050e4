"""The one error-to-exit-code wrapper every entry point runs through."""

from __future__ import annotations

import pytest

from torchtitan.errors import DivergenceError, SaveFailed, UserError, exit_code


def raising(error: BaseException):
    def body():
        raise error

    return body


@pytest.mark.parametrize(
    "body, code, line",
    [
        (lambda: None, 0, ""),
        (lambda: 1, 1, ""),
        (lambda: ["a result"], 0, ""),
        (
            raising(UserError("training.steps must be greater than 0")),
            2,
            "error: training.steps must be greater than 0",
        ),
        (raising(DivergenceError("training diverged at step 3")), 3, "error: training diverged at step 3"),
        (
            raising(SaveFailed("checkpoint of step 2 could not be written")),
            5,
            "error: checkpoint of step 2 could not be written",
        ),
    ],
)
def test_errors_become_one_line_and_their_exit_code(capsys, body, code, line):
    assert exit_code(body) == code
    assert capsys.readouterr().err.strip() == line


def test_only_the_first_rank_prints_and_bugs_keep_their_traceback(capsys):
    assert exit_code(raising(UserError("bad")), print_errors=False) == 2
    assert capsys.readouterr().err == ""
    with pytest.raises(RuntimeError):
        exit_code(raising(RuntimeError("a bug")))
    with pytest.raises(KeyboardInterrupt):
        exit_code(raising(KeyboardInterrupt()))
    assert exit_code(raising(KeyboardInterrupt()), interrupted="stopped; run it again") == 130
    assert capsys.readouterr().err.strip() == "error: stopped; run it again"
