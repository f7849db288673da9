"""Acceptance of the megatron backend (float32): one RL step of a tiny policy through the Trainer interface
gives the torch backend's loss, grad norm, log-probs and updated weights (max abs diff <= 1e-5) with TP=2,
with PP=2 and with DP=2 on 2 gloo ranks, packed with shared prompts (the defaults) on a batch of GRPO groups
with ragged rows; and padded (pack_sequences=false) at TP=2. The loss is the PPO objective of
yatt.algorithms.objective."""

from __future__ import annotations

import pytest
import torch
from megatron_ranks import grouped_sequences, mismatch_body, needs_megatron, resume_body, run_ranks, trainer_step_body

from yatt.algorithms.objective import Algorithm
from yatt.config import AlgorithmConfig, TrainerConfig
from yatt.distributed import World
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.tensors import TokenBatch
from yatt.trainers.packing import model_inputs, shared_prompts
from yatt.trainers.torch_trainer import TorchTrainer

pytestmark = needs_megatron
TINY = TinyModelConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
# lr large enough that the update is far above the tolerance; clip at 0.5 so clipping is exercised
TRAIN = dict(lr=1e-3, grad_clip=0.5, micro_batch_size=3, warmup_steps=1, lr_schedule="cosine")
# a lone prompt, two groups of 3, a lone prompt, a group of 2 (micro-batches of at most 3 rows keep groups whole)
GROUPS = [1, 3, 3, 1, 2]
# DP=2: whole groups per data-parallel rank, uneven (3 micro-batches and 1: rank 1 runs zero-loss passes)
DP_ROWS = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mtrain") / "policy", TINY, seed=5)


def torch_step(policy, pack: bool) -> dict:
    """A ragged batch of GRPO groups with old log-probs and advantages, and the torch backend's step on it
    (packed with shared prompts, or padded)."""
    gen = torch.Generator().manual_seed(1)
    batch = TokenBatch.from_sequences(*grouped_sequences(gen, GROUPS), pad_id=0)
    batch.temperature = 0.8
    cfg = TrainerConfig(**TRAIN, pack_sequences=pack)
    torch_trainer = TorchTrainer(policy, cfg, World(0, 1, 0, torch.device("cpu")), total_steps=4)
    logp, ent = torch_trainer.logprobs(batch, with_entropy=True)
    batch.extras.update(
        old_logprobs=logp + 0.05 * torch.randn(batch.mask.shape, generator=gen) * batch.mask,
        advantages=torch.randn(len(batch), generator=gen),
    )
    denominators = (float(batch.mask.sum()), float(len(batch)), 8)
    micro = torch_trainer.micro_batches(batch)
    stats = torch_trainer.train_mini_batch(batch, Algorithm(AlgorithmConfig()).objective(*denominators))
    weights = dict(torch_trainer.named_weights())
    return {
        "batch": batch,
        "denominators": denominators,
        "stats": stats,
        "weights": weights,
        "logp": logp,
        "entropy": ent,
        "micro_batches": micro,
    }


@pytest.fixture(scope="module")
def step_data(policy):
    """The torch backend's packed step with shared prompts (the defaults)."""
    return torch_step(policy, pack=True)


@pytest.fixture(scope="module")
def padded_step_data(policy):
    return torch_step(policy, pack=False)


def test_the_batch_shares_prompts(step_data):
    """The packed comparison below reads shared prompts: the packed rows hold fewer tokens than the samples."""
    batch = step_data["batch"]
    assert sum(1 for s in shared_prompts(batch) if s) == sum(g - 1 for g in GROUPS)
    assert len(set(batch.lengths())) > 2  # ragged
    micro = step_data["micro_batches"]
    assert sorted(sum(micro, [])) == list(range(len(batch)))
    packed = sum(model_inputs(batch.select(r), True, True).kwargs["input_ids"].shape[1] for r in micro)
    assert packed < sum(batch.lengths()) - 5


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5


