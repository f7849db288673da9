"""This rank's engine processes, and clients to every rank's engines.

Each rank starts one rollout engine and one engine per judge on its own device (on GPU the idle
one sleeps). Endpoints are published through torchrun's key-value store, so any controller can
reach any engine without configuration. Every engine's secret is derived from one per-run secret
(made by rank 0 and shared through the same store), so a process outside the run cannot talk to
the engines, and the engines of one run cannot be confused with another's.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from yatt.config import ExperimentConfig
from yatt.distributed import World
from yatt.engines.client import EngineClient, connect_engine, spawn_engine
from yatt.engines.config import EngineConfig
from yatt.engines.pool import EnginePool
from yatt.transport.codec import new_secret

ROLLOUT = "rollout"


def judge_role(name: str) -> str:
    return f"genrm-{name}"


def derive_secret(run_secret: bytes, role: str, rank: int) -> bytes:
    return hmac.new(run_secret, f"engine:{role}:{rank}".encode(), hashlib.sha256).digest()


class EngineServices:
    def __init__(self, cfg: ExperimentConfig, world: World, run_dir: Path):
        self.cfg, self.world, self.run_dir = cfg, world, run_dir
        if world.is_main:
            world.publish("run_secret", new_secret().hex())
        self.run_secret = bytes.fromhex(world.lookup("run_secret"))
        self.specs: dict[str, tuple[str, EngineConfig, int]] = {
            ROLLOUT: (str(cfg.model.path), cfg.rollout.engine, cfg.run.seed + world.rank)}
        for j in cfg.reward.judges:
            self.specs[judge_role(j.name)] = (str(j.model), j.engine, cfg.run.seed + 1000 + world.rank)
        self.local: dict[str, EngineClient] = {}
        self.policy_weights = None  # set by the shard: () -> named tensors, pushed into a restarted rollout engine
        self.generation = 0
        for role in self.specs:
            self._start(role)
        self._remote: dict[tuple[str, int], EngineClient] = {}

    def _start(self, role: str) -> EngineClient:
        model, engine_cfg, seed = self.specs[role]
        self.generation += 1
        log = self.run_dir / "logs" / f"engine-{role}-rank{self.world.rank}-{self.generation}.log"
        client = spawn_engine(model, engine_cfg, seed=seed, log_path=log,
                              secret=derive_secret(self.run_secret, role, self.world.rank))
        self.local[role] = client
        if role == ROLLOUT and self.policy_weights is not None:
            client.update_weights(self.policy_weights())
        self.world.publish(f"engine/{role}/{self.world.rank}", client.endpoint)
        return client

    @property
    def rollout(self) -> EngineClient:
        return self.local[ROLLOUT]

    def judges(self) -> list[EngineClient]:
        return [c for role, c in self.local.items() if role != ROLLOUT]

    def heal(self) -> int:
        """Restart this rank's dead engines (called between steps, by every rank); returns how many."""
        dead = [role for role, c in self.local.items() if c.proc is not None and c.proc.poll() is not None]
        for role in dead:
            self.local[role].close()
            self._start(role)
        restarted = int(self.world.sum([float(len(dead))])[0])
        if restarted:
            self._remote.clear()  # endpoints changed; look them up again
            self.world.barrier()
        return restarted

    def client(self, role: str, rank: int) -> EngineClient:
        if rank == self.world.rank:
            return self.local[role]
        key = (role, rank)
        if key not in self._remote or self._remote[key]._closed:
            endpoint = self.world.lookup(f"engine/{role}/{rank}")
            self._remote[key] = connect_engine(endpoint, derive_secret(self.run_secret, role, rank),
                                               self.specs[role][1])
        return self._remote[key]

    def pool(self, role: str, ranks: tuple[int, ...] | list[int]) -> EnginePool:
        """A pool over `role` engines on `ranks`; if all die mid-step, this rank's own engine (restarted) takes over."""
        def respawn(_: str) -> EngineClient:
            own = self.local[role]
            return own if own.proc.poll() is None else self._start(role)
        return EnginePool({f"{role}@{r}": self.client(role, r) for r in ranks}, respawn=respawn)

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each local engine has spent stepping since it started."""
        out = {}
        for role, c in self.local.items():
            try:
                out[role] = float(c.health()["busy_s"])
            except Exception:
                out[role] = 0.0
        return out

    def close(self) -> None:
        for c in self._remote.values():
            c.close()
        for c in self.local.values():
            c.close()
