"""The optimizer steps of one RL step: which rows each mini-batch of each epoch holds (`mini_batches`), and
each mini-batch with the global denominators its loss needs (`global_mini_batches`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from yatt.distributed import World
from yatt.tensors import TokenBatch


def mini_batches(
    count: int, group_size: int, epochs: int, per_epoch: int, *, run_seed: int, step: int, rank: int
) -> list[list[Tensor]]:
    """Rows of each optimizer step, per epoch: `epochs` x `per_epoch` chunks of whole groups of `count` rows, in
    an order seeded by (run, step, rank); exactly `per_epoch` chunks (some maybe empty) on every rank, as ranks
    hold different group counts."""
    generator = torch.Generator().manual_seed(run_seed * 7919 + step * 31 + rank)
    out = []
    for _ in range(epochs):
        order = torch.randperm(count // group_size, generator=generator)
        out.append(
            [
                (chunk[:, None] * group_size + torch.arange(group_size)).flatten()
                for chunk in torch.tensor_split(order, per_epoch)
            ]
        )
    return out


def global_mini_batches(
    world: World, batch: TokenBatch, epochs: list[list[Tensor]]
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
