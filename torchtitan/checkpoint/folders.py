"""The checkpoint folder protocol: where checkpoints live, and how a save becomes visible only once complete.

A save writes into a hidden temporary folder (``.step-N.tmp-<token>``); rank 0 then renames it to ``step-N``
(atomic on one filesystem) and fsyncs the parent folder. Deleting renames first too, so a crash mid-delete leaves a
temporary folder, never a half-deleted ``step-N``; temporary folders are removed at the next start.

Replacing a published ``step-N`` (a step saved again) swaps the two folders in one atomic exchange where the system
has one (Linux ``renameat2``); elsewhere the old copy is first renamed to ``.step-N.old-<token>``, which the next
start puts back if a crash came before the new copy was in place. Either way ``step-N`` names a complete checkpoint,
old or new, at every point.

One run at a time: global rank 0 of a run holds ``.<folder name>.lock`` beside the folder (a POSIX record lock,
which the system drops when the process dies, however it dies; the folder's path is resolved through symbolic links
first), so a second run on the folder, by any name, is refused before it touches anything, while a dead run's
leftovers are cleaned by the next start as before.

Lineage: a run resumed from step N while newer checkpoints exist starts a new branch. Those newer checkpoints are
moved to ``superseded/after-step-N-<time>/`` (a marker file lists the moves first, and the next start finishes
them after a crash), so later saves, ``keep_latest_k`` and automatic resumes see only the branch that ran last.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import time
from typing import Any, Optional

from torchtitan.checkpoint.safe_reading import METADATA_FILE
from torchtitan.errors import UserError
from torchtitan.logging import logger
from torchtitan.optim.settings import state_label

STEP_FOLDER = re.compile(r"^step-(\d+)$")
TEMPORARY_FOLDER = re.compile(r"^\.step-\d+(-weights|-hf)?\.tmp-")
REPLACED_FOLDER = re.compile(r"^\.(step-\d+(?:-weights|-hf)?)\.old-[0-9a-f]+$")  # an old copy set aside while replacing
SUPERSEDED_FOLDER = "superseded"  # checkpoints of a branch that a resume from an older step abandoned
DAMAGED_FOLDER = "damaged"  # checkpoints a resume found damaged or incomplete: moved here, never deleted
BRANCH_MARKER = ".branch.json"  # the moves of an abandoned branch, written before they start
DEFAULT_FOLDER = "checkpoint"  # inside job.dump_folder, one subfolder per optimizer state


def resolve_folder(job_config: Any) -> str:
    """``checkpoint.folder``, or unset ``checkpoint/<optimizer state label>``, inside ``job.dump_folder`` unless
    absolute. The label is the optimizer's name plus each option that shapes its state and is not at its default
    (``optim.settings.state_label``), so runs whose states differ never share a folder."""
    folder = job_config.checkpoint.folder
    if folder is None:
        folder = os.path.join(DEFAULT_FOLDER, state_label(job_config))
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


def fsync_file(path: str) -> None:
    """Make a written file's contents durable before it is published."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    remove_tree(doomed)


