"""The step's metrics as pure functions over named reductions (yatt.controllers.metrics), and the mini-batches
each optimizer step trains on (yatt.controllers.minibatches), without a trainer or engines."""

from types import SimpleNamespace

import pytest
import torch
from megatron_ranks import run_ranks

from yatt.controllers.metrics import env_score_metrics, step_metrics, step_reductions
from yatt.controllers.minibatches import mini_batches
from yatt.controllers.policy import token_batch
from yatt.data.rollout import Rollout
from yatt.placement.metrics import maxed, summed

G = 2
CFG = SimpleNamespace(
    rollout=SimpleNamespace(group_size=G),
    balance=SimpleNamespace(enabled=False, attention_coef=0.0),
    algorithm=SimpleNamespace(kl_estimator="k1", dynamic_sampling=SimpleNamespace(enabled=False)),
    reward=SimpleNamespace(teacher=None),
)
STATS = ("policy_loss",)


def rank_reductions(responses: list[list[int]], rewards: list[float], seconds: dict[str, float], counts=None):
    """One rank's step_reductions for rollouts of a 2-token prompt; the trainer's log-probs differ from the
    engine's by 0.5 on the last rollout's tokens. `counts`: the trainer's routing-mismatch counts in the update's."""
    rollouts = [
        Rollout(None, [1, 2], ids, [-1.0] * len(ids), "length" if len(ids) > 2 else "stop", reward=reward)
        for ids, reward in zip(responses, rewards)
    ]
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)
    old = batch.extras["rollout_logprobs"].clone()
    if rollouts:
        old[-1] -= 0.5 * batch.mask[-1]
    batch.extras["old_logprobs"] = old
    tokens = float(batch.mask.sum())
    update = {
        "tokens": tokens,
        "policy_loss": 0.25 * tokens,
        "grad_norm": 2.0,
        "lr": 0.2,
        "skipped": 0.0,
        "optimizer_steps": 2.0,
        **(counts or {}),
    }
    return (*step_reductions(CFG, STATS, rollouts, batch, torch.zeros_like(batch.mask), None, update, seconds), update)


class Ranks:
    """The World of rank 0 of two, whose other rank holds the values `other` gives for the same keys."""

    size, rank = 2, 0

    def __init__(self, other: list[float]):
        self.other = other

    def sum(self, values):
        return [a + b for a, b in zip(values, self.other)]

    def max(self, values):
        return [max(a, b) for a, b in zip(values, self.other)]


def test_step_metrics_come_from_named_sums_and_maxima_over_ranks():
    seconds = {"update": 1.0, "generate": 2.0}
    sums0, peaks0, update = rank_reductions([[5], [6, 7, 8]], [1.0, 0.0], seconds)
    sums1, peaks1, _ = rank_reductions(
        [[5, 6], [5, 6], [7], [7]], [1.0, 1.0, 0.0, 1.0], {"update": 3.0, "generate": 1.0}
    )
    assert list(peaks0) == [
        "response/length_max",
        "rollout/trainer_logprob_diff_max",
        "workload",
        "time/generate_s",
        "time/update_s",
    ]  # by name, in one order on every rank
    s = summed(Ranks(list(sums1.values())), sums0)
    peaks = maxed(Ranks(list(peaks1.values())), peaks0)
    m = step_metrics(CFG, STATS, 2, s, peaks, update)
    assert m["rollout/samples"] == 6 and m["reward/mean"] == pytest.approx(4 / 6) and m["reward/correct_frac"] == 4 / 6
    assert m["response/length_mean"] == pytest.approx(10 / 6) and m["response/length_max"] == 3.0
    assert m["response/truncated_frac"] == pytest.approx(1 / 6)
    assert m["reward/zero_variance_group_frac"] == pytest.approx(1 / 3) and m["reward/pass_at_group"] == 1.0
    assert m["actor/policy_loss"] == pytest.approx(0.25) and m["actor/grad_norm"] == 1.0 and m["actor/lr"] == 0.1
    # log-prob gap: 0.5 on the 3 tokens of rank 0's last rollout and the 1 of rank 1's, over all 10 response tokens
    assert m["rollout/trainer_logprob_diff_mean"] == pytest.approx(0.5 * 4 / 10)
    assert m["rollout/trainer_logprob_diff_max"] == pytest.approx(0.5)
    assert m["time/generate_s"] == 2.0 and m["time/update_s"] == 3.0
    # balancing off: the imbalance a plan would report (worst rank's workload over the mean), nothing moved
    assert m["balance/imbalance_before"] == pytest.approx(max(sums0["workload"], sums1["workload"]) * 2 / s["workload"])
    assert m["balance/moved_samples"] == 0.0
    assert m["perf/gen_tokens_per_s"] == pytest.approx(10 / 2.0)


