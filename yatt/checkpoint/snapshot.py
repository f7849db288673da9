"""State -> host-memory snapshot, and back.

A component's state is a nested tree of dicts, lists, tuples, scalars, tensors and numpy arrays (an
optimizer state dict, RNG states, a data cursor). `snapshot` splits it into a flat {name: tensor}
dict, written with safetensors, and a JSON tree in which each tensor is a reference by name. Nothing
is pickled, so loading a checkpoint cannot run code.

The tensors are *copies*: training mutates parameters and optimizer state in place while the
background writer still reads the snapshot. On GPU the copies go to pinned host memory with
non_blocking transfers and one synchronize at the end, so the stall is one device->host copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

TENSOR, ARRAY, TUPLE, ITEMS = "__tensor__", "__ndarray__", "__tuple__", "__items__"


@dataclass
class Snapshot:
    """One rank's part of a checkpoint, in host memory: tensors plus a JSON-able tree referring to them."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tree: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = _host_copy(obj)
        return {TENSOR: path}
    if isinstance(obj, np.ndarray):  # e.g. numpy's MT19937 key; stored as int64/float64 + its dtype
        wide = obj.astype(np.int64 if obj.dtype.kind in "iub" else np.float64)
        tensors[path] = torch.from_numpy(np.ascontiguousarray(wide))
        return {ARRAY: path, "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in obj.items()}
        # optimizer states are keyed by parameter index: keep the int keys instead of JSON's strings
        return {ITEMS: [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"checkpoint state at {path!r} has type {type(obj).__name__}, which is not saved "
        "(use tensors, numpy arrays, dicts, lists, tuples or scalars)"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if TENSOR in obj:
        return tensors[obj[TENSOR]]
    if ARRAY in obj:
        return tensors[obj[ARRAY]].numpy().astype(np.dtype(obj["dtype"]))
    if TUPLE in obj:
        return tuple(_decode(v, tensors) for v in obj[TUPLE])
    if ITEMS in obj:
        return {k: _decode(v, tensors) for k, v in obj[ITEMS]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def snapshot(components: dict[str, Any]) -> Snapshot:
    """Copy named component states to host memory (blocking only for the copy)."""
    snap = Snapshot()
    snap.tree = {name: _encode(state, name, snap.tensors) for name, state in components.items()}
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the non_blocking copies must have landed before the writer reads them
    return snap


def restore(tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The component states of a snapshot read back from disk."""
    return {name: _decode(state, tensors) for name, state in tree.items()}
