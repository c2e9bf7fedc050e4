"""Checksums of a checkpoint's files: recorded at save, verified before a load.

Every rank hashes the data files it writes as it writes them (:class:`ChecksummingWriter`: DCP writes each file front
to back through the stream its file system opens, so the bytes are hashed on their way out, never read back; on
whichever thread writes them, so an async save hashes in the background) and leaves its part of the record beside
them; the coordinator, once DCP has written ``.metadata``, hashes that too and merges the parts into
one :data:`CHECKSUMS_FILE`::

    {"algorithm": "xxh3_128", "files": {"__0_0.distcp": {"size": 1153508, "xxh3_128": "9f0c..."}, ...}}

written before the checkpoint is published, so every published checkpoint carries it. It takes the place of the CRC32
torch.save would compute for each record, which nothing checks (left out: :func:`_without_torch_crc32`). The hash is
xxHash's XXH3 (128 bits; not a defence against a forger, who can rewrite this file too, but against a disk, a copy or
a transfer that damaged a byte: what the restricted metadata reader of ``safe_reading`` is for the forger). Verifying
reads every listed file once; the ranks of a job split the files between them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
from typing import Any, Iterator, Optional

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from torchtitan.checkpoint.safe_reading import METADATA_FILE

CHECKSUMS_FILE = "checksums.json"
ALGORITHM = "xxh3_128"
_PART_PREFIX = ".checksums-"  # a rank's part of the record, until the coordinator merges them
_CHUNK = 8 << 20
_PIECE = 1 << 20  # written, then hashed while in the cache (a core's L2 holds it and its copy)


def file_digest(path: str) -> str:
    """The XXH3-128 digest of the file at ``path``, in hex, read in chunks."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe(folder: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """The size and digest of each named file of ``folder``."""
    entries = {}
    for name in names:
        path = os.path.join(folder, name)
        entries[name] = {"size": os.path.getsize(path), ALGORITHM: file_digest(path)}
    return entries


def _write_json(path: str, value: Any, durable: bool) -> None:
    with open(path, "w") as f:
        json.dump(value, f, sort_keys=True)
        if durable:
            f.flush()
            os.fsync(f.fileno())


class _HashingRaw(io.RawIOBase):
    """The raw file under a written file's buffer, hashing what reaches it: the buffer gathers the many small writes
    of a tensor's header into one, and hands a tensor's bytes on whole (written and hashed here a piece at a time), so
    hashing costs one call per flush or piece, not per write. ``in_order`` turns False if anything but appending
    happened (then the file is read back instead); closing it leaves the file open (its opener closes it)."""

    def __init__(self, file: Any) -> None:
        super().__init__()
        self.digest, self.size, self.in_order = xxhash.xxh3_128(), 0, True
        self._write = file.write
        # Called by the buffer at every tell and flush: the file's own methods, with no Python call in between.
        self.tell, self.fileno, self.flush, self.seekable = file.tell, file.fileno, file.flush, file.seekable
        self._seek = file.seek

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> Optional[int]:
        # A tensor's bytes go out a piece at a time, each hashed right after the file took it, while the piece is
        # still in the CPU's cache: the hash does not read from memory what the file's write has just read.
        view = memoryview(data).cast("B")
        written = 0
        while written < view.nbytes:
            piece = view[written : written + _PIECE]
            taken = self._write(piece)
            if taken is None:  # a non-blocking file that took nothing
                return written or None
            self.digest.update(piece[:taken])
            self.size += taken
            written += taken
            if taken < piece.nbytes:  # a raw write may take part of the bytes; the buffer hands on the rest
                break
        return written

    def seek(self, *args: Any) -> int:
        self.in_order = False
        return self._seek(*args)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, whose files opened for writing are hashed as they are written."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # DCP may write several files at once, one per thread

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if mode != "wb":
                yield stream
                return
            # The same buffering as the file opened, over a raw file that hashes; the file's own buffer stays empty.
            hashing = _HashingRaw(stream.raw)
            buffered = io.BufferedWriter(hashing, buffer_size=_buffer_size(stream.raw))
            try:
                yield buffered
            finally:
                buffered.close()  # flushes into the file, which the opener closes
        if hashing.in_order:
            with self._lock:
                self.written[os.path.basename(os.fspath(path))] = {
                    "size": hashing.size,
                    ALGORITHM: hashing.digest.hexdigest(),
                }


def _buffer_size(file: Any) -> int:
    """The buffer that ``open`` gives ``file``: its block size, else Python's default."""
    try:
        size = os.fstat(file.fileno()).st_blksize
    except OSError:
        size = 0
    return size if size > 1 else io.DEFAULT_BUFFER_SIZE


