"""Building the CPU kernel of ``torchtitan::adam_mini_step_`` from its source in the package, once per machine.

``torch.utils.cpp_extension.load`` compiles ``csrc/adam_mini_step.cpp`` (OpenMP, ``-O3 -march=native``) into a folder of
the user's cache named by a hash of the source, torch's version and installation folder, the flags and the CPU, so a
changed source, another environment or another machine builds anew and everything else loads the built library. It
compiles the folder's own copy of the source: the build file then names the same path from every checkout of the
project, so a second checkout (another clone, a worktree) using the same environment loads what the first built instead
of rebuilding it, and two checkouts testing at once do not rebuild it in turn. Ranks that start together take turns on a
file lock (released when its holder dies, unlike torch's own lock file, which a killed build leaves behind and the
holder of the file lock removes), so one compiles and the others load. Where no C++ compiler is found, one line says so
and the fused back end runs its compiled graphs instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "adam_mini_step.cpp"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_loaded: Optional[bool] = None  # None: not tried in this process


def cache_root() -> Path:
    """Where built kernels live: ``$TORCHTITAN_CACHE`` or ``$XDG_CACHE_HOME/torchtitan`` (``~/.cache/torchtitan``)."""
    if os.environ.get("TORCHTITAN_CACHE"):
        return Path(os.environ["TORCHTITAN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchtitan"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """The extension's name: the source, torch's version and installation, the flags and the CPU, hashed.

    The installation's folder is part of it because torch's build file names its headers and libraries there: two
    environments (two virtual environments on one machine, a fresh clone's beside a working copy's) sharing one
    build folder would each write a build file naming their own, so that ninja rebuilt the kernel at every switch,
    rewriting the library under the other environment's running processes."""
    installation = str(Path(torch.__file__).resolve().parent)
    key = "\n".join([SOURCE.read_text(), torch.__version__, installation, *CFLAGS, *LDFLAGS, _cpu_model()])
    return "torchtitan_adam_mini_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def compiler() -> Optional[str]:
    """The C++ compiler torch's extension loader would run (``$CXX``, else ``c++``), if present."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _source_copy(folder: Path) -> Path:
    """The source as ``folder``'s own file (written whole, under the caller's lock, where missing or different)."""
    copy = folder / SOURCE.name
    text = SOURCE.read_bytes()
    if not copy.is_file() or copy.read_bytes() != text:
        partial = copy.with_name(copy.name + ".partial")
        partial.write_bytes(text)
        os.replace(partial, copy)
    return copy


def load_cpu_kernel() -> bool:
    """Make the operator's CPU kernel available in this process (building it if no process has); False, with one
    logged line, where it cannot be built."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if compiler() is None:
        logger.warning(
            "Adam-mini: no C++ compiler (%s) found, so its fused step runs as compiled graphs rather than its "
            "one-pass CPU kernel; install g++ for the kernel",
            os.environ.get("CXX", "c++"),
        )
        _loaded = False
        return _loaded
    from filelock import FileLock
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        logger.warning(
            "Adam-mini: ninja (torch's extension builder) not found, so its fused step runs as compiled graphs "
            "rather than its one-pass CPU kernel; pip install ninja for the kernel"
        )
        _loaded = False
        return _loaded
    name = build_name()
    folder = cache_root() / "extensions" / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):
            # torch's loader waits, without end, for its own lock file to go; one left by a process killed while it
            # built cannot be anyone's while this lock is held, so it goes now.
            baton = folder / "lock"
            if baton.exists():
                logger.warning("Adam-mini: removing %s, left by a build that was stopped before it ended", baton)
                baton.unlink()
            cpp_extension.load(
                name,
                [str(_source_copy(folder))],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
    except (OSError, RuntimeError) as e:  # a cache folder that cannot be written, a compiler that fails
        cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        logger.warning(
            "Adam-mini: its one-pass CPU kernel could not be built in %s (%s), so its fused step runs as compiled "
            "graphs; set TORCHTITAN_CACHE to a writable folder, or check the compiler",
            folder,
            cause,
        )
        _loaded = False
        return _loaded
    _loaded = True
    return _loaded
