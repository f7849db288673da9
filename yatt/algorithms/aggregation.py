"""Masked reductions (and a global whitening over all ranks), loss aggregation modes (`LOSS_AGGREGATIONS`, chosen
by algorithm.loss_agg), and logits -> entropy / log-prob helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from yatt.registry import Registry

if TYPE_CHECKING:
    from yatt.distributed import World

EPS = 1e-8  # added to the variance by global_whiten, as OpenRLHF's masked_normalize does
LOG_RATIO_CLAMP = 20.0  # keeps exp() finite for tokens whose probability moved enormously (see kl.py)


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    # where() first so that inf/NaN in padded positions cannot leak through 0 * inf = NaN.
    return torch.where(mask.bool(), x, 0.0) * mask.to(x.dtype)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of x over positions where mask is nonzero (all dims if dim is None)."""
    masked = _masked(x, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask is nonzero; 0 (not NaN) where nothing is valid."""
    m = mask.to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1.0)


def global_whiten(x: Tensor, mask: Tensor, world: World | None, eps: float = EPS) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the valid entries of every rank; 0 where masked.

    The mean and the (population) variance are global: sums over ranks of sum(x), count, then
    sum((x - mean)^2) -- two small all-reduces, and every rank must call this (a rank holding no samples too).
    """
    local = [float(masked_sum(x, mask)), float(mask.sum())]
    total, count = world.sum(local) if world is not None else local
    if count == 0:
        return torch.zeros_like(x)
    mean = total / count
    sq = [float(masked_sum((x - mean) ** 2, mask))]
    (sq_total,) = world.sum(sq) if world is not None else sq
    var = sq_total / count
    return torch.where(mask.bool(), (x - mean) / (var + eps) ** 0.5, 0.0)


def _token_mean(token_loss: Tensor, mask: Tensor, num_tokens, num_seqs, norm_length) -> Tensor:
    denom = num_tokens if num_tokens is not None else mask.to(token_loss.dtype).sum().clamp_min(1.0)
    return masked_sum(token_loss, mask) / denom


def _seq_mean(per_seq: Tensor, num_seqs) -> Tensor:
    denom = num_seqs if num_seqs is not None else max(per_seq.shape[0], 1)
    return per_seq.sum() / denom


def _seq_mean_token_sum(token_loss: Tensor, mask: Tensor, num_tokens, num_seqs, norm_length) -> Tensor:
    return _seq_mean(masked_sum(token_loss, mask, dim=-1), num_seqs)


def _seq_mean_token_mean(token_loss: Tensor, mask: Tensor, num_tokens, num_seqs, norm_length) -> Tensor:
    lengths = mask.to(token_loss.dtype).sum(dim=-1).clamp_min(1.0)
    return _seq_mean(masked_sum(token_loss, mask, dim=-1) / lengths, num_seqs)


def _seq_mean_token_sum_norm(token_loss: Tensor, mask: Tensor, num_tokens, num_seqs, norm_length) -> Tensor:
    length = token_loss.shape[-1] if norm_length is None else norm_length
    if length <= 0:
        raise ValueError(f"norm_length must be > 0, got {length}")
    return _seq_mean(masked_sum(token_loss, mask, dim=-1) / length, num_seqs)


# mode -> (token_loss [B, T], mask [B, T], num_tokens, num_seqs, norm_length) -> scalar loss
LOSS_AGGREGATIONS: Registry = Registry(
    "algorithm.loss_agg",
    {
        "token-mean": _token_mean,
        "seq-mean-token-sum": _seq_mean_token_sum,
        "seq-mean-token-mean": _seq_mean_token_mean,
        "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    },
)


def aggregate_loss(
    token_loss: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    norm_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar with the LOSS_AGGREGATIONS entry `mode`.

    Modes (len_b = valid tokens of sequence b):
      "token-mean":              sum_bt loss / num_tokens                   (num_tokens: mask.sum())
      "seq-mean-token-sum":      sum_b (sum_t loss) / num_seqs                       (num_seqs: B)
      "seq-mean-token-mean":     sum_b (sum_t loss / max(len_b, 1)) / num_seqs
      "seq-mean-token-sum-norm": sum_b (sum_t loss / norm_length) / num_seqs  (Dr. GRPO; norm_length: T)

    Why the denominators are parameters: with gradient accumulation over micro-batches and
    data-parallel ranks, each micro-batch must be divided by the *global* token / sequence count
    (summed over all micro-batches and ranks), not its own. Then summing the micro-batch losses
    (and DDP's gradient all-reduce, scaled by the world size to undo its averaging) gives exactly
    the full-batch loss; a per-micro-batch mean would weight tokens of short micro-batches more.
    For "seq-mean-token-sum-norm" pass the same norm_length everywhere (e.g. the max response
    length), since micro-batches may be padded to different T.
    """
    return LOSS_AGGREGATIONS.get(mode)(token_loss, mask, num_tokens, num_seqs, norm_length)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in float32: logsumexp - sum(p * logits).

    This form avoids log(p) of tiny probabilities; -inf logits (masked vocab) contribute 0.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    weighted = torch.where(probs > 0, probs * logits, 0.0)
    return torch.logsumexp(logits, dim=-1) - weighted.sum(dim=-1)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[..., targets] for logits [B, T, V], targets [B, T]; float32 [B, T].

    Gathers before normalizing so no [B, T, V] log-softmax tensor is kept for backward.
    """
    logits = logits.float()
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """Advantages [B] (one per sequence) or [B, T] as [B, T], the shape of `like` (a view, no copy)."""
    return (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages).expand_as(like)


def clamped_log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """log(pi / pi_old) per token, clamped to +-LOG_RATIO_CLAMP so that its exp() stays finite."""
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
