"""Reading DCP checkpoints without running anything a file names: the part of checkpointing that is security-critical.

A checkpoint may come from anywhere (a shared folder, a download, another cluster), and Python's pickle runs whatever
code a file names. DCP pickles two things, and each is read here by something that can only build data:

- the ``.metadata`` file (what the checkpoint holds, and where) is never given to pickle. :func:`read_metadata_file`
  walks its opcodes with ``pickletools.genops`` (which parses, never executes) and builds the objects itself, from an
  exact allow-list: DCP's metadata dataclasses (made empty, then given their declared fields only),
  ``torch.Size``, DCP's memory-format enum, layouts by name, ``pathlib.PosixPath`` (each called only with the plain
  arguments it expects) and torch's dtypes (constants). A name is looked up as an exact (module, name) pair, never
  followed through dots, and every object handed out is the one imported here. Anything else (another name, an
  opcode that calls or builds something else, fields a class does not declare, a result that is not DCP metadata
  of the expected shape) is refused with one line naming the file and what was found.
- non-tensor entries (such as optimizer hyperparameters) are read by :class:`SafeLoadPlanner` with
  ``torch.load(weights_only=True)``, which builds only tensors and plain containers.

Tensor data is raw bytes laid out as the metadata says, and plain-data state is JSON (``codec.py``). Every load of a
checkpoint must pass both a :class:`SafeFileSystemReader` and a :class:`SafeLoadPlanner` to ``dcp.load``. This
module depends on torch and DCP only, so that it can be reviewed alone.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickletools
from typing import Any, Callable

import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from torchtitan.errors import UserError

METADATA_FILE = ".metadata"  # DCP's name for it; a checkpoint folder without one is incomplete


class UnreadableCheckpoint(UserError):
    """A checkpoint that is damaged, incomplete or holds what a checkpoint never holds; the message names the file
    (or folder) and what is wrong. Nothing of it has been run, and nothing of it should be trusted."""


_META = "torch.distributed.checkpoint.metadata"
# Made empty (NEWOBJ), then given their declared fields (BUILD): DCP's metadata records.
_RECORDS: dict[tuple[str, str], type] = {
    (_META, "Metadata"): dcp_metadata.Metadata,
    (_META, "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
    (_META, "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
    (_META, "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
    (_META, "TensorProperties"): dcp_metadata.TensorProperties,
    (_META, "StorageMeta"): dcp_metadata.StorageMeta,
    (_META, "MetadataIndex"): dcp_metadata.MetadataIndex,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
}


_RECORD_FIELDS: dict[type, frozenset[str]] = {
    cls: frozenset(field.name for field in dataclasses.fields(cls)) for cls in _RECORDS.values()
}


def _ints(*args: Any) -> bool:
    return len(args) == 1 and isinstance(args[0], (tuple, list)) and all(type(v) is int for v in args[0])


# Called (REDUCE), each only with the plain arguments its check accepts.
_CONSTRUCTORS: dict[tuple[str, str], tuple[Callable[..., Any], Callable[..., bool]]] = {
    ("torch", "Size"): (torch.Size, _ints),
    ("torch.serialization", "_get_layout"): (
        torch.serialization._get_layout,
        lambda *a: len(a) == 1 and type(a[0]) is str and a[0].startswith("torch."),
    ),
    (_META, "_MEM_FORMAT_ENCODING"): (dcp_metadata._MEM_FORMAT_ENCODING, lambda *a: len(a) == 1 and type(a[0]) is int),
    ("pathlib", "PosixPath"): (pathlib.PosixPath, lambda *a: all(type(v) is str for v in a)),
}
# Constants: torch's dtypes by their names in the torch namespace.
_CONSTANTS: dict[tuple[str, str], Any] = {
    ("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)
}
ALLOWED_GLOBALS = frozenset(_RECORDS) | frozenset(_CONSTRUCTORS) | frozenset(_CONSTANTS)

_PUSH_ARGUMENT = frozenset(
    {
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "LONG4",
        "BINFLOAT",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "SHORT_BINBYTES",
        "BINBYTES",
        "BINBYTES8",
    }
)
_PUSH_CONSTANT = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_TUPLE_SIZES = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_EMPTY = {"EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_SET": set}
_FROM_MARK = {"TUPLE": tuple, "LIST": list, "DICT": dict, "FROZENSET": frozenset}
_ADD_TO = {"APPEND": list, "APPENDS": list, "SETITEM": dict, "SETITEMS": dict, "ADDITEMS": set}
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})


class _Refused(Exception):
    """What a ``.metadata`` file holds that a checkpoint's metadata never does (turned into UnreadableCheckpoint)."""


