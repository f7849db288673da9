"""PPO with a critic through `ControllerShard.step()` in one process (the fake engine of test_shard_step): the
critic's values feed GAE, it trains next to the policy, its warm-up freezes the policy, it is checkpointed and
owned by the train role."""

import pytest
import torch
from test_shard_step import fake_shard


@pytest.fixture
def ppo(tmp_path, request):
    with fake_shard(tmp_path, "algorithm.advantage.kind=gae", *getattr(request, "param", [])) as made:
        yield made


def weights(trainer):
    return {name: t.clone() for name, t in trainer.named_weights()}


def changed(before, trainer):
    after = dict(trainer.named_weights())
    return any(not torch.equal(before[k], after[k]) for k in before)


def test_values_feed_gae_and_both_models_train(ppo, monkeypatch):
    shard, _ = ppo
    seen = []
    advantages = shard.algorithm.advantages
    monkeypatch.setattr(shard.algorithm, "advantages", lambda inp: seen.append(inp) or advantages(inp))
    policy, critic = weights(shard.trainer), weights(shard.critic.trainer)
    metrics = shard.step(1).metrics
    (inp,) = seen
    # values of every response token (2 per sample), from the critic before its update
    assert inp.values.shape == inp.mask.shape and (inp.values[inp.mask == 0] == 0).all()
    assert metrics["critic/value_mean"] == pytest.approx(float(inp.values.sum() / inp.mask.sum()), abs=1e-6)
    assert changed(policy, shard.trainer) and changed(critic, shard.critic.trainer)
    for key in ("critic/value_loss", "critic/vf_clipfrac", "critic/explained_var", "critic/grad_norm"):
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["critic/grad_norm"] > 0 and metrics["actor/grad_norm"] > 0 and metrics["critic/warmup"] == 0.0
    # 8 prompts, sample j answers "j": the one right sample per group gets reward 1; returns are the rewards
    assert metrics["critic/returns_mean"] == pytest.approx(8 / 64)
    # the train role owns the critic: it is offloaded and onloaded with the policy
    offloaded = []
    shard.critic.trainer.offload = lambda: offloaded.append("critic") or {}
    shard.placement.roles["train"].offload()
    assert offloaded == ["critic"]


def test_the_critic_is_in_checkpoints(ppo):
    shard, _ = ppo
    assert shard.checkpoint.replicated == ("trainer", "critic", "train_stream", "ranks")
    state = shard.checkpoint.state_dict()
    saved = {k: v.clone() for k, v in state["critic"]["model"].items()}
    shard.step(1)
    assert shard.critic.trainer.optimizer_steps == 2
    shard.checkpoint.load_state_dict({**state, "critic": {**state["critic"], "model": saved}})
    assert all(torch.equal(saved[k], v) for k, v in shard.critic.trainer.named_weights())


@pytest.mark.parametrize("ppo", [["critic.warmup_steps=1", "algorithm.old_logprobs=reuse"]], indirect=True)
def test_warm_up_steps_train_only_the_critic(ppo):
    shard, _ = ppo
    policy, critic = weights(shard.trainer), weights(shard.critic.trainer)
    metrics = shard.step(1).metrics
    assert not changed(policy, shard.trainer) and changed(critic, shard.critic.trainer)
    assert metrics["critic/warmup"] == 1.0 and metrics["actor/grad_norm"] == 0.0
    assert shard.trainer.optimizer_steps == 0 and shard.critic.trainer.optimizer_steps == 2
    # no policy forward to reuse: the old log-probs and entropies came from a full pass
    assert metrics["actor/entropy"] > 0 and metrics["rollout/trainer_logprob_diff_mean"] > 0
    metrics = shard.step(2).metrics
    assert changed(policy, shard.trainer) and metrics["critic/warmup"] == 0.0 and metrics["actor/grad_norm"] > 0


def test_a_critic_enabled_by_hand_trains_beside_another_estimator(tmp_path):
    with fake_shard(tmp_path, "critic.enabled=true") as (shard, _):
        assert shard.algorithm.estimator.config.__name__ == "GRPOConfig" and shard.critic is not None
        critic = weights(shard.critic.trainer)
        metrics = shard.step(1).metrics
        # targets: the undiscounted returns, here the outcome reward on every token
        assert metrics["critic/returns_mean"] == pytest.approx(8 / 64) and changed(critic, shard.critic.trainer)
        assert metrics["actor/grad_norm"] > 0
