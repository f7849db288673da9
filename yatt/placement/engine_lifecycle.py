"""This rank's engine processes, and clients to every rank's engines.

Each rank starts one rollout engine and one engine per judge (and a distillation teacher's) on its own device (on
GPU the idle one sleeps). Endpoints are published through torchrun's key-value store, so any controller can
reach any engine without configuration. Every engine's secret is derived from one per-run secret
(`yatt.transport.secret`: from the launcher's environment or an owner-only file, never through the
store, which anyone who reaches the rendezvous port can read), so a process outside the run cannot talk
to the engines, and the engines of one run cannot be confused with another's.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from yatt.config import ExperimentConfig
from yatt.distributed import World
from yatt.engines.client import EngineClient, EngineDied, connect_engine, spawn_engine
from yatt.engines.config import EngineConfig
from yatt.engines.pool import EnginePool
from yatt.engines.resume import Preemption, ResumingPool
from yatt.genrm.judge import judge_engine
from yatt.genrm.teacher import TEACHER, teacher_engine
from yatt.placement.ownership import HookRole
from yatt.tensors import NamedTensors, WeightVersions
from yatt.transport.secret import run_secret

ROLLOUT = "rollout"


def genrm_role(name: str) -> str:
    return f"genrm-{name}"


def derive_secret(run_secret: bytes, role: str, rank: int) -> bytes:
    return hmac.new(run_secret, f"engine:{role}:{rank}".encode(), hashlib.sha256).digest()


# spawn(model_path, engine config, seed, log_path, secret) -> a client owning a started engine
Spawn = Callable[..., EngineClient]
# () -> the policy's current weights, in buckets (the factory binds the trainer's engine_weights)
PolicyWeights = Callable[[], Iterator[NamedTensors]]
# () -> the versions of those weights (the trainer's weight_versions: the delta sync)
PolicyVersions = Callable[[], WeightVersions]


class EngineServices:
    """`spawn` starts one engine (default: a child process, `spawn_engine`); tests pass in-process fakes."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        world: World,
        run_dir: Path,
        spawn: Spawn = spawn_engine,
        policy_weights: PolicyWeights | None = None,
        policy_versions: PolicyVersions | None = None,
    ):
        """`policy_weights`: what `push_policy` pushes, and what a rollout engine restarted mid-run is loaded
        with; None (no trainer, e.g. a test of the engines alone): a restarted engine serves model.path.
        `policy_versions`: their versions, with which each engine client leaves out what its engine holds already
        (rollout.engine.delta_sync, yatt.engines.delta); None: every push is whole."""
        self.cfg, self.world, self.run_dir, self.spawn = cfg, world, run_dir, spawn
        self.policy_weights, self.policy_versions = policy_weights, policy_versions
        self.preemption: Preemption | None = None  # set by a schedule that pushes while rollouts are in flight
        self.run_secret = run_secret(world, run_dir)
        # Several rollout engines per device are roles rollout, rollout-1, ...; pools route among all of them.
        self.rollout_roles = [ROLLOUT] + [f"{ROLLOUT}-{i}" for i in range(1, cfg.rollout.engines_per_rank)]
        own = cfg.rollout.engine
        rollout_engine = own.model_copy(  # a restarted engine is started from this too
            update={
                "max_model_len": own.max_model_len or cfg.rollout_tokens,
                "max_lora_rank": own.max_lora_rank or cfg.model.lora.adapter_rank,  # sized for the adapters it is sent
            }
        )
        self.specs: dict[str, tuple[str, EngineConfig, int]] = {
            role: (str(cfg.model.path), rollout_engine, cfg.run.seed + world.rank + i * world.size)
            for i, role in enumerate(self.rollout_roles)
        }
        for j in cfg.reward.judges:
            self.specs[genrm_role(j.name)] = (str(j.model), judge_engine(j), cfg.run.seed + 1000 + world.rank)
        if cfg.reward.teacher is not None:  # on-policy distillation: served and placed like a judge
            teacher = cfg.reward.teacher
            self.specs[TEACHER] = (str(teacher.model), teacher_engine(teacher), cfg.run.seed + 2000 + world.rank)
        self.local: dict[str, EngineClient] = {}
        self.generation = 0
        self.uncounted_restarts = 0  # engines restarted since take_restarts last counted them
        self._counting = threading.Lock()  # an ahead schedule's producer restarts engines too
        # keep_pushed(): a host copy of the weights last pushed, which a restarted engine is loaded with
        self.pushed: list[NamedTensors] | None = None
        self.pushed_versions: WeightVersions | None = None  # the versions of `pushed`
        self.keeps_pushed = False
        self.synced = {"sent_bytes": 0, "skipped_bytes": 0}  # by the rollout engines' pushes since take_synced
        self.behind = False  # push_policy(load=False): the rollout engines load `pushed` when they next wake
        for role in self.specs:  # from model.path: the policy before any step (a resume pushes its own)
            self._start(role, restart=False)
        self._remote: dict[tuple[str, int], EngineClient] = {}

    def _start(self, role: str, restart: bool = True) -> EngineClient:
        """Start the `role` engine; a restarted rollout engine gets the current policy (`policy_weights`)."""
        model, engine_cfg, seed = self.specs[role]
        self.generation += 1
        log = self.run_dir / "logs" / f"engine-{role}-rank{self.world.rank}-{self.generation}.log"
        client = self.spawn(
            model, engine_cfg, seed=seed, log_path=log, secret=derive_secret(self.run_secret, role, self.world.rank)
        )
        self.local[role] = client
        if restart and role in self.rollout_roles and self.policy_weights is not None:
            # keeping a copy, the engines' version is the last push (none yet: model.path, as they started); a new
            # client knows nothing its engine holds, so this push is whole (yatt.engines.delta)
            if self.keeps_pushed:
                buckets, versions = self.pushed or [], self.pushed_versions
            else:
                buckets, versions = self.policy_weights(), self._versions()
            try:
                for bucket in buckets:
                    self._count_synced(client.update_weights(bucket, versions))
            finally:
                client.finish_sync()
        self.world.publish(f"engine/{role}/{self.world.rank}", client.endpoint)
        return client

    @property
    def rollout(self) -> EngineClient:
        return self.local[ROLLOUT]

    def keep_pushed(self) -> None:
        """From now on a restarted rollout engine gets a host copy of the weights last pushed, not the trainer's
        live ones: for a producer thread that generates with an older version than the trainer holds, and that
        must not join a sharded trainer's gather (one copy of the policy in host memory)."""
        self.keeps_pushed = True

    def push_policy(self, load: bool = True) -> None:
        """The weight sync: the policy's current weights (`policy_weights`) into this rank's rollout engines.
        load=False (with keep_pushed): only the host copy is taken (a sharded trainer's gather still runs on every
        rank), and the engines load it when they next wake (`catch_up`): for a device that judges for other ranks
        while they push, whose rollout engines are asleep and whose judges must not be put to sleep."""
        versions = self._versions()  # before the weights: the trainer does not step during a push
        buckets = self.policy_weights()
        if self.keeps_pushed:
            buckets = self.pushed = [[(name, t.detach().to("cpu", copy=True)) for name, t in b] for b in buckets]
            self.pushed_versions = versions
        if not load:
            if not self.keeps_pushed:
                raise RuntimeError("push_policy(load=False) needs keep_pushed(): the engines load the kept copy later")
            self.behind = True
            return
        self.push_weights(buckets, versions)
        self.behind = False

    def catch_up(self) -> None:
        """Load the weights last pushed into this rank's rollout engines if a push only kept them (load=False)."""
        if self.behind:
            self.behind = False
            self.push_weights(self.pushed or [], self.pushed_versions)

    def _versions(self) -> WeightVersions | None:
        return self.policy_versions() if self.policy_versions is not None else None

    def _count_synced(self, sent: dict[str, int]) -> None:
        with self._counting:
            for key in self.synced:
                self.synced[key] += sent[key]

    def take_synced(self) -> dict[str, int]:
        """Bytes the rollout engines' weight pushes sent and left out (the delta sync) since the last call."""
        with self._counting:
            out, self.synced = self.synced, dict.fromkeys(self.synced, 0)
        return out

    def push_weights(self, buckets: Iterator[NamedTensors], versions: WeightVersions | None = None) -> None:
        """Load the policy's weights into this rank's rollout engines, one bucket at a time; each engine's client
        leaves out what its engine acknowledged at `versions` already (rollout.engine.delta_sync).

        An engine whose update fails (it exits: a half-loaded engine must not serve) or that died is
        restarted, and `_start` pushes it the whole current policy; a second failure is the run's error."""
        failed: set[str] = set()
        try:
            for bucket in buckets:
                for role in self.rollout_roles:
                    if role in failed:
                        continue
                    try:
                        self._count_synced(self.local[role].update_weights(bucket, versions))
                    except Exception as e:
                        print(
                            f"warning: rank {self.world.rank}: weight update of engine {role} failed "
                            f"({str(e).splitlines()[0][:200]}); restarting it with the current weights",
                            flush=True,
                        )
                        failed.add(role)
        finally:
            for role in self.rollout_roles:  # what only a sync needs is freed with it (shm keeps one segment)
                self.local[role].finish_sync()
        for role in failed:
            self.local[role].close()
            self._start(role)
            self._count_restart()

    def device_roles(self) -> dict[str, HookRole]:
        """The engines' roles on this device (yatt.placement.ownership): ROLLOUT's and "genrm"'s engines sleep
        when the device changes owner and wake when it comes back to them."""
        return {
            kind: HookRole(lambda kind=kind: self.sleep(kind), lambda kind=kind: self.wake(kind))
            for kind in (ROLLOUT, "genrm")
        }

    def sleep(self, kind: str) -> list[dict]:
        """Offload this rank's `kind` engines (ROLLOUT or "genrm"); one found dead is restarted (and slept)."""
        return self._each(kind, "sleep")

    def wake(self, kind: str) -> list[dict]:
        """Onload this rank's `kind` engines; one found dead is restarted, awake, with the current weights. Rollout
        engines a push only kept weights for (push_policy(load=False)) load them now."""
        out = self._each(kind, "wake")
        if kind == ROLLOUT:
            self.catch_up()
        return out

    def _each(self, kind: str, method: str) -> list[dict]:
        roles = self.rollout_roles if kind == ROLLOUT else [r for r in self.local if r not in self.rollout_roles]
        out = []
        for role in roles:
            try:
                out.append(getattr(self.local[role], method)())
            except EngineDied as e:  # killed between stages: the run goes on with a fresh one
                print(
                    f"warning: rank {self.world.rank}: engine {role} died ({str(e).splitlines()[0][:200]}); "
                    "restarting it",
                    flush=True,
                )
                self.local[role].close()
                out.append(getattr(self._start(role), method)())
                self._count_restart()
        return out

    def heal_local(self) -> int:
        """Restart this rank's dead engines, counted with take_restarts(); no collective, so a thread that must
        not join the trainer's collectives can call it (an ahead schedule's producer, which uses only this
        rank's engines). Returns 0: the count reaches the step through take_restarts()."""
        for role in [role for role, c in self.local.items() if not c.alive()]:
            self.local[role].close()
            self._start(role)
            self._count_restart()
        return 0

    def heal(self) -> int:
        """Restart this rank's dead engines (called between steps, by every rank); returns how many were
        restarted on all ranks since the last count (these and e.g. the evaluation's)."""
        self.heal_local()
        restarted = int(self.world.sum([float(self.take_restarts())])[0])
        if restarted:
            self.forget_endpoints()
            self.world.barrier()  # every restarted engine's new endpoint is published before anyone looks
        return restarted

    def _count_restart(self) -> None:
        with self._counting:
            self.uncounted_restarts += 1

    def take_restarts(self) -> int:
        """This rank's engines restarted since the last call: by a pool (generation, judging, evaluation),
        a wake or a failed weight push. The step sums them over ranks at its end."""
        with self._counting:
            count, self.uncounted_restarts = self.uncounted_restarts, 0
        return count

    def forget_endpoints(self) -> None:
        """Look other ranks' engines up again (some were restarted at a new endpoint)."""
        self._remote.clear()

    def client(self, role: str, rank: int) -> EngineClient:
        if rank == self.world.rank:
            return self.local[role]
        key = (role, rank)
        if key not in self._remote or self._remote[key].closed:
            endpoint = self.world.lookup(f"engine/{role}/{rank}")
            self._remote[key] = connect_engine(
                endpoint, derive_secret(self.run_secret, role, rank), self.specs[role][1]
            )
        return self._remote[key]

    def pool(self, kind: str, ranks: tuple[int, ...] | list[int]) -> EnginePool | ResumingPool:
        """A pool over the `kind` engines (ROLLOUT or a judge role) on `ranks`; if all of them die mid-step,
        this rank's own engine (restarted if dead) takes over. With a `preemption` (rollout.schedule.in_flight:
        resume), rollout requests in flight at a weight push are resumed on the new weights."""
        roles = self.rollout_roles if kind == ROLLOUT else [kind]

        def respawn(_: str) -> EngineClient:
            own = self.local[kind]
            if own.alive():
                if kind == ROLLOUT:
                    self.catch_up()  # a judging device's rollout engine takes over: the weights last pushed
                return own
            own.close()
            self._count_restart()
            return self._start(kind)

        pool = EnginePool({f"{role}@{r}": self.client(role, r) for r in ranks for role in roles}, respawn=respawn)
        return ResumingPool(pool, self.preemption) if kind == ROLLOUT and self.preemption is not None else pool

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each local engine has spent stepping since it started (all rollout engines as one)."""
        out = {}
        for role, c in self.local.items():
            try:
                busy = float(c.health()["busy_s"])
            except Exception:  # a dead engine is healed at the next step; its time is lost, not an error
                busy = 0.0
            key = ROLLOUT if role in self.rollout_roles else role
            out[key] = out.get(key, 0.0) + busy
        return out

    def close(self) -> None:
        for c in self._remote.values():
            c.close()
        # at once: each waits for its engine's process to end
        closing = [threading.Thread(target=c.close) for c in self.local.values()]
        for t in closing:
            t.start()
        for t in closing:
            t.join()