def _resolve(module: Any, name: Any) -> Any:
    """The allowed object named exactly ``module``, ``name``; never an attribute path, never an import."""
    if type(module) is not str or type(name) is not str:
        raise _Refused("it names a global by something other than text")
    key = (module, name)
    for table in (_RECORDS, _CONSTRUCTORS, _CONSTANTS):
        if key in table:
            found = table[key]
            return found[0] if table is _CONSTRUCTORS else found
    raise _Refused(f"it names {module}.{name}, which is not among the classes DCP metadata uses")


def _call(function: Any, args: Any) -> Any:
    """REDUCE: only an allowed constructor, only with the arguments it expects."""
    for constructor, accepts in _CONSTRUCTORS.values():
        if function is constructor:
            if type(args) is not tuple or not accepts(*args):
                raise _Refused(f"it calls {getattr(function, '__name__', function)} with unexpected arguments")
            return constructor(*args)
    raise _Refused(f"it calls {_describe(function)}, which is not a constructor of DCP metadata")


def _new(cls: Any, args: Any) -> Any:
    """NEWOBJ: an empty instance of a metadata record, before BUILD gives it its fields."""
    if not (isinstance(cls, type) and cls in _RECORD_FIELDS):
        raise _Refused(f"it creates {_describe(cls)}, which is not a record of DCP metadata")
    if args != ():
        raise _Refused(f"it creates {cls.__name__} with arguments")
    return object.__new__(cls)


def _build(instance: Any, state: Any, built: dict[int, Any]) -> None:
    """BUILD: set the declared fields of a record made by NEWOBJ, once; nothing else is ever given attributes."""
    cls = type(instance)
    if cls not in _RECORD_FIELDS or id(instance) in built:
        raise _Refused(f"it sets attributes of {_describe(instance)}")
    built[id(instance)] = instance
    if cls is dcp_metadata.TensorProperties:
        # DCP stores these as a 5-tuple (dtype, layout, requires_grad, memory-format code, pin_memory).
        if not (
            type(state) is tuple
            and len(state) == 5
            and isinstance(state[0], torch.dtype)
            and isinstance(state[1], torch.layout)
            and type(state[2]) is bool
            and isinstance(state[3], dcp_metadata._MEM_FORMAT_ENCODING)
            and type(state[4]) is bool
        ):
            raise _Refused("it holds tensor properties of an unexpected form")
        dcp_metadata.TensorProperties.__setstate__(instance, state)
        return
    declared = _RECORD_FIELDS[cls]
    if type(state) is not dict or not all(type(k) is str and k in declared for k in state):
        raise _Refused(f"it gives {cls.__name__} fields it does not declare")
    instance.__dict__.update(state)


def _describe(value: Any) -> str:
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    return f"an object of type {type(value).__name__}"


