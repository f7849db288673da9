"""algorithm.old_logprobs=reuse on a rank whose rows are all in the first mini-batch: a replicated (DDP) trainer
is not asked for log-probs, a sharded one (FSDP2, megatron: every forward a collective) is, with no rows, so the
other ranks' forwards are not left waiting (a quickstart under FSDP2 hung at step 564 when they were)."""

from __future__ import annotations

import pytest
import torch

from yatt.algorithms.objective import Algorithm
from yatt.config import AlgorithmConfig
from yatt.controllers.policy import old_logprobs
from yatt.tensors import TokenBatch


class Recording:
    head = "lm"

    def __init__(self, replicated: bool):
        self.replicated, self.calls = replicated, []

    def logprobs(self, batch: TokenBatch, with_entropy: bool = False):
        self.calls.append(len(batch))
        return torch.zeros_like(batch.mask), torch.zeros_like(batch.mask)


@pytest.mark.parametrize("replicated, calls", [(True, []), (False, [0])])
def test_a_rank_with_every_row_on_policy_still_joins_a_sharded_forward(replicated, calls):
    batch = TokenBatch.from_sequences([[3, 4], [5, 6]], [[7], [8, 9]], pad_id=0)
    trainer = Recording(replicated)
    algorithm = Algorithm(AlgorithmConfig(old_logprobs="reuse"))
    old, _ = old_logprobs(trainer, algorithm, batch, [torch.tensor([0, 1])], has_ref=False)
    assert trainer.calls == calls and old.shape == batch.mask.shape
