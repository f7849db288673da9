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
from yatt.tensors import TokenBatch
from yatt.trainers.packing import ModelInputs


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


def image_slots(mb: TokenBatch, inputs: ModelInputs, image_token_id: int, dtype: torch.dtype) -> ImageSlots:
    """Where mb's image features go: the placeholders of each image row's prompt, in order, take its pixel
    row's features; never a response token that is one (the engines embedded it as a plain token). Pixels in
    the tower's dtype."""
    response = torch.zeros_like(mb.attention_mask, dtype=torch.bool)
    response[:, 1:] = mb.mask.bool()
    slots = (mb.input_ids == image_token_id) & ~response & mb.attention_mask.bool()
    counts = slots.sum(dim=1)
    image_rows = mb.image_index >= 0
    per_prompt = int(counts[image_rows][0]) if bool(image_rows.any()) else 0
    if bool((counts != torch.where(image_rows, per_prompt, 0)).any()):
        raise ValueError(
            f"image slots per row {counts.tolist()} do not fit the rows' images (pixel rows "
            f"{mb.image_index.tolist()}): every image prompt needs one layout, a text row none"
        )
    source = torch.where(slots, mb.image_index[:, None] * per_prompt + slots.cumsum(dim=1) - 1, -1)
    pixels = {k: v.to(dtype) if v.is_floating_point() else v for k, v in mb.pixels.items()}
    return ImageSlots(pixels, inputs.tokens(source), per_prompt)


def image_features(tower: nn.Module, images: ImageSlots, hidden: int, dtype: torch.dtype) -> Tensor:
    """The vision tower (and connector) of a Hugging Face VL model's inner model (its `get_image_features`)
    over one row per distinct image prompt -> [prompts x per_prompt, hidden]. It runs once per distinct
    prompt, and each slot takes its feature by index (`place_image_features`), so a prompt's G samples, or the
    one copy of it a packed group lays down, share one encoding; its gradient is the sum over the slots that
    read it."""
    features = tower.get_image_features(**images.pixels, return_dict=True).pooler_output
    features = features.reshape(-1, hidden).to(dtype)
    prompts = next(iter(images.pixels.values())).shape[0]
    if features.shape[0] != prompts * images.per_prompt:
        raise ValueError(
            f"{images.per_prompt} image slots per prompt for {features.shape[0] // max(prompts, 1)} image features"
        )
    return features


def place_image_features(embeds: Tensor, features: Tensor, source: Tensor) -> Tensor:
    """embeds [..., H] with features[source] where source >= 0; source has embeds' layout without H (the
    model input's [B, L] or [1, N], or megatron's sequence-first transpose of it)."""
    slots = source >= 0
    taken = features.index_select(0, source[slots])
    return embeds.masked_scatter(slots[..., None].expand_as(embeds), taken)


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
        prompts' image slots only (`place_image_features`). The model's own merge would also fill a placeholder
        token that a response happens to contain, which the engines embedded as a plain token when they
        sampled it."""
        images: ImageSlots = kwargs.pop("images")
        embeds = self.lm.get_input_embeddings()(kwargs.pop("input_ids"))
        features = image_features(self.lm.model, images, embeds.shape[-1], embeds.dtype)
        kwargs["inputs_embeds"] = place_image_features(embeds, features, images.source)
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
