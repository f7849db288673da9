"""Micro-batches inside one rank: by sequence count, or under a token budget.

A padded forward/backward costs about (sequences x longest sequence) token slots, so packing
sequences of similar length together keeps padding, and the cost of each micro-batch, bounded. A
packed one (trainer.pack_sequences) costs its real tokens: the budget bounds activation memory.
The loss uses global denominators (yatt.controllers.objective), so any split gives the same
gradient up to float rounding: packing changes speed and memory, not the update.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_by_tokens(
    lengths: Sequence[int],
    budget: int,
    padded: bool = True,
    max_rows: int | None = None,
    shared: Sequence[int] | None = None,
) -> list[list[int]]:
    """Row indices per micro-batch with at most `budget` tokens (a longer row goes alone) and `max_rows`
    rows: padded tokens (len(mb) * max length) if `padded`, else real tokens (sum of lengths).

    `shared[i]` (packed only): tokens row i shares with row i-1 (a GRPO group's prompt, counted once in the
    packed row: yatt.trainers.packing). Such rows stay together, as one piece, while the piece fits; a group
    that does not fit is cut into pieces, each laying its prompt down again.

    Pieces (single rows unless shared) are taken longest first (ties by first index), so each micro-batch
    holds similar lengths; deterministic. Indices inside a micro-batch are ascending.
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    limit = max_rows or len(lengths) or 1
    pieces: list[tuple[int, list[int]]] = []  # (packed tokens, consecutive rows)
    for i, n in enumerate(lengths):
        saving = 0 if padded or shared is None else shared[i]
        if saving and pieces and pieces[-1][1][-1] == i - 1:
            cost, rows = pieces[-1]
            if cost + n - saving <= budget and len(rows) < limit:
                pieces[-1] = (cost + n - saving, rows + [i])
                continue
        pieces.append((n, [i]))
    batches: list[list[int]] = []
    current: list[int] = []
    width = total = 0
    for cost, rows in sorted(pieces, key=lambda p: (-p[0], p[1][0])):
        longest = max(lengths[i] for i in rows)
        size = (len(current) + len(rows)) * max(width, longest) if padded else total + cost
        if current and (size > budget or len(current) + len(rows) > limit):
            batches.append(sorted(current))
            current, width, total = [], 0, 0
        current += rows
        width, total = max(width, longest), total + cost
    if current:
        batches.append(sorted(current))
    return batches


def micro_batch_rows(
    lengths: Sequence[int], size: int, token_budget: int = 0, padded: bool = True, shared: Sequence[int] | None = None
) -> list[list[int]]:
    """The trainer's micro-batches: under token_budget (and at most `size` rows) when token_budget > 0,
    else `size` rows in order. `shared`: as in pack_by_tokens."""
    if token_budget > 0:
        return pack_by_tokens(lengths, token_budget, padded, max_rows=size, shared=shared)
    return [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)]


def padded_tokens(lengths: Sequence[int], batches: list[list[int]]) -> int:
    """Token slots a padded forward over `batches` computes (the cost packing minimises)."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
