"""The project's exceptions for a user, and the one place that turns them into exit codes.

``UserError`` is a mistake a user can fix (bad config, missing file, bad option); ``DivergenceError`` says training
stopped because its numbers became non-finite; ``Preempted`` that it stopped on a scheduler's signal, saved;
``SaveFailed`` that a checkpoint could not be written (disk full, permission denied, quota), the previous one intact.
Every entry point (``train.py``, ``estimation.py``, ``torchtitan.config.preflight`` and the tools) runs its body through
:func:`exit_code`, which prints either as a single ``error:`` line (``preempted:`` for the last) and returns its
exit code; everything else is an internal bug and keeps its traceback. This module
imports nothing heavy, so tools that only need the codes start fast.

A launcher may not pass the code on: torchrun reports any worker's failure as 1. So ``train.py``'s first rank also
writes how the run ended into its dump folder (:data:`EXIT_RECORD`, :func:`write_exit_record`); the study reads
that record, not the launcher's code, to tell a diverged run (3), a mistake (2), a saved stop (4) or a failed save (5)
from a crash.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable  # neither pathlib nor typing: a job script's record imports this leaf

USER_ERROR_EXIT_CODE = 2  # "your input is wrong"
DIVERGENCE_EXIT_CODE = 3  # "training diverged": the loss, the gradients or the state became non-finite
PREEMPTED_EXIT_CODE = 4  # "stopped on a scheduler's signal, checkpoint saved": run the same command to resume
SAVE_FAILED_EXIT_CODE = 5  # "a checkpoint could not be written" (disk full, permission, quota); the previous one stays
INTERRUPTED_EXIT_CODE = 130  # the shell's code for a run ended by Ctrl-C
EXIT_RECORD = "exit.json"  # in a run's dump folder: {"exit_code", "message", "time"} of its latest ending


class UserError(ValueError):
    """A problem in the user's input, with a message that names the problem and the fix."""


class DivergenceError(Exception):
    """Training stopped because the loss, the gradients or the state became non-finite."""


class Preempted(Exception):
    """Training stopped on a scheduler's signal (SIGTERM, SIGUSR1), saved (``torchtitan.training.preemption``)."""


class SaveFailed(Exception):
    """A checkpoint could not be written (disk full, permission denied, quota): the message names the cause and the
    folder; the previous checkpoint stays complete and visible."""


def exit_code(
    body: Callable[[], object],
    *,
    print_errors: bool = True,
    interrupted: str | None = None,
    on_exit: Callable[[int, str], None] | None = None,
) -> int:
    """Run an entry point's ``body``: the int it returns (anything else: 0), or the exit code of its error.

    ``print_errors`` False keeps the ``error:`` line to itself (every rank but the first of a job);
    ``interrupted``, when given, is the line printed for Ctrl-C or SIGTERM (exit 130) instead of a traceback;
    ``on_exit``, when given, is called with the exit code and its one-line message ("" for a plain return) before
    returning (not for an internal bug, which keeps its traceback).
    """
    try:
        code = body()
    except UserError as e:
        code, message = _report(e, USER_ERROR_EXIT_CODE, print_errors)
    except DivergenceError as e:
        code, message = _report(e, DIVERGENCE_EXIT_CODE, print_errors)
    except Preempted as e:
        code, message = _report(e, PREEMPTED_EXIT_CODE, print_errors, "preempted")
    except SaveFailed as e:
        code, message = _report(e, SAVE_FAILED_EXIT_CODE, print_errors)
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        code, message = _report(interrupted, INTERRUPTED_EXIT_CODE, print_errors)
    else:
        code, message = (code if isinstance(code, int) and not isinstance(code, bool) else 0), ""
    if on_exit is not None:
        on_exit(code, message)
    return code


def _report(error: object, code: int, print_errors: bool, kind: str = "error") -> tuple[int, str]:
    message = f"{kind}: {error}"
    if print_errors:
        print(message, file=sys.stderr)
    return code, message


def write_exit_record(folder: str | os.PathLike, code: int, message: str) -> None:
    """Record in ``folder`` (a run's dump folder) how the run ended: its exit code and one-line message, now."""
    from torchtitan.files import write_text_atomically

    os.makedirs(folder, exist_ok=True)
    record = {"exit_code": code, "message": message, "time": time.time(), "pid": os.getpid()}
    write_text_atomically(os.path.join(folder, EXIT_RECORD), json.dumps(record) + "\n")


def read_exit_record(folder: str | os.PathLike, since: float = 0.0) -> dict | None:
    """The exit record of ``folder`` written at ``since`` or later (an attempt's own, not an earlier one's); None
    when there is none."""
    try:
        with open(os.path.join(folder, EXIT_RECORD)) as f:
            record = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if record.get("time", 0.0) >= since else None
