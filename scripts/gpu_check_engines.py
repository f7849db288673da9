"""GPU check of what placement asks of the engine services: an owner switch (sleep/wake) really frees
and restores device memory, a sleeping engine leaves the other engine on the device serving, and
weights pushed before a sleep are the weights after the wake.

    python scripts/gpu_check_engines.py [--model DIR] [--out DIR]

Two engine processes share the device, a "rollout" and a "judge", as under partial colocation on one
GPU; a full-placement owner switch is one engine's sleep and the other's wake. Without --model a tiny
random Qwen2 is written. Prints one JSON report and exits 1 if a check fails; where vLLM has no sleep
mode (CPU) the memory checks are reported as skipped and the rest still runs.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from yatt.engines.base import SamplingSpec  # noqa: E402
from yatt.engines.client import spawn_engine  # noqa: E402
from yatt.engines.config import EngineConfig  # noqa: E402
from yatt.engines.vllm_config import VLLMConfig  # noqa: E402
from yatt.models.tiny import TinyModelConfig, write_tiny_model  # noqa: E402
from yatt.transport.rpc import RemoteError  # noqa: E402

GREEDY = SamplingSpec(n=1, temperature=0.0, max_tokens=16)
UTILIZATION = 0.25  # per engine; two engines plus this process fit on one device


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


def tokens(engine, prompts) -> list[list[int]]:
    return [group[0].token_ids for group in engine.generate(prompts, GREEDY)]


def perturbed(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (k, v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) if v.is_floating_point() and v.numel() > 1 else v)
        for k, v in weights.items()
    ]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - start, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an HF model folder (default: a tiny random Qwen2)")
    parser.add_argument("--out", type=Path, help="where engine logs go (default: a temporary folder)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="yatt-gpu-engines-"))
    model = args.model or write_tiny_model(out / "tiny", TinyModelConfig(), seed=0)
    weights = load_file(str(next(Path(model).glob("*.safetensors"))))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = [[(7 * i + j) % (vocab - 3) + 3 for j in range(6)] for i in range(32)]
    cfg = EngineConfig(max_model_len=64, vllm=VLLMConfig(gpu_memory_utilization=UTILIZATION, kv_cache_gib=0.25))
    checks: dict[str, bool] = {}
    report: dict = {"cuda": torch.cuda.is_available(), "model": str(model), "logs": str(out), "checks": checks}
    if torch.cuda.is_available():
        report["device"] = torch.cuda.get_device_name()
        report["total_gib"] = round(torch.cuda.mem_get_info()[1] / 2**30, 1)

    rollout = spawn_engine(model, cfg, seed=0, log_path=out / "engine-rollout.log")
    judge = spawn_engine(model, cfg, seed=0, log_path=out / "engine-judge.log")
    try:
        reference, judge_reference = tokens(rollout, prompts), tokens(judge, prompts)
        checks["same weights, same greedy tokens in both engines"] = reference == judge_reference

        # a weight sync, then a switch away from rollout and back: the synced weights must survive
        rollout.update_weights(perturbed(weights))
        updated = tokens(rollout, prompts)
        checks["a weight update changes the rollout engine's output"] = updated != reference
        before = free_bytes()
        slept, report["sleep_s"] = timed(rollout.sleep)
        asleep = free_bytes()
        supported = bool(slept.get("supported"))
        report["sleep_supported"] = supported
        if not supported:
            report["memory_checks"] = f"skipped: vLLM has no sleep mode on {slept.get('device')}"
        else:
            report["freed_gib"] = round((asleep - before) / 2**30, 2)
            reserved = UTILIZATION * torch.cuda.mem_get_info()[1]
            checks["sleep frees at least half of the engine's reservation"] = asleep - before >= 0.5 * reserved
            try:
                rollout.generate(prompts[:1], GREEDY)
                checks["a sleeping engine refuses work"] = False
            except RemoteError as err:
                checks["a sleeping engine refuses work"] = "asleep" in str(err)
        checks["the judge keeps serving while rollout sleeps"] = tokens(judge, prompts) == judge_reference
        _, report["wake_s"] = timed(rollout.wake)
        if supported:
            report["retaken_gib"] = round((asleep - free_bytes()) / 2**30, 2)
            checks["wake takes the memory back"] = asleep - free_bytes() >= 0.5 * (asleep - before)
        checks["weights pushed before the sleep are there after the wake"] = tokens(rollout, prompts) == updated
        rollout.update_weights(list(weights.items()))
        checks["pushing the original weights restores the original output"] = tokens(rollout, prompts) == reference

        # full placement's switch: rollout -> judge -> rollout, three times
        switches = []
        for _ in range(3):
            for leaving, coming in ((rollout, judge), (judge, rollout)):
                start = time.perf_counter()
                leaving.sleep()
                coming.wake()
                switches.append(time.perf_counter() - start)
        report["owner_switch_s"] = [round(s, 3) for s in switches]
        judge.wake()  # the last switch left it asleep
        checks["after six switches both engines give their reference output"] = (
            tokens(rollout, prompts) == reference and tokens(judge, prompts) == judge_reference
        )
    finally:
        rollout.close()
        judge.close()
    report["ok"] = all(checks.values())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
