"""The torchrun world as the controllers see it: rank, size, device, and small metadata reductions."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Sum a few numbers over ranks (metadata only: counts, losses, timings)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.size > 1:
            dist.all_reduce(t)
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def broadcast_object(self, obj):
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def publish(self, key: str, value: str) -> None:
        """Put a small string in torchrun's key-value store (e.g. a service endpoint) for all ranks."""
        if self.size > 1:
            _store().set(f"yatt/{key}", value)
        else:
            _LOCAL_STORE[key] = value

    def lookup(self, key: str) -> str:
        """The value published under `key`, waiting for it if need be."""
        if self.size > 1:
            return _store().get(f"yatt/{key}").decode()
        return _LOCAL_STORE[key]


_LOCAL_STORE: dict[str, str] = {}


def _store():
    # The default group's store is the one torchrun set up (MASTER_ADDR:MASTER_PORT), reachable by all ranks
    # on all nodes; using it means endpoints need no configuration.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def env_rank() -> int:
    """This process's rank as torchrun announces it (0 when run without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def init_world(timeout_s: float = 1800) -> World:
    """Join torchrun's process group (gloo on CPU, NCCL on GPU); a plain `python` run is a world of one."""
    rank, size = env_rank(), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return World(rank, size, local_rank, device)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
