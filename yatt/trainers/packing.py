"""What a micro-batch feeds the model, padded or packed, and where its per-token outputs go back.

Padded: the micro-batch as it is, [B, L] with an attention mask; every row is computed to the longest
one's length. Packed (`trainer.pack_sequences`): the sequences laid end to end in one row [1, N], N =
their real tokens, with per-sequence position ids, so the linear layers — nearly all of the compute — never
see a pad token.

Shared prompts (`trainer.share_prompts`, packed only): an RL batch holds G samples of each prompt, as
consecutive rows. A row whose prompt is the row before's (same length, same ids) does not repeat it in the
packed row: only its response is laid down, with positions continuing from the prompt's end, and its
attention reads the prompt tokens of the group's first row. Causal attention makes a prompt's hidden states
the same in every sample, so this is exact, and the prompt's gradient is the sum over the samples that read
it (autograd adds them up). The linear layers then see each prompt once per micro-batch, not G times.

Attention keeps every sample to its own tokens through `PackedLayout`: `gather` lays the packed queries,
keys and values out as the padded [B, H, L, D] block of the samples' own sequences (a shared prompt copied
into each of its samples' rows), causal SDPA runs there (exact: with right padding a real token never
attends to a pad slot), and `scatter` takes each packed token's output back from one slot. Only attention
pays for the padding and the copies; on GPU the SDPA call dispatches to its fused kernels. Without shared
prompts the micro-batch also carries `cu_seq_lens_*`, what transformers' flash-attention varlen path reads
(`attention_implementation` picks it where flash-attn is installed and prompts are not shared).

Either way only the positions whose next token is a response token (`mb.mask`) reach the output head:
prompt positions need no log-prob.

Image prompts pack the same way: a prompt's image tokens are tokens of its prompt, laid down once per group
with the rest of it, and `ModelInputs.tokens` lays per-token values (where each image feature goes) out like
the ids. Only the decoder takes the packed attention; the vision tower runs apart, on whole images
(`attention_implementation` gives it plain SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from yatt.tensors import TokenBatch

ATTENTION = "yatt_packed"


@dataclass
class ModelInputs:
    """One micro-batch's forward: model kwargs, and which hidden rows the head scores."""

    kwargs: dict[str, Any]  # input_ids, attention_mask or position_ids + packed_layout (+ cu_seq_lens_*), ...
    select: Tensor  # [M] rows of the flattened hidden states [batch * width, H] to score
    targets: Tensor  # [M] the token each selected position predicts
    rows: Tensor  # [M] where each score goes in the micro-batch's [B, L-1] per-token tensors
    cols: Tensor  # [M]
    owner: Tensor | None = None  # packed: [B, L] bool, the tokens the packed row lays down (row-major)
    index: Tensor | None = None  # packed: [B, L] the packed position each real token reads (a shared prompt's
    # tokens: its group's first row's), -1 at padding

    def tokens(self, values: Tensor) -> Tensor:
        """Per-token values of the micro-batch's [B, L] layout in the model's input layout ([1, N] packed)."""
        return values if self.owner is None else values[self.owner][None]


@dataclass
class PackedLayout:
    """Where the packed row's tokens sit in the samples' own sequences (what packed_attention needs)."""

    gather: Tensor  # [B * width] packed token at each slot of the padded [B, width] block (pad slots: 0)
    scatter: Tensor  # [N] the slot each packed token takes its attention output from
    count: int  # B
    width: int  # the longest sample


def shared_prompts(mb: TokenBatch) -> list[int]:
    """Tokens each row shares with the row before it: its prompt (the tokens before its first scored target),
    when both rows have responses and the same prompt (same ids and, for image prompts, the same pixel row:
    two image prompts may expand to the same ids); else 0."""
    if len(mb) == 0:
        return []
    scored = mb.mask.bool()
    has_response = scored.any(dim=1)
    prompt = scored.int().argmax(dim=1) + 1
    ids, cols = mb.input_ids, torch.arange(mb.input_ids.shape[1], device=mb.input_ids.device)
    same = ((ids[1:] == ids[:-1]) | (cols >= prompt[1:, None])).all(dim=1) & (prompt[1:] == prompt[:-1])
    shares = same & has_response[1:] & has_response[:-1]
    if mb.image_index is not None:
        shares &= mb.image_index[1:] == mb.image_index[:-1]
    return [0] + torch.where(shares, prompt[1:], 0).tolist()


