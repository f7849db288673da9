"""Token-budget micro-batches: packing decisions, and the same update as count-based micro-batches."""

import math

import pytest
import torch

from yatt.algorithms.objective import Algorithm
from yatt.balance.micro_batches import micro_batch_rows, pack_by_tokens, padded_tokens
from yatt.config import AlgorithmConfig, TrainerConfig
from yatt.distributed import World
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.tensors import TokenBatch
from yatt.trainers.torch_trainer import TorchTrainer


def test_pack_respects_the_budget_and_covers_every_row_once():
    lengths = [5, 40, 7, 38, 6, 100, 8, 39]
    batches = pack_by_tokens(lengths, budget=80)
    assert sorted(i for b in batches for i in b) == list(range(8))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 80 or len(b) == 1  # a 100-token row goes alone
    assert batches == [[5], [1, 7], [3, 6], [0, 2, 4]]  # longest first, similar lengths together
    assert batches == pack_by_tokens(lengths, budget=80)  # deterministic
    assert padded_tokens(lengths, batches) < padded_tokens(lengths, micro_batch_rows(lengths, 4))


def test_count_based_rows_and_bad_budget():
    assert micro_batch_rows([1] * 5, size=2) == [[0, 1], [2, 3], [4]]
    assert micro_batch_rows([3, 1, 2], size=2, token_budget=4) == [[0], [1, 2]]
    assert micro_batch_rows([], size=2, token_budget=4) == []
    with pytest.raises(ValueError):
        pack_by_tokens([1], 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m",
        TinyModelConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        ),
    )


def test_token_budget_gives_the_same_update_as_count_based(tiny):
    world = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (4,), generator=gen).tolist() for _ in range(8)]
    responses = [torch.randint(3, 40, (1 + (5 * i) % 11,), generator=gen).tolist() + [2] for i in range(8)]
    results = []
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    # by count; by padded tokens (4 micro-batches); packed: by real tokens
    for cfg, count in (
        (TrainerConfig(lr=1e-2, micro_batch_size=8, micro_batch_tokens=0), 1),
        (TrainerConfig(lr=1e-2, micro_batch_tokens=30, pack_sequences=False), 4),
        (TrainerConfig(lr=1e-2, micro_batch_tokens=30), len(pack_by_tokens(lengths, 30, padded=False))),
    ):
        torch.manual_seed(0)
        trainer = TorchTrainer(tiny, cfg, world)
        batch = TokenBatch.from_sequences(prompts, responses, pad_id=0)
        batch.extras.update(old_logprobs=trainer.logprobs(batch)[0], advantages=torch.tensor([1.0, -1.0] * 4))
        assert len(trainer.micro_batches(batch)) == count
        stats = trainer.train_mini_batch(batch, Algorithm(AlgorithmConfig()).objective(float(batch.mask.sum()), 8, 8))
        results.append((stats["grad_norm"], batch.extras["old_logprobs"], dict(trainer.named_weights())))
    assert pack_by_tokens(lengths, 30, padded=False) != pack_by_tokens(lengths, 30)  # real tokens pack otherwise
    for other in results[1:]:
        assert math.isclose(results[0][0], other[0], rel_tol=1e-4)
        torch.testing.assert_close(results[0][1], other[1])  # packed logprobs land on their own rows
        for name, w in results[0][2].items():
            torch.testing.assert_close(w, other[2][name], rtol=1e-3, atol=1e-4)


def test_rows_that_share_a_prompt_pack_together_and_count_it_once():
    """A group's rows stay one piece while it fits (the shared prompt counted once); a group that does not
    fit is cut, and each piece pays its prompt again."""
    lengths, shared = [10, 12, 11, 5], [0, 8, 8, 0]
    assert pack_by_tokens(lengths, 20, padded=False, shared=shared) == [[0, 1, 2], [3]]  # 10 + 4 + 3 = 17
    assert pack_by_tokens(lengths, 15, padded=False, shared=shared) == [[0, 1], [2], [3]]
    assert pack_by_tokens(lengths, 20, padded=False, shared=shared, max_rows=2) == [[0, 1], [2, 3]]
    assert pack_by_tokens(lengths, 20, padded=False) == [[1], [2], [0, 3]]  # without sharing: rows apart
    assert pack_by_tokens(lengths, 40, padded=True, shared=shared) == pack_by_tokens(lengths, 40)  # padded: no sharing
