"""SFT examples: a row -> token ids and labels with the loss on the response only.

- `prompt` + `answer` rows: ids = prompt + answer + eos; labels cover answer + eos.
- `messages` rows: the conversation through the tokenizer's chat template; labels cover every assistant turn
  (its content and the end-of-turn text the template writes after it), nothing else. A turn's span is found by
  rendering the conversation up to the turn with the generation prompt and up to the end of the turn, which
  works for any template whose renderings of a conversation's prefixes are prefixes of each other (ChatML,
  Llama, Qwen, SmolLM2 ...); a template that is not is refused, naming the row.
- with an agent loop (SFTConfig.agent), `prompt` + `answer` rows whose answer is the model's turns, each ended
  by the tokenizer's end-of-sequence token (written as its text, e.g. ``</s>``): the turns are replayed through
  the run's own loop (yatt.agents.base.replay), which runs the tools and adds their responses as a rollout of
  the run would; labels cover the model's turns, not the tool responses.
For evaluation a row becomes a prompt (its messages up to the last assistant turn) and a reference answer
(the row's answer, else the last assistant turn's content), scored by the verifier its data_source names.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from yatt.agents.base import AgentLoop, replay
from yatt.data.errors import DataError
from yatt.data.rows import PromptRow
from yatt.data.tokens import chat_ids, text_ids


def _render(tokenizer, messages: list[dict], where: str, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as err:  # jinja errors, a template's raise_exception
        raise DataError(f"{where}: the chat template failed on these messages: {err}") from None


def chat_segments(tokenizer, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_target) pieces; targets are the assistant turns."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: a 'messages' row needs a tokenizer with a chat template")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: a 'messages' row for SFT needs at least one assistant message to learn")
    pieces, done = [], ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], where, add_generation_prompt=True) if k else ""
        through = _render(tokenizer, messages[: k + 1], where, add_generation_prompt=False)
        if not (before.startswith(done) and through.startswith(before)):
            raise DataError(f"{where}: the chat template does not render this conversation's turns as prefixes of "
                            "each other, so the assistant tokens cannot be located")
        pieces += [(before[len(done):], False), (through[len(before):], True)]
        done = through
    full = _render(tokenizer, messages, where, add_generation_prompt=False)
    if not full.startswith(done):
        raise DataError(f"{where}: the chat template renders the whole conversation differently from its turns")
    return [p for p in pieces + [(full[len(done):], False)] if p[0]]


def example_ids(row: PromptRow, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of one training example and labels (-100 where no loss is taken)."""
    if row.messages is not None:
        ids, labels = [], []
        for text, target in chat_segments(tokenizer, row.messages, row.where):
            piece = text_ids(tokenizer, text, row.where)
            ids += piece
            labels += piece if target else [-100] * len(piece)
        return ids, labels
    if row.answer is None:
        raise DataError(f"{row.where}: a 'prompt' row for SFT needs an 'answer' to learn")
    prompt = row.prompt_ids(tokenizer)
    answer = text_ids(tokenizer, row.answer, row.where) + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def agent_example_ids(row: PromptRow, tokenizer, loop: AgentLoop, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """A conversation's example: the prompt's ids as the run builds them (PromptRow.prompt_ids), then what `loop`
    makes of the answer's model turns; labels are the model's tokens (mask 1), -100 on the prompt and the tools'."""
    if row.answer is None:
        raise DataError(f"{row.where}: a row for an agent's SFT needs an 'answer' (the model's turns) to learn")
    eos = tokenizer.eos_token
    texts = row.answer.split(eos)
    if texts[-1] == "":  # the last turn's end-of-sequence written out
        texts.pop()
    turns = [text_ids(tokenizer, text, row.where) + [tokenizer.eos_token_id] for text in texts]
    prompt = row.prompt_ids(tokenizer)
    try:
        trajectory = replay(loop, prompt, turns, max_new_tokens, row)
    except ValueError as err:
        raise DataError(f"{row.where}: {err}") from None
    labels = [t if m else -100 for t, m in zip(trajectory.response_ids, trajectory.response_mask)]
    return prompt + trajectory.response_ids, [-100] * len(prompt) + labels


def _batched_prompt_examples(rows: list[PromptRow], tokenizer) -> list[tuple[list[int], list[int]]]:
    """example_ids of every row; prompt + answer rows are tokenized in one batch call (10x faster on 20k rows),
    and a row whose ids hold the unknown token goes through example_ids again for its error."""
    plain = [r for r in rows if r.messages is None and r.answer is not None]
    batch = {}
    if plain:
        prompts = tokenizer([r.prompt for r in plain], add_special_tokens=False)["input_ids"]
        answers = tokenizer([r.answer for r in plain], add_special_tokens=False)["input_ids"]
        unk = getattr(tokenizer, "unk_token_id", None)
        for r, p, a in zip(plain, prompts, answers):
            if unk is None or (unk not in p and unk not in a):
                a = list(a) + [tokenizer.eos_token_id]
                batch[id(r)] = (list(p) + a, [-100] * len(p) + a)
    return [batch[id(r)] if id(r) in batch else example_ids(r, tokenizer) for r in rows]


def encode_examples(rows: list[PromptRow], tokenizer, max_tokens: int | None = None,
                    loop: AgentLoop | None = None, max_new_tokens: int = 0, log=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels of all rows (padding has label -100); with `loop`, each row is a conversation
    (agent_example_ids, each model turn at most `max_new_tokens`; an environment's game can take a second each,
    so `log` gets a progress line every ~10 s)."""
    if loop is None:
        pairs = _batched_prompt_examples(rows, tokenizer)
    else:
        pairs, start, shown = [], time.perf_counter(), time.perf_counter()
        for row in rows:
            pairs.append(agent_example_ids(row, tokenizer, loop, max_new_tokens))
            if log and time.perf_counter() - shown > 10:
                shown = time.perf_counter()
                log(f"  replayed {len(pairs)}/{len(rows)} conversations through the loop, {shown - start:.0f}s")
    for row, (ids, _) in zip(rows, pairs):
        if max_tokens is not None and len(ids) > max_tokens:
            raise DataError(f"{row.where}: the example has {len(ids)} tokens, more than max_tokens={max_tokens}")
    width = max(len(ids) for ids, _ in pairs)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(pairs), width), pad, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (x, y) in enumerate(pairs):
        ids[i, : len(x)], labels[i, : len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, labels


def eval_prompt(row: PromptRow, tokenizer) -> tuple[list[int], PromptRow]:
    """The prompt ids a model answers and the row its answer is scored against (reference filled in)."""
    if row.messages is None:
        return row.prompt_ids(tokenizer), row
    last = max((k for k, m in enumerate(row.messages) if m["role"] == "assistant"), default=None)
    context = row.messages if last is None else row.messages[:last]
    if not context:
        raise DataError(f"{row.where}: no message before the assistant's to use as the prompt")
    answer = row.answer if row.answer is not None or last is None else row.messages[last]["content"]
    if answer is None:
        raise DataError(f"{row.where}: an eval row needs an 'answer' or a final assistant message")
    return chat_ids(tokenizer, context, row.where), replace(row, answer=answer)
