"""Per-token log-probs and entropies of a causal LM, without full-vocabulary float32 logits.

A loss needs one log-prob per response token, yet a plain forward materialises logits [B, L, V] (and
float32 copies, and their gradients) — for a 49k vocabulary that is most of a step's memory. Here the
decoder's hidden states are taken at the scored positions only ([M, H]), and the output head runs over
them `chunk_tokens` at a time: each chunk's logits live only while its log-probs are computed, and in
backward they are recomputed chunk by chunk (activation checkpointing of the head). The values are the
same as from full logits; the peak is one chunk's [chunk_tokens, V] instead of [B, L, V].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from yatt.algorithms import entropy_from_logits, token_logprobs


def _chunk_scores(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor] | Tensor:
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, targets)
    return (logp, entropy_from_logits(logits)) if with_entropy else logp


def head_scores(
    hidden: Tensor, head: nn.Linear, targets: Tensor, temperature: float, with_entropy: bool, chunk_tokens: int
) -> tuple[Tensor, Tensor | None]:
    """log softmax(head(hidden) / T)[targets] (and the entropy) for hidden [M, H], targets [M] -> [M]."""
    chunk = chunk_tokens if chunk_tokens > 0 else max(len(hidden), 1)
    recompute = torch.is_grad_enabled() and hidden.requires_grad and chunk < len(hidden)
    logps, ents = [], []
    # at least one (maybe empty) chunk: an empty micro-batch still reaches every weight, which DDP needs
    for start in range(0, max(len(hidden), 1), chunk):
        args = (
            hidden[start : start + chunk],
            head.weight,
            head.bias,
            targets[start : start + chunk],
            temperature,
            with_entropy,
        )
        out = checkpoint(_chunk_scores, *args, use_reentrant=False) if recompute else _chunk_scores(*args)
        logp, ent = out if with_entropy else (out, None)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents) if with_entropy else None


@dataclass
class ImageSlots:
    """A micro-batch's images as the scorer takes them: the vision tower's inputs, one row per distinct image
    prompt, and for each token of the model's input (its [B, L] or packed [1, N] layout) the image feature it
    takes: prompt row x per_prompt + the slot's rank within its prompt, or -1 (the token's own embedding)."""

    pixels: dict[str, Tensor]  # [P, ...] each
    source: Tensor  # long, the layout of input_ids
    per_prompt: int  # image tokens per prompt (every image prompt of a batch has one image layout)


class TokenScorer(nn.Module):
    """A Hugging Face causal LM seen as (model inputs, scored positions) -> per-token log-probs [M].

    Data parallelism wraps this module (so DDP sees the forward that produces the loss); the LM inside
    keeps its Hugging Face parameter names.
    """

    def __init__(self, lm: nn.Module, chunk_tokens: int):
        super().__init__()
        config = lm.config
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
            raise ValueError(
                f"{type(lm).__name__} transforms its logits after the output head "
                "(softcapping or a logit scale), which yatt's trainer does not reproduce"
            )
        self.lm, self.chunk_tokens = lm, chunk_tokens

    def forward(
        self, model_kwargs: dict[str, Any], select: Tensor, targets: Tensor, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        if "images" in model_kwargs:
            model_kwargs = self._merge_images(dict(model_kwargs))
        hidden = self.lm.get_decoder()(**model_kwargs, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, select)
        return head_scores(
            hidden, self.lm.get_output_embeddings(), targets, temperature, with_entropy, self.chunk_tokens
        )

    def _merge_images(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A vision-language model's decoder inputs: token embeddings with the vision tower's features in the
        prompts' image slots only. The tower runs once per distinct prompt (`images.pixels` rows), and each
        slot takes its feature by index, so a prompt's G samples, or the one copy of it a packed group lays
        down, share one encoding; its gradient is the sum over the slots that read it. The model's own merge
        would also fill a placeholder token that a response happens to contain, which the engines embedded as
        a plain token when they sampled it."""
        images: ImageSlots = kwargs.pop("images")
        embeds = self.lm.get_input_embeddings()(kwargs.pop("input_ids"))
        features = self.lm.model.get_image_features(**images.pixels, return_dict=True).pooler_output
        features = features.reshape(-1, embeds.shape[-1]).to(embeds.dtype)
        prompts = next(iter(images.pixels.values())).shape[0]
        if features.shape[0] != prompts * images.per_prompt:
            raise ValueError(
                f"{images.per_prompt} image slots per prompt for {features.shape[0] // max(prompts, 1)} image features"
            )
        slots = images.source >= 0
        taken = features.index_select(0, images.source[slots])
        kwargs["inputs_embeds"] = embeds.masked_scatter(slots[..., None].expand_as(embeds), taken)
        return kwargs


class ValueScorer(nn.Module):
    """A one-label token-classification model (decoder + scalar head) seen as (model inputs, scored positions)
    -> per-token values [M], float32: the call of `TokenScorer`, so the trainer runs a critic and a policy
    through the same code (targets and temperature do not apply to values)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if model.config.num_labels != 1:
            raise ValueError(
                f"a value model needs one output per token, {type(model).__name__} has "
                f"num_labels={model.config.num_labels}"
            )
        self.model = model

    def forward(
        self, model_kwargs: dict[str, Any], select: Tensor, targets: Tensor, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, None]:
        if with_entropy:
            raise ValueError("a value model has no entropy")
        scores = self.model(**model_kwargs, use_cache=False).logits  # [rows, width, 1]: one scalar per position
        return scores.reshape(-1).index_select(0, select).float(), None
