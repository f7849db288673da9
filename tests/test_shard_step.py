"""`ControllerShard.step()` in one process: a real tiny trainer, and a fake rollout engine served by the real
engine service over a real socket (in a thread), built through the same factory as a run."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, experiment
from transformers import AutoTokenizer

from yatt.config import load_experiment
from yatt.controllers.components import build_components
from yatt.controllers.metrics import STAGES, StageTimer
from yatt.controllers.shard import ControllerShard
from yatt.distributed import World
from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.client import connect_engine
from yatt.engines.server import EngineService
from yatt.transport.rpc import RpcServer

WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))


class FakeEngine:
    """A `RolloutEngine` whose sample j of every prompt is the digit j (then eos), log-prob -1 per token."""

    def __init__(self, digit_ids: list[int], eos: int):
        self.digit_ids, self.eos = digit_ids, eos
        self.queued: dict[str, SamplingSpec] = {}
        self.updates: list[dict[str, torch.Tensor]] = []  # one dict per update_weights call
        self.sleeps = 0

    def add_requests(self, request_ids, prompts, sampling, seeds):
        self.queued.update({rid: sampling for rid in request_ids})

    def step(self):
        done = [(rid, [self._sample(j, spec) for j in range(spec.n)]) for rid, spec in self.queued.items()]
        self.queued.clear()
        return done

    def _sample(self, j: int, spec: SamplingSpec) -> Completion:
        tokens = [self.digit_ids[j % 10], self.eos][: spec.max_tokens]
        return Completion(
            tokens, [-1.0] * len(tokens) if spec.logprobs else [], "stop" if tokens[-1] == self.eos else "length"
        )

    def num_unfinished(self):
        return len(self.queued)

    def abort(self, request_ids):
        for rid in request_ids:
            self.queued.pop(rid, None)

    def update_weights(self, named_tensors):
        self.updates.append({name: t.clone() for name, t in named_tensors})

    def sleep(self):
        self.sleeps += 1
        return {"supported": False, "freed_bytes": 0}

    def wake(self):
        return {"supported": False}

    def health(self):
        return {"ok": True, "backend": "fake"}

    def shutdown(self):
        pass


@contextmanager
def fake_shard(tmp_path, *overrides: str):
    config = experiment(tmp_path, ONE_TOKEN_GRPO.replace("max_new_tokens: 1", "max_new_tokens: 2"))
    cfg = load_experiment(config, ["data.shuffle=false", *overrides])  # step 1: rows 0..7, "0+0=" .. "0+7="
    tok = AutoTokenizer.from_pretrained(str(cfg.model.path))
    engines, servers = [], []

    def spawn(model_path, engine_cfg, seed, log_path, secret):
        engines.append(FakeEngine(tok.convert_tokens_to_ids(list("0123456789")), tok.eos_token_id))
        server = RpcServer(EngineService(engines[-1]), secret)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return connect_engine(server.endpoint, secret, engine_cfg)

    shard = ControllerShard(cfg, WORLD, build_components(cfg, WORLD, tmp_path / "run", spawn=spawn))
    try:
        yield shard, engines
    finally:
        shard.close()
        for server, thread in servers:
            server.stop()
            thread.join()
            server.close()


@pytest.fixture
def shard(tmp_path, request):
    with fake_shard(tmp_path, *getattr(request, "param", [])) as made:  # indirect parametrization: overrides
        yield made


def test_step_trains_on_the_engine_samples_and_syncs_the_weights(shard):
    shard, engines = shard
    [engine] = engines
    before = {name: t.clone() for name, t in shard.trainer.named_weights()}
    metrics = shard.step(1).metrics

    # prompts "0+b=" (b = 0..7) x samples "0".."7": exactly one right sample per group
    assert metrics["rollout/samples"] == 64 and metrics["response/length_mean"] == 2.0
    assert metrics["reward/mean"] == metrics["reward/correct_frac"] == 8 / 64
    assert metrics["reward/zero_variance_group_frac"] == 0.0
    # every statistic the algorithm declares is logged, and the update really happened
    for name in shard.algorithm.stats:
        assert torch.isfinite(torch.tensor(metrics[f"actor/{name}"])), name
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_steps"] == 0
    after = dict(shard.trainer.named_weights())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the sync pushed every trained weight into the engine, by Hugging Face name, in buckets
    pushed = {k: v for update in engine.updates for k, v in update.items()}
    assert set(pushed) == set(after) and all(torch.equal(pushed[k], after[k]) for k in after)
    # log-prob mismatch metric: the fake says -1 per token, the trainer computes its own
    assert metrics["rollout/trainer_logprob_diff_mean"] > 0
    # full placement: rollout -> train -> rollout, and the engine slept while the trainer owned the device
    assert metrics["placement/switches"] == 2 and engine.sleeps == 1
    assert {f"time/{stage}_s" for stage in ("generate", "reward", "logprobs", "update", "sync")} <= set(metrics)


def test_the_stages_hand_their_data_on_as_return_values(shard):
    """produce -> consume: what generation made (and its statistics) comes back from it; nothing per-step is
    left on the shard, and the shard sets nothing on the engine services (the factory gave them the policy)."""
    shard, [engine] = shard
    shard_attrs, services = set(vars(shard)), dict(vars(shard.engines))
    timer = StageTimer(STAGES)
    rollouts, generation, sampling_metrics = shard.produce(1, timer)
    assert len(rollouts) == 64 and sampling_metrics == {}
    assert generation.rollout_s > 0 and generation.pools["rollout/rerouted"] == 0 and timer.seconds["generate"] > 0
    metrics, balance_metrics = shard.consume(rollouts, 1, timer)
    assert metrics["rollout/samples"] == 64 and metrics["reward/mean"] == 8 / 64 and balance_metrics == {}
    assert set(vars(shard)) == shard_attrs
    assert set(vars(shard.engines)) == set(services) and shard.engines.policy_weights is services["policy_weights"]
    assert services["policy_weights"].__qualname__.startswith("build_components.")  # bound by the factory
    trained = dict(shard.trainer.named_weights())
    pushed = {name: t for bucket in shard.engines.policy_weights() for name, t in bucket}
    assert set(pushed) == set(trained) and engine.updates  # the sync pushed what policy_weights gives


def test_the_step_follows_the_configured_algorithm(shard):
    shard, _ = shard
    assert shard.algorithm.estimator.config.__name__ == "GRPOConfig"
    assert shard.algorithm.stats == (
        "policy_loss",
        "clip_frac",
        "dual_clip_frac",
        "ratio_mean",
        "approx_kl",
        "approx_kl_k2",
    )
    state = shard.checkpoint.state_dict()
    assert shard.checkpoint.replicated == ("trainer", "train_stream", "ranks")
    assert set(state) >= {"trainer", "train_stream", "rng", "progress", "ranks"}


def test_reusing_the_on_policy_forward_changes_nothing_but_the_work(tmp_path):
    """old_logprobs=reuse (the first of 2 mini-batches takes its old log-probs from its own forward) gives
    the step of recompute (a pass over every sample first): same loss, ratios, metrics and weights."""
    results = {}
    for mode in ("recompute", "reuse", "rollout"):
        torch.manual_seed(0)
        with fake_shard(tmp_path / mode, f"algorithm.old_logprobs={mode}") as (shard, _):
            results[mode] = (shard.step(1).metrics, {k: v.clone() for k, v in shard.trainer.named_weights()})
    (want, want_w), (got, got_w) = results["recompute"], results["reuse"]
    for key in (
        "actor/policy_loss",
        "actor/ratio_mean",
        "actor/clip_frac",
        "actor/grad_norm",
        "actor/entropy",
        "rollout/trainer_logprob_diff_mean",
        "rollout/trainer_logprob_diff_max",
    ):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key
    assert want["actor/entropy"] > 0
    for name, w in want_w.items():
        torch.testing.assert_close(got_w[name], w, rtol=0, atol=1e-5)
    # rollout: the fake engine's log-probs (-1 per token) are the old policy: ratios far from 1; entropies
    # come from the first epoch's forwards (the second mini-batch's after one optimizer step)
    rollout = results["rollout"][0]
    assert rollout["actor/ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    assert rollout["actor/entropy"] == pytest.approx(want["actor/entropy"], rel=0.05)


ALGORITHMS = {
    "rloo": ["algorithm.advantage.kind=rloo"],
    "reinforce_pp_kl_reward": [
        "algorithm.advantage.kind=reinforce_pp",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_mode=reward",
        "algorithm.kl_estimator=k1",
    ],
    "reinforce_pp_baseline": ["algorithm.advantage.kind=reinforce_pp_baseline"],
    "gspo_entropy_masked_is": [
        "algorithm.policy_loss.kind=gspo",
        "algorithm.loss_agg=seq-mean-token-mean",
        "algorithm.entropy_coef=0.01",
        "algorithm.rollout_is.mode=mask",
        "algorithm.rollout_is.level=sequence",
    ],
    "recompute_truncated_is_adaptive_kl": [
        "algorithm.old_logprobs=recompute",
        "algorithm.rollout_is.mode=truncate",
        "algorithm.kl_coef=0.1",
        "algorithm.kl_control.kind=adaptive",
        "algorithm.kl_control.target_kl=1e-6",
        "algorithm.kl_control.horizon=64",
    ],
    "ppo_critic_kl_reward": [
        "algorithm.advantage.kind=gae",
        "algorithm.kl_coef=0.05",
        "algorithm.kl_mode=reward",
        "critic.loss_agg=seq-mean-token-mean",
    ],
}


@pytest.mark.parametrize("shard", list(ALGORITHMS.values()), ids=list(ALGORITHMS), indirect=True)
def test_every_algorithm_trains_through_the_step(shard):
    shard, _ = shard
    before = {name: t.clone() for name, t in shard.trainer.named_weights()}
    metrics = shard.step(1).metrics
    for name in shard.algorithm.stats:
        assert torch.isfinite(torch.tensor(metrics[f"actor/{name}"])), name
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("rollout_is/"))
    assert metrics["actor/grad_norm"] > 0
    after = dict(shard.trainer.named_weights())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the fake engine's log-prob is -1 per token, the trainer's differs: the IS ratio is measured
    assert metrics["rollout_is/mismatch_kl"] > 0 and metrics["rollout_is/ratio_max"] > 0
    mode = shard.cfg.algorithm.rollout_is.mode
    assert (metrics["rollout_is/weight_mean"] == 1.0) == (mode == "none")


@pytest.mark.parametrize("shard", [ALGORITHMS["recompute_truncated_is_adaptive_kl"]], indirect=True)
def test_adaptive_kl_coefficient_moves_and_is_checkpointed(shard):
    shard, _ = shard
    metrics = shard.step(1).metrics
    # step 1 measures KL 0 (policy = reference, before the update): error -1 clipped to -.2, 64 samples over
    # a horizon of 64: x .8
    assert metrics["actor/kl_coef"] == 0.1 and metrics["actor/kl_ref"] == 0.0
    assert shard.algorithm.kl_coef == pytest.approx(0.08)
    state = {k: dict(v) if k == "kl_control" else v for k, v in shard.checkpoint.state_dict().items()}
    metrics = shard.step(2).metrics  # now the policy moved: KL above the 1e-6 target, x 1.2
    assert metrics["actor/kl_coef"] == pytest.approx(0.08) and metrics["actor/kl_ref"] > 1e-6
    assert shard.algorithm.kl_coef == pytest.approx(0.096)
    shard.checkpoint.load_state_dict(state)
    assert shard.algorithm.kl_coef == pytest.approx(0.08)


@pytest.mark.parametrize("shard", [["rollout.sync_every=2"]], indirect=True)
def test_sync_every_keeps_the_engines_stale_between_syncs(shard):
    shard, engines = shard
    [engine] = engines
    shard.step(1)
    assert engine.updates == []  # step 1: the engine still holds the initial policy
    shard.step(2)
    assert engine.updates


@pytest.mark.parametrize("delta", [True, False])
def test_a_step_that_does_not_train_the_policy_syncs_nothing_with_delta_sync(tmp_path, delta):
    """PPO's critic warm-up: the policy does not step, so the delta sync (rollout.engine.delta_sync) sends its
    engine nothing; the first sync (the engine holds model.path, of which the client knows nothing) and a trained
    step's send everything."""
    ppo = ["algorithm.advantage.kind=gae", "critic.warmup_steps=2", f"rollout.engine.delta_sync={delta}"]
    with fake_shard(tmp_path, *ppo) as (shard, [engine]):
        full = round(sum(t.numel() * 4 for _, t in shard.trainer.named_weights()) / 2**20, 6)
        sent = []
        for step in (1, 2, 3):
            metrics = shard.step(step).metrics
            sent.append((round(metrics["sync/sent_mb"], 6), round(metrics["sync/skipped_mb"], 6), len(engine.updates)))
        pushed = {k: v for update in engine.updates for k, v in update.items()}
        assert all(torch.equal(pushed[k], t) for k, t in shard.trainer.named_weights())  # the engine holds the policy
    calls = sent[0][2]  # update_weights calls of one whole sync
    if delta:
        assert sent == [(full, 0.0, calls), (0.0, full, calls), (full, 0.0, 2 * calls)]
    else:
        assert sent == [(full, 0.0, calls), (full, 0.0, 2 * calls), (full, 0.0, 3 * calls)]


