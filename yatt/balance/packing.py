"""Micro-batches inside one rank: by sequence count, or packed under a padded-token budget.

A padded forward/backward costs about (sequences x longest sequence) token slots, so packing
sequences of similar length together keeps padding, and the cost of each micro-batch, bounded.
The loss uses global denominators (yatt.controllers.objective), so any split gives the same
gradient up to float rounding: packing changes speed and memory, not the update.
"""

from __future__ import annotations

from typing import Sequence


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices per micro-batch with len(mb) * max length <= budget (a longer row goes alone).

    Rows are taken longest first (ties by index), so each micro-batch holds similar lengths;
    deterministic. Indices inside a micro-batch are ascending.
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    batches: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if current and (len(current) + 1) * max(width, lengths[i]) > budget:
            batches.append(sorted(current))
            current, width = [], 0
        current.append(i)
        width = max(width, lengths[i])
    if current:
        batches.append(sorted(current))
    return batches


def micro_batch_rows(lengths: Sequence[int], size: int, token_budget: int = 0) -> list[list[int]]:
    """The trainer's micro-batches: packed by tokens when token_budget > 0, else `size` rows in order."""
    if token_budget > 0:
        return pack_by_tokens(lengths, token_budget)
    return [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)]


def padded_tokens(lengths: Sequence[int], batches: list[list[int]]) -> int:
    """Token slots a padded forward over `batches` computes (the cost packing minimises)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
