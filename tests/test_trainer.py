"""The torch trainer's pieces that need no engine: token batches and the learning-rate schedule."""

import math

import pytest
import torch

from yatt.config import TrainerConfig
from yatt.tensors import TokenBatch
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


def test_token_batch_edge_rows_and_a_gapped_mask():
    """An empty response, an empty batch (a rank left without samples), and values laid under a mask with gaps
    (an agent loop's tool tokens masked out): each row's values go to its own masked columns, in order."""
    batch = TokenBatch.from_sequences([[5, 6], [7]], [[], [8, 9, 2]], pad_id=0)
    assert batch.attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch.mask.tolist() == [[0, 0, 0], [1, 1, 1]]
    batch.mask = batch.mask * batch.per_token([[], [1, 0, 1]])
    assert batch.per_token([[], [-1.0, -3.0]]).tolist() == [[0, 0, 0], [-1.0, 0, -3.0]]
    with pytest.raises(ValueError, match="1 rows of values for a batch of 2"):
        batch.per_token([[]])
    empty = TokenBatch.from_sequences([], [], pad_id=0)
    assert empty.input_ids.shape == (0, 2) and empty.mask.shape == (0, 1) and empty.per_token([]).shape == (0, 1)


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


# ---- the trainer on a real (tiny) model, one process ---------------------------------------------

from yatt.algorithms.objective import Algorithm  # noqa: E402
from yatt.config import AlgorithmConfig  # noqa: E402
from yatt.distributed import World  # noqa: E402
from yatt.models.tiny import TinyModelConfig, write_tiny_model  # noqa: E402
from yatt.trainers.torch_trainer import TorchTrainer  # noqa: E402

WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m",
        TinyModelConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        ),
    )


def rl_batch(trainer: TorchTrainer, ref: TorchTrainer | None = None) -> TokenBatch:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (4,), generator=gen).tolist() for _ in range(8)]
    responses = [torch.randint(3, 40, (1 + i % 4,), generator=gen).tolist() + [2] for i in range(8)]
    batch = TokenBatch.from_sequences(prompts, responses, pad_id=0)
    old, _ = trainer.logprobs(batch)
    batch.extras.update(old_logprobs=old, advantages=torch.tensor([1.0, -1.0] * 4))
    if ref is not None:
        batch.extras["ref_logprobs"] = ref.logprobs(batch)[0]
    return batch


def weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.named_weights()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batching_does_not_change_the_update(tiny, mode):
    """Global denominators make 4 micro-batches of 2 give the same step as one micro-batch of 8."""
    algo = AlgorithmConfig(loss_agg=mode)
    results = []
    for micro in (8, 2):
        torch.manual_seed(0)
        trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-2, micro_batch_size=micro), WORLD)
        batch = rl_batch(trainer)
        stats = trainer.train_mini_batch(batch, Algorithm(algo).objective(float(batch.mask.sum()), len(batch), 8))
        assert math.isfinite(stats["grad_norm"]) and stats["tokens"] == batch.mask.sum()
        results.append((stats["grad_norm"], weights(trainer)))
    assert math.isclose(results[0][0], results[1][0], rel_tol=1e-4)
    for name, w in results[0][1].items():
        # Adam divides by |g| + eps: elements whose gradient is ~eps may differ by float noise
        torch.testing.assert_close(w, results[1][1][name], rtol=1e-3, atol=1e-4)


def test_kl_loss_against_a_frozen_reference(tiny):
    algo = AlgorithmConfig(kl_coef=0.5, kl_estimator="k3", kl_mode="loss")
    trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-2), WORLD)
    ref = TorchTrainer(tiny, TrainerConfig(), WORLD, trainable=False)
    ref_before, policy_before = weights(ref), weights(trainer)
    loss_fn = Algorithm(algo).objective(1.0, 1.0, 8)
    for _ in range(3):
        batch = rl_batch(trainer, ref)
        stats = trainer.train_mini_batch(batch, loss_fn)
    assert stats["kl_loss"] > 0  # the policy has moved away from the reference
    assert all(torch.equal(ref_before[k], v) for k, v in weights(ref).items())
    assert any(not torch.equal(policy_before[k], v) for k, v in weights(trainer).items())
    with pytest.raises(AssertionError, match="frozen"):
        ref.train_mini_batch(batch, loss_fn)


def test_offload_reports_what_a_gpu_would_free(tiny):
    trainer = TorchTrainer(tiny, TrainerConfig(), WORLD)
    report = trainer.offload()
    params = sum(p.numel() * 4 for _, p in trainer.named_weights())
    assert report["moved_bytes"] == 0 and report["resident_bytes"] >= params
    assert trainer.onload() == {"moved_bytes": 0}
