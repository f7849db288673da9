"""GPU check of the process group yatt builds: under torchrun it is `cpu:gloo,cuda:nccl` on GPU machines, and
every World op (metadata on the CPU, gloo) and a DDP step (gradients on the device, NCCL) run on it in one job;
an engine child would see only this rank's GPU.

    torchrun --nproc_per_node N scripts/gpu_check_collectives.py     # N = 1 is enough to exercise both backends

Each rank checks the answers of World's ops (reductions, a ragged all-gather, a ring exchange, an object
broadcast, a barrier) and that DDP averaged the gradients of different inputs; rank 0 prints one JSON report.
Exits 1 if a check fails. On CPU the same runs over gloo alone (the suite does that).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.distributed_c10d import Backend, BackendConfig  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from yatt.distributed import backend_for, close_world, init_world  # noqa: E402
from yatt.engines.client import engine_env  # noqa: E402
from yatt.engines.config import EngineConfig  # noqa: E402


def run_checks() -> dict[str, bool]:
    world = init_world(timeout_s=120)
    r, n, cuda = world.rank, world.size, world.device.type == "cuda"
    checks = {
        "group exists under torchrun": dist.is_initialized() and world.grouped,
        "backends as chosen": str(dist.get_backend_config()) == str(BackendConfig(Backend(backend_for(cuda)))),
    }
    checks["sum"] = world.sum([1.0, float(r)]) == [float(n), float(n * (n - 1) // 2)]
    checks["max"] = world.max([float(r)]) == [float(n - 1)]
    gathered = world.all_gather(torch.full((r, 2), r, dtype=torch.int64))  # rank r holds r rows
    checks["ragged all_gather"] = [g.tolist() for g in gathered] == [[[q, q]] * q for q in range(n)]
    if n > 1:  # a ring: send to the next rank, receive from the previous
        nxt, prev = (r + 1) % n, (r - 1) % n
        box = torch.empty(prev + 1, dtype=torch.float64)
        world.exchange({nxt: [torch.full((r + 1,), r + 0.5, dtype=torch.float64)]}, {prev: [box]})
        checks["exchange"] = box.tolist() == [prev + 0.5] * (prev + 1)
    checks["broadcast_object"] = world.broadcast_object({"from": r}) == {"from": 0}
    world.barrier()
    # DDP on the device: rank r's input is r + 1, so the averaged weight gradient is the mean of 1..n
    model = torch.nn.Linear(1, 1, bias=False).to(world.device)
    ddp = DistributedDataParallel(model)
    ddp(torch.full((1, 1), r + 1.0, device=world.device)).sum().backward()
    checks["ddp averages gradients on the device"] = abs(float(model.weight.grad) - (n + 1) / 2) < 1e-6
    if cuda:
        visible = engine_env(EngineConfig())["CUDA_VISIBLE_DEVICES"]
        parent = [e for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
        checks["engine sees only this GPU"] = visible == (parent[world.local_rank] if parent else str(world.local_rank))
    world.barrier()
    close_world()
    return checks


def main() -> int:
    checks = run_checks()
    ok = all(checks.values())
    if os.environ.get("RANK", "0") == "0" or not ok:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "rank": int(os.environ.get("RANK", "0")),
                    "cuda": torch.cuda.is_available(),
                    "backend": backend_for(torch.cuda.is_available()),
                    "checks": checks,
                },
                indent=1,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