@contextlib.contextmanager
def _without_torch_crc32() -> Iterator[None]:
    """torch.save computes a CRC32 of every record it writes (a fifth to a third of a save's CPU) that nothing verifies
    (``torch.load`` reads records without checking it); the XXH3 of every file, verified before each load, takes its
    place, so the writes here skip it (torch's own switch; the files load as before)."""
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


class ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that records the checksums of what it writes (see the module docstring)."""

    def __init__(self, path: Any, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        with _without_torch_crc32():
            future = super().write_data(plan, planner)
            results = future.wait()
        names = sorted({result.storage_data.relative_path for result in results})
        if names:
            folder = os.fspath(self.path)
            entries = {}
            for name in names:
                entry = self.fs.written.get(name)
                if entry is None or entry["size"] != os.path.getsize(os.path.join(folder, name)):
                    entry = describe(folder, [name])[name]  # not hashed on its way out: read back
                entries[name] = entry
            # Read by the coordinator and removed before the checkpoint is published: no need to reach the disk.
            _write_json(os.path.join(folder, f"{_PART_PREFIX}{names[0]}.json"), entries, durable=False)
        return future

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        folder = os.fspath(self.path)
        files = describe(folder, [METADATA_FILE])
        for name in sorted(os.listdir(folder)):
            if name.startswith(_PART_PREFIX):
                with open(os.path.join(folder, name)) as f:
                    files.update(json.load(f))
                os.remove(os.path.join(folder, name))
        _write_json(os.path.join(folder, CHECKSUMS_FILE), {"algorithm": ALGORITHM, "files": files}, durable=True)


def read_record(folder: str) -> Optional[dict[str, dict[str, Any]]]:
    """The files and checksums recorded for the checkpoint in ``folder``; None when it has no record (written
    before checksums were recorded). Raises ValueError, in words, for a record that is damaged."""
    path = os.path.join(folder, CHECKSUMS_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"'{path}' cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"'{path}' is damaged (not JSON)") from None
    files = record.get("files") if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or record.get("algorithm") != ALGORITHM
        or not isinstance(files, dict)
        or METADATA_FILE not in files
        or not all(
            isinstance(entry, dict) and type(entry.get("size")) is int and isinstance(entry.get(ALGORITHM), str)
            for entry in files.values()
        )
        or not all(isinstance(name, str) and name == os.path.basename(name) for name in files)
    ):
        raise ValueError(f"'{path}' is damaged (not a record of {ALGORITHM} checksums)")
    return files


def verify_files(folder: str, files: dict[str, dict[str, Any]], names: list[str]) -> Optional[str]:
    """What is wrong with the named files of ``folder`` against their record, in words; None when they verify.

    Every recorded file must exist with its recorded size (a cheap check of all of them); the contents of ``names``
    alone are hashed (a rank's share).
    """
    for name in sorted(files):
        path = os.path.join(folder, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            return f"'{path}' is missing (incomplete)"
        except OSError as e:
            return f"'{path}' cannot be read ({e.strerror or e})"
        if size != files[name]["size"]:
            return f"'{path}' holds {size} bytes where {files[name]['size']} were written (truncated or damaged)"
    for name in names:
        path = os.path.join(folder, name)
        try:
            digest = file_digest(path)
        except OSError as e:
            return f"'{path}' cannot be read ({e.strerror or e})"
        if digest != files[name][ALGORITHM]:
            return f"'{path}' does not match its checksum (damaged)"
    return None
