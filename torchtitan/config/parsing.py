"""The job config parsed: defaults, then a TOML file, then ``--section.key value`` overrides; and ``--help``.

Works on any dataclass whose fields are tables (``JobConfig``): the key names, types, defaults, help and range checks
all come from the tables' fields (``torchtitan.config.tables``), so the TOML loader, the command line and ``--help``
read the same facts. torchtitan's 2024 keys are translated or refused (``torchtitan.config.legacy``). Mistakes raise
:class:`torchtitan.errors.UserError` with one line naming the key and, for typos, the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
import types
import typing
from typing import Any

from torchtitan.config.legacy import LEGACY_KEYS, LEGACY_SECTIONS, refuse_both_names, translate
from torchtitan.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


def parse(cls: type, argv: list[str], prog: str) -> Any:
    """A ``cls`` (a dataclass of tables) from its defaults, then ``--job.config_file`` (if given), then the other
    command-line overrides, each key and range checked; ``--help`` prints the options and exits."""
    if "-h" in argv or "--help" in argv:
        print(help_text(cls, prog))
        raise SystemExit(0)
    overrides = _split_command_line(cls, argv)
    refuse_both_names((key for key, _ in overrides), "the command line")
    config = cls()
    # The last --job.config_file wins, like any other repeated option.
    config_file = next((v for k, v in reversed(overrides) if k == "job.config_file"), None)
    if config_file is not None:
        _apply_toml(config, config_file)
        config.job.config_file = config_file
    for key, raw in overrides:
        if key in LEGACY_KEYS:
            _set_from_toml(config, key, _legacy_value(raw))
            continue
        value = _from_string(key, _field_type(cls, key), raw)
        _set_from_toml(config, key, value)
    _check_ranges(config)
    return config


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s resolved field types (read only; resolving them is the slow part of parsing a job)."""
    return typing.get_type_hints(cls)


def _sections(cls: type) -> dict[str, type]:
    hints = _hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _keys(cls: type) -> dict[str, dataclasses.Field]:
    keys = {}
    for section, section_cls in _sections(cls).items():
        for f in dataclasses.fields(section_cls):
            keys[f"{section}.{f.name}"] = f
    return keys


def _field_type(cls: type, key: str) -> Any:
    section, name = key.split(".", 1)
    return _hints(_sections(cls)[section])[name]


def _unknown(kind: str, name: str, valid: list[str]) -> UserError:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else " (see --help for the valid keys)"
    return UserError(f"unknown {kind} '{name}'{hint}")


def _check_key(cls: type, key: str) -> None:
    keys = _keys(cls)
    if key in keys:
        return
    section = key.split(".", 1)[0]
    if "." not in key or section not in _sections(cls):
        # A typo'd section: compare whole keys so that the suggestion is complete.
        raise _unknown("config key", key, list(keys))
    raise _unknown("config key", key, [k for k in keys if k.startswith(section + ".")])


def _base_type(tp: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) for ``T`` or ``Optional[T]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _base_type(tp)
    return {bool: "bool", int: "int", float: "float", str: "str"}[base] + (" or none" if optional else "")


def _from_string(key: str, tp: Any, raw: str) -> Any:
    base, optional = _base_type(tp)
    if optional and raw.lower() in ("none", "null", ""):
        return None
    if base is bool:
        lowered = raw.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
    else:
        try:
            return base(raw)
        except ValueError:
            pass
    raise UserError(f"{key} expects {_type_name(tp)}, got '{raw}'")


def _from_toml(key: str, tp: Any, value: Any) -> Any:
    base, optional = _base_type(tp)
    if value is None and optional:
        return None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is str and optional and isinstance(value, str) and value.lower() == "none":
        return None
    if isinstance(value, base) and (base is bool or not isinstance(value, bool)):
        return value
    raise UserError(f"{key} expects {_type_name(tp)}, got {type(value).__name__} {value!r} in the config file")


