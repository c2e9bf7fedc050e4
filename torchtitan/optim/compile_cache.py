"""Where and how an optimizer's step compiles: a cache folder per optimizer kind, and each graph compiled once per
machine.

Every rank on a machine compiles the same step graphs for the same shard shapes at the same moment (the first step),
each missing inductor's cache because none has written it yet: four ranks of a CPU debugging run spend four times the
CPU on it. ``optimizer_compile`` with a ``signature`` (what the graphs depend on: shapes, dtypes, constants) lets one
rank compile under a file lock in the cache folder and leave a mark; the others wait for the lock, find the mark and
load the compiled graphs from inductor's cache. Ranks whose shards differ (uneven FSDP shards) have signatures of
their own and compile side by side. The mark is only a hint: a mark whose graphs are not in the cache (another
torch, a cleared cache) costs a compile without the lock, as without marks.

Nothing that waits for another rank may run inside: the steps compiled here are local (no collectives).
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import os
import tempfile
from typing import Any, Iterator, Optional

import torch
import torch._functorch.config
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


@contextlib.contextmanager
def optimizer_compile(
    tag: str, *, subclass_inputs: bool, signature: Optional[str] = None, device_type: Optional[str] = None
) -> Iterator[None]:
    """Compile an optimizer's step inside ``<inductor cache>/optim_<tag>``; with ``signature``, once per machine (see
    the module's docstring); ``device_type``: where the step's tensors are ("cpu": see ``_probe_cpu_once``).

    AOT autograd's on-disk cache saves tracing each graph again in every process (every rank, every restart). It
    keys a tensor subclass by what the subclass says of itself: a DTensor by its global shape, placements and mesh,
    not by the rank's local shard — where FSDP shards a parameter unevenly (3 ranks, a dimension of 64), a rank
    would be handed the graph another rank compiled for its shard's shape (torchao's steps then fail a size check;
    a graph compiled without size checks would update part of the shard) — and torchao's quantized state by its
    shapes and contents, not its class. So with ``subclass_inputs`` (DTensors or quantized state among the
    inputs) the step compiles in a folder of its ``signature`` (which holds every local shard's shape and every
    subclass's own description), where AOT autograd's cache can only hold graphs of the same shards; without a
    signature (a step this process compiled before, which dynamo recompiles) AOT autograd's cache is off and
    inductor's own cache, keyed by the plain graphs that run, still keeps a warm restart warm. Steps compiled on
    plain tensors keep AOT autograd's cache (keyed by their shapes) in the tag's folder.
    """
    original = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if device_type == "cpu" and signature is not None:
        _probe_cpu_once()  # in the shared folder, before this step's own
    folder = os.path.join(original or _default_inductor_cache_dir(), f"optim_{tag}")
    if subclass_inputs and signature is not None:
        folder = os.path.join(folder, f"shards_{signature}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    aot_cache_off = subclass_inputs and signature is None
    try:
        with (
            torch._functorch.config.patch(enable_autograd_cache=False) if aot_cache_off else contextlib.nullcontext(),
            _once_per_machine(folder, signature) if signature is not None else contextlib.nullcontext(),
        ):
            yield
    finally:
        if original is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = original


@functools.lru_cache(maxsize=None)
def _probe_cpu_once() -> None:
    """Probe the CPU's vector instructions as inductor does before it generates its first CPU kernel in a process:
    it compiles about ten small programs into the current inductor cache folder (about 7 CPU seconds when the folder
    has none) and loads each, then keeps the answer for the process. Probed here in the shared folder, the probes are
    compiled once per machine, not once in each optimizer's folder (and each shard signature's)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
    except ImportError:  # moved: inductor probes wherever it first compiles, as before
        return
    pick_vec_isa()


@contextlib.contextmanager
def _once_per_machine(folder: str, signature: str) -> Iterator[None]:
    from filelock import FileLock

    marks = os.path.join(folder, "compiled")
    mark = os.path.join(marks, signature)
    if os.path.exists(mark):
        yield  # compiled here before: inductor's cache holds the graphs
        return
    os.makedirs(marks, exist_ok=True)
    lock = FileLock(os.path.join(marks, f"{signature}.lock"))
    lock.acquire()
    if os.path.exists(mark):  # compiled while this rank waited
        lock.release()
        yield
        return
    try:
        yield
        with open(mark, "w"):
            pass
    finally:
        lock.release()


def has_subclass(parts: Any) -> bool:
    """Whether a tensor subclass (a DTensor, quantized state) is among ``parts``."""
    return any(is_traceable_wrapper_subclass(leaf) for leaf in pytree.tree_leaves(parts))


def signature(*parts: Any) -> str:
    """A name for what a step's compiled graphs depend on: each tensor's kind, shape, stride, dtype and device (a
    DTensor's placements and local shard too, a quantized tensor's own description and inner tensors), every other
    value by its repr."""
    described = [
        _described(leaf) if isinstance(leaf, torch.Tensor) else repr(leaf) for leaf in pytree.tree_leaves(parts)
    ]
    return hashlib.blake2b(repr((torch.__version__, described)).encode(), digest_size=16).hexdigest()


def _described(t: torch.Tensor) -> tuple:
    plain = (type(t).__name__, tuple(t.shape), t.stride(), t.dtype, t.device.type)
    if isinstance(t, DTensor):
        return (*plain, t.placements, _described(t.to_local()))
    if is_traceable_wrapper_subclass(t):  # torchao's quantized state: its block size, signedness, codes and scales
        names, context = t.__tensor_flatten__()
        return (*plain, repr(context), tuple(_described(getattr(t, name)) for name in names))
    return plain


@functools.lru_cache(maxsize=None)
def _default_inductor_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return default_cache_dir()
    except ImportError:  # the helper moved; the same place by hand
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