def _interpret(data: bytes) -> Any:
    """The object a pickle of DCP metadata describes, built by this function alone (see the module docstring)."""
    stack: list[Any] = []
    marks: list[list[Any]] = []
    memo: dict[int, Any] = {}
    built: dict[int, Any] = {}  # by id, holding each record so that no id is reused
    for opcode, arg, _ in pickletools.genops(io.BytesIO(data)):
        name = opcode.name
        # The most frequent opcodes of DCP metadata first.
        if name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in _GET:
            if arg not in memo:
                raise _Refused("its pickle refers to an object it never stored")
            stack.append(memo[arg])
        elif name in _PUSH_ARGUMENT:
            stack.append(arg)
        elif name in _TUPLE_SIZES:
            size = _TUPLE_SIZES[name]
            if len(stack) < size:
                raise _Refused(f"its pickle is malformed ({name} on a short stack)")
            items = tuple(stack[len(stack) - size :])
            del stack[len(stack) - size :]
            stack.append(items)
        elif name == "MARK":
            marks.append(stack)
            stack = []
        elif name == "NEWOBJ":
            args = stack.pop()
            stack.append(_new(stack.pop(), args))
        elif name == "BUILD":
            state = stack.pop()
            _build(stack[-1], state, built)
        elif name in _EMPTY:
            stack.append(_EMPTY[name]())
        elif name in _ADD_TO:
            if name in ("APPEND", "SETITEM"):
                count = 1 if name == "APPEND" else 2
                if len(stack) <= count:
                    raise _Refused(f"its pickle is malformed ({name} on a short stack)")
                items, stack = stack[len(stack) - count :], stack[: len(stack) - count]
            else:
                items, stack = stack, marks.pop()
            target = stack[-1]
            if type(target) is not _ADD_TO[name]:
                raise _Refused(f"it applies {name} to {_describe(target)}")
            if type(target) is list:
                target.extend(items)
            elif type(target) is dict:
                target.update(zip(items[::2], items[1::2]))
            else:
                target.update(items)
        elif name in _PUSH_CONSTANT:
            stack.append(_PUSH_CONSTANT[name])
        elif name == "REDUCE":
            args = stack.pop()
            stack.append(_call(stack.pop(), args))
        elif name == "STACK_GLOBAL":
            attribute = stack.pop()
            stack.append(_resolve(stack.pop(), attribute))
        elif name == "GLOBAL":
            module, _, attribute = arg.partition(" ")
            stack.append(_resolve(module, attribute))
        elif name in _FROM_MARK:
            items, stack = stack, marks.pop()
            if name == "DICT":
                stack.append(dict(zip(items[::2], items[1::2])))
            else:
                stack.append(_FROM_MARK[name](items))
        elif name in _PUT:
            memo[arg] = stack[-1]
        elif name in ("PROTO", "FRAME"):
            continue
        elif name == "STOP":
            if len(stack) != 1 or marks:
                raise _Refused("its pickle ends with a malformed stack")
            return stack[0]
        elif name == "POP":
            stack.pop()
        elif name == "POP_MARK":
            stack = marks.pop()
        elif name == "DUP":
            stack.append(stack[-1])
        else:
            raise _Refused(f"it holds the pickle opcode {name}, which DCP metadata never uses")
    raise _Refused("its pickle has no end")


def _check_size(value: Any, what: str) -> None:
    if type(value) is not torch.Size:
        raise _Refused(f"{what} is not a torch.Size")


