"""What the hf engine pays per turn of a tool conversation for re-prefilling the history it has no cache of.

    OMP_NUM_THREADS=1 python benchmarks/agent_prefill.py [--model models/quickstart-tools-policy]
        [--data data/products/eval.jsonl] [--prompts 64] [--repeats 5] [--out benchmarks/results/agent_prefill]

The hf engine keeps no KV cache across requests, so a conversation's turn k+1 is a new request whose prompt is
the whole history (prompt, model turns, tool responses), prefilled again. vLLM reuses the history's full KV blocks
through its prefix cache (on by default; yatt.engines.vllm_engine resets it at each weight update only).

The workload is the tool quickstart's second turn (yatt.quickstart.products): the prompt, the model's calculator
call and the tool-response turn, as the tool loop lays them down. In-process `HFEngine` (one thread, the
quickstart's engine settings), one warm-up call, then the median of `--repeats` timed calls of:
- prefill(history): the turn-2 prompts, 1 new token;
- prefill(prompt): the bare prompts, 1 new token (what a turn with a kept cache would prefill: ~nothing);
- turn 1 and turn 2 as generated (until eos; <= 80 tokens, turn 2 <= what the 192-token cap leaves), the
  SFT'd policy's real turns.
The re-prefill cost per turn is prefill(history) - prefill(prompt). Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from yatt.engines.base import SamplingSpec, generate
from yatt.engines.config import EngineConfig
from yatt.engines.hf_engine import HFEngine
from yatt.models.tiny import EOS
from yatt.models.tokenizer import load_tokenizer
from yatt.quickstart.products import tool_call_text
from yatt.tools.hermes import tool_response_text


def timed(engine, prompts, max_tokens: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a call, and the mean generated tokens per prompt."""
    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=max_tokens, logprobs=True)
    generate(engine, prompts[:4], spec, list(range(4)))  # warm-up
    seconds, tokens = [], []
    for r in range(repeats):
        start = time.perf_counter()
        out = generate(engine, prompts, spec, [1000 * r + i for i in range(len(prompts))])
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(len(c[0].token_ids) for c in out) / len(prompts))
    return statistics.median(seconds), statistics.mean(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/quickstart-tools-policy")
    parser.add_argument("--data", default="data/products/eval.jsonl")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/agent_prefill")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[: args.prompts]]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    prompts, histories = [], []
    for row in rows:
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("*"))
        prompt = encode(row["prompt"])
        turn = encode(tool_call_text(a, b)) + [tokenizer.eos_token_id]
        prompts.append(prompt)
        histories.append(prompt + turn + encode(tool_response_text([row["answer"]], turn_ended=False)))
    engine = HFEngine(args.model, EngineConfig(backend="hf", max_num_seqs=256, max_model_len=192), seed=0)
    result = {"model": args.model, "prompts": len(rows), "repeats": args.repeats}
    result["prompt_tokens"] = statistics.mean(map(len, prompts))
    result["history_tokens"] = statistics.mean(map(len, histories))
    result["prefill_prompt_s"], _ = timed(engine, prompts, 1, args.repeats)
    result["prefill_history_s"], _ = timed(engine, histories, 1, args.repeats)
    result["turn1_s"], result["turn1_tokens"] = timed(engine, prompts, 80, args.repeats)
    room = 192 - max(map(len, histories))  # what the trajectory cap leaves turn 2, as the tool loop gives it
    result["turn2_s"], result["turn2_tokens"] = timed(engine, histories, room, args.repeats)
    extra = result["prefill_history_s"] - result["prefill_prompt_s"]
    result["reprefill_s"] = extra
    result["reprefill_frac_of_turn2"] = extra / result["turn2_s"]
    result["reprefill_frac_of_conversation"] = extra / (result["turn1_s"] + result["turn2_s"])
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    n = len(rows)
    table = [
        f"# hf engine: re-prefill cost per turn ({args.model}, {n} conversations at once, 1 thread)",
        "",
        "| what | tokens per conversation | seconds (median) |",
        "|---|---|---|",
        f"| prefill(prompt), 1 new token | {result['prompt_tokens']:.1f} | {result['prefill_prompt_s']:.3f} |",
        f"| prefill(history), 1 new token | {result['history_tokens']:.1f} | {result['prefill_history_s']:.3f} |",
        f"| turn 1 as generated | {result['turn1_tokens']:.1f} new | {result['turn1_s']:.3f} |",
        f"| turn 2 as generated (history re-prefilled) | {result['turn2_tokens']:.1f} new | {result['turn2_s']:.3f} |",
        "",
        f"Re-prefill per turn: {extra:.3f} s for {n} conversations ({1000 * extra / n:.2f} ms each), "
        f"{100 * result['reprefill_frac_of_turn2']:.0f}% of turn 2 and "
        f"{100 * result['reprefill_frac_of_conversation']:.0f}% of a two-turn conversation. "
        f"({EOS} ends a model turn; written by benchmarks/agent_prefill.py.)",
    ]
    Path(args.out + ".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    engine.shutdown()


if __name__ == "__main__":
    main()
