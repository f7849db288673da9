"""A judge at run time: rollouts -> judge prompts (token ids) -> verdicts -> scores."""

from __future__ import annotations

import json
from dataclasses import dataclass

from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.config import EngineConfig
from yatt.genrm.config import JudgeConfig
from yatt.genrm.mixing import mean_over_repeats
from yatt.genrm.template import render
from yatt.models.tokenizer import load_tokenizer


@dataclass
class JudgeScore:
    score: float
    unparseable: int  # repeats whose verdict could not be read


def judge_engine(cfg: JudgeConfig) -> EngineConfig:
    """The judge's engine config, its context defaulting to the model's (the judge reads prompt + response)."""
    if cfg.engine.max_model_len is not None:
        return cfg.engine
    positions = json.loads((cfg.model / "config.json").read_text()).get("max_position_embeddings")
    return cfg.engine.model_copy(update={"max_model_len": positions})


class Judge:
    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        self.sampling = SamplingSpec(
            n=cfg.repeats,
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            stop_token_ids=[self.tokenizer.eos_token_id],
            logprobs=False,
        )
        self.max_prompt_tokens = judge_engine(cfg).max_model_len - cfg.max_tokens

    def prompt_ids(self, question: str, reference: str | None, response: str) -> list[int]:
        ids = self.tokenizer(render(self.cfg.template, question, reference, response), add_special_tokens=False)[
            "input_ids"
        ]
        if len(ids) > self.max_prompt_tokens:
            # Keep the end (the verdict question) and drop the start; counted by the caller as a normal judgement.
            ids = ids[-self.max_prompt_tokens :]
        return ids

    def score(self, completions: list[Completion]) -> JudgeScore:
        verdicts = [
            self.cfg.verdict.parse(self.tokenizer.decode(c.token_ids, skip_special_tokens=True)) for c in completions
        ]
        mean, bad = mean_over_repeats(verdicts, self.cfg.unparseable_score)
        return JudgeScore(mean, bad)