def remove_tree(path: str) -> bool:
    """Delete ``path`` and everything under it; True when it is gone. A folder that cannot be deleted is said in one
    line (its space is still taken), never left without a word."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        logger.warning(
            f"checkpoint: could not delete {path} ({e.strerror or e}: {e.filename}); delete it by hand to free its "
            "space"
        )
        return False
    return True


def _exchange(first: str, second: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = libc.renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange)
    return result == 0


def publish(temporary: str, final: str) -> None:
    """Atomically make a finished save visible under its final name, replacing an older one of the same name.

    ``final`` names a complete checkpoint, the old or the new one, at every point (see the module docstring).
    """
    fsync_folder(temporary)
    parent = os.path.dirname(final)
    if not os.path.exists(final):
        os.rename(temporary, final)
        fsync_folder(parent)
        return
    # A step saved again (e.g. by a run resumed from an earlier step): the new save wins.
    logger.warning(f"checkpoint: replacing existing {final}")
    if _exchange(temporary, final):
        fsync_folder(parent)
        remove_tree(temporary)  # it now holds the old copy
        return
    old = os.path.join(parent, f".{os.path.basename(final)}.old-{secrets.token_hex(4)}")
    os.rename(final, old)  # a crash from here until the next rename: the next start restores the old copy
    fsync_folder(parent)
    os.rename(temporary, final)
    fsync_folder(parent)
    remove_tree(old)


def incomplete_steps(folder: str) -> list[int]:
    """Steps whose ``step-N`` folder has no metadata file: a published checkpoint always has one, so these were
    damaged after publishing (a file deleted, a copy cut short)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = STEP_FOLDER.match(name)
        path = os.path.join(folder, name)
        if match and os.path.isdir(path) and not os.path.isfile(os.path.join(path, METADATA_FILE)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def set_aside_damaged(folder: str, step: int) -> str:
    """Move the checkpoint of ``step`` into ``damaged/`` (never delete it: its owner may want to look, or recover
    it); the path it now has."""
    target = os.path.join(
        folder, DAMAGED_FOLDER, f"step-{step}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    )
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(step_folder(folder, step), target)
    fsync_folder(os.path.dirname(target))
    fsync_folder(folder)
    return target


def set_aside_newer(folder: str, kept_step: int) -> Optional[str]:
    """Move the checkpoints newer than ``kept_step`` (and their weights and Hugging Face exports) into
    ``superseded/``, so that the branch resumed from ``kept_step`` is the only one saves and resumes see; the folder
    they went to, or None."""
    newer = [step for step in complete_steps(folder) if step > kept_step]
    if not newer:
        return None
    target = os.path.join(
        SUPERSEDED_FOLDER, f"after-step-{kept_step}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    )
    marker = os.path.join(folder, BRANCH_MARKER)
    with open(marker + ".tmp", "w") as f:
        json.dump({"target": target, "steps": newer}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker + ".tmp", marker)
    fsync_folder(folder)
    finish_set_aside(folder)
    return os.path.join(folder, target)


def finish_set_aside(folder: str) -> None:
    """Carry out the moves a branch marker lists (all of them again after a crash: each is done once)."""
    marker = os.path.join(folder, BRANCH_MARKER)
    if not os.path.isfile(marker):
        return
    with open(marker) as f:
        plan = json.load(f)
    target = os.path.join(folder, plan["target"])
    os.makedirs(target, exist_ok=True)
    for step in plan["steps"]:
        for path in (step_folder(folder, step), weights_folder(folder, step), hf_folder(folder, step)):
            if os.path.exists(path):
                os.rename(path, os.path.join(target, os.path.basename(path)))
    fsync_folder(target)
    fsync_folder(folder)
    os.remove(marker)
    fsync_folder(folder)


def restore_replaced(folder: str) -> list[str]:
    """After a crash while replacing ``step-N``: put the old copy back where the new one never arrived, else drop
    it; returns the names of the folders put back."""
    restored = []
    for name in sorted(os.listdir(folder)):
        match = REPLACED_FOLDER.match(name)
        if match is None:
            continue
        old, final = os.path.join(folder, name), os.path.join(folder, match.group(1))
        if os.path.exists(final):
            remove_tree(old)
        else:
            os.rename(old, final)
            restored.append(match.group(1))
    fsync_folder(folder)
    return restored


def recover(folder: str) -> list[str]:
    """At a start: finish what a crash interrupted (moves of a branch, a replacement), then remove the leftovers
    of interrupted saves and deletes; returns what it did, in words."""
    if not os.path.isdir(folder):
        return []
    notes = []
    if os.path.isfile(os.path.join(folder, BRANCH_MARKER)):
        finish_set_aside(folder)
        notes.append("finished setting aside a superseded branch")
    notes += [f"put back {name} (its replacement was interrupted)" for name in restore_replaced(folder)]
    removed = clean_temporary(folder)
    if removed:
        notes.append(f"removed {len(removed)} incomplete save(s): {removed}")
    return notes


def clean_temporary(folder: str) -> list[str]:
    """Remove leftovers of interrupted saves and deletes; returns their names."""
    if not os.path.isdir(folder):
        return []
    leftovers = sorted(name for name in os.listdir(folder) if TEMPORARY_FOLDER.match(name))
    return [name for name in leftovers if remove_tree(os.path.join(folder, name))]


# -- one run per folder -------------------------------------------------------------------------------------------


def lock_path(folder: str) -> str:
    """The lock file of ``folder``: beside it, so that the folder holds checkpoints only.

    The path is resolved through symbolic links first: a folder named through a link and by its own path is one
    folder with one lock.
    """
    head, name = os.path.split(os.path.realpath(folder))
    return os.path.join(head, f".{name}.lock")


class FolderInUse(UserError):
    """A second run on a checkpoint folder that a live run holds: refused before it touches anything of that run's."""


class FolderLock:
    """This process's hold on a checkpoint folder (``try_lock_folder``); ``release`` it when the run ends.

    POSIX record locks belong to a process (a forked data-loader worker holds none) and any close of the file in
    that process drops them, so each process opens a lock file once and counts its holders.
    """

    _held: dict[str, "FolderLock"] = {}

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd, self.holders = path, fd, 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders > 0 or self.fd is None:
            return
        FolderLock._held.pop(self.path, None)
        # Removed while still held: a run that opened this file meanwhile sees it is gone and takes a new one.
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def try_lock_folder(folder: str) -> tuple[Optional[FolderLock], Optional[str]]:
    """Hold ``folder`` for this process: ``(lock, None)``, or ``(None, who)`` when a live process holds it.

    Raises OSError where the lock file cannot be made or the filesystem keeps no locks.
    """
    path = lock_path(folder)
    held = FolderLock._held.get(path)
    if held is not None:
        held.holders += 1
        return held, None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                return None, holder or "a process that has not yet said who it is"
            raise
        try:
            same_file = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same_file = False
        if same_file:
            break
        os.close(fd)  # its last holder removed the file between our open and our lock: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0
    )
    os.fsync(fd)
    lock = FolderLock(path, fd)
    FolderLock._held[path] = lock
    return lock, None
