"""Weight sync through shared memory (`yatt.transport.weights.shm`) against the socket (`zmq`), on real engines.

hf engine child processes (and in-process services where a fault must not end the test process): shm gives the
engine exactly the weights and log-probs zmq gives; a bad update is refused whole before any copy; a client's
segment is kept between syncs (the engine's mapping of it too) and is gone after a close, after an engine is
killed under a sync and after the trainer is killed;
a rank heals an engine killed under an shm sync; a vLLM engine takes shm updates as it takes zmq ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_refs import hf_logprobs, load_policies, two_policies
from safetensors.torch import load_file

from yatt.config import load_experiment
from yatt.distributed import World
from yatt.engines import server as server_module
from yatt.engines.base import SamplingSpec
from yatt.engines.client import EngineDied, connect_engine, spawn_engine
from yatt.engines.config import EngineConfig
from yatt.engines.hf_engine import HFEngine
from yatt.engines.server import EngineService
from yatt.placement.engine_lifecycle import EngineServices
from yatt.transport.codec import new_secret
from yatt.transport.rpc import RemoteError, RpcServer
from yatt.transport.weights.choose import endpoint_host, is_local_host, preferred
from yatt.transport.weights.frames import FrameWeights
from yatt.transport.weights.shm import MAPPINGS, ShmWeights, check_descriptor, segments, sweep

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[4, 5, 6, 13, 7, 8, 9, 16], [4, 5], [9, 8, 7, 6, 5, 4, 3]]
GREEDY = SamplingSpec(n=1, temperature=0.0, max_tokens=10)
SAMPLED = SamplingSpec(n=2, temperature=1.0, max_tokens=10)


def hf_cfg(transport: str) -> EngineConfig:
    return EngineConfig(
        backend="hf", max_model_len=64, weight_bucket_mb=1, startup_timeout_s=120, weight_transport=transport
    )


def own_segments() -> list[str]:
    return segments(os.getpid())


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return two_policies(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def hf(folders) -> dict[str, torch.nn.Module]:
    return load_policies(folders)


def named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


# ---- choosing, and the descriptor's checks (no engine) ----------------------------------------------------------
def test_auto_is_shm_on_this_host_and_zmq_elsewhere():
    assert endpoint_host("tcp://127.0.0.1:5555") == "127.0.0.1" and endpoint_host("tcp://[::1]:5") == "::1"
    assert is_local_host("127.0.0.1") and is_local_host("localhost")
    assert not is_local_host("192.0.2.7")  # TEST-NET-1: never this host's
    assert preferred("auto", "tcp://127.0.0.1:1") == "shm" and preferred("auto", "tcp://192.0.2.7:1") == "zmq"
    assert preferred("zmq", "tcp://127.0.0.1:1") == "zmq"


def test_an_unknown_transport_is_a_config_error_naming_the_choices():
    with pytest.raises(ValueError, match="unknown weight_transport 'nccl'; registered: auto, shm, zmq"):
        EngineConfig(weight_transport="nccl")
    with pytest.raises(ValueError, match="weight_transport"):
        EngineConfig(weight_transport="os:system")  # never an import path: the engine could not know it


def test_a_descriptor_is_checked_whole_before_anything_is_mapped():
    sender = ShmWeights()
    try:
        good = sender.pack([("a", torch.ones(3, 4)), ("b", torch.arange(5))], lambda t: t.dtype)
        name, size, entries = check_descriptor({"descriptor": good["descriptor"]})
        assert [(n, d, s) for n, d, s, _ in entries] == [("a", torch.float32, [3, 4]), ("b", torch.int64, [5])]
        with ShmWeights.unpack({"descriptor": good["descriptor"]}) as pairs:
            assert torch.equal(pairs[0][1], torch.ones(3, 4)) and torch.equal(pairs[1][1], torch.arange(5))
        desc = good["descriptor"]
        bad = {
            "traversal": {**desc, "name": "../../etc/passwd"},
            "outside": {**desc, "tensors": [["a", "float32", [3, 4], size - 8]]},
            "misaligned": {**desc, "tensors": [["a", "float32", [1], 2]]},
            "dtype": {**desc, "tensors": [["a", "complex64", [1], 0]]},
            "shape": {**desc, "tensors": [["a", "float32", [-1], 0]]},
            "keys": {**desc, "extra": 1},
        }
        for why, d in bad.items():
            with pytest.raises(ValueError):
                check_descriptor({"descriptor": d})
            print(why, "refused")
    finally:
        sender.close()
    assert own_segments() == []


def test_a_segment_and_its_mapping_are_kept_between_syncs_until_the_sender_closes():
    """The sender reuses its segment while buckets fit, and the engine its mapping (no page faults again); a
    larger bucket replaces the segment, and a closed sender's mapping is dropped at the engine's next update."""
    first, second = ShmWeights(), ShmWeights()
    try:

        def sync(sender: ShmWeights, value: float, n: int = 1000) -> str:
            payload = sender.pack([("w", torch.full((n,), value))], lambda t: t.dtype)
            with ShmWeights.unpack({"descriptor": payload["descriptor"]}) as pairs:
                assert torch.equal(pairs[0][1], torch.full((n,), value))  # this sync's bytes, not a stale page
            sender.finish()
            return payload["descriptor"]["name"]

        name = sync(first, 1.0)
        mapping = MAPPINGS.kept[name]
        assert sync(first, 2.0) == name and MAPPINGS.kept[name] is mapping and own_segments() == [name]
        grown = sync(first, 3.0, n=100_000)  # a larger bucket: a larger segment, the old one removed
        assert grown != name and own_segments() == [grown] and name not in MAPPINGS.kept
        other = sync(second, 4.0)
        assert set(MAPPINGS.kept) == {grown, other}
        first.close()
        assert own_segments() == [other]
        sync(second, 5.0)
        assert list(MAPPINGS.kept) == [other]  # the closed sender's mapping went at the next update
        second.begin([[("w", torch.empty(10, device="meta"))], [("w", torch.empty(50_000, device="meta"))]])
        sized = own_segments()  # sized for the sync's largest bucket before its first: never replaced mid-sync
        assert sized != [other] and sync(second, 6.0) == sync(second, 7.0, n=50_000) == sized[0]
    finally:
        first.close()
        second.close()
        MAPPINGS.close()
    assert own_segments() == []


def test_a_dead_process_segment_is_swept_by_the_next_sender():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    tag = ShmWeights.__module__  # any segment of that (exited) pid, named as a sender names it
    from yatt.transport.weights.shm import SHM_DIR, host_tag

    path = SHM_DIR / f"yatt-w-{host_tag()}-{pid}-{'0' * 12}-1"
    path.write_bytes(b"x" * 64)
    try:
        assert path.name in segments(pid), tag
        ShmWeights().close()  # a new sender sweeps first
        assert not path.exists()
        assert sweep() == []
    finally:
        path.unlink(missing_ok=True)


# ---- real engine processes ------------------------------------------------------------------------------------
def sync_and_sample(folders, hf, tmp_path, transport: str):
    client = spawn_engine(folders["A"], hf_cfg(transport), seed=0, log_path=tmp_path / f"{transport}.log")
    try:
        client.update_weights(named(hf["B"]))
        assert client.weight_transport().name == transport
        during = own_segments()
        client.finish_sync()
        assert own_segments() == during  # kept for the next sync
        greedy = client.generate(PROMPTS, GREEDY)
        sampled = client.generate(PROMPTS, SAMPLED, seeds=[0, 2, 4])
        return greedy, sampled, client.health()["weight_updates"], during, client._rpc.sent_bytes
    finally:
        client.close()


@pytest.mark.engine
def test_shm_gives_the_engine_the_weights_and_logprobs_zmq_gives(folders, hf, tmp_path):
    zmq = sync_and_sample(folders, hf, tmp_path, "zmq")
    shm = sync_and_sample(folders, hf, tmp_path, "shm")
    assert shm[0] == zmq[0] and shm[1] == zmq[1]  # same tokens and log-probs, bit for bit
    assert shm[2] == zmq[2] > 1  # the same buckets
    for prompt, (c,) in zip(PROMPTS, shm[0]):  # and they are model B's
        torch.testing.assert_close(
            torch.tensor(c.logprobs), hf_logprobs(hf["B"], prompt, c.token_ids), atol=1e-4, rtol=0
        )
    assert zmq[3] == [] and len(shm[3]) == 1  # one segment, reused by every bucket
    weight_bytes = sum(p.numel() * 4 for p in hf["B"].parameters())
    assert zmq[4] > weight_bytes > 100 * shm[4]  # only descriptors went through the socket
    assert own_segments() == []  # removed at close


@pytest.fixture
def in_process(folders, monkeypatch):
    """A real HFEngine behind a real EngineService and RpcServer in this process; the engine's exit after a
    failed update (die) is recorded instead of ending the test process."""
    exits: list[int] = []
    monkeypatch.setattr(server_module, "die", exits.append)
    engine = HFEngine(str(folders["A"]), hf_cfg("shm"), seed=0)
    secret = new_secret()
    server = RpcServer(EngineService(engine), secret)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = connect_engine(server.endpoint, secret, hf_cfg("shm"))
    yield engine, client, exits
    client.close()
    server.stop()
    thread.join()
    server.close()
    engine.shutdown()


@pytest.mark.engine
def test_a_bad_shm_update_is_refused_whole_before_any_copy(in_process, hf):
    engine, client, exits = in_process
    snapshot = {n: p.clone() for n, p in engine.model.state_dict().items()}
    good = named(hf["B"])
    with pytest.raises(RemoteError, match="nope"):
        client.update_weights([*good[:3], ("model.layers.0.mlp.nope.weight", torch.zeros(2))])
    with pytest.raises(RemoteError, match=r"model\.norm\.weight.*\(7,\)"):
        client.update_weights([*good[:3], ("model.norm.weight", torch.zeros(7))])
    assert all(torch.equal(snapshot[n], p) for n, p in engine.model.state_dict().items())
    assert engine.weight_updates == 0
    time.sleep(0.7)
    assert exits == [5, 5]  # a real engine process would have exited, and its rank restarted it
    # a descriptor pointing outside its segment is refused before the engine sees it (and is no engine failure)
    payload = client.weight_transport().pack(good[:1], lambda t: t.dtype)
    payload["descriptor"]["tensors"][0][3] = payload["descriptor"]["size"]
    with pytest.raises(RemoteError, match="not inside"):
        client._call("update_weights", **payload)
    assert engine.weight_updates == 0 and exits == [5, 5]
    client.finish_sync()
    client.close()
    assert own_segments() == []


@pytest.mark.engine
def test_an_engine_killed_under_an_shm_sync_leaves_no_segment(folders, hf, tmp_path):
    client = spawn_engine(folders["A"], hf_cfg("shm"), seed=0, log_path=tmp_path / "e.log")
    try:
        client.update_weights(named(hf["B"])[:2])
        assert len(own_segments()) == 1
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(EngineDied):
            client.update_weights(named(hf["B"]))
    finally:
        client.close()
    assert own_segments() == []


TRAINER = """
import os, sys, time
from safetensors.torch import load_file
from yatt.engines.client import spawn_engine
from yatt.engines.config import EngineConfig
cfg = EngineConfig(backend="hf", max_model_len=64, startup_timeout_s=120, weight_transport="shm")
client = spawn_engine(sys.argv[1], cfg, seed=0, log_path=sys.argv[2])
norm = load_file(sys.argv[1] + "/model.safetensors")["model.norm.weight"]
client.update_weights([("model.norm.weight", norm)])  # the segment stays until finish_sync
print(client.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.engine
def test_a_killed_trainer_leaves_no_segment(folders, tmp_path):
    """SIGKILL runs no cleanup in the trainer: its engine, seeing its parent gone, removes the parent's segments
    (and any later sender would sweep them)."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(folders["A"]), str(tmp_path / "e.log")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        engine_pid = int(trainer.stdout.readline())
        assert len(segments(trainer.pid)) == 1
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 15
        while (segments(trainer.pid) or Path(f"/proc/{engine_pid}").exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert segments(trainer.pid) == []
        assert "parent" in (tmp_path / "e.log").read_text()
    finally:
        trainer.kill()
        sweep()


@pytest.mark.engine
def test_a_rank_heals_an_engine_killed_under_an_shm_sync(tmp_path, folders):
    cfg = load_experiment(
        REPO / "configs" / "quickstart.yaml",
        [
            f"run.output_dir={tmp_path}",
            f"model.path={folders['A']}",
            "rollout.engine.backend=hf",
            "rollout.engine.weight_transport=shm",
            "reward.judges=[]",
        ],
    )
    weights = load_file(str(folders["B"] / "model.safetensors"))  # the trainer's policy
    services = EngineServices(
        cfg, World(0, 1, 0, torch.device("cpu")), tmp_path / "run", policy_weights=lambda: iter([list(weights.items())])
    )
    try:
        services.push_policy()
        expected = services.rollout.generate(PROMPTS, GREEDY)
        old = services.rollout.pid
        os.kill(old, signal.SIGKILL)  # dies under the next sync
        services.push_policy()
        assert services.rollout.pid != old and services.rollout.alive()
        assert services.rollout.generate(PROMPTS, GREEDY) == expected  # restarted with the current weights
        assert services.heal() == 1
        assert type(services.rollout.weight_transport()) is ShmWeights
        kept = services.rollout.weight_transport().segment  # the live client's, kept between syncs
        assert own_segments() == ([kept.name] if kept else [])  # the dead engine's client's is gone
    finally:
        services.close()
    assert own_segments() == []


def test_zmq_frames_refuse_a_payload_that_is_not_name_tensor_pairs():
    with pytest.raises(TypeError):
        with FrameWeights.unpack({"named_tensors": [["a"]]}):
            pass


@pytest.mark.engine
def test_a_vllm_engine_takes_shm_updates_as_it_takes_zmq_ones(folders, hf, tmp_path):
    """One vLLM engine, two clients: the shm one loads B; the zmq one loads A back, then B: the same samples."""
    cfg = EngineConfig(
        max_model_len=256,
        max_num_seqs=64,
        vllm={"kv_cache_gib": 0.25},
        weight_bucket_mb=1,
        startup_timeout_s=300,
        weight_transport="shm",
    )
    secret = new_secret()
    shm = spawn_engine(folders["A"], cfg, seed=0, log_path=tmp_path / "vllm.log", secret=secret)
    zmq = connect_engine(shm.endpoint, secret, cfg.model_copy(update={"weight_transport": "zmq"}))
    try:
        a = shm.generate(PROMPTS, GREEDY)
        shm.update_weights(named(hf["B"]))
        shm.finish_sync()
        assert own_segments() == [shm.weight_transport().segment.name]  # kept for the next sync
        by_shm = shm.generate(PROMPTS, GREEDY), shm.generate(PROMPTS, SAMPLED, seeds=[0, 2, 4])
        for prompt, (c,) in zip(PROMPTS, by_shm[0]):
            torch.testing.assert_close(
                torch.tensor(c.logprobs), hf_logprobs(hf["B"], prompt, c.token_ids), atol=1e-4, rtol=0
            )
        zmq.update_weights(named(hf["A"]))
        assert zmq.generate(PROMPTS, GREEDY) == a
        zmq.update_weights(named(hf["B"]))
        assert (zmq.generate(PROMPTS, GREEDY), zmq.generate(PROMPTS, SAMPLED, seeds=[0, 2, 4])) == by_shm
        assert by_shm[0] != a
    finally:
        zmq.close()
        shm.close()
    assert own_segments() == []
