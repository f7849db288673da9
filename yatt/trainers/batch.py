"""Token batches: prompt+response sequences, right-padded, with per-token tensors aligned to targets.

Per-token tensors have shape [B, L-1]: column t belongs to target token input_ids[:, t+1], predicted
from the logits at position t. `mask` is 1 where that target is a response token. A batch of image prompts
also carries `pixels`: the processor's image tensors, one row per sequence (yatt.models.vision).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class TokenBatch:
    input_ids: Tensor                      # [B, L] long
    attention_mask: Tensor                 # [B, L] long
    mask: Tensor                           # [B, L-1] float: response targets
    extras: dict[str, Tensor] = field(default_factory=dict)  # [B] or [B, L-1] tensors riding along
    # the sampling temperature of the responses: log-probs are of softmax(logits / temperature), the
    # distribution the engine sampled from (1.0 for data that was not sampled, e.g. SFT)
    temperature: float = 1.0
    # image prompts: the vision inputs the model takes next to input_ids (e.g. pixel_values), [B, ...] each;
    # every row has the same image layout (count and size); empty for text
    pixels: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def from_sequences(cls, prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> "TokenBatch":
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        width = max(lengths, default=2)  # a rank may hold no samples after rebalancing
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width - 1), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
            attn[i, : len(p) + len(r)] = 1
            mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
        return cls(ids, attn, mask)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def per_token(self, values: list[list[float]]) -> Tensor:
        """Lay response-aligned lists (e.g. rollout logprobs) into a [B, L-1] tensor under the mask."""
        out = torch.zeros_like(self.mask)
        for i, row in enumerate(values):
            cols = self.mask[i].nonzero().flatten()
            if len(row) != len(cols):
                raise ValueError(f"row {i}: {len(row)} values for {len(cols)} response tokens")
            out[i, cols] = torch.tensor(row, dtype=out.dtype)
        return out

    def select(self, rows: Tensor | list[int]) -> "TokenBatch":
        """A sub-batch of `rows`, trimmed to its own longest sequence (less padding to compute)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.attention_mask[rows].sum(dim=1).max()) if len(rows) else 2
        extras = {k: (v[rows, : width - 1] if v.dim() == 2 else v[rows]) for k, v in self.extras.items()}
        return TokenBatch(self.input_ids[rows, :width], self.attention_mask[rows, :width],
                          self.mask[rows, : width - 1], extras, self.temperature,
                          {k: v[rows] for k, v in self.pixels.items()})

    def lengths(self) -> list[int]:
        """Real (unpadded) tokens per sequence."""
        return self.attention_mask.sum(dim=1).tolist()

    def to(self, device: torch.device) -> "TokenBatch":
        return TokenBatch(self.input_ids.to(device), self.attention_mask.to(device), self.mask.to(device),
                          {k: v.to(device) for k, v in self.extras.items()}, self.temperature,
                          {k: v.to(device) for k, v in self.pixels.items()})
