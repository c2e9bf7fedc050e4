"""The checkpoint folder protocol: where checkpoints live, and how a save becomes visible only once complete.

A save writes into a hidden temporary folder (``.step-N.tmp-<token>``); rank 0 then renames it to ``step-N``
(atomic on one filesystem) and fsyncs the parent folder. Deleting renames first too, so a crash mid-delete leaves a
temporary folder, never a half-deleted ``step-N``; temporary folders are removed at the next start.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from typing import Any

from torchtitan.checkpoint.safe_reading import METADATA_FILE
from torchtitan.logging import logger
from torchtitan.optim.builder import resolve_optimizer_name

STEP_FOLDER = re.compile(r"^step-(\d+)$")
TEMPORARY_FOLDER = re.compile(r"^\.step-\d+(-weights|-hf)?\.tmp-")
DEFAULT_FOLDER = "checkpoint"  # inside job.dump_folder, one subfolder per optimizer


def resolve_folder(job_config: Any) -> str:
    """``checkpoint.folder``, or unset ``checkpoint/<optimizer name>``, inside ``job.dump_folder`` unless absolute."""
    folder = job_config.checkpoint.folder
    if folder is None:
        folder = os.path.join(DEFAULT_FOLDER, resolve_optimizer_name(job_config.optimizer.name).name)
    return folder if os.path.isabs(folder) else os.path.join(job_config.job.dump_folder, folder)


def complete_steps(folder: str) -> list[int]:
    """Steps of the published checkpoints in ``folder``, oldest first (temporary folders never count)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = STEP_FOLDER.match(name)
        if match and os.path.isfile(os.path.join(folder, name, METADATA_FILE)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def step_folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def weights_folder(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}-weights")


def hf_folder(folder: str, step: int) -> str:
    """The Hugging Face export of ``step`` (``checkpoint.last_save_in_hf``)."""
    return os.path.join(folder, f"step-{step}-hf")


def temporary_name(final_path: str, token: str) -> str:
    head, name = os.path.split(final_path)
    return os.path.join(head, f".{name}.tmp-{token}")


def fsync_folder(path: str) -> None:
    """Make renames and new entries in ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_folder(path: str) -> None:
    """Delete a folder so that a crash mid-way never leaves a half-deleted checkpoint under a visible name."""
    doomed = temporary_name(path, "deleting-" + secrets.token_hex(4))
    os.rename(path, doomed)
    fsync_folder(os.path.dirname(path))
    shutil.rmtree(doomed, ignore_errors=True)


def publish(temporary: str, final: str) -> None:
    """Atomically make a finished save visible under its final name, replacing an older one of the same name."""
    fsync_folder(temporary)
    if os.path.exists(final):
        # A re-run over the same step (e.g. resumed from an earlier load_step): the new save wins. The old one is
        # moved aside first because a folder cannot be renamed onto a non-empty folder.
        logger.warning(f"checkpoint: replacing existing {final}")
        remove_folder(final)
    os.rename(temporary, final)
    fsync_folder(os.path.dirname(final))


def clean_temporary(folder: str) -> list[str]:
    """Remove leftovers of interrupted saves and deletes; returns their names."""
    if not os.path.isdir(folder):
        return []
    removed = sorted(name for name in os.listdir(folder) if TEMPORARY_FOLDER.match(name))
    for name in removed:
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return removed
