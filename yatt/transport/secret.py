"""The per-run secret every engine key is derived from, shared without the rendezvous store.

Why not the store: torchrun's key-value store listens on every interface without authentication, so
whatever is published there (endpoints, barriers) is readable and writable by any process that can reach
the rendezvous port. A secret published there is no secret. So the secret comes, in this order, from

1. ``YATT_RUN_SECRET`` (64 hex characters) in the ranks' environment: torchrun passes its own environment
   to every rank it starts, so on a multi-node cluster the job script exports the same value on every node
   (e.g. generated once and handed out by the scheduler);
2. ``YATT_RUN_SECRET_FILE``: a file holding those 64 hex characters, readable by the job's user only (checked);
3. otherwise rank 0 makes a fresh one and writes it, readable by its owner only, to ``<run_dir>/.run_secret``;
   the other ranks read that file. This works on one node and on nodes sharing the run directory.

Only a fingerprint (a keyed hash that reveals nothing about the secret) goes through the store, so that every
rank can check it read the secret of *this* launch (not a stale file from an earlier one, nor another node's
unshared file) and fail with one clear line otherwise.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from yatt.distributed import World
from yatt.transport.codec import new_secret

SECRET_ENV = "YATT_RUN_SECRET"
SECRET_FILE_ENV = "YATT_RUN_SECRET_FILE"
SECRET_FILE = ".run_secret"
FINGERPRINT_KEY = "run_secret_fingerprint"


class RunSecretError(Exception):
    """The run secret is missing, malformed, unsafe to use, or differs between ranks."""


def fingerprint(secret: bytes) -> str:
    return hashlib.sha256(b"yatt run secret fingerprint\0" + secret).hexdigest()[:32]


def parse_secret(text: str, where: str) -> bytes:
    text = text.strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise RunSecretError(
            f"{where}: the run secret must be at least 32 hex characters "
            "(e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`)"
        )
    return secret


def read_secret_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as e:
        raise RunSecretError(f"{path}: cannot read the run secret ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RunSecretError(f"{path}: the run secret file is readable by other users; chmod 600 it")
    return parse_secret(text, str(path))


def provided_secret(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The secret the launcher provides through the environment, or None."""
    if env.get(SECRET_ENV):
        return parse_secret(env[SECRET_ENV], SECRET_ENV)
    if env.get(SECRET_FILE_ENV):
        return read_secret_file(Path(env[SECRET_FILE_ENV]))
    return None


def write_secret_file(path: Path, secret: bytes) -> None:
    """Owner-only from its first byte (no chmod race), then renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex())
    os.replace(tmp, path)


def run_secret(world: World, run_dir: Path, env: Mapping[str, str] = os.environ) -> bytes:
    """This run's secret, the same on every rank; called by every rank."""
    secret = provided_secret(env)
    path = run_dir / SECRET_FILE
    if secret is None and world.is_main:
        secret = new_secret()
        write_secret_file(path, secret)
    if world.is_main:
        world.publish(FINGERPRINT_KEY, fingerprint(secret))
    expected = world.lookup(FINGERPRINT_KEY)
    if secret is None:
        if not path.exists():
            raise RunSecretError(
                f"rank {world.rank}: no run secret: {path} does not exist here (nodes do not share the run "
                f"directory?); export the same {SECRET_ENV} or {SECRET_FILE_ENV} on every node"
            )
        secret = read_secret_file(path)
    if fingerprint(secret) != expected:
        raise RunSecretError(
            f"rank {world.rank}: this rank's run secret differs from rank 0's; "
            f"export the same {SECRET_ENV} (or {SECRET_FILE_ENV}) on every node"
        )
    return secret
