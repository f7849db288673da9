"""Per-token log-probs and entropies of a causal LM, without full-vocabulary float32 logits.

A loss needs one log-prob per response token, yet a plain forward materialises logits [B, L, V] (and
float32 copies, and their gradients) — for a 49k vocabulary that is most of a step's memory. Here the
decoder's hidden states are taken at the scored positions only ([M, H]), and the output head runs over
them `chunk_tokens` at a time: each chunk's logits live only while its log-probs are computed, and in
backward they are recomputed chunk by chunk (activation checkpointing of the head). The values are the
same as from full logits; the peak is one chunk's [chunk_tokens, V] instead of [B, L, V].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from yatt.algorithms import entropy_from_logits, token_logprobs


def _chunk_scores(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                  with_entropy: bool) -> tuple[Tensor, Tensor] | Tensor:
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, targets)
    return (logp, entropy_from_logits(logits)) if with_entropy else logp


def head_scores(hidden: Tensor, head: nn.Linear, targets: Tensor, temperature: float, with_entropy: bool,
                chunk_tokens: int) -> tuple[Tensor, Tensor | None]:
    """log softmax(head(hidden) / T)[targets] (and the entropy) for hidden [M, H], targets [M] -> [M]."""
    chunk = chunk_tokens if chunk_tokens > 0 else max(len(hidden), 1)
    recompute = torch.is_grad_enabled() and hidden.requires_grad and chunk < len(hidden)
    logps, ents = [], []
    # at least one (maybe empty) chunk: an empty micro-batch still reaches every weight, which DDP needs
    for start in range(0, max(len(hidden), 1), chunk):
        args = (hidden[start:start + chunk], head.weight, head.bias, targets[start:start + chunk], temperature,
                with_entropy)
        out = checkpoint(_chunk_scores, *args, use_reentrant=False) if recompute else _chunk_scores(*args)
        logp, ent = out if with_entropy else (out, None)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents) if with_entropy else None


class TokenScorer(nn.Module):
    """A Hugging Face causal LM seen as (model inputs, scored positions) -> per-token log-probs [M].

    Data parallelism wraps this module (so DDP sees the forward that produces the loss); the LM inside
    keeps its Hugging Face parameter names.
    """

    def __init__(self, lm: nn.Module, chunk_tokens: int):
        super().__init__()
        config = lm.config
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
            raise ValueError(f"{type(lm).__name__} transforms its logits after the output head "
                             "(softcapping or a logit scale), which yatt's trainer does not reproduce")
        self.lm, self.chunk_tokens = lm, chunk_tokens

    def forward(self, model_kwargs: dict[str, Any], select: Tensor, targets: Tensor, temperature: float,
                with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        # a vision-language model: its base model (vision tower + connector + decoder) takes the pixel inputs;
        # its get_decoder() would be the text decoder alone
        body = self.lm.model if getattr(self.lm.config, "vision_config", None) is not None else self.lm.get_decoder()
        hidden = body(**model_kwargs, use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, select)
        return head_scores(hidden, self.lm.get_output_embeddings(), targets, temperature, with_entropy,
                           self.chunk_tokens)
