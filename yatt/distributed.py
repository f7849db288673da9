"""The torchrun world as the controllers see it: rank, size, device, and every collective yatt issues.

The rule: **metadata travels as CPU tensors through gloo; model tensors travel on the device through NCCL (DDP).**
This module is the only one that calls torch.distributed collectives or point-to-point ops (the trainer's DDP
wrapper aside), so the rule is kept in one place and tested there (tests/test_collectives.py).

Why: NCCL rejects CPU tensors, and the controllers' traffic is small metadata (counts, losses, timings,
token lengths, the samples load balancing moves, pickled objects) that lives on the host. Copying it to
the GPU for every reduction would cost a device sync each time and put controller data on the device the
trainer and engines fight over. So on GPU machines the process group is built with one backend per device
type, `init_process_group("cpu:gloo,cuda:nccl")`: torch dispatches each op by its tensors' device, so a CPU
tensor goes through gloo and DDP's CUDA gradient buckets through NCCL, on the same group and ranks. Every
World op below builds its tensors on the CPU and refuses device tensors. Object collectives are given
`device=cpu` explicitly (torch would also pick cpu for a group with a cpu backend, see
`_get_object_coll_device`), and the barrier is an all-reduce of a CPU tensor, because `dist.barrier`
goes through NCCL once the group is bound to a GPU (`init_process_group(device_id=...)`, which init_world
therefore does not pass).

Under torchrun the group exists even for one process, and World issues its collectives whenever a group
exists, so a one-GPU run exercises the same gloo path as a multi-GPU one (and
scripts/gpu_check_collectives.py a DDP step over NCCL beside it). A plain `python` run
without torchrun is a group-less world of one, and every op is local.

A data-parallel view (`data_parallel_world`): with a trainer that splits the model over tensor/pipeline
parallel ranks, the ranks of one model-parallel group are one data-parallel rank. The view's rank and size
are the data-parallel ones and its collectives run over a process group of the ranks that share this
rank's model-parallel coordinates (one such group per coordinate, all computing the same values), so data
sharding, global denominators and metric sums count every data-parallel rank once.

`YATT_RECORD_COLLECTIVES=<dir>` makes each rank append one JSON line per issued op (which World call, the
torch op, its tensors' device/dtype/shape) to `<dir>/rank<r>.jsonl`, so a CPU run can prove what a GPU run
would send where.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RECORD_ENV = "YATT_RECORD_COLLECTIVES"
_CPU = torch.device("cpu")


def backend_for(cuda_available: bool) -> str:
    """The process-group backend: gloo alone on CPU; gloo for CPU tensors and NCCL for CUDA ones on GPU."""
    return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"


def launched_by_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    """True under torchrun (or any launcher that sets the env:// rendezvous variables)."""
    return "MASTER_ADDR" in env or "WORLD_SIZE" in env or any(k.startswith("TORCHELASTIC_") for k in env)


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def _host(t: torch.Tensor, call: str) -> torch.Tensor:
    if t.device.type != "cpu":
        raise ValueError(f"World.{call} takes CPU tensors (metadata goes through gloo), got one on {t.device}")
    return t.contiguous()


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device
    # a data-parallel view (data_parallel_world): the process group its ops use and its members' global
    # ranks, by view rank; None: the whole torchrun world
    group: Any = None
    members: tuple[int, ...] | None = None

    def global_rank(self, rank: int) -> int:
        """The torchrun rank of this world's `rank` (the same number unless this is a view)."""
        return rank if self.members is None else self.members[rank]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def grouped(self) -> bool:
        """Whether ops go over a process group (any torchrun launch, even of one process)."""
        return self.size > 1 or _grouped()

    # ---- reductions of a few numbers ---------------------------------------------------------------
    def sum(self, values: list[float]) -> list[float]:
        """Sum a few numbers over ranks (metadata only: counts, losses, timings)."""
        return self._all_reduce("sum", values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._all_reduce("max", values, dist.ReduceOp.MAX)

    def _all_reduce(self, call: str, values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.grouped:
            self._record(call, "all_reduce", [t], reduce=call)
            dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    # ---- tensors of metadata ----------------------------------------------------------------------
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's CPU tensor, by rank. The first dimension may differ between ranks (e.g. per-sample
        lengths); the other dimensions and the dtype must not."""
        t = _host(t, "all_gather")
        if not self.grouped:
            return [t.clone()]
        count = torch.tensor([t.shape[0]], dtype=torch.int64)
        counts = [torch.zeros_like(count) for _ in range(self.size)]
        self._record("all_gather", "all_gather", [count])
        dist.all_gather(counts, count, group=self.group)
        width = max(1, max(int(c) for c in counts))  # no empty collectives
        padded = torch.zeros((width, *t.shape[1:]), dtype=t.dtype)
        padded[: t.shape[0]] = t
        gathered = [torch.zeros_like(padded) for _ in range(self.size)]
        self._record("all_gather", "all_gather", [padded])
        dist.all_gather(gathered, padded, group=self.group)
        return [g[: int(c)] for g, c in zip(gathered, counts)]

    def exchange(
        self, sends: Mapping[int, Sequence[torch.Tensor]], recvs: Mapping[int, Sequence[torch.Tensor]]
    ) -> None:
        """Point to point: send `sends[peer]` to each peer and fill the buffers `recvs[peer]` from it.

        The i-th tensor a rank sends to a peer lands in the peer's i-th buffer for that rank (same shape
        and dtype: receivers size buffers from metadata they already agree on). All transfers run at once
        (gloo has no all_to_all) and are finished on return. Every rank must call it at the same point.
        """
        for peer in (*sends, *recvs):
            if peer == self.rank or not 0 <= peer < self.size:
                raise ValueError(f"rank {self.rank} cannot exchange with rank {peer} (world of {self.size})")
        requests = []
        for peer, tensors in sends.items():
            for tag, t in enumerate(tensors):
                t = _host(t, "exchange")
                self._record("exchange", "send", [t], peer=peer)
                requests.append(dist.isend(t, self.global_rank(peer), tag=tag))
        for peer, buffers in recvs.items():
            for tag, t in enumerate(buffers):
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError(f"World.exchange receives into contiguous CPU buffers, got {t.device}")
                self._record("exchange", "recv", [t], peer=peer)
                requests.append(dist.irecv(t, self.global_rank(peer), tag=tag))
        for request in requests:
            request.wait()

    # ---- objects, barrier -------------------------------------------------------------------------
    def broadcast_object(self, obj):
        """Rank 0's picklable object on every rank (small things: a token, a resume decision)."""
        if not self.grouped:
            return obj
        box = [obj]
        # torch broadcasts the pickled sizes (int64) and bytes (uint8) as tensors on `device`
        self._record("broadcast_object", "broadcast", [_desc(_CPU, torch.int64, [1]), _desc(_CPU, torch.uint8, [-1])])
        dist.broadcast_object_list(box, src=self.global_rank(0), group=self.group, device=_CPU)
        return box[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable object, by rank (a model-parallel group's share of the rollouts)."""
        if not self.grouped:
            return [obj]
        out = [None] * self.size
        self._record("all_gather_object", "all_gather", [_desc(_CPU, torch.int64, [1]), _desc(_CPU, torch.uint8, [-1])])
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @property
    def backend(self) -> str:
        """The process group's backends per device type (e.g. "cpu:gloo,cuda:nccl"), or "none"."""
        return dist.get_backend_config() if _grouped() else "none"

    def barrier(self) -> None:
        if self.grouped:
            t = torch.zeros(1, dtype=torch.int32)
            self._record("barrier", "all_reduce", [t], reduce="sum")
            dist.all_reduce(t, group=self.group)

    # ---- the key-value store ----------------------------------------------------------------------
    def publish(self, key: str, value: str) -> None:
        """Put a small string in torchrun's key-value store (e.g. a service endpoint) for all ranks."""
        if _grouped():
            _store().set(f"yatt/{key}", value)
        else:
            _LOCAL_STORE[key] = value

    def lookup(self, key: str) -> str:
        """The value published under `key`, waiting for it if need be."""
        if _grouped():
            return _store().get(f"yatt/{key}").decode()
        return _LOCAL_STORE[key]

    def _record(self, call: str, op: str, tensors: list, **extra: Any) -> None:
        folder = os.environ.get(RECORD_ENV)
        if not folder:
            return
        entry = {
            "call": call,
            "op": op,
            "tensors": [t if isinstance(t, dict) else _desc(t.device, t.dtype, list(t.shape)) for t in tensors],
            **extra,
        }
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / f"rank{self.rank}.jsonl", "a") as f:  # a line per op: survives a crash
            f.write(json.dumps(entry) + "\n")


def _desc(device: torch.device, dtype: torch.dtype, shape: list[int]) -> dict:
    return {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "shape": shape}


_LOCAL_STORE: dict[str, str] = {}


def _store():
    # The default group's store is the one torchrun set up (MASTER_ADDR:MASTER_PORT), reachable by all ranks
    # on all nodes; using it means endpoints need no configuration.
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def store_client(timeout_s: float):
    """A connection of this process's own to torchrun's key-value store (MASTER_ADDR:MASTER_PORT), beside the
    default group's: that client serialises every op, so a long blocking `get` on it would stall a thread that
    must keep beating (yatt.peers)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def is_dtensor(t: torch.Tensor) -> bool:
    # A DTensor exists only once its module is loaded, and loading it takes seconds: a process that never made
    # one (every backend but FSDP2) must not pay that at its first checkpoint just to be told no.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def dim0_shard(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """A DTensor sharded on dim 0 over a 1-D mesh (FSDP2's parameters and moments): (this rank's rows, the whole
    tensor's rows, this rank's place on the mesh, the mesh's size); None for any other placement. A local view:
    no collective."""
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    if mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        return None
    return t.to_local(), t.shape[0], mesh.get_local_rank(), mesh.size()


def data_parallel_world(world: World, tensor_parallel: int, pipeline_parallel: int) -> World:
    """The data-parallel view of `world` when the model is split TP x PP, with megatron-core's rank order
    (tensor-parallel ranks adjacent, then data-parallel, then pipeline stages):
    rank = tp_rank + TP * (dp_rank + DP * pp_rank). Collective: every rank builds every group."""
    split = tensor_parallel * pipeline_parallel
    if split == 1:
        return world
    if world.size % split:
        raise ValueError(f"tensor_parallel x pipeline_parallel = {split} does not divide {world.size} ranks")
    dp = world.size // split
    mine = None
    for pp_rank in range(pipeline_parallel):
        for tp_rank in range(tensor_parallel):
            members = tuple(tp_rank + tensor_parallel * (d + dp * pp_rank) for d in range(dp))
            group = dist.new_group(list(members), backend="gloo") if _grouped() else None
            if world.rank in members:
                mine = (members, group)
    members, group = mine
    return World(members.index(world.rank), dp, world.local_rank, world.device, group, members)


def own_group(world: World) -> World:
    """`world`'s ranks over a process group of their own, for a thread whose collectives must never interleave
    with the main thread's on `world` (an ahead schedule's producer). Collective: every rank of `world` calls it."""
    members = tuple(world.global_rank(r) for r in range(world.size))
    group = dist.new_group(list(members), backend="gloo") if _grouped() else None
    return World(world.rank, world.size, world.local_rank, world.device, group, members)


def model_parallel_world(world: World, tensor_parallel: int, pipeline_parallel: int) -> World | None:
    """The view of the ranks that hold one copy of the model together (the ranks of one data-parallel rank, in
    torchrun order), or None when each rank holds the whole model. They generate a data-parallel rank's prompts
    between them (yatt.controllers.generation.GroupShare). Collective: every rank builds every group."""
    split = tensor_parallel * pipeline_parallel
    if split == 1:
        return None
    dp = world.size // split
    mine = None
    for d in range(dp):
        members = tuple(
            sorted(t + tensor_parallel * (d + dp * p) for p in range(pipeline_parallel) for t in range(tensor_parallel))
        )
        group = dist.new_group(list(members), backend="gloo") if _grouped() else None
        if world.rank in members:
            mine = (members, group)
    members, group = mine
    return World(members.index(world.rank), split, world.local_rank, world.device, group, members)


def env_rank() -> int:
    """This process's rank as torchrun announces it (0 when run without torchrun)."""
    return int(os.environ.get("RANK", "0"))


def init_world(timeout_s: float = 1800) -> World:
    """Join torchrun's process group (see the module docstring); a plain `python` run is a world of one."""
    rank, size = env_rank(), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else _CPU
    if (size > 1 or launched_by_torchrun()) and not dist.is_initialized():
        # No device_id: binding the group to a GPU would make dist.barrier and eager init go through NCCL.
        dist.init_process_group(backend_for(cuda), timeout=timedelta(seconds=timeout_s))
    return World(rank, size, local_rank, device)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
