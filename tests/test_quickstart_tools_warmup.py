"""The tool quickstart's warm-up gives what its run needs, measured the way the run sees it.

The warm-up (configs/sft_quickstart_tools.yaml) replays each row's model turns through the run's own loop, the
`rollout.agent` section of configs/quickstart_tools.yaml, so a warm-up example holds the ids a rollout holds:
the prompt as the run encodes it, the calculator's response as the loop writes it, masked like a rollout's. A
warm-up by the real SFT code (fitted on a few rows in CI; the real one, ~5 minutes, in the slow suite), loaded from
its folder as the run loads it, then calls the calculator with the prompt's own expression (the quickstart once
shipped a warm-up whose calls miscopied every operand, so no sample was right and GRPO had nothing to learn from).
The real warm-up's greedy policy guesses on every prompt while its samples at the run's temperature call on ~25%,
mostly right: the reward the run's first groups learn from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from yatt.agents import build_loop
from yatt.agents.base import TokenizerCodec
from yatt.config import load_experiment
from yatt.config_loading import load_config
from yatt.controllers.rollouts import group_rollouts, score_rollouts
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.prepare import encode_prompts
from yatt.data.sft import agent_example_ids
from yatt.models.tiny import build_char_tokenizer
from yatt.models.tokenizer import load_tokenizer
from yatt.quickstart.products import write_products_files
from yatt.quickstart.sft import Sampling, SFTConfig, greedy_conversations, run_sft

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "configs/quickstart_tools.yaml"
WARMUP = REPO / "configs/sft_quickstart_tools.yaml"
EXPRESSION = re.compile(r'"expression":"([^"]*)"')


@pytest.fixture(scope="module")
def products(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("products")
    write_products_files(out, sizes={"train": 64, "eval": 64})  # the warm-up rows of `make quickstart-tools`
    return out


def test_the_warmup_replays_the_run_s_own_loop(tmp_path):
    run, warmup = load_experiment(RUN), load_config(SFTConfig, WARMUP)
    assert warmup.agent == run.rollout.agent
    assert warmup.max_new_tokens == run.rollout.max_new_tokens


def test_a_warmup_row_holds_the_ids_a_rollout_of_the_run_holds(tmp_path, products):
    """Its prompt part is the run's prompt ids (tokenizer loaded from the folder as the run loads it), and the
    rest is the tool loop's trajectory for the row's turns."""
    warmup, run = load_config(SFTConfig, WARMUP), load_experiment(RUN)
    build_char_tokenizer(warmup.model.alphabet, warmup.model.special_tokens, warmup.model.words).save_pretrained(
        tmp_path / "tok"
    )
    tokenizer = load_tokenizer(tmp_path / "tok")
    loop = build_loop(run.rollout.agent, TokenizerCodec(tokenizer))
    row = next(r for r in read_jsonl_shard([products / "sft.jsonl"], 0, 1) if "tool_call" in r.answer)
    ids, labels = agent_example_ids(row, tokenizer, loop, warmup.max_new_tokens)
    [prompt] = encode_prompts([row], tokenizer, run.data.max_prompt_tokens)
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [-100] * len(prompt)
    text = tokenizer.decode(ids[len(prompt) :])
    product = row.prompt.removesuffix("=")
    assert text.startswith(f'<tool_call>{{"name":"c","arguments":{{"expression":"{product}"}}}}</tool_call></s>')
    assert f"<tool_response>\n{eval(product)}\n</tool_response>" in text and text.endswith(f"{eval(product)}</s>")
    trained = tokenizer.decode([t for t in labels if t != -100])  # the model's turns only, not the tool's
    assert "<tool_response>" not in trained and trained.count(str(eval(product))) == 1


def run_conversations(folder: Path, rows, sampling: Sampling | None = None) -> list[tuple[str, int, float]]:
    """(response text, tool calls, the run's reward) of greedy (or sampled) conversations with the policy in
    `folder`, loaded as the run loads it, through the run's own tool loop."""
    run = load_experiment(RUN)
    tokenizer = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    prompts = encode_prompts(rows, tokenizer, run.data.max_prompt_tokens)
    loop = build_loop(run.rollout.agent, TokenizerCodec(tokenizer))
    eos = tokenizer.eos_token_id
    trajectories = greedy_conversations(model, loop, prompts, run.rollout.max_new_tokens, eos, sampling)
    rollouts = [group_rollouts(row, ids, None, [t], tokenizer)[0] for row, ids, t in zip(rows, prompts, trajectories)]
    score_rollouts(rollouts)  # the run's reward: the last model turn, by the row's verifier
    return [(tokenizer.decode(t.response_ids), t.tool_calls, r.reward) for t, r in zip(trajectories, rollouts)]


def copies(row, text: str, calls: int) -> bool:
    found = EXPRESSION.search(text)
    return bool(found) and found.group(1) == row.prompt.removesuffix("=") and calls == 1


def test_the_run_replays_what_a_fitted_warmup_learned(tmp_path, products):
    """The warm-up's settings fitted on 16 calling rows (at a higher lr and smaller batches, which only changes
    how soon: ~150 steps) until its own check, greedy conversations through the loop, gets them all right; the
    run's loop then calls with each prompt's expression and ends with the product."""
    calling = [json.loads(line) for line in (products / "sft.jsonl").read_text().splitlines() if "tool_call" in line]
    fit, held = tmp_path / "fit.jsonl", tmp_path / "answers.jsonl"
    fit.write_text("".join(json.dumps(r) + "\n" for r in calling[:16]))
    answers = [{**r, "answer": r["answer"].rsplit("</s>", 1)[1]} for r in calling[:16]]  # the product, as eval rows
    held.write_text("".join(json.dumps(r) + "\n" for r in answers))
    out = tmp_path / "policy"
    fixed = [f"sft_file={fit}", f"eval_file={held}", f"output_dir={out}", "stop_at_accuracy=1.0", "log_every=0"]
    fast = ["lr=3e-3", "batch_size=16", "warmup_steps=0", "eval_every=25", "eval_often_every=25", "max_steps=400"]
    fast += ["eval_temperature=0"]  # greedy: the fitted rows all call
    cfg = load_config(SFTConfig, WARMUP, fixed + fast + ["stop_at_call_accuracy=1.0", "threads=1"])
    summary = run_sft(cfg, log=lambda *a: None)
    assert summary["stopped_by"] == "accuracy", summary
    rows = read_jsonl_shard([held], 0, 1)
    seen = run_conversations(out, rows)
    assert sum(copies(row, text, calls) for row, (text, calls, _) in zip(rows, seen)) >= len(rows) - 1, seen
    assert sum(reward >= 1.0 for *_, reward in seen) >= len(rows) - 1, seen


@pytest.fixture(scope="module")
def warmed_up(products, tmp_path_factory) -> tuple[Path, dict]:
    """The repository's warm-up, as `make quickstart-tools` runs it, on its own rows (the stop check is met after about
    300 steps, ~2.5 minutes on 2 cores); only the stop check's and the final evaluation's rows are fewer."""
    out = tmp_path_factory.mktemp("tools_policy") / "policy"
    overrides = [f"sft_file={products / 'sft.jsonl'}", f"eval_file={products / 'eval.jsonl'}", f"output_dir={out}"]
    cfg = load_config(SFTConfig, WARMUP, overrides + ["eval_examples=64", "final_eval_examples=64"])
    torch.set_num_threads(cfg.threads)
    try:
        summary = run_sft(cfg, log=lambda *a: None)
    finally:
        torch.set_num_threads(1)
    return out, summary


@pytest.mark.slow
def test_the_warmup_calls_the_calculator_with_the_prompt_s_expression(warmed_up, products):
    """What the run needs, from the real warm-up (slow: ~3 minutes): it stopped by its check (not by max_steps),
    and the policy, loaded from its folder as the run loads it and run through the run's loop, guesses when decoded
    greedily (the run's evaluation starts near 0) while at the run's temperature a share of its samples call with
    the prompt's own expression and are rewarded (what GRPO's first groups learn from)."""
    folder, summary = warmed_up
    assert summary["stopped_by"] == "accuracy", summary
    rows = read_jsonl_shard([products / "eval.jsonl"], 0, 1)
    greedy = run_conversations(folder, rows)
    assert sum(calls for _, calls, _ in greedy) <= 0.1 * len(rows), greedy
    run = load_experiment(RUN)
    sampled = run_conversations(folder, rows, Sampling(run.rollout.temperature, seed=1))
    copied = sum(copies(row, text, calls) for row, (text, calls, _) in zip(rows, sampled))
    assert copied >= 0.08 * len(rows), f"{copied} of {len(rows)} sampled calls hold the prompt's expression"
    assert sum(reward >= 1.0 for *_, reward in sampled) >= 0.05 * len(rows), sampled
