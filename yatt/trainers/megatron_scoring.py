"""Per-token log-probs and entropies from a megatron-core GPTModel whose vocabulary is split over TP ranks.

With tensor parallelism each rank holds the logits of its slice of the vocabulary only, so the softmax
statistics are reduced across the tensor-parallel group: the max (no gradient: log-softmax does not depend
on it), then in one all-reduce the sum of exponentials, the target token's logit (held by exactly one rank)
and, for the entropy, sum p * logit. The sums go through megatron's `reduce_from_tensor_model_parallel_region`
(all-reduce forward, identity backward): the loss is the same on every TP rank, so each rank's logits get
exactly their own part of the gradient. (megatron's `vocab_parallel_cross_entropy` gives -log p only and
overwrites its input.)

Only the positions whose next token is scored reach the output layer ([M, 1, H] instead of [L, B, H]), and
the logits columns past the real vocabulary (padding to a multiple of TP) are masked out.

Input rows are right-padded [B, L] with a causal mask, or one packed row [1, N] (yatt.trainers.packing:
samples end to end, a shared prompt once) with its position ids and `PackedLayout`. The layout goes down the
decoder as its attention_mask to `yatt.trainers.megatron_attention`, and each packed token's rotary embedding
is its own position's (GPTModel would give the row's positions 0..N-1).

A value model (PPO's critic, `value_head` in place of the output layer: yatt.trainers.megatron_model) gives
one float32 value per scored position instead. Its head is replicated over TP and sees the same whole hidden
states on every TP rank, so no reduction is needed: each rank computes the same values and loss, hence the
same head gradient and the whole gradient of the hidden states (the decoder's last all-reduce passes it
through unchanged in backward, as for the final norm's replicated weight).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from yatt.trainers.packing import PackedLayout
from yatt.trainers.scoring import ImageSlots, image_features, place_image_features


def vocab_parallel_scores(
    logits: Tensor, targets: Tensor, vocab_start: int, vocab_size: int, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """logits [M, V/TP] (this rank's columns, starting at global id vocab_start), targets [M] global ids ->
    log softmax(logits)[targets] [M] and the entropy [M] (or None), over the full real vocabulary."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    logits = logits.float()
    width = logits.shape[-1]
    valid = torch.arange(vocab_start, vocab_start + width, device=logits.device) < vocab_size
    logits = logits.masked_fill(~valid, float("-inf"))
    top = logits.detach().max(dim=-1).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - top[:, None]
    exp = shifted.exp()
    local = targets - vocab_start
    mine = (local >= 0) & (local < width)
    picked = shifted.gather(1, local.clamp(0, width - 1)[:, None])[:, 0]
    parts = [exp.sum(dim=-1), torch.where(mine, picked, torch.zeros_like(picked))]
    if with_entropy:
        parts.append(torch.where(valid, exp * shifted, torch.zeros_like(exp)).sum(dim=-1))
    # one all-reduce for the sums (each costs ~1 ms over gloo); elementwise the same sums as one per part
    sums = reduce(torch.stack(parts))
    total, target = sums[0], sums[1]
    log_total = total.log()
    logp = target - log_total
    if not with_entropy:
        return logp, None
    return logp, log_total - sums[2] / total


class MegatronScorer(nn.Module):
    """GPTModel seen as (input ids, scored positions) -> per-token log-probs (and entropies) [M], or with a
    `value_head` per-token values [M] (and no entropy): the call of `yatt.trainers.scoring.TokenScorer`.

    The GPTModel is the attribute `module`, so megatron's helpers that look for model attributes through
    wrappers (`get_attr_wrapped_model`: set_input_tensor, pre_process, shared_embedding_or_output_weight)
    find it under this wrapper as under their own DDP. On a pipeline stage other than the last, forward
    returns the stage's hidden states [L, B, H] for the next stage.
    """

    def __init__(self, gpt: nn.Module, vocab_size: int):
        super().__init__()
        self.module, self.vocab_size = gpt, vocab_size

    def forward(
        self,
        input_ids: Tensor,
        select: Tensor,
        targets: Tensor,
        temperature: float,
        with_entropy: bool,
        position_ids: Tensor | None = None,
        packed_layout: PackedLayout | None = None,
        images: ImageSlots | None = None,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """input_ids [B, L] right-padded rows, or with `packed_layout` one packed row [1, N] with its
        `position_ids` (yatt.trainers.packing.model_inputs); select indexes the flattened [B * L] or [N].
        `images` (a VL policy's first stage): the tower's features go in their slots of the decoder input."""
        from megatron.core import parallel_state as ps

        gpt = self.module
        if packed_layout is None:
            width = input_ids.shape[1]
            positions = torch.arange(width, device=input_ids.device).expand_as(input_ids)
            # right-padded rows: causal attention alone keeps real tokens from seeing the padding after them
            mask = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
        else:  # core attention reads the layout (yatt.trainers.megatron_attention) in place of a mask
            positions, mask = position_ids, packed_layout
        decoder_input, rotary, cos, sin, offset = gpt._preprocess(input_ids=input_ids, position_ids=positions)[:5]
        if images is not None:  # decoder_input is sequence-first, [L, B, H]
            features = image_features(gpt.vision, images, decoder_input.shape[-1], decoder_input.dtype)
            decoder_input = place_image_features(decoder_input, features, images.source.t())
        if packed_layout is not None:
            # GPTModel's rotary table covers positions 0..N-1 of the row; a packed token takes its own
            # position's frequencies: [max + 1, 1, 1, D] indexed by position -> [N, 1, 1, D]
            table = gpt.rotary_pos_emb(int(positions.max()) + 1)
            rotary = table.index_select(0, positions[0].to(table.device))
        hidden = gpt.decoder(
            hidden_states=decoder_input,
            attention_mask=mask,
            rotary_pos_emb=rotary,
            rotary_pos_cos=cos,
            rotary_pos_sin=sin,
            sequence_len_offset=offset,
        )
        if not gpt.post_process:
            return hidden
        # [L, B, H] -> the scored rows (row-major over [B, L], or the packed row's, as yatt.trainers.packing
        # numbers them)
        hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1]).index_select(0, select)
        if gpt.output_layer is None:  # a value model: targets and temperature do not apply to values
            if with_entropy:
                raise ValueError("a value model has no entropy")
            return gpt.value_head(hidden)[:, 0].float(), None
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(hidden[:, None], weight=weight)
        logits = logits[:, 0]
        if temperature != 1.0:
            logits = logits / temperature
        start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
        return vocab_parallel_scores(logits, targets, start, self.vocab_size, with_entropy)
