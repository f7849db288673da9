"""Partition weighted items into k parts of near-equal total weight.

Pure functions, no torch. All results are deterministic: ties are broken by
item index (and, for Karmarkar-Karp, by creation order of partial solutions).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from yatt.registry import Registry

# A "part" is (sum, indices); a "tuple" is k parts sorted by descending sum.
_Part = tuple[float, list[int]]


def _validate(weights: Sequence[float], k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    for i, w in enumerate(weights):
        if w < 0:
            raise ValueError(f"weights must be non-negative, got weights[{i}]={w}")


def _sorted_desc(weights: Sequence[float]) -> list[int]:
    """Indices ordered by descending weight, ties by ascending index."""
    return sorted(range(len(weights)), key=lambda i: (-weights[i], i))


def _sort_parts(parts: list[_Part]) -> list[_Part]:
    # Stable and fully deterministic: by sum desc, then fewer items, then indices.
    return sorted(parts, key=lambda p: (-p[0], len(p[1]), p[1]))


def karmarkar_karp(weights: Sequence[float], k: int, equal_count: bool = False) -> list[list[int]]:
    """Multi-way Karmarkar-Karp (largest differencing method).

    Keeps a max-heap of partial k-tuples keyed by spread (max part sum minus
    min part sum). Repeatedly pops the two tuples with the largest spread and
    merges them by pairing the largest part of one with the smallest part of
    the other, the second largest with the second smallest, and so on.

    With ``equal_count=True`` the items are taken in descending-weight chunks
    of k, each chunk forming a tuple with one item per part (the last chunk may
    be short). Merging preserves equal counts for full-chunk tuples and at most
    one tuple is ever uneven, so final part sizes differ by at most one.

    Returns k lists of indices into ``weights`` (each sorted ascending); every
    index appears exactly once. Parts may be empty when ``len(weights) < k``.
    """
    _validate(weights, k)
    n = len(weights)
    if n == 0:
        return [[] for _ in range(k)]

    order = _sorted_desc(weights)
    if equal_count:
        groups = [order[s : s + k] for s in range(0, n, k)]
    else:
        groups = [[i] for i in order]

    heap: list[tuple[float, int, list[_Part]]] = []
    seq = 0
    for group in groups:
        parts: list[_Part] = [(float(weights[i]), [i]) for i in group]
        parts += [(0.0, []) for _ in range(k - len(group))]
        parts = _sort_parts(parts)
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), seq, parts))
        seq += 1

    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged = _sort_parts(merged)
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), seq, merged))
        seq += 1

    return [sorted(idx) for _, idx in heap[0][2]]


def greedy_partition(weights: Sequence[float], k: int, equal_count: bool = False) -> list[list[int]]:
    """LPT greedy: items in descending weight order go to the currently lightest part.

    With ``equal_count=True`` only parts with room are eligible: every part holds
    at most ``n // k`` items, and exactly ``n % k`` parts may hold one more, so
    part sizes differ by at most one. Ties go to the lowest part index.
    """
    _validate(weights, k)
    n = len(weights)
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0.0] * k
    base, extras = divmod(n, k)

    for i in _sorted_desc(weights):
        best = -1
        for p in range(k):
            if equal_count:
                c = len(parts[p])
                if not (c < base or (c == base and extras > 0)):
                    continue
            if best < 0 or sums[p] < sums[best]:
                best = p
        if equal_count and len(parts[best]) == base:
            extras -= 1
        parts[best].append(i)
        sums[best] += weights[i]

    return [sorted(p) for p in parts]


def imbalance(weights: Sequence[float], parts: Sequence[Sequence[int]]) -> float:
    """Max part sum divided by mean part sum over all parts (1.0 is perfect balance).

    Returns 1.0 when every part sum is zero.
    """
    if len(parts) == 0:
        raise ValueError("parts must contain at least one part")
    sums = [sum(weights[i] for i in p) for p in parts]
    total = sum(sums)
    if total == 0:
        return 1.0
    return max(sums) / (total / len(parts))


Partitioner = Callable[..., list[list[int]]]

PARTITIONERS: Registry = Registry("balance.partitioner", {"kk": karmarkar_karp, "greedy": greedy_partition})


def get_partitioner(name: str) -> Partitioner:
    """Look up a partitioner by name (one of ``PARTITIONERS``, or an import path)."""
    return PARTITIONERS.get(name)
