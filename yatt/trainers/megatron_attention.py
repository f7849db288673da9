"""Core attention for packed rows on the megatron backend, without Transformer Engine.

megatron-core's own packed-sequence attention (`PackedSeqParams`, the `thd` format) needs Transformer Engine;
its local `DotProductAttention` refuses it. `PackedDotProductAttention` takes the torch backend's way
(yatt.trainers.packing): the decoder's `attention_mask` argument carries a `PackedLayout` instead of a mask
(megatron hands attention_mask from the decoder through every layer to core attention unchanged), and then
the packed queries, keys and values [N, 1, heads, D] are laid out as the padded [B, heads, width, D] block of
the samples' own sequences (a shared prompt copied into each of its samples' rows), causal SDPA runs there,
and each packed token takes its output back from its own slot. Exact: with right padding a real token never
attends to a pad slot. With a tensor mask (the padded path) it is megatron's DotProductAttention unchanged.

Grouped-query attention shares each key/value head among its queries inside SDPA (`enable_gqa`) instead of
repeating them first as DotProductAttention does (the same outputs, without copying keys and values per query
head), and the softmax scale is its `softmax_scale` (1/sqrt(head dim), divided by the layer number with
apply_query_key_layer_scaling).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

from yatt.trainers.packing import PackedLayout


class PackedDotProductAttention(DotProductAttention):
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """query [N, 1, heads, D], key/value [N, 1, groups, D] (this TP rank's heads) -> [N, 1, heads * D]."""
        if not isinstance(attention_mask, PackedLayout):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("packed rows take their layout through attention_mask, not bias or packed_seq_params")
        layout = attention_mask
        gqa = self.num_attention_heads_per_partition > self.num_query_groups_per_partition
        gather = layout.gather.to(query.device)

        def pad(x: Tensor) -> Tensor:  # [N, 1, h, D] -> [B, h, width, D]
            h, d = x.shape[2], x.shape[3]
            return x[:, 0].index_select(0, gather).view(layout.count, layout.width, h, d).transpose(1, 2)

        dropout = self.attention_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(
            pad(query),
            pad(key),
            pad(value),
            dropout_p=dropout,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=gqa,
        )
        # [B, h, width, D] -> [B * width, h * D] -> the packed tokens' own slots [N, 1, h * D]
        out = out.transpose(1, 2).reshape(layout.count * layout.width, -1)
        return out.index_select(0, layout.scatter.to(out.device))[:, None]


def packed_layer_spec(spec: Any) -> Any:
    """megatron's local GPT layer spec with PackedDotProductAttention as the self-attention's core."""
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return spec
