"""What junk on the engine wire costs the engine, and what it does to an honest client's latency.

    OMP_NUM_THREADS=1 flock /tmp/yatt-heavy.lock python benchmarks/wire.py [--junk-mb 24] [--attackers 6] \
        [--out benchmarks/results/wire.json]

One real engine child process (hf backend, the quickstart policy or a tiny random model) serves an honest
client, side by side in one run:
1. idle: the honest client's latency (median of `--calls` generate calls of `--new-tokens` tokens);
2. junk: `--attackers` processes that reached the engine's port but hold no key send `--junk-mb` MB in all
   of empty ZMQ frames (a valid ZMTP greeting, then 2-byte frames: what took the engine 63 s of CPU and
   2.1 GB before the CURVE handshake), over and over until it is all sent; the engine's CPU time
   (utime+stime from /proc) during the attack is the cost, the attackers' own CPU time is printed beside it;
3. under load: the same honest calls while the attackers keep sending; the ratio to idle is printed.
It also prints bulk throughput of one 64 MB message over plain ZMQ and over CURVE: what encryption costs a
weight sync.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from yatt.engines.base import SamplingSpec  # noqa: E402
from yatt.engines.client import spawn_engine  # noqa: E402
from yatt.engines.config import EngineConfig  # noqa: E402
from yatt.transport.codec import new_secret  # noqa: E402

# ZMTP 3.0 greeting for the NULL mechanism (what an unconfigured ZMQ socket sends): signature, version,
# mechanism name padded to 20 bytes, as-server flag, 31 bytes of filler.
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
EMPTY_FRAME = b"\x01\x00"  # flags MORE, length 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def attacker(host: str, port: int, total_bytes: int, stop_at: float, sent, cpu, repeat: bool) -> None:
    """Send `total_bytes` of empty frames (in as many connections as it takes); with `repeat`, keep going
    until `stop_at`."""
    chunk = EMPTY_FRAME * (1 << 19)  # 1 MB
    done = 0
    while (done < total_bytes or repeat) and time.time() < stop_at:
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(GREETING)
                while (done < total_bytes or repeat) and time.time() < stop_at:
                    s.sendall(chunk)
                    done += len(chunk)
        except OSError:  # the engine dropped us: connect again and carry on
            time.sleep(0.001)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    with sent.get_lock():
        sent.value += done
        cpu.value += ru.ru_utime + ru.ru_stime


def honest_latency(engine, calls: int, spec: SamplingSpec) -> list[float]:
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        engine.generate([[4 + i % 10, 5, 6]], spec)
        out.append(time.perf_counter() - t0)
    return out


def attack(endpoint: str, attackers: int, total_mb: float, seconds: float, repeat: bool):
    """Start the attackers; returns (processes, bytes sent, their CPU seconds), the last two filled as they end."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sent, cpu = mp.Value("d", 0.0), mp.Value("d", 0.0)
    per = int(total_mb * 1e6 / attackers)
    stop_at = time.time() + seconds
    procs = [
        mp.Process(target=attacker, args=(host, int(port), per, stop_at, sent, cpu, repeat)) for _ in range(attackers)
    ]
    for p in procs:
        p.start()
    return procs, sent, cpu


def bulk_throughput(mb: int = 64) -> dict[str, float]:
    import zmq

    from yatt.transport.curve import derive_keys, secure_client, secure_server

    out = {}
    for name in ("plain", "curve"):
        ctx = zmq.Context()
        server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        if name == "curve":
            keys = derive_keys(new_secret())
            secure_server(server, keys)
            secure_client(client, keys)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"hi")
        server.recv_multipart()
        data = b"x" * (mb << 20)
        t0 = time.perf_counter()
        client.send(data, copy=False)
        server.recv_multipart(copy=False)
        out[name] = mb * 1.048576 / (time.perf_counter() - t0)  # MB/s
        ctx.destroy(linger=0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--junk-mb", type=float, default=24.0)
    parser.add_argument("--attackers", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--model", default="models/quickstart-policy", help="the engine's policy (missing: a random tiny one)"
    )
    parser.add_argument("--out", default="benchmarks/results/wire.json")
    args = parser.parse_args()

    cfg = EngineConfig(backend="hf", max_model_len=64, max_num_seqs=16, request_timeout_s=120, startup_timeout_s=300)
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=args.new_tokens, logprobs=False)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model)
        if not model.exists():
            from yatt.models.tiny import TinyModelConfig, write_tiny_model

            model = write_tiny_model(Path(tmp) / "m", TinyModelConfig(max_position_embeddings=96), seed=0)
        engine = spawn_engine(model, cfg, seed=0, log_path=Path(tmp) / "engine.log", secret=new_secret())
        try:
            honest_latency(engine, 3, spec)  # warm up
            idle = honest_latency(engine, args.calls, spec)
            print(f"idle: honest generate median {statistics.median(idle) * 1e3:.1f} ms", flush=True)

            cpu0, t0 = cpu_seconds(engine.pid), time.perf_counter()
            procs, sent, attacker_cpu = attack(engine.endpoint, args.attackers, args.junk_mb, 120, repeat=False)
            for p in procs:
                p.join()
            time.sleep(0.5)  # let the engine finish whatever the junk left it
            junk_cpu, junk_wall = cpu_seconds(engine.pid) - cpu0, time.perf_counter() - t0
            junk_sent, junk_sender_cpu = sent.value, attacker_cpu.value
            c1, quiet = cpu_seconds(engine.pid), min(junk_wall, 5.0)
            time.sleep(quiet)  # the engine's own idle polling over the same wall time
            idle_cpu = (cpu_seconds(engine.pid) - c1) / quiet * junk_wall
            print(
                f"junk: {junk_sent / 1e6:.0f} MB of empty frames from {args.attackers} keyless senders in "
                f"{junk_wall:.1f} s cost the engine {junk_cpu:.2f} s CPU (idle polling alone: {idle_cpu:.2f} s; "
                f"the senders: {junk_sender_cpu:.2f} s)",
                flush=True,
            )

            procs, _, _ = attack(engine.endpoint, args.attackers, args.junk_mb, 3600, repeat=True)
            time.sleep(0.5)
            loaded = honest_latency(engine, args.calls, spec)
            for p in procs:
                p.terminate()
                p.join()
            stats = engine._rpc.call("rpc_stats")
        finally:
            engine.close()
    bulk = bulk_throughput()
    ratio = statistics.median(loaded) / statistics.median(idle)
    result = {
        "junk_mb": junk_sent / 1e6,
        "attackers": args.attackers,
        "junk_sender_cpu_s": junk_sender_cpu,
        "junk_engine_cpu_s": junk_cpu,
        "junk_wall_s": junk_wall,
        "engine_idle_cpu_s_same_wall": idle_cpu,
        "honest_idle_median_s": statistics.median(idle),
        "honest_loaded_median_s": statistics.median(loaded),
        "honest_latency_ratio": ratio,
        "rpc_stats": stats,
        "bulk_plain_mb_s": bulk["plain"],
        "bulk_curve_mb_s": bulk["curve"],
        "bulk_curve_over_plain": bulk["curve"] / bulk["plain"],
    }
    print(
        f"under load: honest generate median {result['honest_loaded_median_s'] * 1e3:.1f} ms = {ratio:.2f}x idle; "
        f"engine stats {stats}"
    )
    print(
        f"bulk 64 MB: plain {bulk['plain']:.0f} MB/s, curve {bulk['curve']:.0f} MB/s "
        f"({result['bulk_curve_over_plain']:.2f}x)"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
