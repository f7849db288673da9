"""A vision-language policy on the megatron backend (float32): one RL step on a batch of image groups and text
rows (ragged, one empty response) gives the torch backend's loss sums, grad norm, log-probs, entropies and
updated weights, the vision tower's and connector's included (max abs diff <= 1e-5), at TP=2 (packed with
shared prompts, and padded), PP=2 and DP=2; with model.freeze_vision the tower stays as it was on both, and the
megatron backend, like the torch one, sends engines everything but the frozen tower."""

from __future__ import annotations

import pytest
import torch
from megatron_ranks import needs_megatron, run_ranks, trainer_step_body
from vl_batches import batch_of, rollouts, vl_setup

from yatt.algorithms.objective import Algorithm
from yatt.config import AlgorithmConfig, TrainerConfig
from yatt.distributed import World
from yatt.models.vision import vision_parameter
from yatt.trainers.torch_trainer import TorchTrainer

pytestmark = needs_megatron
# lr large enough that the update is far above the tolerance; clip at 0.5 so clipping is exercised
TRAIN = dict(lr=1e-3, grad_clip=0.5, micro_batch_size=5, warmup_steps=1, lr_schedule="cosine")
# DP=2: whole groups per data-parallel rank (an image group and a text row, the rest)
DP_ROWS = [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return vl_setup(tmp_path_factory.mktemp("mvl"))


def torch_step(setup, pack: bool, freeze_vision: bool = False) -> dict:
    folder, images, text = setup
    batch = batch_of(rollouts(images, text), 0.8)
    world = World(0, 1, 0, torch.device("cpu"))
    trainer = TorchTrainer(folder, TrainerConfig(**TRAIN, pack_sequences=pack), world, 4, freeze_vision=freeze_vision)
    logp, ent = trainer.logprobs(batch, with_entropy=True)
    gen = torch.Generator().manual_seed(2)
    batch.extras.update(
        old_logprobs=logp + 0.05 * torch.randn(batch.mask.shape, generator=gen) * batch.mask,
        advantages=torch.randn(len(batch), generator=gen),
    )
    denominators = (float(batch.mask.sum()), float(len(batch)), 8)
    stats = trainer.train_mini_batch(batch, Algorithm(AlgorithmConfig()).objective(*denominators))
    weights = {k: v.detach().clone() for k, v in trainer.named_weights()}
    return dict(batch=batch, denominators=denominators, stats=stats, weights=weights, logp=logp, entropy=ent)


@pytest.fixture(scope="module")
def packed_step(setup):
    return torch_step(setup, pack=True)


# TP=2 packed in the default suite; PP=2, DP=2 and padded (~15 s each) are slow
SPLITS = [
    (2, 1, 1, True),
    pytest.param(1, 2, 1, True, marks=pytest.mark.slow),
    pytest.param(1, 1, 2, True, marks=pytest.mark.slow),
    pytest.param(2, 1, 1, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tp,pp,dp,pack", SPLITS, ids=str)
def test_one_vl_rl_step_equals_the_torch_backend(tmp_path, setup, packed_step, tp, pp, dp, pack):
    want = packed_step if pack else torch_step(setup, pack=False)
    batch = want["batch"]
    rows = [list(range(len(batch)))] if dp == 1 else DP_ROWS
    tokens, seqs, norm_length = want["denominators"]
    results = run_ranks(
        tp * pp * dp,
        trainer_step_body,
        tmp_path,
        str(setup[0]),
        tp,
        pp,
        batch,
        rows,
        (tokens / dp, seqs / dp, norm_length),
        {**TRAIN, "pack_sequences": pack},
    )
    initial = TorchTrainer(setup[0], TrainerConfig(), World(0, 1, 0, torch.device("cpu")))
    before = {k: v.detach() for k, v in initial.named_weights()}
    moved = [k for k, w in want["weights"].items() if vision_parameter(k) and (w - before[k]).abs().max() > 1e-4]
    assert moved, "the step must move the vision tower ten times the tolerance"
    for r in results:
        assert abs(r["stats"]["grad_norm"] - want["stats"]["grad_norm"]) <= 1e-5, (r["stats"], want["stats"])
        assert set(r["weights"]) == set(want["weights"])  # the folder's names, the tower's included
        for name, w in want["weights"].items():
            assert float((r["weights"][name] - w).abs().max()) <= 1e-5, name
    by_dp = {r["dp_rank"]: r for r in results}
    for key in ("loss", "clip_fraction"):
        if key in want["stats"]:
            assert abs(sum(by_dp[d]["stats"][key] for d in range(dp)) - want["stats"][key]) <= 1e-5, key
    for r in results:
        own = batch.select(rows[r["dp_rank"]])
        width = own.mask.shape[1]
        assert float((r["logp"] - want["logp"][rows[r["dp_rank"]], :width]).abs().max()) <= 1e-5
        assert float((r["entropy"] - want["entropy"][rows[r["dp_rank"]], :width]).abs().max()) <= 1e-5


def test_freeze_vision_keeps_the_tower_on_megatron(tmp_path, setup):
    want = torch_step(setup, pack=True, freeze_vision=True)
    batch = want["batch"]
    tokens, seqs, norm_length = want["denominators"]
    results = run_ranks(
        2,
        trainer_step_body,
        tmp_path,
        str(setup[0]),
        2,
        1,
        batch,
        [list(range(len(batch)))],
        (tokens, seqs, norm_length),
        {**TRAIN, "pack_sequences": True},
        True,
    )
    initial = dict(TorchTrainer(setup[0], TrainerConfig(), World(0, 1, 0, torch.device("cpu"))).named_weights())
    tower = {name for name in want["weights"] if vision_parameter(name)}
    assert tower and all(torch.equal(want["weights"][name], initial[name]) for name in tower)
    for r in results:
        assert abs(r["stats"]["grad_norm"] - want["stats"]["grad_norm"]) <= 1e-5
        assert set(r["weights"]) == set(want["weights"]) - tower  # engines are not sent a frozen tower
        for name in r["weights"]:
            assert float((r["weights"][name] - want["weights"][name]).abs().max()) <= 1e-5, name
