"""On a GPU, a tensor made on the host (a Python number through ``torch.tensor``, or arithmetic on the CPU step
counts) that meets the parameters' tensors is copied to the device, and an ordinary copy waits for the device: each
one stalls the step. Counted on CPU by following where host-born tensors go, every registered optimizer's step
makes a fixed number of them, however many parameters it updates."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.helpers import TINY, job_config, set_synthetic_grads, tiny_model
from torchtitan.optim import build_optimizers
from torchtitan.optim.state.storage import is_quantized

aten = torch.ops.aten
# Ops that make a tensor from Python data on the host.
_FROM_HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.scalar_tensor.default}


class HostToDeviceCopies(TorchDispatchMode):
    """Counts the host-to-device copies a step would make on a GPU.

    Host tensors are those made from Python data without a device, the ``host`` tensors given (optimizer step
    counts: CPU tensors on a GPU too) and whatever is computed from host tensors alone. A host tensor moved with an
    explicit device (``.to(device)``, ``torch.tensor(..., device=...)``), or entering an op together with other
    tensors other than as a 0-d scalar (which torch reads on the host, as a kernel argument), is one copy, once:
    from then on it is on the device. On CPU a move to the device returns the tensor
    itself, so the moves are followed where they are asked for, in ``torch.Tensor.to`` and ``torch.tensor``."""

    def __init__(self, host: list[torch.Tensor]):
        super().__init__()
        self.host = {id(t): t for t in host}  # kept alive, so that ids stay unique
        self.copies = 0
        self._originals = {}

    def _moved(self, *tensors: torch.Tensor) -> None:
        if any(id(t) in self.host for t in tensors):
            self.copies += 1
        for t in tensors:
            self.host.pop(id(t), None)

    def __enter__(self):
        original_to, original_tensor = torch.Tensor.to, torch.tensor
        self._originals = {"to": original_to, "tensor": original_tensor}
        counter = self

        def to(tensor, *args, **kwargs):
            out = original_to(tensor, *args, **kwargs)
            if "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args):
                counter._moved(tensor, out)
            return out

        def tensor(*args, **kwargs):
            out = original_tensor(*args, **kwargs)
            if kwargs.get("device") is not None:
                counter._moved(out)
            return out

        torch.Tensor.to, torch.tensor = to, tensor
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.to, torch.tensor = self._originals["to"], self._originals["tensor"]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        host = [key for key in inputs if key in self.host]
        if func in _FROM_HOST_DATA or (inputs and len(host) == len(inputs)):
            self.host.update({id(t): t for t in tree_leaves(out) if isinstance(t, torch.Tensor)})
        else:
            # A 0-d host tensor beside device tensors is read on the host as a kernel argument: no copy.
            moved = [key for key in host if inputs[key].dim() > 0]
            self.copies += len(moved)
            for key in moved:
                del self.host[key]
        return out


def copies_per_step(name: str, layers: int, *options: str) -> int:
    args = dataclasses.replace(TINY, dim=64, n_layers=layers, multiple_of=64)  # 64 x 64 weights: quantized state
    model = tiny_model(args, dtype=torch.float32)
    optimizer = build_optimizers([model], job_config("--optimizer.name", name, *options)).optimizers[0]
    quantized = "bit" in name or "Fp8" in name
    with torch.compiler.set_stance("force_eager"):  # compiled steps run op by op, so the mode sees every op
        for step in range(2):  # the first step makes the state
            set_synthetic_grads(model, step)
            optimizer.step()
        set_synthetic_grads(model, 2)
        steps = [state["step"] for state in optimizer.state.values() if isinstance(state.get("step"), torch.Tensor)]
        lrs = [group["lr"] for group in optimizer.param_groups if isinstance(group["lr"], torch.Tensor)]
        with HostToDeviceCopies(steps + lrs) as counter:
            optimizer.step()
    assert not quantized or any(
        is_quantized(state["exp_avg" if "exp_avg" in state else "m"]) for state in optimizer.state.values()
    )
    return counter.copies


# Quantized state in blocks that divide the test model's rows (64 wide), so that its matrices are quantized.
SMALL_BLOCKS = ("--optimizer.block_size", "64")
VARIANTS = [
    ("AdamW",),
    ("AdamW", "--optimizer.state_dtype", "bfloat16"),
    ("Adam",),
    ("AdamMini", "--optimizer.implementation", "foreach"),
    ("AdamMini", "--optimizer.implementation", "fused"),
    ("AdamMini8bit", "--optimizer.implementation", "fused", *SMALL_BLOCKS),
    ("AdamMini4bit", "--optimizer.implementation", "fused", *SMALL_BLOCKS),
    ("AdamMini8bit", "--optimizer.implementation", "foreach", *SMALL_BLOCKS),
    ("AdamW8bit", *SMALL_BLOCKS),
    ("AdamW4bit", *SMALL_BLOCKS),
    ("AdamWFp8", *SMALL_BLOCKS),
    ("Muon",),
    ("Muon", "--optimizer.state_dtype", "bfloat16"),
    ("NorMuon",),
    ("AdEMAMix",),
    ("SOAP",),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: " ".join(v).replace("--optimizer.", ""))
def test_host_to_device_copies_per_step_do_not_grow_with_the_parameters(variant):
    name, *options = variant
    few, many = copies_per_step(name, 1, *options), copies_per_step(name, 3, *options)
    assert many == few, f"{few} host-to-device copies a step with 1 layer, {many} with 3"
