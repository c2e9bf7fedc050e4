"""The project's exceptions for a user, and the one place that turns them into exit codes.

``UserError`` is a mistake a user can fix (bad config, missing file, bad option); ``DivergenceError`` says training
stopped because its numbers became non-finite; ``Preempted`` that it stopped on a scheduler's signal, saved.
Every entry point (``train.py``, ``estimation.py``, ``torchtitan.config.preflight`` and the tools) runs its body through
:func:`exit_code`, which prints either as a single ``error:`` line (``preempted:`` for the last) and returns its
exit code; everything else is an internal bug and keeps its traceback. This module
imports nothing heavy, so tools that only need the codes start fast.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

USER_ERROR_EXIT_CODE = 2  # "your input is wrong"
DIVERGENCE_EXIT_CODE = 3  # "training diverged": the loss, the gradients or the state became non-finite
PREEMPTED_EXIT_CODE = 4  # "stopped on a scheduler's signal, checkpoint saved": run the same command to resume
INTERRUPTED_EXIT_CODE = 130  # the shell's code for a run ended by Ctrl-C


class UserError(ValueError):
    """A problem in the user's input, with a message that names the problem and the fix."""


class DivergenceError(Exception):
    """Training stopped because the loss, the gradients or the state became non-finite."""


class Preempted(Exception):
    """Training stopped on a scheduler's signal (SIGTERM, SIGUSR1), saved (``torchtitan.training.preemption``)."""


def exit_code(body: Callable[[], Any], *, print_errors: bool = True, interrupted: Optional[str] = None) -> int:
    """Run an entry point's ``body``: the int it returns (anything else: 0), or the exit code of its error.

    ``print_errors`` False keeps the ``error:`` line to itself (every rank but the first of a job);
    ``interrupted``, when given, is the line printed for Ctrl-C or SIGTERM (exit 130) instead of a traceback.
    """
    try:
        code = body()
    except UserError as e:
        return _report(e, USER_ERROR_EXIT_CODE, print_errors)
    except DivergenceError as e:
        return _report(e, DIVERGENCE_EXIT_CODE, print_errors)
    except Preempted as e:
        return _report(e, PREEMPTED_EXIT_CODE, print_errors, "preempted")
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        return _report(interrupted, INTERRUPTED_EXIT_CODE, print_errors)
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


def _report(error: object, code: int, print_errors: bool, kind: str = "error") -> int:
    if print_errors:
        print(f"{kind}: {error}", file=sys.stderr)
    return code