def _apply_toml(config: Any, path: str) -> None:
    if not os.path.isfile(path):
        raise UserError(f"config file '{path}' not found; pass an existing TOML file to --job.config_file")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file '{path}' is not valid TOML: {e}") from None
    cls = type(config)
    sections = _sections(cls)
    refuse_both_names(
        (f"{s}.{name}" for s, t in zip(data, data.values()) if isinstance(t, dict) for name in t), f"'{path}'"
    )
    for section, table in data.items():
        if section not in sections and section not in LEGACY_SECTIONS:
            raise _unknown("config section", f"[{section}]", [f"[{s}]" for s in sections])
        if not isinstance(table, dict):
            raise UserError(f"'{section}' in '{path}' must be a table like [{section}]")
        for name, value in table.items():
            _set_from_toml(config, f"{section}.{name}", value)


def _set_from_toml(config: Any, key: str, value: Any) -> None:
    """Set one key of a TOML file (or a parsed command-line value), torchtitan's 2024 keys translated."""
    cls = type(config)
    pairs = translate(key, value)
    for target, target_value in [(key, value)] if pairs is None else pairs:
        _check_key(cls, target)
        section, name = target.split(".", 1)
        setattr(getattr(config, section), name, _from_toml(target, _field_type(cls, target), target_value))


def _legacy_value(raw: str) -> Any:
    """A command-line value of a torchtitan 2024 key, read as TOML (true, 8, [], "text"), else as text."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if raw.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _split_command_line(cls: type, argv: list[str]) -> list[tuple[str, str]]:
    """``--a.b v``, ``--a.b=v`` and bare boolean ``--a.b`` into (key, raw string) pairs."""
    pairs = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument '{arg}'; options look like --section.key value")
        key, has_value, raw = arg[2:].partition("=")
        if key in LEGACY_KEYS:
            base = str  # any value is read by _legacy_value; a bare flag (next is an option) means true
            if not has_value and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                has_value, raw = True, "true"
        else:
            _check_key(cls, key)
            base, _ = _base_type(_field_type(cls, key))
        if not has_value:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if base is bool and (nxt is None or nxt.lower() not in ("true", "false", "1", "0", "yes", "no")):
                raw = "true"
            elif nxt is None:
                raise UserError(f"--{key} needs a value")
            else:
                raw = nxt
                i += 1
        pairs.append((key, raw))
        i += 1
    return pairs


def set_option(config: Any, key: str, raw: str) -> None:
    """Set ``section.key`` of ``config`` from a string, checked as a command-line value is (UserError if wrong)."""
    _check_key(type(config), key)
    section, name = key.split(".", 1)
    setattr(getattr(config, section), name, _from_string(key, _field_type(type(config), key), raw))
    _check_ranges(config)


def _check_ranges(config: Any) -> None:
    for key, f in _keys(type(config)).items():
        section, name = key.split(".", 1)
        value = getattr(getattr(config, section), name)
        if value is None:
            continue
        meta = f.metadata
        if "choices" in meta and value not in meta["choices"]:
            close = difflib.get_close_matches(str(value), meta["choices"], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(f"{key} must be one of {', '.join(meta['choices'])}; got '{value}'{hint}")
        for check, ok, words in (
            ("gt", lambda v, b: v > b, "greater than"),
            ("ge", lambda v, b: v >= b, "at least"),
            ("lt", lambda v, b: v < b, "less than"),
            ("le", lambda v, b: v <= b, "at most"),
        ):
            if check in meta and not ok(value, meta[check]):
                raise UserError(f"{key} must be {words} {meta[check]}; got {value}")


def help_text(cls: type, prog: str = "train.py") -> str:
    lines = [
        f"usage: {prog} [--job.config_file FILE.toml] [--section.key value ...]",
        "",
        "Options come from defaults, then the TOML file, then the command line (booleans also as bare flags).",
    ]
    for section, section_cls in _sections(cls).items():
        lines.append(f"\n[{section}]")
        hints = _hints(section_cls)
        for f in dataclasses.fields(section_cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            kind = "{" + ",".join(choices) + "}" if choices else _type_name(hints[f.name]).upper()
            lines.append(f"  --{section}.{f.name} {kind}  (default: {default})")
            lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)
