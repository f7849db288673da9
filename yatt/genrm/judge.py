"""A judge at run time: rollouts -> judge prompts (token ids, and images for a VL judge) -> verdicts -> scores.

A judge whose folder is a vision-language model (yatt.models.vision) sees an image prompt's images: its
request carries one placeholder per image (at the template's {images}) and the images' bytes, which its
engine expands with the judge's own processor, as the policy's engines do. A text-only judge gets the text
alone (the question without its image markers) and no images. A VL judge given a text prompt judges it on the
text: {images} is empty.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

from yatt.data.images import IMAGE_PLACEHOLDER
from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.config import EngineConfig
from yatt.genrm.config import JudgeConfig
from yatt.genrm.mixing import mean_over_repeats
from yatt.genrm.template import render
from yatt.models.tokenizer import load_tokenizer
from yatt.models.vision import ImageInputs, is_vision_model


@dataclass
class JudgeScore:
    score: float
    unparseable: int  # repeats whose verdict could not be read


def judge_engine(cfg: JudgeConfig) -> EngineConfig:
    """The judge's engine config, its context defaulting to the model's (the judge reads prompt + response)."""
    if cfg.engine.max_model_len is not None:
        return cfg.engine
    config = json.loads((cfg.model / "config.json").read_text())
    positions = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
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
        self.vision = is_vision_model(cfg.model)
        self.image_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER) if self.vision else None
        self._inputs: ImageInputs | None = None  # the judge's processor, loaded at the first image
        self._image_tokens: dict[tuple[int, int], int] = {}  # image size -> tokens it expands to

    def request(
        self, question: str, reference: str | None, response: str, images: list[bytes] | None = None
    ) -> tuple[list[int], list[bytes] | None]:
        """The judge's prompt ids and the images its engine gets with them (None: none). `images`: the judged
        prompt's images (encoded bytes), None for a text prompt."""
        seen = images if self.vision and images else None
        if images or self.vision:  # only {images} places images: a marker left in a text is no image
            question = question.replace(IMAGE_PLACEHOLDER, "")
        if self.vision:
            reference = reference and reference.replace(IMAGE_PLACEHOLDER, "")
            response = response.replace(IMAGE_PLACEHOLDER, "")
        text = render(self.cfg.template, question, reference, response, IMAGE_PLACEHOLDER * len(seen or []))
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._fit(ids, seen), seen

    def prompt_ids(self, question: str, reference: str | None, response: str) -> list[int]:
        """The prompt of a text judgement."""
        return self.request(question, reference, response)[0]

    def _fit(self, ids: list[int], images: list[bytes] | None) -> list[int]:
        """Within the judge's context (its images counted as expanded): keep the end (the verdict question)
        and the image placeholders, drop text from the start; counted by the caller as a normal judgement."""
        over = len(ids) + sum(self._expanded(b) - 1 for b in images or []) - self.max_prompt_tokens
        if over <= 0:
            return ids
        if over >= len(ids) - len(images or []):
            raise ValueError(
                f"judge {self.cfg.name!r}: the prompt's {len(images or [])} image(s) alone need more than the "
                f"{self.max_prompt_tokens} prompt tokens its context leaves; raise its engine.max_model_len"
            )
        out, dropped = [], 0
        for token in ids:
            if dropped < over and token != self.image_id:
                dropped += 1
                continue
            out.append(token)
        return out

    def _expanded(self, data: bytes) -> int:
        """Tokens one image becomes in the judge's engine, measured once per image size (a processor's
        expansion depends on the size alone)."""
        from PIL import Image

        size = Image.open(io.BytesIO(data)).size  # the header only; the images were checked when the data loaded
        if size not in self._image_tokens:
            self._inputs = self._inputs or ImageInputs(self.cfg.model)
            ids, _ = self._inputs.encode([self._inputs.image_token_id], [data], f"judge {self.cfg.name}")
            self._image_tokens[size] = len(ids)
        return self._image_tokens[size]

    def score(self, completions: list[Completion]) -> JudgeScore:
        verdicts = [
            self.cfg.verdict.parse(self.tokenizer.decode(c.token_ids, skip_special_tokens=True)) for c in completions
        ]
        mean, bad = mean_over_repeats(verdicts, self.cfg.unparseable_score)
        return JudgeScore(mean, bad)
