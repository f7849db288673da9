"""Shared pieces of the end-to-end tests: a random tiny digit policy, one-digit addition rows, an
experiment YAML around them, 2 ranks started by torchrun or by launch/train.py --nproc, and a process tree to kill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from yatt.models.tiny import TinyModelConfig, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
DIGITS = TinyModelConfig(
    alphabet="0123456789+=",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def one_digit_rows(path: Path, count: int) -> Path:
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str((a + b) % 10), "data_source": "exact_match"}
        for a in range(10)
        for b in range(10)
    ][:count]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# one-token GRPO on 2 mini-batches, the cheapest real training step the e2e tests share
ONE_TOKEN_GRPO = """rollout: {group_size: 8, max_new_tokens: 1, engine: {vllm: {kv_cache_gib: 0.25}}}
algorithm: {mini_batches: 2}
trainer: {lr: 0.01, micro_batch_size: 16}
"""


def experiment(tmp: Path, body: str, model: TinyModelConfig = DIGITS, name: str = "exp.yaml") -> Path:
    """A random tiny policy (seed 3: about one sample in 13 is right, so groups have reward variance),
    64 train / 16 eval one-digit rows, 8 prompts per step, and `body` (more YAML sections) after them."""
    policy = write_tiny_model(tmp / "policy0", model, seed=3)
    train, evalset = one_digit_rows(tmp / "train.jsonl", 64), one_digit_rows(tmp / "eval.jsonl", 16)
    config = tmp / name
    config.write_text(f"""
model: {{path: {policy}}}
data:
  train: {{kind: jsonl, files: [{train}]}}
  eval: {{kind: jsonl, files: [{evalset}]}}
  prompts_per_step: 8
  eval_prompts: 16
  max_prompt_tokens: 8
{body}""")
    return config


def torchrun_args(config: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(REPO / "launch/train.py"),
        "--config",
        str(config),
        *args,
    ]


def nproc_args(config: Path, *args: str) -> list[str]:
    """launch/train.py starting its own 2 ranks (the Makefile's way: one line per failure)."""
    return [sys.executable, str(REPO / "launch/train.py"), "--nproc", "2", "--config", str(config), *args]


def env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }


def torchrun(
    config: Path, *args: str, cwd: Path, timeout: int = 900, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun_args(config, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env(), **(extra_env or {})},
        cwd=cwd,
    )


def train_repo_config(config: str, run_name: str, output_dir: Path, *args: str, timeout: int) -> tuple[dict, float]:
    """Train the repository's `config` as `make quickstart` does (2 ranks, from the repository root; args:
    --placement and key=value overrides), writing under output_dir: its summary.json and the wall seconds."""
    start = time.monotonic()
    subprocess.run(
        nproc_args(REPO / config, *args, f"run.output_dir={output_dir}"),
        cwd=REPO,
        env=env(),
        check=True,
        timeout=timeout,
    )
    wall = time.monotonic() - start
    return json.loads((output_dir / run_name / "summary.json").read_text()), wall


def process_tree(root_pid: int) -> list[int]:
    """root_pid and all its descendants (torchrun puts each rank in its own session, so killpg misses them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


# the vocabulary of a policy that a tiny judge reads ("...?yes"/"no") and the judge's own shape
JUDGE_TINY = TinyModelConfig(
    alphabet="0123456789+=:?yesno",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def bigram_table(folder: Path, follows: dict[str, set[str]], default: str) -> Path:
    """Turn the tiny model in `folder` (an untied output layer, hidden size >= vocab) into a bigram table, so its
    next token is a fixed function of the last one: its layers add nothing to the residual stream (zero output
    projections), the embeddings are one-hot (the final norm keeps them one-hot), and the output layer gives
    every token of follows[token] (else `default`) the same logit, ~11 after the norm's scale (others 0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, vocab = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder).get_vocab()
    hidden = model.config.hidden_size
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(len(vocab), hidden))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for token, i in vocab.items():
            for nxt in follows.get(token, {default}):
                model.lm_head.weight[vocab[nxt], i] = 1.0
    model.save_pretrained(folder)
    return folder


def genrm_reward(tmp: Path, engine: str, positions: int = 32) -> str:
    """The reward section of a run judged by a random tiny judge (written to tmp/judge, seed 4) mixed with the
    rule. Its verdicts are mostly unreadable, which exercises the fallback; the rule part keeps a learning
    signal. `engine`: the judge's engine section as YAML flow, e.g. "{backend: hf}"; `positions`: the judge's
    context (responses longer than a few tokens need more than 32)."""
    judge = write_tiny_model(
        tmp / "judge", JUDGE_TINY.model_copy(update={"max_position_embeddings": positions}), seed=4
    )
    return f"""reward:
  kind: genrm_with_rule
  judges:
    - name: j
      model: {judge}
      template: "{{question}}{{reference}}:{{response}}?"
      max_tokens: 3
      unparseable_score: 0.5
      engine: {engine}
"""