@pytest.mark.parametrize("shard", [["algorithm.advantage.kind=remax"]], indirect=True)
def test_remax_baseline_is_the_greedy_reward_of_each_prompt(shard, monkeypatch):
    shard, _ = shard
    seen = []
    advantages = shard.algorithm.advantages
    monkeypatch.setattr(shard.algorithm, "advantages", lambda inp: seen.append(inp) or advantages(inp))
    metrics = shard.step(1).metrics
    # the fake's greedy answer is "0": right for prompt "0+0=" only, so prompt 0's baseline is 1, the others' 0
    (inp,) = seen
    torch.testing.assert_close(inp.baselines, torch.tensor([1.0] * 8 + [0.0] * 56))
    # sample j answers j: prompt b's right sample is j = b; advantages = reward - baseline
    expected = torch.tensor([float(j == b) for b in range(8) for j in range(8)]) - inp.baselines
    torch.testing.assert_close(advantages(inp)[0], expected)
    assert metrics["actor/grad_norm"] > 0


def test_rollout_is_weights_are_the_same_with_reused_old_logprobs(tmp_path):
    """Masked IS weights come from each micro-batch's old log-probs inside the loss, so old_logprobs=reuse
    (the first mini-batch's from its own forward) trains exactly like recompute."""
    results = {}
    for mode in ("recompute", "reuse"):
        torch.manual_seed(0)
        with fake_shard(
            tmp_path / mode,
            f"algorithm.old_logprobs={mode}",
            "algorithm.rollout_is.mode=mask",
            "algorithm.rollout_is.lower_threshold=0.25",
        ) as (shard, _):
            results[mode] = (shard.step(1).metrics, {k: v.clone() for k, v in shard.trainer.named_weights()})
    (want, want_w), (got, got_w) = results["recompute"], results["reuse"]
    # the fake's -1 per token against the trainer's own log-probs: some tokens dropped, not all
    assert 0 < want["rollout_is/changed_frac"] < 1
    for key in (
        "actor/policy_loss",
        "actor/grad_norm",
        "rollout_is/ratio_mean",
        "rollout_is/ratio_max",
        "rollout_is/changed_frac",
        "rollout_is/weight_mean",
        "rollout_is/mismatch_kl",
    ):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key
    for name, w in want_w.items():
        torch.testing.assert_close(got_w[name], w, rtol=0, atol=1e-5)
