"""One logger for the project: INFO on rank 0, warnings and errors only on the other ranks."""

import logging
import os

logger = logging.getLogger("torchtitan")


def init_logger() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[titan] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.propagate = False
