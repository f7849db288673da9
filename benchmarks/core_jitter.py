"""How much a rank loses by waiting on its peers at every collective, on this machine's cores.

    python benchmarks/core_jitter.py [--chunks 600] [--repeats 3] [--out benchmarks/results/core_jitter]

Each process, pinned to its own core with one thread, runs the same fixed matmul chunk (~5 ms, about the work
between two of a tensor-parallel step's collectives on the quickstart) `--chunks` times:
- alone: one process, the other cores idle;
- together: one process per core, each at its own pace (a data-parallel rank syncs about once a step);
- lockstep: one process per core and a barrier after every chunk, as tensor parallelism's all-reduces make
  them. Each chunk then lasts as long as the slowest core's.
The lockstep/together ratio of wall time is the share of a step lost to waiting when every core does the same
work; a barrier alone (no chunk) is measured and reported, so its own cost is not mistaken for waiting.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import torch
from harness import write_results

REPO = Path(__file__).resolve().parents[1]


def chunk(a: torch.Tensor) -> None:
    for _ in range(20):
        a @ a


def spin_barrier(counters, rank: int, seq: int) -> None:
    """Shared-memory counters, polled: how yatt's host collectives (yatt.trainers.megatron_collectives) wait."""
    counters[rank] = seq
    while min(counters) < seq:
        pass


def worker(rank: int, core: int, chunks: int, counters, work: bool, out) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    for _ in range(20):  # warm-up
        chunk(a)
    if counters is not None:
        spin_barrier(counters, rank, 1)
    times, start = [], time.perf_counter()
    for i in range(chunks):
        t = time.perf_counter()
        if work:
            chunk(a)
        times.append(time.perf_counter() - t)
        if counters is not None:
            spin_barrier(counters, rank, i + 2)
    out.put((core, time.perf_counter() - start, times))


def measure(cores: list[int], chunks: int, lockstep: bool, work: bool = True) -> dict:
    ctx = mp.get_context("spawn")
    counters, out = (ctx.Array("q", len(cores), lock=False) if lockstep else None), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, c, chunks, counters, work, out)) for r, c in enumerate(cores)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    times = sorted(t for _, _, ts in results for t in ts)
    pick = lambda q: 1e3 * times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return {
        "wall_s": max(w for _, w, _ in results),
        "chunk_ms_median": 1e3 * statistics.median(times),
        "chunk_ms_p90": pick(0.9),
        "chunk_ms_p99": pick(0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=600)
    parser.add_argument(
        "--repeats", type=int, default=3, help="together/lockstep pairs (the box's noise comes in bursts)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/core_jitter")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    rows = [("alone", measure(cores[:1], args.chunks, lockstep=False))]
    ratios = []
    for i in range(args.repeats):
        together = measure(cores, args.chunks, lockstep=False)
        lockstep = measure(cores, args.chunks, lockstep=True)
        rows += [(f"together #{i + 1}", together), (f"lockstep #{i + 1}", lockstep)]
        ratios.append(lockstep["wall_s"] / together["wall_s"])
    barrier_ms = 1e3 * measure(cores, args.chunks, lockstep=True, work=False)["wall_s"] / args.chunks
    md = [
        f"# Waiting at collectives: {len(cores)} cores, {args.chunks} chunks each",
        "",
        "| mode | wall s | chunk ms median | p90 | p99 |",
        "|---|---|---|---|---|",
        *(
            f"| {mode} | {r['wall_s']:.2f} | {r['chunk_ms_median']:.2f} | {r['chunk_ms_p90']:.2f} | "
            f"{r['chunk_ms_p99']:.2f} |"
            for mode, r in rows
        ),
        "",
        f"lockstep / together, wall time: {', '.join(f'{r:.2f}x' for r in ratios)}; median "
        f"**{statistics.median(ratios):.2f}x** (a barrier alone costs {barrier_ms:.3f} ms a chunk)",
        "",
    ]
    results = {"cores": len(cores), "chunks": args.chunks, "rows": dict(rows), "lockstep_ratios": ratios}
    write_results(args.out, results | {"barrier_ms": barrier_ms}, md)


if __name__ == "__main__":
    main()
