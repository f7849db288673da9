"""State -> host-memory snapshot, and back.

A component's state is a nested tree of dicts, lists, tuples, scalars, tensors and numpy arrays (an
optimizer state dict, RNG states, a data cursor). `snapshot` splits it into a flat {name: tensor}
dict, written with safetensors, and a JSON tree in which each tensor is a reference by name. Nothing
is pickled, so loading a checkpoint cannot run code.

The tensors are *copies*: training mutates parameters and optimizer state in place while the
background writer still reads the snapshot. On GPU the copies go to pinned host memory with
non_blocking transfers and one synchronize at the end, so the stall is one device->host copy.

A DTensor sharded on dim 0 (FSDP2) is saved as the rank's rows plus the whole tensor's row count, so that
yatt.checkpoint.resume can cut it again for another number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from yatt.distributed import dim0_shard, is_dtensor

TENSOR, ARRAY, TUPLE, ITEMS, ROWS = "__tensor__", "__ndarray__", "__tuple__", "__items__", "rows"


def chunk_rows(total: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [start, end) of a `total`-row tensor that rank `rank` of `world` holds when it is sharded on dim 0
    as FSDP2 does it (torch.chunk: ceil(total / world) rows a rank, the last ranks fewer or none)."""
    size = -(-total // world)
    return min(rank * size, total), min((rank + 1) * size, total)


def _row_shard(t: torch.Tensor, path: str) -> tuple[torch.Tensor, int]:
    """A DTensor sharded on dim 0 over a 1-D mesh (FSDP2's parameters and moments): (this rank's rows, the whole
    tensor's rows). Saved as its rows, so a resume on another number of ranks can cut it again."""
    shard = dim0_shard(t)
    if shard is None:
        raise TypeError(f"checkpoint state at {path!r} is a DTensor placed {t.placements} on a "
                        f"{t.device_mesh.ndim}-D mesh; only dim-0 shards over a 1-D mesh are saved")  # fmt: skip
    local, total, rank, size = shard
    start, end = chunk_rows(total, rank, size)
    if local.shape[0] != end - start:  # a layout other than torch.chunk's could not be cut again on resume
        raise TypeError(f"checkpoint state at {path!r}: this rank holds {local.shape[0]} rows of {total}, expected "
                        f"{end - start}")  # fmt: skip
    return local, total


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
    if isinstance(obj, torch.Tensor) and is_dtensor(obj):
        local, total = _row_shard(obj, path)
        tensors[path] = _host_copy(local)
        return {TENSOR: path, ROWS: total}
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


class Tensors(Protocol):
    """Where a tree's tensors are read from: one rank's file, or (resharding) every saved rank's."""

    def __getitem__(self, name: str) -> torch.Tensor: ...
    def rows(self, name: str, total: int) -> torch.Tensor: ...


def _decode(obj: Any, tensors: Tensors | dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if TENSOR in obj:
        if ROWS in obj and not isinstance(tensors, dict):
            return tensors.rows(obj[TENSOR], obj[ROWS])
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


def restore(tree: dict[str, Any], tensors: Tensors | dict[str, torch.Tensor]) -> dict[str, Any]:
    """The component states of a snapshot read back from disk (a dict: one rank's tensors, as saved)."""
    return {name: _decode(state, tensors) for name, state in tree.items()}
