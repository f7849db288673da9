"""All-reduce and all-gather among the ranks of one process group that share a host, through shared memory.

On CPU, megatron's tensor-parallel collectives go through gloo, which moves every tensor over loopback TCP: on
the 2-core box a 0.4 MB all-reduce takes ~1.2 ms and a 4-byte one ~0.12 ms, and a TP=2 step of the quickstart
made ~150 of them (a third of its step time; benchmarks/results/step_time_megatron.md). Ranks on one host can
instead each copy their tensor into a shared buffer, post a sequence number, wait for their peers' and read
the buffers: a memory copy and a sum, as vLLM's CPU backend and DeepSpeed's CPU inference do for their tensor
parallelism.

Every rank adds the buffers in rank order, so all ranks get bit-identical results (for two ranks the same
bits as gloo's sum: a + b == b + a). Two buffer sets alternate by sequence number: a rank reuses a set only
after every peer posted the next number, which each posts after it finished reading the set. Tensors larger
than a buffer go through in chunks. The posting relies on the host's stores becoming visible in program order
(x86's TSO); `HostGroup.create` returns None on other machines, when the group spans hosts or when the shared
memory cannot be reserved, and the caller stays on the process group.
"""

from __future__ import annotations

import os
import platform
import socket
import tempfile
import time

import torch
import torch.distributed as dist
from torch import Tensor

SLOT_BYTES = 8 * 2**20  # per rank and buffer set: 32 MiB of shared memory for a group of 2
LINE = 8  # int64 per counter: one 64-byte cache line each, so posting does not invalidate a peer's line
TIMEOUT_S = 1800.0  # gloo's default collective timeout: a peer that never posts is dead or hung
OPS = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}


class HostGroup:
    """In-place `all_reduce` and `all_gather` for the ranks of one process group, all on this host."""

    def __init__(self, memory: Tensor, rank: int, size: int):
        self.rank, self.size, self.seq = rank, size, 0
        self.counters = memory[: size * LINE * 8].view(torch.int64)[::LINE]
        data = memory[size * LINE * 8 :]
        self.sets = [[data[(s * size + r) * SLOT_BYTES :][:SLOT_BYTES] for r in range(size)] for s in (0, 1)]

    @classmethod
    def create(cls, group: dist.ProcessGroup) -> HostGroup | None:
        """Collective over `group`: map one shared file (unlinked once every rank has it, so nothing outlives
        the processes). None where shared memory cannot serve the group."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        hosts: list = [None] * size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if size == 1 or len(set(hosts)) > 1 or platform.machine().lower() not in ("x86_64", "amd64"):
            return None
        nbytes = size * LINE * 8 + 2 * size * SLOT_BYTES
        name: list = [None]
        if rank == 0:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="yatt-collectives-", dir=shm)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve it now: a full tmpfs would SIGBUS on first touch
                name[0] = path
            except OSError:
                os.unlink(path)
            finally:
                os.close(fd)
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
        if name[0] is None:
            return None
        memory = torch.from_file(name[0], shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(name[0])
        return cls(memory, rank, size)

    @staticmethod
    def serves(tensor: Tensor) -> bool:
        return tensor.is_contiguous() and tensor.device.type == "cpu"

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
        """Reduce `tensor` (contiguous, on CPU) over the group in place, every rank in rank order."""
        combine, flat = OPS[op], tensor.view(-1)
        for chunk in self._chunks(flat):
            slots = self._exchange(chunk)
            combine(slots[0], slots[1], out=chunk)
            for slot in slots[2:]:
                combine(chunk, slot, out=chunk)
        return tensor

    def all_gather(self, outputs: list[Tensor], tensor: Tensor) -> None:
        """outputs[r] = rank r's `tensor` (each contiguous, of its shape and dtype)."""
        start = 0
        for chunk in self._chunks(tensor.view(-1)):
            for out, slot in zip(outputs, self._exchange(chunk)):
                out.view(-1)[start : start + chunk.numel()].copy_(slot)
            start += chunk.numel()

    def _chunks(self, flat: Tensor) -> list[Tensor]:
        return list(flat.split(max(1, SLOT_BYTES // flat.element_size()))) or [flat]

    def _exchange(self, chunk: Tensor) -> list[Tensor]:
        """Post this rank's chunk; return every rank's, as views of the shared buffers (valid until the call
        after next)."""
        self.seq += 1
        nbytes = chunk.numel() * chunk.element_size()
        slots = [s[:nbytes].view(chunk.dtype) for s in self.sets[self.seq % 2]]
        slots[self.rank].copy_(chunk)
        self.counters[self.rank] = self.seq
        start, spins = time.monotonic(), 0
        while int(self.counters.min()) < self.seq:
            spins += 1
            if spins % 64 == 0:  # more ranks than cores (tests): let the peer we wait for run
                os.sched_yield()
                if time.monotonic() - start > TIMEOUT_S:
                    raise RuntimeError(
                        f"host collectives: rank {self.rank} waited {TIMEOUT_S:.0f} s for its peers "
                        f"(call {self.seq}); a peer died or the ranks run different collectives"
                    )
        return slots
