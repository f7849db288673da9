"""Micro-batches inside one rank: by sequence count, or under a token budget.

A padded forward/backward costs about (sequences x longest sequence) token slots, so packing
sequences of similar length together keeps padding, and the cost of each micro-batch, bounded. A
packed one (trainer.pack_sequences) costs its real tokens: the budget bounds activation memory.
The loss uses global denominators (yatt.controllers.objective), so any split gives the same
gradient up to float rounding: packing changes speed and memory, not the update.
"""

from __future__ import annotations

from typing import Sequence


def pack_by_tokens(lengths: Sequence[int], budget: int, padded: bool = True,
                   max_rows: int | None = None) -> list[list[int]]:
    """Row indices per micro-batch with at most `budget` tokens (a longer row goes alone) and `max_rows`
    rows: padded tokens (len(mb) * max length) if `padded`, else real tokens (sum of lengths).

    Rows are taken longest first (ties by index), so each micro-batch holds similar lengths;
    deterministic. Indices inside a micro-batch are ascending.
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    batches: list[list[int]] = []
    current: list[int] = []
    width = total = 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        cost = (len(current) + 1) * max(width, lengths[i]) if padded else total + lengths[i]
        if current and (cost > budget or len(current) == max_rows):
            batches.append(sorted(current))
            current, width, total = [], 0, 0
        current.append(i)
        width, total = max(width, lengths[i]), total + lengths[i]
    if current:
        batches.append(sorted(current))
    return batches


def micro_batch_rows(lengths: Sequence[int], size: int, token_budget: int = 0,
                     padded: bool = True) -> list[list[int]]:
    """The trainer's micro-batches: under token_budget (and at most `size` rows) when token_budget > 0,
    else `size` rows in order."""
    if token_budget > 0:
        return pack_by_tokens(lengths, token_budget, padded, max_rows=size)
    return [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)]


def padded_tokens(lengths: Sequence[int], batches: list[list[int]]) -> int:
    """Token slots a padded forward over `batches` computes (the cost packing minimises)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
