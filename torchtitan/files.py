"""Files written whole or not at all: a reader (a resumed sweep, the report, a later run) never sees half of one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union


def write_text_atomically(path: Union[str, Path], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, renamed over ``path`` once complete."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)
