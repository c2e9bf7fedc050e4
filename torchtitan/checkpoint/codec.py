"""Plain data <-> JSON bytes, for checkpointed state that is not tensors (schedulers, data-loader position, train
state).

JSON alone would silently turn tuples into lists and int keys into strings, so those (and small tensors such as a
sampler's generator state) are written as tagged objects and restored exactly. Decoding builds only plain data and
plain tensors: nothing in a checkpoint can name a class or a function to run.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import torch

_TAGS = ("__tuple__", "__items__", "__tensor__", "__bytes__")


def encode_plain(value: Any) -> bytes:
    """Plain Python data (dict, list, tuple, str, int, float, bool, None, bytes, small tensors) as JSON bytes."""
    return json.dumps(_to_json(value, "state"), separators=(",", ":")).encode("utf-8")


def decode_plain(data: bytes) -> Any:
    """The inverse of :func:`encode_plain`."""
    return _from_json(json.loads(data.decode("utf-8")))


def _to_json(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_to_json(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        looks_tagged = len(value) == 1 and next(iter(value)) in _TAGS
        if all(isinstance(k, str) for k in value) and not looks_tagged:
            return {k: _to_json(v, f"{path}.{k}") for k, v in value.items()}
        return {"__items__": [[_to_json(k, f"{path}.<key>"), _to_json(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, torch.Tensor) and not value.is_complex() and type(value) is torch.Tensor:
        tensor = value.detach().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        return {"__tensor__": {"dtype": dtype, "shape": list(tensor.shape), "values": tensor.flatten().tolist()}}
    raise TypeError(
        f"{path} is a {type(value).__name__}; checkpointed non-model state must be plain data "
        "(dict, list, tuple, str, int, float, bool, None, bytes or a plain tensor)"
    )


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "__tuple__":
            return tuple(_from_json(v) for v in body)
        if tag == "__items__":
            return {_from_json(k): _from_json(v) for k, v in body}
        if tag == "__bytes__":
            return base64.b64decode(body)
        if tag == "__tensor__":
            dtype = getattr(torch, body["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown tensor dtype {body['dtype']!r} in checkpoint")
            return torch.tensor(body["values"], dtype=dtype).reshape(body["shape"])
    return {k: _from_json(v) for k, v in value.items()}
