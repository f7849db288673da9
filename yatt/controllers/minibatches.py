"""The optimizer steps of one RL step: which rows each mini-batch of each epoch holds (`mini_batches`), and
each mini-batch with the global denominators its loss needs (`global_mini_batches`)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from yatt.config import ExperimentConfig
from yatt.distributed import World
from yatt.tensors import TokenBatch


def mini_batches(count: int, cfg: ExperimentConfig, step: int, rank: int) -> list[list[Tensor]]:
    """Rows of each optimizer step, per epoch: algorithm.ppo_epochs x algorithm.mini_batches chunks of whole
    groups (rollout.group_size) of `count` rows, in an order seeded by (run, step, rank); exactly mini_batches
    chunks (some maybe empty) on every rank, as ranks hold different group counts."""
    group = cfg.rollout.group_size
    generator = torch.Generator().manual_seed(cfg.run.seed * 7919 + step * 31 + rank)
    out = []
    for _ in range(cfg.algorithm.ppo_epochs):
        order = torch.randperm(count // group, generator=generator)
        chunks = torch.tensor_split(order, cfg.algorithm.mini_batches)
        out.append([(chunk[:, None] * group + torch.arange(group)).flatten() for chunk in chunks])
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
