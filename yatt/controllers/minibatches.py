"""The optimizer steps of one RL step: each epoch's mini-batches with the global denominators their loss needs."""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from yatt.distributed import World
from yatt.tensors import TokenBatch


def global_mini_batches(world: World, batch: TokenBatch, epochs: list[list[Tensor]]
                        ) -> Iterator[tuple[int, TokenBatch, float, float]]:
    """(epoch, mini-batch, its tokens / world size, its sequences / world size) for the rows of each epoch's
    mini-batches. The counts are summed over ranks: a loss divided by them, summed over micro-batches and
    averaged over ranks by data parallelism, is exactly the loss of the whole global mini-batch. A mini-batch
    no rank holds data for is skipped (every rank sees the same sums, so all skip it)."""
    for epoch, minis in enumerate(epochs):
        for rows in minis:
            mini = batch.select(rows)
            tokens, seqs = world.sum([float(mini.mask.sum()), float(len(mini))])
            if seqs:
                yield epoch, mini, tokens / world.size, seqs / world.size
