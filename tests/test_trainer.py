"""The torch trainer's pieces that need no engine: token batches and the learning-rate schedule."""

import math

import pytest
import torch

from yatt.config import TrainerConfig
from yatt.trainers.batch import TokenBatch
from yatt.trainers.torch_trainer import lr_factor


def test_token_batch_aligns_response_targets():
    batch = TokenBatch.from_sequences([[5, 6, 7], [5]], [[8, 2], [9, 9, 2]], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 2], [5, 9, 9, 2, 0]]
    # column t is the target input_ids[t+1]; response targets are 8,2 (row 0) and 9,9,2 (row 1)
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    lp = batch.per_token([[-0.5, -0.25], [-1.0, -2.0, -3.0]])
    assert lp.tolist() == [[0, 0, -0.5, -0.25], [-1.0, -2.0, -3.0, 0]]
    with pytest.raises(ValueError, match="row 0: 1 values for 2 response tokens"):
        batch.per_token([[-0.5], [-1.0, -2.0, -3.0]])


def test_select_trims_to_the_longest_selected_row():
    batch = TokenBatch.from_sequences([[5, 6, 7], [5]], [[8, 2], [9]], pad_id=0)
    batch.extras["adv"] = torch.tensor([1.0, -1.0])
    sub = batch.select([1])
    assert sub.input_ids.tolist() == [[5, 9]] and sub.mask.tolist() == [[1]] and sub.extras["adv"].tolist() == [-1.0]


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    cfg = TrainerConfig(warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(s, cfg, total_steps=12) for s in range(13)]
    assert factors[:2] == [0.5, 1.0]
    assert math.isclose(factors[2], 1.0) and math.isclose(factors[7], 0.55) and math.isclose(factors[12], 0.1)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
    assert lr_factor(100, TrainerConfig(), total_steps=10) == 1.0