def test_a_rank_without_samples_joins_the_reductions_with_zeros():
    sums, peaks, update = rank_reductions([], [], {"generate": 0.0})
    assert set(sums.values()) == {0.0} and peaks["response/length_max"] == 0.0
    m = step_metrics(CFG, STATS, 1, sums, peaks, update)
    assert m["reward/mean"] == 0.0 and m["balance/imbalance_before"] == 1.0


ENV_SCORES = [  # per rank, each rollout's named scores: the ranks saw different names, one saw none at all
    [{"reward/correct": 1.0, "metric/a": 2.0}, {"reward/correct": 0.0}, {}],
    [{"reward/correct": 1.0, "metric/b": 5.0}],
    [],
]


def env_scores_body(world, scores: list[list[dict]]) -> dict:
    rollouts = [Rollout(None, [1], [2], [0.0], "stop", env_scores=s) for s in scores[world.rank]]
    return env_score_metrics(world, rollouts, "env")


def test_env_scores_are_means_over_the_samples_of_every_rank_that_have_them(tmp_path):
    results = run_ranks(3, env_scores_body, tmp_path, ENV_SCORES)
    # correct: 3 samples of 5 have it; a: 1 sample (rank 0), b: 1 sample (rank 1); a rank with none still joins
    expected = {"env/metric/a": 2.0, "env/metric/b": 5.0, "env/reward/correct": 2 / 3}
    assert results == [expected] * 3


def test_the_routing_mismatch_is_the_share_of_compared_tokens_over_ranks():
    counts = {
        "routing/tokens": 10.0,
        "routing/tokens_differ": 3.0,
        "routing/layers": 40.0,
        "routing/layers_differ": 4.0,
    }
    sums0, peaks0, update = rank_reductions([[5], [6, 7, 8]], [1.0, 0.0], {"generate": 1.0})
    assert "moe/routing_mismatch" not in step_metrics(CFG, STATS, 1, sums0, peaks0, update)  # no routing to compare
    sums0, peaks0, _ = rank_reductions([[5], [6, 7, 8]], [1.0, 0.0], {"generate": 1.0}, counts)
    other = {**counts, "routing/tokens_differ": 1.0, "routing/layers_differ": 2.0}
    sums1, _, _ = rank_reductions([[5, 6], [7]], [1.0, 1.0], {"generate": 1.0}, other)
    m = step_metrics(CFG, STATS, 2, summed(Ranks(list(sums1.values())), sums0), peaks0, update)
    assert m["moe/routing_mismatch"] == pytest.approx(4 / 20)
    assert m["moe/routing_mismatch_layers"] == pytest.approx(6 / 80)


def _minis(count, group, epochs, per_epoch, step, rank):
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(group_size=group),
        algorithm=SimpleNamespace(ppo_epochs=epochs, mini_batches=per_epoch),
        run=SimpleNamespace(seed=1),
    )
    return mini_batches(count, cfg, step, rank)


def test_mini_batches_keep_groups_whole_and_give_every_rank_the_same_count():
    epochs = _minis(12, 3, 2, 2, step=5, rank=0)
    assert len(epochs) == 2 and all(len(minis) == 2 for minis in epochs)
    for minis in epochs:
        rows = torch.cat(minis)
        assert sorted(rows.tolist()) == list(range(12))  # every row once per epoch
        for mini in minis:
            assert all(set(range(r - r % 3, r - r % 3 + 3)) <= set(mini.tolist()) for r in mini.tolist())
    again = _minis(12, 3, 2, 2, step=5, rank=0)
    assert all(torch.equal(a, b) for ea, eb in zip(epochs, again) for a, b in zip(ea, eb))  # seeded
    other_steps = [_minis(12, 3, 2, 2, step=s, rank=0) for s in range(6, 12)]
    assert any(not torch.equal(torch.cat(o[0]), torch.cat(epochs[0])) for o in other_steps)
    # a rank holding fewer groups than mini-batches still takes part in every optimizer step (an empty chunk)
    few = _minis(3, 3, 1, 2, step=5, rank=1)
    assert [len(m) for m in few[0]] == [3, 0]