@pytest.mark.parametrize(
    "tp,pp,dp,pack", [(2, 1, 1, True), (1, 2, 1, True), (1, 1, 2, True), (2, 1, 1, False)], ids=str
)
def test_one_rl_step_equals_the_torch_backend(tmp_path, policy, step_data, padded_step_data, tp, pp, dp, pack):
    step_data = step_data if pack else padded_step_data
    batch = step_data["batch"]
    rows = [list(range(len(batch)))] if dp == 1 else DP_ROWS
    # the controller's denominators: global counts / data-parallel size (DP then averages gradients)
    tokens, seqs, norm_length = step_data["denominators"]
    results = run_ranks(
        tp * pp * dp,
        trainer_step_body,
        tmp_path,
        str(policy),
        tp,
        pp,
        batch,
        rows,
        (tokens / dp, seqs / dp, norm_length),
        {**TRAIN, "pack_sequences": pack},
    )
    want = step_data["stats"]
    if dp == 1:  # micro-batches as the torch backend builds them (by real tokens when packed)
        assert all(r["micro_batches"] == step_data["micro_batches"] for r in results)
    for r in results:
        assert close(r["stats"]["grad_norm"], want["grad_norm"]), (r["stats"], want)
        assert close(r["stats"]["lr"], want["lr"])
        assert r["stats"]["skipped"] == 0.0
        assert set(r["weights"]) == set(step_data["weights"])
        for name, w in step_data["weights"].items():
            diff = float((r["weights"][name] - w).abs().max())
            assert diff <= 1e-5, (name, diff)
        # a bucket never splits a decoder layer
        layers = [{k.split(".")[2] for k in b if k.startswith("model.layers.")} for b in r["buckets"]]
        flat = [x for b in layers for x in b]
        assert len(flat) == len(set(flat))
    # loss_fn sums: per data-parallel rank (the controller sums them); the same on every TP/PP rank
    by_dp = {r["dp_rank"]: r for r in results}
    assert sorted(by_dp) == list(range(dp))
    for key in want:
        if key not in ("grad_norm", "lr", "skipped"):
            assert close(sum(by_dp[d]["stats"][key] for d in range(dp)), want[key]), key
    for r in results:
        own = batch.select(rows[r["dp_rank"]])
        want_logp = step_data["logp"][rows[r["dp_rank"]], : own.mask.shape[1]]
        assert float((r["logp"] - want_logp).abs().max()) <= 1e-5
        want_ent = step_data["entropy"][rows[r["dp_rank"]], : own.mask.shape[1]]
        assert float((r["entropy"] - want_ent).abs().max()) <= 1e-5


def test_bfloat16_step_runs_and_stays_near_float32(tmp_path, policy, step_data):
    """bfloat16 weights (float32 master weights in megatron's optimizer), TP=2: the log-probs drift a
    little from float32, the step is taken, and the weights stay near the float32 update."""
    tokens, seqs, norm_length = step_data["denominators"]
    results = run_ranks(
        2,
        trainer_step_body,
        tmp_path,
        str(policy),
        2,
        1,
        step_data["batch"],
        [list(range(len(step_data["batch"])))],
        (tokens, seqs, norm_length),
        {**TRAIN, "dtype": "bfloat16"},
    )
    for r in results:
        assert r["stats"]["skipped"] == 0.0 and abs(r["stats"]["grad_norm"] - step_data["stats"]["grad_norm"]) < 0.2
        drift = float((r["logp"] - step_data["logp"]).abs().max())
        assert 0 < drift < 0.05
        assert all(r["weights"][k].dtype == torch.bfloat16 for k in r["weights"])
        worst = max(float((r["weights"][k].float() - w).abs().max()) for k, w in step_data["weights"].items())
        assert worst < 2e-2


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_shard_resumes_exactly(tmp_path, policy, step_data, tp, pp):
    """state_dict of this rank's shard (weights, Adam state, schedule position) -> a fresh trainer: its next
    step is the uninterrupted one's, bit for bit; each rank's shard is about 1/2 of the model."""
    results = run_ranks(
        tp * pp, resume_body, tmp_path, str(policy), tp, pp, step_data["batch"], step_data["denominators"], TRAIN
    )
    for r in results:
        assert r["resumed"] == r["straight"]
        for k, w in r["straight_weights"].items():
            assert torch.equal(r["resumed_weights"][k], w), k
        assert r["shard_numel"] <= 0.65 * r["model_numel"]


def test_model_parallel_ranks_must_get_the_same_batch(tmp_path, policy, step_data):
    results = run_ranks(2, mismatch_body, tmp_path, str(policy), step_data["batch"])
    assert all("handed different batches" in r for r in results), results