def _validate(metadata: Any) -> None:
    """Raise _Refused unless ``metadata`` has the shape of DCP's metadata, all the way down (no recursion: the
    shape is fixed, so a file nested without end is refused at its first wrong level)."""
    if type(metadata) is not dcp_metadata.Metadata:
        raise _Refused(f"it holds {_describe(metadata)}, not DCP metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) is not dict:
        raise _Refused("its list of entries is missing")
    for key, entry in entries.items():
        if type(key) is not str:
            raise _Refused("an entry's name is not a string")
        if type(entry) is dcp_metadata.BytesStorageMetadata:
            continue
        if type(entry) is not dcp_metadata.TensorStorageMetadata:
            raise _Refused(f"entry {key!r} is {_describe(entry)}")
        if type(getattr(entry, "properties", None)) is not dcp_metadata.TensorProperties:
            raise _Refused(f"entry {key!r} has no tensor properties")
        _check_size(getattr(entry, "size", None), f"entry {key!r}'s size")
        chunks = getattr(entry, "chunks", None)
        if type(chunks) is not list:
            raise _Refused(f"entry {key!r} has no list of chunks")
        for chunk in chunks:
            if type(chunk) is not dcp_metadata.ChunkStorageMetadata:
                raise _Refused(f"a chunk of entry {key!r} is {_describe(chunk)}")
            _check_size(getattr(chunk, "offsets", None), f"a chunk of entry {key!r}")
            _check_size(getattr(chunk, "sizes", None), f"a chunk of entry {key!r}")
    storage = getattr(metadata, "storage_data", None)
    if type(storage) is not dict:
        raise _Refused("it says nowhere where its data lies")
    for index, info in storage.items():
        if type(index) is not dcp_metadata.MetadataIndex or type(info) is not dcp_filesystem._StorageInfo:
            raise _Refused("its data locations are not DCP's")
        relative = getattr(info, "relative_path", None)
        if type(relative) is not str or not relative or relative != os.path.basename(relative) or relative[0] == ".":
            raise _Refused(f"its data lies in {relative!r}, which is not a file of the checkpoint's folder")
        if not all(type(getattr(info, f, None)) is int and getattr(info, f) >= 0 for f in ("offset", "length")):
            raise _Refused(f"its data location in {relative} is not a byte range")
        if getattr(info, "transform_descriptors", None):
            raise _Refused(f"its data in {relative} asks for transforms, which checkpoints here never use")
    planner_data = getattr(metadata, "planner_data", None)
    if planner_data is not None and not (
        type(planner_data) is dict
        and all(
            type(k) is str and type(v) in (tuple, list) and all(type(p) in (str, int) for p in v)
            for k, v in planner_data.items()
        )
    ):
        raise _Refused("its planner data is not a table of entry paths")
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and type(storage_meta) is not dcp_metadata.StorageMeta:
        raise _Refused(f"its storage record is {_describe(storage_meta)}")


def read_metadata_file(path: str) -> Any:
    """The DCP metadata in the file ``path``, built from an exact allow-list (see the module docstring).

    Raises UnreadableCheckpoint, naming the file, when it is missing, unreadable, damaged or holds anything else.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise UnreadableCheckpoint(f"'{path}' is missing: the checkpoint is incomplete") from None
    except OSError as e:
        raise UnreadableCheckpoint(f"'{path}' cannot be read ({e.strerror or e})") from None
    try:
        metadata = _interpret(data)
        _validate(metadata)
    except _Refused as e:
        raise UnreadableCheckpoint(f"'{path}' is refused: {e}; nothing of it was run") from None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, RuntimeError, MemoryError) as e:
        # The opcode parser says "pickle exhausted before seeing STOP" and the like for a truncated or damaged file.
        raise UnreadableCheckpoint(f"'{path}' is damaged ({type(e).__name__}: {e})") from None
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader whose ``.metadata`` is read by :func:`read_metadata_file`, never by pickle; or, given
    ``metadata`` already read that way (and verified), that."""

    def __init__(self, path: Any, metadata: Any = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        if self._metadata is not None and rank is None:
            metadata = self._metadata
        else:
            metadata = read_metadata_file(os.path.join(os.fspath(self.path), name))
        # What FileSystemReader.read_metadata does after unpickling: tag the metadata with this load's id.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor entries (e.g. optimizer hyperparameters) are read with
    ``torch.load(weights_only=True)``, which only builds tensors and plain containers, never arbitrary objects."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        safe_value = torch.load(value, weights_only=True)
        # Hand the parent a re-serialisation of the already-vetted value, so that its (unrestricted) load only ever
        # sees bytes we produced; this keeps us off DCP's private planner fields.
        vetted = io.BytesIO()
        torch.save(safe_value, vetted)
        vetted.seek(0)
        super().load_bytes(read_item, vetted)