def model_inputs(mb: TokenBatch, packed: bool, share_prompts: bool = False) -> ModelInputs:
    rows, cols = mb.mask.nonzero(as_tuple=True)
    targets = mb.input_ids[rows, cols + 1]
    count, width = mb.input_ids.shape
    if not packed:
        return ModelInputs(
            {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask}, rows * width + cols, targets, rows, cols
        )
    device, lengths = mb.input_ids.device, mb.attention_mask.sum(dim=1)
    shares = shared_prompts(mb) if share_prompts else [0] * count
    first = list(range(count))  # the row whose tokens a shared prompt is: its group's first
    for i in range(1, count):
        if shares[i]:
            first[i] = first[i - 1]
    shared = torch.tensor(shares, device=device, dtype=torch.long)
    first = torch.tensor(first, device=device, dtype=torch.long)
    own = lengths - shared  # the tokens each row adds to the packed row
    base = torch.cumsum(own, 0) - own - shared  # packed index of a row's token c >= shared: base + c
    positions = torch.arange(width, device=device).expand(count, width)
    is_shared = positions < shared[:, None]
    token_index = torch.where(is_shared, base[first][:, None], base[:, None]) + positions
    real = mb.attention_mask.bool()
    owner = real & ~is_shared  # the packed row, in row-major order: token_index[owner] == arange(N)
    longest = int(lengths.max()) if count else 0
    slots = torch.arange(count, device=device)[:, None] * longest + positions
    layout = PackedLayout(
        gather=torch.where(real, token_index, 0)[:, :longest].flatten(),
        scatter=slots[owner],
        count=count,
        width=longest,
    )
    kwargs = {"input_ids": mb.input_ids[owner][None], "position_ids": positions[owner][None], "packed_layout": layout}
    if not any(shares):  # what flash-attention's varlen kernel reads (no use for shared prompts)
        cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    index = torch.where(real, token_index, -1)
    return ModelInputs(kwargs, token_index[rows, cols], targets, rows, cols, owner, index)


def packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention within each sample's own sequence. query [1, H, N, D], key/value [1, Hkv, N, D] ->
    ([1, N, H, D], None), as transformers' attention functions return."""
    layout: PackedLayout | None = kwargs.pop("packed_layout", None)
    if layout is None:  # an unpacked call (e.g. generate on this model): plain SDPA with the model's mask
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    gather = layout.gather.to(query.device)

    def pad(x: Tensor) -> Tensor:  # [1, h, N, D] -> [B, h, width, D]; a shared prompt's rows copied per sample
        h, d = x.shape[1], x.shape[3]
        return x[0].index_select(1, gather).view(h, layout.count, layout.width, d).transpose(0, 1)

    out, _ = sdpa_attention_forward(module, pad(query), pad(key), pad(value), None, dropout, scaling, is_causal=True)
    # out: [B, width, H, D] -> the packed rows [1, N, H, D]
    return out.reshape(layout.count * layout.width, *out.shape[2:]).index_select(0, layout.scatter.to(out.device))[
        None
    ], None


def _mask(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """Packed rows come without a padding mask: the layout keeps their samples apart inside
    packed_attention, so they need no [N, N] mask. A padded batch gets SDPA's usual mask."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def attention_implementation(
    device: torch.device, share_prompts: bool = False, vision: bool = False
) -> str | dict[str, str]:
    """flash_attention_2 where its varlen kernel is installed (CUDA) and no prompt is shared, else the SDPA
    path above (shared prompts need the layout's copies, which cu_seq_lens cannot express). A vision-language
    model gets it for its decoder (text_config) only; its vision tower attends over whole images with SDPA."""
    implementation = ATTENTION
    if device.type == "cuda" and not share_prompts:
        try:
            import flash_attn  # noqa: F401

            implementation = "flash_attention_2"
        except ImportError:
            pass
    return {"text_config": implementation, "vision_config": "sdpa"} if vision else implementation


AttentionInterface.register(ATTENTION, packed_attention)
AttentionMaskInterface.register(ATTENTION, _mask)
