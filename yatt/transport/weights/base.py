"""The interface of a weight transport, and how the ones this box cannot test would plug in.

A transport is a class with two sides:

- the sending side, one instance per engine client (`yatt.engines.client.EngineClient`): `begin(buckets)` opens
  a sync, given its buckets as meta tensors in the dtypes they travel in (``shm`` sizes its segment for the
  largest); `pack(bucket, cast)` turns one bucket of Hugging Face-named tensors into the keyword arguments of one
  ``update_weights`` RPC (``{"transport": name, ...}``), each tensor cast to ``cast(tensor)``; what it returns,
  and the buffers it points to, stay valid until the next `pack`, `finish` or `close`. `finish()` ends a sync
  (all buckets sent): it frees what only a sync needs (``shm`` keeps its segment for the next sync). `close()`
  frees everything; it must be safe to call twice.
- the receiving side, `unpack(payload)`, a static context manager the engine service
  (`yatt.engines.server.EngineService.update_weights`) enters with the RPC's keyword arguments: it checks the
  payload whole (names, dtypes, shapes, and that every tensor lies inside what was sent) before yielding
  ``[(name, tensor), ...]``, so that a malformed update is refused before the engine copies anything. The
  tensors are valid inside the ``with`` block only: an engine that keeps one past its ``update_weights`` call
  copies it (`yatt.engines.vllm_lora.ServedAdapter` does). The engine's own check of names against its
  parameters then runs, also before any copy (`yatt.engines.hf_engine.HFEngine.update_weights`).

The RPC message itself stays authenticated and encrypted whatever the transport; a transport that moves the
bytes outside it must keep them where only the run's user can read them (``shm``: owner-only files).

Not built (no GPU here), and how each would plug in behind the same two sides:

- ``cuda_ipc`` (trainer and engine on the same GPU, colocated): `pack` would keep one device buffer per bucket
  (cast tensors copied in, as ``shm`` does on the host) and send its CUDA IPC handle
  (``torch.multiprocessing.reductions.reduce_tensor(buffer)``: the handle bytes, offset and size, plus the event
  handle of the copy) with the same per-tensor name/dtype/shape/offset list as ``shm``; `unpack` would rebuild
  the buffer in the engine (``rebuild_cuda_tensor``), wait on the event, and yield views. The sender must keep
  the buffer alive until the engine has answered (it does: `pack` is called again only after the RPC returns),
  and `finish` frees it. ``auto`` would choose it when the client's tensors and the engine are on the same
  device (the engine's health reports its device). `scripts/gpu_check_weight_sync.py` measures the IPC step alone.
- ``nccl`` (engines on other GPUs or nodes): a process group of the trainer rank and its engines built once
  (``torch.distributed`` with a TCP store the engine joins at startup; the engine is not a torchrun rank, so a
  separate group, never the default one). `pack` would send a descriptor (names, dtypes, shapes, a sync id)
  over the RPC and then broadcast one flat buffer from the trainer rank; `unpack` would receive it into a
  device buffer of the described size and yield views. The RPC call returns only after the broadcast, so the
  client must post the RPC and broadcast concurrently (a thread), and a dead engine must not hang the trainer
  in the collective: a timeout on the group, and the engine restarted as today.

Both keep the contract above: check before copy, tensors valid inside the ``with`` only, one bucket per RPC.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from yatt.tensors import NamedTensors

# tensor -> the dtype the engine keeps it in (floats in the engine's dtype; exact scalars stay float64)
Cast = Callable[[torch.Tensor], torch.dtype]


class WeightTransport(Protocol):
    name: str

    def begin(self, buckets: list[NamedTensors]) -> None: ...

    def pack(self, bucket: NamedTensors, cast: Cast) -> dict[str, Any]: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...

    @staticmethod
    def unpack(payload: dict[str, Any]) -> AbstractContextManager[NamedTensors]: ...
