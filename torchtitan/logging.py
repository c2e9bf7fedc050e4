"""One logger for the project: INFO on rank 0, warnings and errors only on the other ranks."""

import logging
import os
from contextlib import contextmanager
from typing import Iterator

logger = logging.getLogger("torchtitan")


def init_logger() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # A fresh handler each time, bound to the current sys.stderr (which tests may have replaced).
    for old in list(logger.handlers):
        logger.removeHandler(old)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[titan] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False


@contextmanager
def quiet(level: int = logging.WARNING) -> Iterator[None]:
    """Only warnings and errors from the project's logger inside the block (a check that builds what a run builds,
    such as preflight's layout check, says nothing of what it built)."""
    previous = logger.level
    logger.setLevel(max(level, previous))
    try:
        yield
    finally:
        logger.setLevel(previous)
