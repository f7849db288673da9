"""GPU check of the step a ``cuda_ipc`` weight transport would rest on: a CUDA tensor handed to another process
by IPC handle, opened and copied there, against the host path that ``shm`` takes on a GPU machine.

    python scripts/gpu_check_weight_sync.py [--mb 256] [--dtype bfloat16] [--repeats 5]

NOT RUN in this project yet: no GPU was lent while it was written (`yatt/transport/weights/base.py` describes the
transport; only ``zmq`` and ``shm`` exist). What it does, on one GPU:

1. the parent fills a flat device buffer of `--mb` MB and sends it to a child process through a
   `torch.multiprocessing` queue, whose reductions send a CUDA IPC handle (no bytes are copied);
2. the child opens the handle, copies the buffer into its own device tensor (what an engine's parameters would
   take), checks its checksum, and reports how long opening and copying took;
3. the parent times the ``shm`` route on the same buffer: device -> host copy (into a /dev/shm-backed tensor,
   as `ShmWeights.pack` writes) and the child's host -> device copy back.

It tests only CUDA IPC of one tensor between two processes and reports times: no engine, no vLLM (the lent
machine has none), no NCCL. Prints one JSON report; exits 1 if a checksum differs, 0 with "skipped" without CUDA.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def child(queue, answers, repeats: int) -> None:
    for _ in range(repeats):
        t0 = time.perf_counter()  # the parent puts right after the last answer: get() is mostly the message
        item = queue.get()
        if item is None:
            return
        kind, payload, expected = item
        if kind == "ipc":
            src = payload  # rebuilt from the IPC handle (cudaIpcOpenMemHandle) by torch's reductions in get()
            torch.cuda.synchronize()
            opened = time.perf_counter() - t0
        else:  # "host": a shared host buffer (file name, nbytes, dtype name)
            name, nbytes, dtype = payload
            t0 = time.perf_counter()
            with open(name, "rb") as f:
                mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
            src = torch.frombuffer(mm, dtype=getattr(torch, dtype))
            opened = time.perf_counter() - t0
        t1 = time.perf_counter()
        own = torch.empty(src.shape, dtype=src.dtype, device="cuda")
        own.copy_(src)
        torch.cuda.synchronize()
        copied = time.perf_counter() - t1
        checksum = float(own.float().sum())
        del src, own
        answers.put(
            {
                "kind": kind,
                "open_s": opened,
                "copy_s": copied,
                "ok": abs(checksum - expected) < 1e-3 * abs(expected) + 1e-3,
            }
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    dtype = getattr(torch, args.dtype)
    numel = (args.mb << 20) // dtype.itemsize
    buf = torch.rand(numel, device="cuda").to(dtype)
    expected = float(buf.float().sum())
    ctx = mp.get_context("spawn")
    queue, answers = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(queue, answers, 2 * args.repeats))
    proc.start()
    report: dict[str, list] = {"ipc": [], "host": []}
    shm_path = f"/dev/shm/yatt-gpu-check-{os.getpid()}"
    try:
        host = torch.from_file(shm_path, shared=True, size=numel, dtype=dtype)
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            queue.put(("ipc", buf, expected))
            got = answers.get(timeout=300)
            got["total_s"] = time.perf_counter() - t0
            report["ipc"].append(got)
            t0 = time.perf_counter()
            host.copy_(buf)  # what ShmWeights.pack does with a device tensor
            d2h = time.perf_counter() - t0
            queue.put(("host", (shm_path, numel * dtype.itemsize, args.dtype), expected))
            got = answers.get(timeout=300)
            got.update(d2h_s=d2h, total_s=time.perf_counter() - t0)
            report["host"].append(got)
    finally:
        queue.put(None)
        proc.join(60)
        if os.path.exists(shm_path):
            os.unlink(shm_path)
    summary = {
        kind: {key: statistics.median(r[key] for r in rows) for key in rows[0] if key.endswith("_s")}
        for kind, rows in report.items()
    }
    ok = all(r["ok"] for rows in report.values() for r in rows)
    print(
        json.dumps(
            {"device": torch.cuda.get_device_name(), "mb": args.mb, "dtype": args.dtype, "ok": ok, "median": summary},
            indent=2,
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
