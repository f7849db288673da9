"""Supervised fine-tuning (SFT) of a causal LM, stopped on a held-out accuracy threshold.

The model is a fresh tiny Qwen2 with a character tokenizer (the quickstart's starting policy and judge), or
any Hugging Face causal LM folder (`init_from`). Rows are yatt JSONL rows (yatt.data.jsonl): `prompt` +
`answer` (loss on the answer and end-of-sequence tokens) or `messages` (loss on the assistant turns only,
through the tokenizer's chat template; yatt.data.sft). Training stops at the first evaluation whose greedy
(or, with `eval_temperature`, sampled) accuracy reaches `stop_at_accuracy`; a response is right when the
verifier its row's `data_source` names (the same registry RL rewards use, yatt.rewards.rules) gives it a full
score.

With `agent` (the run's `rollout.agent` section) the rows are conversations: each row's model turns are replayed
through the run's own agent loop (yatt.data.sft.agent_example_ids), so the warm-up sees exactly the ids a rollout
of the run holds, and the stop check is the run's: conversations through the same loop (greedy, or sampled at
the run's temperature), tools called, the last model turn scored (`greedy_conversations`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoModelForCausalLM

from yatt.agents import build_loop
from yatt.agents.base import AgentLoop, TokenizerCodec, Trajectory, row_kwargs
from yatt.agents.config import AgentConfig
from yatt.config_loading import dump_config
from yatt.data.errors import DataError
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.rows import PromptRow
from yatt.data.sft import encode_examples, eval_prompt
from yatt.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from yatt.models.tokenizer import load_tokenizer
from yatt.rewards.rules import answers_match as exact_match  # noqa: F401  (the exact_match rule on text)
from yatt.rewards.rules import score


class SFTConfig(BaseModel):
    """Everything one SFT run needs; loaded from YAML with `yatt.config_loading.load_config`."""

    model_config = ConfigDict(extra="forbid")

    model: TinyModelConfig = Field(
        default_factory=TinyModelConfig, description="Shape and alphabet of the fresh tiny model."
    )
    init_from: Path | None = Field(
        None, description="Start from this HF model folder instead of a fresh model (model: is then ignored)."
    )
    sft_file: Path = Field(description="JSONL rows to train on: prompt + answer, or messages (yatt.data.jsonl).")
    eval_file: Path = Field(description="Held-out JSONL rows for the greedy accuracy (scored by data_source).")
    output_dir: Path = Field(description="Hugging Face model folder to write (replaced atomically).")
    lr: float = Field(1e-3, gt=0, description="AdamW peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    grad_clip: float | None = Field(None, gt=0, description="Clip the gradient norm to this value (None: no clipping).")
    warmup_steps: int = Field(100, ge=0, description="Steps of linear learning-rate warm-up from 0.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warm-up: constant, or cosine decay to min_lr_ratio * lr at max_steps."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine: the final learning rate as a fraction of lr.")
    batch_size: int = Field(64, gt=0, description="Rows per optimizer step.")
    max_steps: int = Field(2000, gt=0, description="Stop after this many steps even if the accuracy is not reached.")
    eval_every: int = Field(
        25, gt=0, description="Steps between evaluations while accuracy is below `eval_often_above`."
    )
    eval_often_every: int = Field(
        10, gt=0, description="Steps between evaluations once accuracy is at least `eval_often_above`."
    )
    eval_often_above: float = Field(
        0.05, ge=0, le=1, description="Accuracy from which evaluations come every `eval_often_every` steps."
    )
    eval_examples: int = Field(200, gt=0, description="First rows of eval_file used by the stop check.")
    stop_at_accuracy: float = Field(
        0.45, gt=0, le=1, description="Stop at the first evaluation with at least this accuracy."
    )
    eval_temperature: float = Field(
        0.0,
        ge=0,
        description="Temperature of the stop check's decoding (0: greedy). The run's rollout.temperature measures "
        "what RL will sample: a tool warm-up whose greedy policy answers directly but whose samples call must "
        "stop when enough samples are right, or GRPO has no reward to learn from.",
    )
    stop_at_call_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="With `agent`: stop only when, besides stop_at_accuracy, the conversations that called a tool "
        "are right at least this often (a warm-up that teaches a tool on part of its rows: the run then learns to "
        "call more, so the calls it starts from must be right).",
    )
    final_eval_examples: int | None = Field(
        None, gt=0, description="Rows of eval_file for the final accuracy in the summary (None: all)."
    )
    max_new_tokens: int = Field(
        8,
        gt=0,
        description="Longest greedy response at evaluation, end-of-sequence included (with `agent`: "
        "each model turn, in training too, as rollout.max_new_tokens).",
    )
    agent: AgentConfig | None = Field(
        None,
        description="The run's rollout.agent section: rows are conversations whose answer is the model's turns, "
        "each ended by the end-of-sequence token, replayed through this loop (tools run, their responses in the "
        "context but not the loss); the stop check is greedy conversations through it.",
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        description="Longest training example in tokens; a longer row is an error naming it (None: no limit).",
    )
    log_every: int = Field(
        50, ge=0, description="Steps between progress lines (loss, tokens/s, eta); 0: only at evals."
    )
    seed: int = Field(0, description="Seed of the model initialisation and of the data order.")
    threads: int = Field(
        1,
        gt=0,
        description="Compute threads (torch.set_num_threads). The warm-up runs alone, so it may take every core: "
        "on a 2-core CPU, 2 threads ran a step of the tool warm-up 1.7x faster than 1.",
    )

    @model_validator(mode="after")
    def _calls_need_an_agent(self) -> SFTConfig:
        if self.stop_at_call_accuracy is not None and self.agent is None:
            raise ValueError("stop_at_call_accuracy is set but agent is not: only an agent's conversations call tools")
        return self


class Sampling:
    """Sampled decoding for an evaluation at the run's temperature, from a seeded generator (so a warm-up's stop
    check is the same on a rerun)."""

    def __init__(self, temperature: float, seed: int):
        self.temperature, self.generator = temperature, torch.Generator().manual_seed(seed)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]


@torch.inference_mode()
def greedy_decode(
    model, prompt_ids: torch.Tensor, max_new_tokens: int, eos_id: int, sampling: Sampling | None = None
) -> torch.Tensor:
    """Batched decoding with a KV cache for prompts of equal length (no padding needed): greedy, or sampled at
    `sampling`'s temperature from its generator."""
    out = model(input_ids=prompt_ids, use_cache=True)
    cache, generated = out.past_key_values, []
    done = torch.zeros(prompt_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        token = sampling.pick(out.logits[:, -1]) if sampling else out.logits[:, -1].argmax(-1)
        generated.append(token)
        done |= token == eos_id
        if done.all():
            break
        out = model(input_ids=token[:, None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return torch.stack(generated, dim=1)


def cut_at_eos(tokens: list[int], eos_id: int) -> list[int]:
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def greedy_turns(
    model, histories: list[list[int]], max_tokens: list[int], eos_id: int, sampling: Sampling | None = None
) -> list[list[int]]:
    """One model turn per history (greedy, or sampled with `sampling`; a batch per history length), each cut
    after its end-of-sequence token or at its own max_tokens."""
    by_length: dict[int, list[int]] = {}
    for i, history in enumerate(histories):
        by_length.setdefault(len(history), []).append(i)
    turns: list[list[int]] = [[] for _ in histories]
    for group in by_length.values():
        prompt_ids = torch.tensor([histories[i] for i in group])
        out = greedy_decode(model, prompt_ids, max(max_tokens[i] for i in group), eos_id, sampling).tolist()
        for i, tokens in zip(group, out):
            tokens = tokens[: max_tokens[i]]
            turns[i] = tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens
    return turns


def greedy_conversations(
    model,
    loop: AgentLoop,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    sampling: Sampling | None = None,
    rows: list[PromptRow] | None = None,
) -> list[Trajectory]:
    """`loop`'s greedy (or, with `sampling`, sampled) conversation from every prompt (and its row, for a loop that
    takes it: an environment's task). Each runs in its own thread (a loop is plain sequential code that calls
    `generate`); whenever every live conversation waits on a turn, those turns are decoded together in this
    thread (`greedy_turns`), so the model is only ever called here."""
    cond = threading.Condition()
    waiting: dict[int, tuple[list[int], int]] = {}
    answers: dict[int, list[int]] = {}
    out: list[Trajectory | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    live = len(prompts)

    def converse(i: int) -> None:
        nonlocal live

        def generate(history: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float], str]:
            with cond:
                waiting[i] = (list(history), max_tokens)
                cond.notify_all()
                cond.wait_for(lambda: i in answers)
                turn = answers.pop(i)
            return turn, [0.0] * len(turn), "stop" if turn and turn[-1] == eos_id else "length"

        try:
            row = rows[i] if rows is not None else None
            out[i] = loop.run(prompts[i], generate, max_new_tokens, 0, **row_kwargs(loop, row))
        except BaseException as err:  # raised again in the caller's thread
            errors.append(err)
        finally:
            with cond:
                live -= 1
                cond.notify_all()

    threads = [threading.Thread(target=converse, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    while True:
        with cond:
            cond.wait_for(lambda: len(waiting) == live)
            if not waiting:
                break
            batch = dict(waiting)
            waiting.clear()
        keys = list(batch)
        turns = greedy_turns(model, [batch[k][0] for k in keys], [batch[k][1] for k in keys], eos_id, sampling)
        with cond:
            answers.update(zip(keys, turns))
            cond.notify_all()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return out


def evaluate(
    model,
    tokenizer,
    rows: list[PromptRow],
    max_new_tokens: int,
    batch_size: int = 500,
    log=None,
    loop: AgentLoop | None = None,
    sampling: Sampling | None = None,
) -> dict[str, float]:
    """Greedy (with `sampling`: sampled) `accuracy` on `rows`: the fraction whose response (with `loop`: the last
    model turn of the conversation, or the environment's reward when the loop is an environment's) gets a full
    score from the row's verifier. With `loop` also `reward`, the mean score, `calls`, the fraction of
    conversations that called a tool, and `call_accuracy`, the accuracy of those (0 if none did). Rows are
    grouped by prompt length so no padding is needed; `log` gets a progress line every ~10 s."""
    was_training = model.training
    model.eval()
    prompts = [eval_prompt(row, tokenizer) for row in rows]
    if loop is not None:
        start = time.perf_counter()
        trajectories = greedy_conversations(
            model, loop, [ids for ids, _ in prompts], max_new_tokens, tokenizer.eos_token_id, sampling, rows
        )
        model.train(was_training)
        scores = [
            t.reward if t.reward is not None else score(t.final_text, row) for t, (_, row) in zip(trajectories, prompts)
        ]
        right = [s >= 1.0 for s in scores]
        called = [t.tool_calls > 0 for t in trajectories]
        calls = sum(called)
        result = {
            "accuracy": sum(right) / max(len(rows), 1),
            "reward": sum(scores) / max(len(rows), 1),
            "calls": calls / max(len(rows), 1),
            "call_accuracy": sum(r for r, c in zip(right, called) if c) / max(calls, 1),
        }
        if log:
            log(
                f"  eval: mean score {result['reward']:.3f}, {result['calls']:.2f} of the conversations call a tool, "
                f"{result['call_accuracy']:.3f} of those right, {time.perf_counter() - start:.1f}s"
            )
        return result
    by_length: dict[int, list[tuple[list[int], PromptRow]]] = {}
    for ids, scored in prompts:
        by_length.setdefault(len(ids), []).append((ids, scored))
    correct, done, start, shown = 0, 0, time.perf_counter(), time.perf_counter()
    for group in by_length.values():
        for first in range(0, len(group), batch_size):
            chunk = group[first : first + batch_size]
            prompt_ids = torch.tensor([ids for ids, _ in chunk])
            responses = greedy_decode(model, prompt_ids, max_new_tokens, tokenizer.eos_token_id, sampling).tolist()
            for resp, (_, row) in zip(responses, chunk):
                text = tokenizer.decode(cut_at_eos(resp, tokenizer.eos_token_id), skip_special_tokens=True)
                correct += score(text, row) >= 1.0
            done += len(chunk)
            if log and time.perf_counter() - shown > 10:
                shown = time.perf_counter()
                log(f"  eval {done}/{len(rows)} prompts, {shown - start:.0f}s")
    model.train(was_training)
    return {"accuracy": correct / max(len(rows), 1)}


def lr_factor(cfg: SFTConfig, step: int) -> float:
    """Linear warm-up, then constant or cosine decay to min_lr_ratio at max_steps."""
    warm = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    if cfg.lr_schedule == "constant" or step < cfg.warmup_steps:
        return warm
    progress = min(1.0, (step - cfg.warmup_steps) / max(cfg.max_steps - cfg.warmup_steps, 1))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def sft_loss(model, ids: torch.Tensor, labels: torch.Tensor, pad_id: int) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=(ids != pad_id).long())
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    aux = getattr(out, "aux_loss", None)  # an MoE model with output_router_logits: its load-balancing loss
    if aux is not None:
        loss = loss + model.config.router_aux_loss_coef * aux
    return loss


def write_folder_atomically(output_dir: Path, write) -> None:
    """Call `write(tmp)` on a fresh sibling folder, then swap it into `output_dir` (replacing an old one)."""
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_dir.with_name(f"{output_dir.name}.tmp-{os.getpid()}")
    old = output_dir.with_name(f"{output_dir.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        if output_dir.exists():
            os.replace(output_dir, old)  # a non-empty folder cannot be replaced in one step
        os.replace(tmp, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def changed_fields(cfg: SFTConfig, folder: Path) -> list[str]:
    """The fields of `cfg` that differ from the config `folder` was trained from (its sft_config.yaml; none when
    it has none: a folder not written by this code)."""
    saved = Path(folder) / "sft_config.yaml"
    if not saved.is_file():
        return []
    before, now = yaml.safe_load(saved.read_text()) or {}, cfg.model_dump(mode="json")
    return [key for key in now if before.get(key) != now[key]]


def run_sft(cfg: SFTConfig, log=print) -> dict:
    """Train, evaluate, stop on the accuracy threshold, write the HF folder; returns the summary."""
    start = time.perf_counter()
    if cfg.init_from is not None:  # any Hugging Face causal LM folder (e.g. a yatt model to continue)
        tokenizer = load_tokenizer(cfg.init_from)
        model = AutoModelForCausalLM.from_pretrained(str(cfg.init_from), dtype=torch.float32)
        if tokenizer.pad_token_id is None:  # padding only fills label -100 positions, so any id will do
            tokenizer.pad_token = tokenizer.eos_token
    else:
        tokenizer = build_char_tokenizer(cfg.model.alphabet, cfg.model.special_tokens, cfg.model.words)
        model = build_tiny_model(cfg.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.seed)
    pad_id = tokenizer.pad_token_id
    params = sum(p.numel() for p in model.parameters())

    train_rows = read_jsonl_shard([cfg.sft_file], 0, 1)
    eval_rows = read_jsonl_shard([cfg.eval_file], 0, 1)
    stop_rows = eval_rows[: cfg.eval_examples]
    for split, rows, path in (("training", train_rows, cfg.sft_file), ("eval", eval_rows, cfg.eval_file)):
        if not rows:
            raise DataError(f"{path}: no {split} rows")
    for row in eval_rows:
        eval_prompt(row, tokenizer)  # a bad eval row fails now, not after minutes of training
    loop = build_loop(cfg.agent, TokenizerCodec(tokenizer)) if cfg.agent is not None else None
    ids, labels = encode_examples(train_rows, tokenizer, cfg.max_tokens, loop, cfg.max_new_tokens, log)
    log(
        f"sft: {params:,} params, {len(train_rows)} training rows ({int((labels != -100).sum()):,} target tokens), "
        f"{len(stop_rows)} eval rows for the stop check"
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.adam_betas)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    gen = torch.Generator().manual_seed(cfg.seed)
    order, cursor = torch.randperm(len(ids), generator=gen), 0

    model.train()
    history, window, accuracy, step, next_eval, tokens = [], [], 0.0, 0, cfg.eval_every, 0
    stopped_by = "max_steps"
    while step < cfg.max_steps:
        if cursor + cfg.batch_size > len(order):  # new epoch
            order, cursor = torch.randperm(len(ids), generator=gen), 0
        batch = order[cursor : cursor + cfg.batch_size]
        cursor += cfg.batch_size
        width = int((labels[batch] != -100).nonzero()[:, 1].max()) + 1  # drop all-padding columns
        loss = sft_loss(model, ids[batch, :width], labels[batch, :width], pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        window.append(loss.item())
        tokens += int((ids[batch, :width] != pad_id).sum())
        if cfg.log_every and step % cfg.log_every == 0 and step != next_eval:
            elapsed = time.perf_counter() - start
            log(
                f"step {step:5d}  loss {sum(window) / len(window):.4f}  {tokens / elapsed:,.0f} tok/s  {elapsed:6.1f}s"
                f"  eta {elapsed / step * (cfg.max_steps - step):.0f}s (max_steps)"
            )

        if step == next_eval or step == cfg.max_steps:
            sampling = Sampling(cfg.eval_temperature, cfg.seed) if cfg.eval_temperature else None
            result = evaluate(model, tokenizer, stop_rows, cfg.max_new_tokens, log=log, loop=loop, sampling=sampling)
            accuracy = result["accuracy"]
            elapsed = time.perf_counter() - start
            mean_loss = sum(window) / len(window)
            history.append({"step": step, "loss": round(mean_loss, 5), **result, "seconds": round(elapsed, 2)})
            log(f"step {step:5d}  loss {mean_loss:.4f}  accuracy {accuracy:.3f}  {elapsed:6.1f}s")
            window = []
            calls_right = result.get("call_accuracy", 1.0) >= (cfg.stop_at_call_accuracy or 0.0)
            if accuracy >= cfg.stop_at_accuracy and calls_right:
                stopped_by = "accuracy"
                break
            next_eval = step + (cfg.eval_often_every if accuracy >= cfg.eval_often_above else cfg.eval_every)

    train_seconds = time.perf_counter() - start
    final_rows = eval_rows[: cfg.final_eval_examples] if cfg.final_eval_examples else eval_rows
    sampling = Sampling(cfg.eval_temperature, cfg.seed) if cfg.eval_temperature else None
    final = evaluate(model, tokenizer, final_rows, cfg.max_new_tokens, log=log, loop=loop, sampling=sampling)
    if sampling:  # the run's own evaluation is greedy
        greedy = evaluate(model, tokenizer, final_rows, cfg.max_new_tokens, log=log, loop=loop)
        final.update({f"greedy_{k}": v for k, v in greedy.items()})
    final_accuracy = final["accuracy"]
    summary = {
        "steps": step,
        "stopped_by": stopped_by,
        "accuracy": accuracy,
        "accuracy_examples": len(stop_rows),
        "final_accuracy": final_accuracy,
        "final_accuracy_examples": len(final_rows),
        **{f"final_{k}": v for k, v in final.items() if k != "accuracy"},
        "seconds": round(train_seconds, 2),
        "params": params,
        "seed": cfg.seed,
        "history": history,
    }
    log(
        f"sft: stopped by {stopped_by} at step {step} after {train_seconds:.1f}s; "
        f"accuracy {final_accuracy:.3f} on {len(final_rows)} held-out rows"
    )

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        dump_config(cfg, folder / "sft_config.yaml")
        (folder / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    write_folder_atomically(cfg.output_dir, write)
    log(f"sft: wrote {cfg.output_dir}")
    return summary
