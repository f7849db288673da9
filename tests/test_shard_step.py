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
        return Completion(tokens, [-1.0] * len(tokens) if spec.logprobs else [],
                          "stop" if tokens[-1] == self.eos else "length")

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
def shard(tmp_path):
    with fake_shard(tmp_path) as made:
        yield made


def test_step_trains_on_the_engine_samples_and_syncs_the_weights(shard):
    shard, engines = shard
    [engine] = engines
    before = {name: t.clone() for name, t in shard.trainer.named_weights()}
    metrics = shard.step(1)

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


def test_the_step_follows_the_configured_algorithm(shard):
    shard, _ = shard
    assert shard.algorithm.estimator.config.__name__ == "GRPOConfig"
    assert shard.algorithm.stats == ("policy_loss", "clip_frac", "dual_clip_frac", "ratio_mean", "approx_kl")
    state = shard.state_dict()
    assert shard.replicated == ("trainer",) and set(state) >= {"trainer", "train_stream", "rng", "progress"}


def test_reusing_the_on_policy_forward_changes_nothing_but_the_work(tmp_path):
    """old_logprobs=reuse (the first of 2 mini-batches takes its old log-probs from its own forward) gives
    the step of recompute (a pass over every sample first): same loss, ratios, metrics and weights."""
    results = {}
    for mode in ("recompute", "reuse", "rollout"):
        torch.manual_seed(0)
        with fake_shard(tmp_path / mode, f"algorithm.old_logprobs={mode}") as (shard, _):
            results[mode] = (shard.step(1), {k: v.clone() for k, v in shard.trainer.named_weights()})
    (want, want_w), (got, got_w) = results["recompute"], results["reuse"]
    for key in ("actor/policy_loss", "actor/ratio_mean", "actor/clip_frac", "actor/grad_norm", "actor/entropy",
                "rollout/trainer_logprob_diff_mean", "rollout/trainer_logprob_diff_max"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key
    assert want["actor/entropy"] > 0
    for name, w in want_w.items():
        torch.testing.assert_close(got_w[name], w, rtol=0, atol=1e-5)
    # rollout: the fake engine's log-probs (-1 per token) are the old policy: ratios far from 1; entropies
    # come from the first epoch's forwards (the second mini-batch's after one optimizer step)
    rollout = results["rollout"][0]
    assert rollout["actor/ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    assert rollout["actor/entropy"] == pytest.approx(want["actor/entropy"], rel=0.05)
