"""Files written whole or not at all: a reader (a resumed sweep, the report, a later run) never sees half of one."""

from __future__ import annotations

import json
import math
import os


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, renamed over ``path`` once complete."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)


def strict_json(value) -> str:
    """``value`` as JSON that every parser reads (indented, newline-terminated): a NaN or infinite number, which
    Python's json would write as ``NaN``/``Infinity``, becomes ``null`` with a ``{key}_reason`` beside it in its
    object ("infinite", "-infinite" or "not a number"); in a list, ``null`` alone."""

    def reason(x: float) -> str:
        return "not a number" if math.isnan(x) else "infinite" if x > 0 else "-infinite"

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                out[k] = clean(x)
                if isinstance(x, float) and not math.isfinite(x):
                    out[f"{k}_reason"] = reason(x)
            return out
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(value), indent=2, allow_nan=False) + "\n"
