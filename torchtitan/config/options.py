"""How an option of the job config is declared: its default, one line of help and its range checks."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **checks: Any) -> Any:
    """A config field: its default, one line of help and its range checks."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})
