"""Weight sync through the socket (zmq), through shared memory (shm), and shm with the delta sync, side by side.

    OMP_NUM_THREADS=1 python benchmarks/weight_sync.py [--models quickstart,smollm2] [--engines hf,vllm] \
        [--repeats 3] [--out benchmarks/results/weight_sync]

Per model and engine backend, one real engine child process (`spawn_engine`, as a training run starts it) and
two clients of it, one per transport (`rollout.engine.weight_transport`: zmq, shm); each sync sends the whole
policy as the trainer holds it (float32, Hugging Face names, default 256 MB buckets) and ends with
`finish_sync`, as `EngineServices.push_weights` does. Two more shm clients sync with the delta sync
(rollout.engine.delta_sync, yatt/engines/delta.py), given the trainer's versions: "delta, unchanged" a policy that
did not step since (PPO's critic warm-up, a skipped step: where it pays), "delta, all changed" one whose every
tensor changed (a full fine-tune step: what it costs when it cannot pay). The variants alternate (zmq, shm, ...,
zmq, shm, ...) so that a slow moment of the machine hits all; the table shows each one's median sync seconds, the
MB it sent and the bytes its RPC client put through the socket. All clients send the same file's tensors to one
engine, so what one delta client holds is never made stale by another. A rank syncs only its own engines, so one
rank measures the path; more ranks on the same cores would only share them.

Models (nothing is downloaded):
- quickstart: a random tiny Qwen2 of the quickstart policy's shape (`yatt.models.tiny`, 0.79M params);
- smollm2: a randomly initialised Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads,
  intermediate 1536, 49,152-token vocabulary, tied embeddings), saved with save_pretrained, with the tiny
  character tokenizer (the sync never tokenizes). The GGUF SmolLM2 of docs/smollm2.md has the same tensors.

Writes <out>.json (every timing, settings) and <out>.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import harness  # noqa: E402
import torch  # noqa: E402
from harness import smollm2_shaped  # noqa: E402 (this folder is on sys.path: `python benchmarks/X.py`)
from safetensors.torch import load_file  # noqa: E402

from yatt.engines.client import connect_engine, spawn_engine  # noqa: E402
from yatt.engines.config import EngineConfig  # noqa: E402
from yatt.models.tiny import build_char_tokenizer, write_tiny_model  # noqa: E402
from yatt.tensors import WeightVersions  # noqa: E402
from yatt.transport.codec import new_secret  # noqa: E402

UNCHANGED, CHANGED = "shm, delta, unchanged", "shm, delta, all changed"
TRANSPORTS = ("zmq", "shm", UNCHANGED, CHANGED)  # the variants (the first two: transports, full syncs)


def engine_cfg(backend: str) -> EngineConfig:
    extra = {"vllm": {"kv_cache_gib": 0.25}} if backend == "vllm" else {}
    return EngineConfig(backend=backend, max_model_len=128, max_num_seqs=16, startup_timeout_s=900, **extra)


def measure(model: Path, backend: str, repeats: int, log: Path) -> dict[str, dict[str, list[float]]]:
    weights = list(load_file(str(model / "model.safetensors")).items())  # float32, as the trainer holds them
    secret = new_secret()
    cfg = engine_cfg(backend)
    owner = spawn_engine(model, cfg.model_copy(update={"weight_transport": "zmq"}), 0, log, secret=secret)
    shm = cfg.model_copy(update={"weight_transport": "shm"})
    clients = {"zmq": owner, **{v: connect_engine(owner.endpoint, secret, shm) for v in TRANSPORTS[1:]}}
    syncs = iter(range(1 << 30))
    versions = {  # the trainer's versions: none (a full sync), fixed (no step since), new at every sync
        "zmq": lambda: None,
        "shm": lambda: None,
        UNCHANGED: lambda: WeightVersions(default=0),
        CHANGED: lambda: WeightVersions(default=next(syncs)),
    }
    out = {t: {"seconds": [], "socket_bytes": [], "sent_bytes": []} for t in TRANSPORTS}
    try:
        for variant in TRANSPORTS:  # warm-up: transport choice, first-touch of the engine's code paths, first delta
            clients[variant].update_weights(weights, versions[variant]())
            clients[variant].finish_sync()
        for _ in range(repeats):
            for variant in TRANSPORTS:
                client = clients[variant]
                sent0, t0 = client._rpc.sent_bytes, time.perf_counter()
                sent = client.update_weights(weights, versions[variant]())["sent_bytes"]
                client.finish_sync()
                out[variant]["seconds"].append(time.perf_counter() - t0)
                out[variant]["socket_bytes"].append(client._rpc.sent_bytes - sent0)
                out[variant]["sent_bytes"].append(sent)
        assert owner.health()["ok"]
    finally:
        for variant in TRANSPORTS[1:]:
            clients[variant].close()
        owner.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="quickstart,smollm2")
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/weight_sync")
    args = parser.parse_args()
    commit = harness.commit()
    load_before = os.getloadavg()[0]  # the box may be shared: the load says how much the times are inflated
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        makers = {
            "quickstart": lambda p: write_tiny_model(p, seed=0),
            "smollm2": lambda p: smollm2_shaped(p, build_char_tokenizer("0123456789+-= abcdefghijklmnopqrstuvwxyz")),
        }
        for name in args.models.split(","):
            model = makers[name](Path(tmp) / name)
            weights = load_file(str(model / "model.safetensors"))
            params, nbytes = sum(t.numel() for t in weights.values()), sum(t.numel() * 4 for t in weights.values())
            for backend in args.engines.split(","):
                print(f"{name} ({params / 1e6:.2f}M params) on {backend} ...", flush=True)
                got = measure(model, backend, args.repeats, Path(tmp) / f"{name}-{backend}.log")
                raw[f"{name}/{backend}"] = {"params": params, "weight_bytes": nbytes, **got}
                zmq_s = statistics.median(got["zmq"]["seconds"])
                for transport in TRANSPORTS:
                    s = statistics.median(got[transport]["seconds"])
                    sent = statistics.median(got[transport]["sent_bytes"])
                    row = (
                        name,
                        params,
                        backend,
                        transport,
                        s,
                        s / zmq_s,
                        sent,
                        statistics.median(got[transport]["socket_bytes"]),
                    )
                    rows.append(row)
                    print(f"  {transport}: {s:.3f} s ({s / zmq_s:.2f}x zmq), {sent / 1e6:.2f} MB sent, "
                          f"{row[-1] / 1e6:.2f} MB through the socket")  # fmt: skip
    command = "OMP_NUM_THREADS=1 python benchmarks/weight_sync.py " + " ".join(
        f"--{k} {v}" for k, v in (("models", args.models), ("engines", args.engines), ("repeats", args.repeats))
    )
    meta = {
        "date": date.today().isoformat(),
        "commit": commit.strip(),
        "command": command,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "bucket_mb": engine_cfg("hf").weight_bucket_mb,
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # at start, at end
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({**meta, "results": raw}, indent=2) + "\n")
    lines = [
        "# Weight sync: zmq (tensors in the RPC message) vs shm (shared memory, a descriptor on the socket), and the "
        "delta sync",
        "",
        f"{meta['date']}, commit {meta['commit']}: `{command}` (JSON: [weight_sync.json](weight_sync.json)).",
        "One engine child process per model and engine, four clients of it; a sync = the whole float32 policy in "
        f"{meta['bucket_mb']} MB buckets + finish_sync; median of {args.repeats} alternating syncs. Load average "
        f"(1 min) {meta['load_average_1m'][0]} at the start, {meta['load_average_1m'][1]} at the end, on "
        f"{meta['cores']} cores.",
        "",
        "| model | params | engine | variant | sync s (median) | vs zmq | MB sent | MB through the socket |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, params, backend, transport, s, ratio, sent, socket in rows:
        lines.append(
            f"| {name} | {params / 1e6:.2f}M | {backend} | {transport} | {s:.4f} | {ratio:.2f}x | {sent / 1e6:.3f} "
            f"| {socket / 1e6:.3f} |"
        )
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
