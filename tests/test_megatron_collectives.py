"""yatt.trainers.megatron_collectives and megatron_compat's patch 5: shared-memory all-reduce / all-gather among the
ranks of a group on one host give gloo's results bit for bit, in chunks past a buffer, and only on the
registered group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")


def _worker(rank: int, size: int, tmp: str) -> None:
    from yatt.trainers import megatron_collectives as hc
    from yatt.trainers import megatron_compat as compat

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=size)
    gloo_all_reduce, gloo_all_gather = dist.all_reduce, dist.all_gather
    group = dist.new_group(list(range(size)))
    hc.SLOT_BYTES = 4096  # small buffers: the 10,000-float tensors below go through in chunks
    compat.use_host_collectives(group)
    host = compat._HOST[group]
    checks = {"served": host is not None, "patched": dist.all_reduce is not gloo_all_reduce}

    torch.manual_seed(rank)
    for shape, dtype in (((3,), torch.float32), ((100, 100), torch.float32), ((7, 5), torch.bfloat16)):
        x = torch.randn(shape).to(dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            mine, reference = x.clone(), x.clone()
            handle = dist.all_reduce(mine, op=op, group=group, async_op=True)
            handle.wait()
            gloo_all_reduce(reference, op=op)
            name = f"reduce {tuple(shape)} {dtype} {op}"
            if size == 2 or op != dist.ReduceOp.SUM:
                checks[name] = torch.equal(mine, reference)
            else:  # gloo adds 3 ranks' tensors in another order; every rank must still get the same bits
                checks[name] = torch.allclose(mine.float(), reference.float(), rtol=1e-2, atol=1e-2)
                checks[f"{name} bits"] = mine.float().view(-1).tolist()
        outs = [torch.empty_like(x) for _ in range(size)]
        reference = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(outs, x, group=group)
        gloo_all_gather(reference, x)
        checks[f"gather {tuple(shape)} {dtype}"] = all(map(torch.equal, outs, reference))
    # the default group is not registered: its calls go to gloo unchanged
    y = torch.full((4,), float(rank + 1))
    dist.all_reduce(y)
    checks["default group"] = y.tolist() == [size * (size + 1) / 2] * 4
    # a non-contiguous tensor falls back to gloo
    z = torch.arange(12.0).reshape(3, 4).t()
    dist.all_reduce(z, group=group)
    checks["non-contiguous"] = torch.equal(z, torch.arange(12.0).reshape(3, 4).t() * size)
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(checks, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_host_collectives_equal_gloo_bit_for_bit(tmp_path, size):
    shm = Path("/dev/shm")
    before = set(shm.glob("yatt-collectives-*"))
    mp.spawn(_worker, args=(size, str(tmp_path)), nprocs=size, join=True)
    first_bits = None
    for rank in range(size):
        checks = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert checks.pop("served") and checks.pop("patched")
        bits = {name: checks.pop(name) for name in list(checks) if name.endswith(" bits")}
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, (rank, failed)
        assert rank == 0 or bits == first_bits  # the same result on every rank
        first_bits = first_bits if rank else bits
    assert set(shm.glob("yatt-collectives-*")) == before  # unlinked once mapped
