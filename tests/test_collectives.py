"""Every collective yatt issues is metadata on the CPU, which a GPU process group (cpu:gloo,cuda:nccl) routes
through gloo; engines see only their rank's GPU. Proven on CPU (see yatt.distributed's docstring)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import Backend, BackendConfig, _get_object_coll_device

from yatt.distributed import RECORD_ENV, World, backend_for, close_world, init_world, launched_by_torchrun
from yatt.engines.client import device_env

REPO = Path(__file__).resolve().parents[1]

# What gloo implements for CPU tensors, as World issues them (op name, and the reduction for all_reduce).
GLOO_CPU_OPS = {"all_reduce", "all_gather", "broadcast", "send", "recv"}
GLOO_REDUCTIONS = {"sum", "max"}


def check_records(records: list[dict]) -> None:
    """Every recorded op is one gloo runs on CPU, on CPU tensors only (-> gloo under cpu:gloo,cuda:nccl)."""
    for r in records:
        assert r["op"] in GLOO_CPU_OPS, r
        assert r["op"] != "all_reduce" or r["reduce"] in GLOO_REDUCTIONS, r
        assert r["tensors"] and all(t["device"] == "cpu" for t in r["tensors"]), r


def read_records(folder: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


def lockstep(records: list[dict]) -> list[dict]:
    """The collective (not point-to-point) ops, which every rank must issue in the same order and shapes."""
    return [r for r in records if r["op"] not in ("send", "recv")]


# ---- the backend choice ---------------------------------------------------------------------------


def test_backend_for_routes_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl():
    assert BackendConfig(Backend(backend_for(True))).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    assert BackendConfig(Backend(backend_for(False))).get_device_backend_map()["cpu"] == "gloo"


def test_torchrun_is_detected_from_its_environment():
    assert not launched_by_torchrun({"PATH": "/bin"})
    assert launched_by_torchrun({"WORLD_SIZE": "1"})
    assert launched_by_torchrun({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert launched_by_torchrun({"TORCHELASTIC_RUN_ID": "x"})


def test_a_plain_run_is_a_groupless_world_of_one(tmp_path, monkeypatch):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    for var in [
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "LOCAL_RANK",
        *(k for k in os.environ if k.startswith("TORCHELASTIC_")),
    ]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    world = init_world()
    assert not dist.is_initialized() and not world.grouped and world.size == 1
    assert world.sum([1.0, 2.0]) == [1.0, 2.0] and world.max([3.0]) == [3.0]
    assert [t.tolist() for t in world.all_gather(torch.tensor([[1, 2]]))] == [[[1, 2]]]
    assert world.broadcast_object({"a": 1}) == {"a": 1}
    world.barrier()
    world.publish("k", "v")
    assert world.lookup("k") == "v"
    assert not list(tmp_path.iterdir())  # nothing issued, nothing recorded


def test_world_refuses_device_tensors():
    world = World(0, 1, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU tensors"):
        world.all_gather(torch.zeros(2, device="meta"))


# ---- under a group with one backend per device type -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, tmp: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ[RECORD_ENV] = f"{tmp}/two"
    # The CPU build has no NCCL, so cuda:gloo stands in for cuda:nccl: the same per-device dispatch.
    dist.init_process_group("cpu:gloo,cuda:gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    world = World(rank, 2, rank, torch.device("cpu"))
    out = {
        "object_device": _get_object_coll_device(),
        "sum": world.sum([1.0, float(rank)]),
        "max": world.max([float(rank), -1.0]),
        "gathered": [t.tolist() for t in world.all_gather(torch.arange(3 * rank, dtype=torch.int64).view(-1, 3))],
        "object": world.broadcast_object(f"from {rank}"),
    }
    world.barrier()
    if rank == 0:
        world.publish("endpoint", "tcp://x")
    out["lookup"] = world.lookup("endpoint")
    peer = 1 - rank
    ints, floats = torch.empty(2 + peer, dtype=torch.int64), torch.empty(1, dtype=torch.float64)
    world.exchange(
        {peer: [torch.full((2 + rank,), rank), torch.tensor([rank + 0.5], dtype=torch.float64)]}, {peer: [ints, floats]}
    )
    out["received"] = [ints.tolist(), floats.tolist()]
    close_world()
    if rank == 0:  # torchrun with one process: the group exists and World issues its ops through it
        os.environ.update(
            {
                RECORD_ENV: f"{tmp}/one",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "1",
                "RANK": "0",
                "LOCAL_RANK": "0",
            }
        )
        one = init_world()
        out["one"] = {"grouped": dist.is_initialized(), "sum": one.sum([2.0]), "object": one.broadcast_object(7)}
        one.barrier()
        close_world()
    Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def mixed_group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("collectives")
    mp.spawn(_worker, args=(str(tmp), _free_port()), nprocs=2, join=True)
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_world_ops_give_the_right_answers(mixed_group):
    _, (a, b) = mixed_group
    for rank, out in enumerate((a, b)):
        assert out["object_device"] == "cpu"  # torch's own pick for object collectives on such a group
        assert out["sum"] == [2.0, 1.0] and out["max"] == [1.0, -1.0]
        assert out["gathered"] == [[], [[0, 1, 2]]]  # rank 0 had no rows, rank 1 one row
        assert out["object"] == "from 0" and out["lookup"] == "tcp://x"
        peer = 1 - rank
        assert out["received"] == [[peer] * (2 + peer), [peer + 0.5]]
    assert a["one"] == {"grouped": True, "sum": [2.0], "object": 7}


def test_world_ops_are_recorded_as_cpu_gloo_ops_in_lockstep(mixed_group):
    tmp, _ = mixed_group
    ranks = [read_records(tmp / "two", r) for r in range(2)]
    for records in ranks:
        check_records(records)
        assert {r["call"] for r in records} == {"sum", "max", "all_gather", "broadcast_object", "barrier", "exchange"}
        assert sorted(r["op"] for r in records if r["call"] == "exchange") == ["recv", "recv", "send", "send"]
    assert lockstep(ranks[0]) == lockstep(ranks[1])
    one = read_records(tmp / "one", 0)
    check_records(one)
    assert [r["call"] for r in one] == ["sum", "broadcast_object", "barrier"]


def test_gpu_check_script_passes_here(tmp_path):
    """scripts/gpu_check_collectives.py (World's ops and a DDP step on torchrun's group) works before a GPU is lent."""
    from e2e import env

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            str(REPO / "scripts/gpu_check_collectives.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert report["ok"] and report["checks"]["exchange"] and report["checks"]["backends as chosen"], report


# ---- nobody else calls torch.distributed ------------------------------------------------------------

ALLOWED_DIST = {"is_initialized", "is_available"}
DDP_OWNERS = {"yatt/trainers"}  # DDP (NCCL on the device) is the trainer's business
# the megatron backend's model-parallel collectives (TP shards, PP stages, over megatron's own groups, with
# tensors on the device) are the trainer's business as DDP is
MODEL_PARALLEL_OWNERS = {"yatt/trainers/megatron_", "yatt/trainers/sharding.py"}  # and FSDP2's gathers (DTensor)
# --nproc runs torchrun's agent (torch.distributed.launcher / elastic): it starts the ranks, it issues no collective
LAUNCHER = "yatt/launcher.py"


def distributed_calls(source: str) -> list[str]:
    """torch.distributed uses in `source` other than the allowed queries."""
    found = [
        m.group(0)
        for m in re.finditer(r"\b(?:torch\.distributed|dist)\.(\w+)", source)
        if m.group(1) not in ALLOWED_DIST
    ]
    found += re.findall(
        r"^\s*(?:from torch\.distributed\S* import .*|from torch import distributed.*)$", source, re.MULTILINE
    )
    return found


def test_the_checker_sees_what_it_must():
    assert distributed_calls("dist.all_gather(a, b)\nx = dist.isend(t, 1)") == ["dist.all_gather", "dist.isend"]
    assert distributed_calls("torch.distributed.all_reduce(t)") == ["torch.distributed.all_reduce"]
    assert distributed_calls("from torch.distributed import all_reduce") == ["from torch.distributed import all_reduce"]
    assert distributed_calls("if dist.is_initialized():\n    pass") == []


def test_only_yatt_distributed_issues_collectives():
    offenders = {}
    for path in sorted((REPO / "yatt").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in ("yatt/distributed.py", LAUNCHER) or any(rel.startswith(p) for p in MODEL_PARALLEL_OWNERS):
            continue
        source = path.read_text()
        calls = distributed_calls(source)
        if "DistributedDataParallel" in source and not any(rel.startswith(p) for p in DDP_OWNERS):
            calls.append("DistributedDataParallel")
        if calls:
            offenders[rel] = calls
    assert offenders == {}, "use yatt.distributed.World instead"


# ---- engines see only their rank's GPU ---------------------------------------------------------------


def test_engine_sees_only_its_ranks_gpu():
    assert device_env(torch.device("cpu"), "0,1") == {}  # CPU: the environment is left alone
    assert device_env(torch.device("cuda", 1), None) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert device_env(torch.device("cuda", 1), "") == {"CUDA_VISIBLE_DEVICES": "1"}
    assert device_env(torch.device("cuda", 0), "4,6") == {"CUDA_VISIBLE_DEVICES": "4"}
    assert device_env(torch.device("cuda", 1), "4, 6") == {"CUDA_VISIBLE_DEVICES": "6"}
    assert device_env(torch.device("cuda", 1), "GPU-aa,GPU-bb") == {"CUDA_VISIBLE_DEVICES": "GPU-bb"}
    with pytest.raises(ValueError, match="not among"):
        device_env(torch.device("cuda", 2), "4,6")


def test_engine_env_pins_to_the_spawning_ranks_gpu(monkeypatch):
    from yatt.engines import client
    from yatt.engines.config import EngineConfig

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert client.engine_env(EngineConfig())["CUDA_VISIBLE_DEVICES"] == "4,6"  # CPU machine: left alone
    monkeypatch.setattr(client, "_current_device", lambda: torch.device("cuda", 1))  # init_world's set_device
    assert client.engine_env(EngineConfig())["CUDA_VISIBLE_DEVICES"] == "6"
    assert client.engine_env(EngineConfig(), {"CUDA_VISIBLE_DEVICES": "4"})["CUDA_VISIBLE_DEVICES"] == "4"


def test_engine_gpus_place_engines_apart_from_the_trainer_ranks(monkeypatch):
    """rollout.engine.gpus: the engine of local rank r runs on gpus[r % len(gpus)]; CPU ranks keep theirs."""
    from yatt.engines import client
    from yatt.engines.client import engine_device
    from yatt.engines.config import EngineConfig

    cpu = torch.device("cpu")
    assert engine_device([4, 5], cpu) == cpu
    assert engine_device(None, torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert engine_device([4, 5], torch.device("cuda", 0)) == torch.device("cuda", 4)
    assert engine_device([4, 5], torch.device("cuda", 3)) == torch.device("cuda", 5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setattr(client, "_current_device", lambda: torch.device("cuda", 1))
    assert client.engine_env(EngineConfig(gpus=[4, 5, 6, 7]))["CUDA_VISIBLE_DEVICES"] == "5"
    assert client.engine_env(EngineConfig())["CUDA_VISIBLE_DEVICES"] == "1"


def test_preflight_asks_ahead_schedules_on_gpus_for_engine_gpus(tmp_path):
    """An ahead schedule on a GPU machine needs rollout.engine.gpus, and engines' GPUs must exist; a CPU
    machine (0 GPUs) checks neither."""
    from yatt.config import ExperimentConfig
    from yatt.preflight import ConfigError, check_gpus

    def cfg(**rollout) -> ExperimentConfig:
        return ExperimentConfig.model_validate(
            {
                "model": {"path": str(tmp_path)},
                "data": {"train": {"kind": "jsonl", "files": ["x.jsonl"]}},
                "rollout": rollout,
            }
        )

    ahead = {"schedule": {"mode": "one_step_off"}}
    check_gpus(cfg(**ahead), "c.yaml", count=0)
    with pytest.raises(ConfigError, match=r"one_step_off on GPUs needs rollout.engine.gpus"):
        check_gpus(cfg(**ahead), "c.yaml", count=8)
    check_gpus(cfg(**ahead, engine={"gpus": [4, 5, 6, 7]}), "c.yaml", count=8)
    check_gpus(cfg(**ahead, engine={"gpus": [0]}), "c.yaml", count=1)  # one GPU, shared: asked for, so allowed
    with pytest.raises(ConfigError, match=r"rollout.engine.gpus=\[8\]: this machine shows the run 8 GPU"):
        check_gpus(cfg(engine={"gpus": [8]}), "c.yaml", count=8)
    check_gpus(cfg(), "c.yaml", count=8)  # sync: the rank's own GPU, taking turns
