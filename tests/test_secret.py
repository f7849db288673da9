"""The run secret never goes through torchrun's store: an outsider that reads the store learns no key."""

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yatt.distributed import World, close_world
from yatt.placement.engine_lifecycle import ROLLOUT, derive_secret
from yatt.transport.secret import (
    FINGERPRINT_KEY,
    SECRET_ENV,
    SECRET_FILE,
    SECRET_FILE_ENV,
    RunSecretError,
    provided_secret,
    read_secret_file,
    run_secret,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, tmp: str, port: int, env: dict) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    world = World(rank, 2, rank, torch.device("cpu"))
    run_dir = Path(tmp) / "run"
    run_dir.mkdir(exist_ok=True)
    try:
        out = {"secret": run_secret(world, run_dir, env).hex()}
    except RunSecretError as e:
        out = {"error": str(e)}
    Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(out))
    if rank == 0:  # keep the store up until the outsider has looked at it
        deadline = time.monotonic() + 60
        while not Path(f"{tmp}/outsider-done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    world.barrier()
    close_world()


def _launch(tmp: Path, env: dict, outsider=None) -> list[dict]:
    port = _free_port()
    ctx = mp.start_processes(_rank, args=(str(tmp), port, env), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 60
    while not all((tmp / f"rank{r}.json").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if outsider is not None:
        outsider(port)
    (tmp / "outsider-done").touch()
    ctx.join()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_an_outsider_reading_the_store_cannot_obtain_a_working_key(tmp_path):
    seen: dict = {}

    def outsider(port: int) -> None:
        # Any process that reaches the rendezvous port: a plain store client, no rank.
        # (yatt keys sit under the default group's "0/" prefix: that hides nothing)
        store = dist.PrefixStore("0/", dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5)))
        for key in ("yatt/run_secret", f"yatt/{FINGERPRINT_KEY}"):
            seen[key] = store.get(key).decode() if store.check([key]) else None

    a, b = _launch(tmp_path, {}, outsider)
    assert a["secret"] == b["secret"] and len(bytes.fromhex(a["secret"])) == 32
    secret = bytes.fromhex(a["secret"])
    assert seen["yatt/run_secret"] is None  # today's code published it here
    fp = seen[f"yatt/{FINGERPRINT_KEY}"]
    assert fp and secret.hex() not in fp and fp != derive_secret(secret, ROLLOUT, 0).hex()
    file = tmp_path / "run" / SECRET_FILE
    assert file.stat().st_mode & 0o077 == 0, "the secret file must be owner-only"


def test_a_provided_secret_is_used_by_every_rank(tmp_path):
    given = os.urandom(32)
    a, b = _launch(tmp_path, {SECRET_ENV: given.hex()})
    assert a["secret"] == b["secret"] == given.hex()
    assert not (tmp_path / "run" / SECRET_FILE).exists()


def test_provided_secrets_are_checked(tmp_path):
    env_file = tmp_path / "s"
    env_file.write_text("cd" * 32)
    env_file.chmod(0o600)
    assert provided_secret({SECRET_FILE_ENV: str(env_file)}) == bytes.fromhex("cd" * 32)
    env_file.chmod(0o644)
    with pytest.raises(RunSecretError, match="readable by other users"):
        read_secret_file(env_file)
    with pytest.raises(RunSecretError, match=SECRET_ENV):
        provided_secret({SECRET_ENV: "not hex"})
    with pytest.raises(RunSecretError, match="cannot read"):
        provided_secret({SECRET_FILE_ENV: str(tmp_path / "missing")})


def test_a_rank_without_the_secret_file_fails_clearly(tmp_path, monkeypatch):
    # A world of one whose rank is not 0 and whose run directory lacks the file (an unshared node).
    from yatt import distributed

    monkeypatch.setitem(distributed._LOCAL_STORE, FINGERPRINT_KEY, "0" * 32)
    world = World(1, 1, 0, torch.device("cpu"))
    with pytest.raises(RunSecretError, match=f"{SECRET_FILE}.*does not exist.*{SECRET_ENV}"):
        run_secret(world, tmp_path, {})
    (tmp_path / SECRET_FILE).write_text("ef" * 32)
    (tmp_path / SECRET_FILE).chmod(0o600)
    with pytest.raises(RunSecretError, match="differs from rank 0"):
        run_secret(world, tmp_path, {})
