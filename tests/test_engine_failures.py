"""Engines fail whole: a failed weight update ends the engine, and the rank restarts it with the current weights."""

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from yatt.config import load_experiment
from yatt.distributed import World
from yatt.engines.base import SamplingSpec
from yatt.engines.client import EngineDied, spawn_engine
from yatt.engines.config import EngineConfig
from yatt.models.tiny import write_tiny_model
from yatt.placement.engine_lifecycle import EngineServices
from yatt.transport.codec import new_secret
from yatt.transport.rpc import RemoteError

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingSpec(n=1, temperature=0.0, max_tokens=4, logprobs=False)


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    """A random tiny policy of the quickstart's shape (CI has no SFT'd one)."""
    return write_tiny_model(tmp_path_factory.mktemp("policy") / "tiny")


def wait_dead(engine, seconds: float = 10.0) -> int | None:
    deadline = time.monotonic() + seconds
    while engine.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.proc.poll()


def test_a_failed_weight_update_ends_the_engine_instead_of_leaving_it_half_loaded(tmp_path, policy):
    cfg = EngineConfig(backend="hf", max_model_len=32, startup_timeout_s=120, request_timeout_s=30)
    engine = spawn_engine(policy, cfg, seed=0, log_path=tmp_path / "e.log", secret=new_secret())
    try:
        with pytest.raises((RemoteError, EngineDied), match="shape"):
            engine.update_weights([("model.embed_tokens.weight", torch.zeros(3, 5))])
        assert wait_dead(engine) == 5  # exited (so the rank's death detection sees it), not a zombie
    finally:
        engine.close()


def test_a_rank_restarts_an_engine_whose_update_failed_with_the_current_weights(tmp_path, policy):
    cfg = load_experiment(
        REPO / "configs" / "quickstart.yaml",
        [f"run.output_dir={tmp_path}", f"model.path={policy}", "rollout.engine.backend=hf", "reward.judges=[]"],
    )
    weights = load_file(str(policy / "model.safetensors"))  # the trainer's policy, as the factory binds it
    services = EngineServices(
        cfg, World(0, 1, 0, torch.device("cpu")), tmp_path / "run", policy_weights=lambda: iter([list(weights.items())])
    )
    try:
        prompt = [[4, 5, 6]]
        before = services.rollout.generate(prompt, GREEDY)[0][0].token_ids
        old_pid = services.rollout.pid
        bad = [("model.embed_tokens.weight", torch.zeros(3, 5))]
        services.push_weights(iter([bad]))
        assert services.rollout.pid != old_pid and services.rollout.alive()
        assert services.rollout.generate(prompt, GREEDY)[0][0].token_ids == before  # the policy's weights again
        assert services.heal() == 1  # counted in the step's restart metric
    finally:
        services.close()


def test_an_engine_killed_between_stages_is_restarted_by_wake_with_the_current_weights(tmp_path, policy):
    import os
    import signal

    cfg = load_experiment(
        REPO / "configs" / "quickstart.yaml",
        [f"run.output_dir={tmp_path}", f"model.path={policy}", "rollout.engine.backend=hf", "reward.judges=[]"],
    )
    weights = load_file(str(policy / "model.safetensors"))  # the trainer's policy, as the factory binds it
    services = EngineServices(
        cfg, World(0, 1, 0, torch.device("cpu")), tmp_path / "run", policy_weights=lambda: iter([list(weights.items())])
    )
    try:
        prompt = [[4, 5, 6]]
        before = services.rollout.generate(prompt, GREEDY)[0][0].token_ids
        services.sleep("rollout")
        os.kill(services.rollout.pid, signal.SIGKILL)  # e.g. during training, before the sync stage's wake
        wait_dead(services.rollout)
        services.wake("rollout")  # today: EngineDied ended the run
        assert services.rollout.alive()
        assert services.rollout.generate(prompt, GREEDY)[0][0].token_ids == before
        assert services.heal() == 1
    finally:
        services.close()
