"""What a micro-batch feeds the model, padded or packed, and where its per-token outputs go back.

Padded: the micro-batch as it is, [B, L] with an attention mask; every row is computed to the longest
one's length. Packed (`trainer.pack_sequences`): the sequences laid end to end in one row [1, N], N =
their real tokens, with per-sequence position ids and cumulative lengths (`cu_seq_lens_*`, the names
transformers' flash-attention path reads), so the linear layers — nearly all of the compute — never see a
pad token.

Attention must still keep packed sequences apart. `ATTENTION` is registered with transformers as an
attention implementation: flash-attention's varlen kernel where it is installed (GPU), else it scatters
the packed queries, keys and values into a padded [B, H, L, D] block, runs causal SDPA there (exact: with
right padding a real token never attends to a pad) and gathers the real rows back. Only attention pays
for the padding; on GPU the SDPA path dispatches to its fused kernels.

Either way only the positions whose next token is a response token (`mb.mask`) reach the output head:
prompt positions need no log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from yatt.trainers.batch import TokenBatch

ATTENTION = "yatt_packed"


@dataclass
class ModelInputs:
    """One micro-batch's forward: model kwargs, and which hidden rows the head scores."""

    kwargs: dict[str, Any]  # input_ids, attention_mask or position_ids + cu_seq_lens_*, ...
    select: Tensor  # [M] rows of the flattened hidden states [batch * width, H] to score
    targets: Tensor  # [M] the token each selected position predicts
    rows: Tensor  # [M] where each score goes in the micro-batch's [B, L-1] per-token tensors
    cols: Tensor  # [M]


def model_inputs(mb: TokenBatch, packed: bool) -> ModelInputs:
    rows, cols = mb.mask.nonzero(as_tuple=True)
    targets = mb.input_ids[rows, cols + 1]
    if not packed:
        width = mb.input_ids.shape[1]
        return ModelInputs({"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}, rows * width + cols,
                           targets, rows, cols)
    lengths = mb.attention_mask.sum(dim=1)
    starts = torch.cumsum(lengths, 0) - lengths
    real = mb.attention_mask.bool()
    positions = torch.arange(mb.input_ids.shape[1], device=lengths.device).expand_as(mb.input_ids)
    cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    longest = int(lengths.max()) if len(lengths) else 0
    kwargs = {"input_ids": mb.input_ids[real][None], "position_ids": positions[real][None],
              "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return ModelInputs(kwargs, starts[rows] + cols, targets, rows, cols)


def _padded_index(cu: Tensor, longest: int) -> Tensor:
    """For each packed token, its slot in a [B * longest] padded layout."""
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    offset = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1].long()[seq]
    return seq * longest + offset


def packed_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[Tensor, None]:
    """Causal attention within each packed sequence. query [1, H, N, D], key/value [1, Hkv, N, D] ->
    ([1, N, H, D], None), as transformers' attention functions return."""
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:  # an unpacked call (e.g. generate on this model): plain SDPA with the model's mask
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    index = _padded_index(cu, longest)
    count = len(cu) - 1

    def pad(x: Tensor) -> Tensor:  # [1, h, N, D] -> [B, h, longest, D]
        h, d = x.shape[1], x.shape[3]
        out = x.new_zeros(h, count * longest, d).index_copy(1, index, x[0])
        return out.view(h, count, longest, d).transpose(0, 1)

    out, _ = sdpa_attention_forward(module, pad(query), pad(key), pad(value), None, dropout, scaling,
                                    is_causal=True)
    # out: [B, longest, H, D] -> the packed rows [1, N, H, D]
    return out.reshape(count * longest, *out.shape[2:]).index_select(0, index)[None], None


def _mask(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """Packed rows come without a padding mask: cu_seq_lens keep their sequences apart inside
    packed_attention, so they need no [N, N] mask. A padded batch gets SDPA's usual mask."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def attention_implementation(device: torch.device) -> str:
    """flash_attention_2 where its varlen kernel is installed (CUDA), else the SDPA fallback above."""
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401
            return "flash_attention_2"
        except ImportError:
            pass
    return ATTENTION


AttentionInterface.register(ATTENTION, packed_attention)
AttentionMaskInterface.register(ATTENTION, _mask)
