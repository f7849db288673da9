"""The delta weight sync (rollout.engine.delta_sync, yatt/engines/delta.py): an engine is sent only what it does not
hold at the trainer's version, and what it ends up holding is bit for bit what a full sync gives.

- units: a fused q/k/v or gate/up group and a module's tensors go whole; unknown versions are always sent;
- the trainer's versions (yatt.trainers.weights.WeightChanges): AdamW leaves a parameter without a gradient bit for
  bit unchanged, and only the stepped ones change version; a checkpoint load changes every version;
- a real hf engine behind a real service: the weights after delta syncs equal those after full syncs, bit for bit,
  and a skipped tensor is one the engine holds (a wrong version would leave the old bytes: the skip is real);
- a rank's engine services: a push of an unchanged policy sends nothing; an engine killed meanwhile (which such a
  push does not notice) is healed before the next step and sent everything, as is one whose update failed; the
  restarted engine serves the policy.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from engine_refs import two_policies
from safetensors.torch import load_file

from yatt.config import load_experiment
from yatt.distributed import World
from yatt.engines.base import SamplingSpec
from yatt.engines.client import connect_engine
from yatt.engines.config import EngineConfig
from yatt.engines.delta import HeldWeights, sync_unit
from yatt.engines.hf_engine import HFEngine
from yatt.engines.server import EngineService
from yatt.placement.engine_lifecycle import EngineServices
from yatt.tensors import TokenBatch, WeightVersions
from yatt.trainers.config import TrainerConfig
from yatt.trainers.torch_trainer import TorchTrainer
from yatt.trainers.weights import WeightChanges
from yatt.transport.codec import new_secret
from yatt.transport.rpc import RpcServer

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingSpec(n=1, temperature=0.0, max_tokens=6, logprobs=False)
PROMPTS = [[4, 5, 6], [7, 8]]


def test_units_keep_modules_and_fused_groups_whole():
    assert sync_unit("model.layers.0.self_attn.k_proj.bias") == "model.layers.0.self_attn.q_proj+k_proj+v_proj"
    assert sync_unit("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.gate_proj+up_proj"
    assert sync_unit("model.layers.0.self_attn.o_proj.lora_A") == "model.layers.0.self_attn.o_proj"
    assert sync_unit("model.layers.0.mlp.experts.down_proj") == "model.layers.0.mlp.experts"
    t = torch.zeros(1)
    names = ["l.q_proj.weight", "l.k_proj.weight", "l.v_proj.weight", "l.o_proj.weight", "l.o_proj.bias", "norm.w"]
    named = [(n, t) for n in names]
    held = HeldWeights()
    assert held.held(named, WeightVersions(default=1)) == set()  # nothing acknowledged: all sent
    held.acknowledged(names, WeightVersions(default=1))
    assert held.held(named, WeightVersions(default=1)) == set(names)
    # q changed: its fused group goes whole; o_proj's bias changed: its weight goes with it
    bumped = WeightVersions({"l.q_proj.weight": 2, "l.o_proj.bias": 2}, default=1)
    assert held.held(named, bumped) == {"norm.w"}
    assert held.held(named, WeightVersions({"norm.w": 1})) == {"norm.w"}  # unknown versions (None): sent
    held.sending(["norm.w"])  # in flight: no longer known to be held, whatever happens to the RPC
    assert held.held(named, WeightVersions(default=1)) == set(names) - {"norm.w"}


def test_adamw_leaves_a_parameter_without_a_gradient_untouched_and_its_version_too():
    torch.manual_seed(0)
    used, unused, zero = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
    opt = torch.optim.AdamW([used, unused, zero], lr=0.1, weight_decay=0.1)
    changes = WeightChanges()
    before = [p.detach().clone() for p in (used, unused, zero)]
    (used.sum() + 0 * zero.sum()).backward()
    opt.step()
    changes.stepped([used, unused, zero])
    assert not torch.equal(used, before[0]) and torch.equal(unused, before[1])  # no gradient: bit for bit
    assert not torch.equal(zero, before[2])  # a zero gradient is a gradient: weight decay moved it
    assert (changes.of(used), changes.of(unused), changes.of(zero)) == (1, 0, 1)
    changes.all_changed()
    assert {changes.of(p) for p in (used, unused, zero)} == {2}


def test_the_trainer_versions_change_with_its_steps_and_loads(tmp_path):
    folders = two_policies(tmp_path)
    world = World(0, 1, 0, torch.device("cpu"))
    trainer = TorchTrainer(folders["A"], TrainerConfig(lr=1e-2, micro_batch_size=8), world)
    names = [n for b in trainer.engine_weights(1 << 30) for n, _ in b]
    v0 = trainer.weight_versions()
    assert set(v0.named) == set(names) and {v0(n) for n in names} == {0}
    batch = TokenBatch.from_sequences([[4, 5, 6]] * 4, [[7, 8]] * 4, pad_id=0)
    trainer.train_mini_batch(batch, lambda logp, ent, mb: ((-logp * mb.mask).sum(), {}))
    v1 = trainer.weight_versions()
    assert all(v1(n) != v0(n) for n in names)  # every trained tensor had a gradient
    assert trainer.weight_versions().named == v1.named  # no step: the same
    trainer.load_state_dict(trainer.state_dict())
    assert all(trainer.weight_versions()(n) > v1(n) for n in names)


def engine_cfg(delta: bool) -> EngineConfig:
    return EngineConfig(backend="hf", max_model_len=32, weight_transport="zmq", delta_sync=delta)


@pytest.fixture
def two_engines(tmp_path):
    """Two real HFEngines behind real services in this process: one synced with deltas, one in full."""
    folders = two_policies(tmp_path)
    made = []
    for delta in (True, False):
        engine = HFEngine(str(folders["A"]), engine_cfg(delta), seed=0)
        secret = new_secret()
        server = RpcServer(EngineService(engine), secret)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        made.append((engine, connect_engine(server.endpoint, secret, engine_cfg(delta)), server, thread))
    yield folders, made
    for engine, client, server, thread in made:
        client.close()
        server.stop()
        thread.join()
        server.close()
        engine.shutdown()


def test_an_engine_synced_by_deltas_holds_bit_for_bit_what_full_syncs_give(two_engines):
    folders, [(delta_engine, delta, *_), (full_engine, full, *_)] = two_engines
    weights = load_file(str(folders["B"] / "model.safetensors"))
    versions = dict.fromkeys(weights, 1)
    for client in (delta, full):  # the first sync: the engine started from A, which the client knows nothing of
        assert client.update_weights(list(weights.items()), WeightVersions(versions))["skipped_bytes"] == 0
    total = sum(t.numel() * 4 for t in weights.values())
    for step in range(2, 5):  # each step changes a few modules (and, at step 4, nothing)
        changed = [n for n in weights if f"layers.{step % 2}.mlp" in n or n.startswith("model.norm")][: 4 - step // 4]
        if step == 4:
            changed = []
        for name in changed:
            weights[name] = weights[name] + 0.01 * step
            versions[name] = step
        sent = {}
        for key, client in (("delta", delta), ("full", full)):
            sent[key] = client.update_weights(list(weights.items()), WeightVersions(versions))
        assert sent["full"] == {"sent_bytes": total, "skipped_bytes": 0}
        assert sent["delta"]["sent_bytes"] + sent["delta"]["skipped_bytes"] == total
        assert sent["delta"]["skipped_bytes"] > total / 2
        assert (sent["delta"]["sent_bytes"] == 0) == (not changed)
        a, b = delta_engine.model.state_dict(), full_engine.model.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert delta.generate(PROMPTS, GREEDY) == full.generate(PROMPTS, GREEDY)
    # the skip is real: a version that lies (a changed tensor under its old number) leaves the old bytes
    name = "model.norm.weight"
    old = delta_engine.model.state_dict()[name].clone()
    delta.update_weights([(name, weights[name] * 2)], WeightVersions(versions))
    assert torch.equal(delta_engine.model.state_dict()[name], old)


@pytest.mark.engine
def test_an_unchanged_push_sends_nothing_and_a_restarted_engine_gets_everything(tmp_path):
    folders = two_policies(tmp_path)
    cfg = load_experiment(
        REPO / "configs" / "quickstart.yaml",
        [f"run.output_dir={tmp_path}", f"model.path={folders['A']}", "rollout.engine.backend=hf", "reward.judges=[]"],
    )
    assert cfg.rollout.engine.delta_sync  # the default
    weights = load_file(str(folders["B"] / "model.safetensors"))  # the trainer's policy
    total = sum(t.numel() * 4 for t in weights.values())
    version = WeightVersions(default=7)
    services = EngineServices(
        cfg,
        World(0, 1, 0, torch.device("cpu")),
        tmp_path / "run",
        policy_weights=lambda: iter([list(weights.items())]),
        policy_versions=lambda: version,
    )
    try:
        services.push_policy()
        assert services.take_synced() == {"sent_bytes": total, "skipped_bytes": 0}
        expected = services.rollout.generate(PROMPTS, GREEDY)
        services.push_policy()  # no step since: nothing travels
        assert services.take_synced() == {"sent_bytes": 0, "skipped_bytes": total}
        old = services.rollout.pid
        os.kill(old, signal.SIGKILL)  # dies during training
        services.rollout.proc.wait()
        services.push_policy()  # nothing to send it, so no call notices; the heal before the next step does
        assert services.take_synced() == {"sent_bytes": 0, "skipped_bytes": total}
        assert services.heal() == 1 and services.rollout.pid != old
        assert services.take_synced() == {"sent_bytes": total, "skipped_bytes": 0}  # a new engine: everything
        assert services.rollout.generate(PROMPTS, GREEDY) == expected
        services.push_policy()
        assert services.take_synced() == {"sent_bytes": 0, "skipped_bytes": total}
        # a failed update (refused whole; the engine exits): restarted, and sent everything again
        old = services.rollout.pid
        services.push_weights(iter([[("model.norm.weight", torch.zeros(3))]]), WeightVersions(default=8))
        assert services.rollout.pid != old and services.take_synced() == {"sent_bytes": total, "skipped_bytes": 0}
        assert services.rollout.generate(PROMPTS, GREEDY) == expected
    finally:
        services.close()
