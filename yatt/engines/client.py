"""Start an engine child process and talk to it over RPC (`EngineClient`).

The engine runs in its own process because an in-process vLLM inside a torchrun rank adopts
torchrun's process group (and destroys it on shutdown), reseeds the global RNG and pins torch's
thread count. The child therefore gets an environment without torchrun's variables.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import yatt
from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.config import EngineConfig
from yatt.engines.delta import HeldWeights, Versions
from yatt.engines.server import advertised_address
from yatt.registry import is_import_path
from yatt.tensors import DTYPES, weight_buckets
from yatt.transport.codec import new_secret
from yatt.transport.rpc import RemoteError, RpcClient
from yatt.transport.weights import WEIGHT_TRANSPORTS
from yatt.transport.weights.base import WeightTransport
from yatt.transport.weights.choose import AUTO, preferred

log = logging.getLogger(__name__)

TORCHRUN_VARS = frozenset({
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
})  # fmt: skip
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


class EngineStartError(RuntimeError):
    """The engine process exited or timed out before serving; the message holds its log tail."""


class EngineDied(RuntimeError):
    """The engine process is gone; the message names its exit code and holds its log tail."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<cannot read {path}: {e}>"


def device_env(device: torch.device, parent_visible: str | None) -> dict[str, str]:
    """The environment that shows an engine child only its rank's GPU: `CUDA_VISIBLE_DEVICES` set to the
    entry of the parent's list (`parent_visible`, the parent's CUDA_VISIBLE_DEVICES) that `device` indexes,
    or to the index itself when the parent has no list. Nothing on CPU.

    Without it every engine of every rank would start on GPU 0 (and vLLM would size its memory share
    against what the other ranks' engines already took there). `engine_env` applies it for the device
    the spawning rank computes on (`init_world` made it torch's current device).
    """
    if device.type != "cuda":
        return {}
    index = 0 if device.index is None else device.index
    entries = [e.strip() for e in (parent_visible or "").split(",") if e.strip()]
    if not entries:
        return {"CUDA_VISIBLE_DEVICES": str(index)}
    if index >= len(entries):
        raise ValueError(f"device {device} is not among CUDA_VISIBLE_DEVICES={parent_visible!r}")
    return {"CUDA_VISIBLE_DEVICES": entries[index]}


def engine_device(gpus: list[int] | None, rank_device: torch.device) -> torch.device:
    """The device an engine spawned by a rank computing on `rank_device` runs on: the rank's own, or with
    `gpus` (EngineConfig.gpus) the entry its local rank (the rank's GPU index) picks."""
    if rank_device.type != "cuda" or not gpus:
        return rank_device
    return torch.device("cuda", gpus[(rank_device.index or 0) % len(gpus)])


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def plugin_root(path: str) -> str:
    """The folder this process imports the module of `path` ("pkg.module:attr") from, so that an engine process
    (started from any directory, with its own sys.path) imports a plug-in backend from the same place."""
    module = path.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return ""  # not a file on the path (a built-in module, or not importable: the engine process says so)
    depth = module.count(".") + (Path(spec.origin).name == "__init__.py")
    return str(Path(spec.origin).absolute().parents[depth])


def engine_env(cfg: EngineConfig, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ours minus torchrun's variables, plus engine tuning and the backend's own
    variables (its `env` hook); on GPU machines it sees only one GPU (`device_env`): the spawning rank's, or the
    one `cfg.gpus` gives it (`engine_device`); a plug-in
    backend's folder is on its PYTHONPATH (`plugin_root`)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith(TORCHRUN_PREFIXES)}
    env["OMP_NUM_THREADS"] = str(cfg.threads)
    backend_env = getattr(cfg.backend_entry, "env", None)
    for key, value in (backend_env(cfg.backend_config) if backend_env else {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    if os.path.exists(TCMALLOC) and TCMALLOC not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (TCMALLOC, env.get("LD_PRELOAD", "")) if p)
    root = str(Path(yatt.__file__).resolve().parents[1])  # so `-m yatt...` works from any cwd
    roots = [root, *([plugin_root(cfg.backend)] if is_import_path(cfg.backend) else [])]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*roots, env.get("PYTHONPATH", "")) if p)
    env.update(device_env(engine_device(cfg.gpus, _current_device()), os.environ.get("CUDA_VISIBLE_DEVICES")))
    env.update(extra_env or {})
    return env


class EngineClient:
    """A controller's handle on one engine process (whatever `RolloutEngine` backend it serves), over RPC.

    `spawn_engine` returns one that owns its child process (and stops it on `close`); `connect_engine`
    returns one for an engine another rank owns (close only drops the connection). Generation is
    streamed: `submit` queues prompts under keys and `poll` returns the groups that finished;
    `generate` is submit + poll until all are back.
    """

    def __init__(
        self, proc: subprocess.Popen | None, endpoint: str, secret: bytes, cfg: EngineConfig, log_path: Path | None
    ) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.cfg = cfg
        self.log_path = Path(log_path) if log_path else None
        self.client_id = uuid.uuid4().hex[:12]
        self._closed = False
        self._rpc = RpcClient(endpoint, secret, cfg.request_timeout_s, liveness=self._check_alive)
        self._weights: WeightTransport | None = None  # chosen at the first update (auto probes the engine)
        self.held = HeldWeights()  # what the engine acknowledged, by version (the delta sync)
        atexit.register(self.close)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def closed(self) -> bool:
        return self._closed

    def alive(self) -> bool:
        """False once the engine process this client owns has exited (an engine it does not own is
        reported dead by its calls, not here)."""
        return self.proc is None or self.proc.poll() is None

    def _check_alive(self) -> None:
        if not self.alive():
            rc = self.proc.poll()
            raise EngineDied(
                f"engine process {self.proc.pid} exited with code {rc}; last lines of {self.log_path}:\n"
                + log_tail(self.log_path)
            )

    def _call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("EngineClient is closed")
        self._check_alive()
        try:
            return self._rpc.call(method, timeout_s=timeout_s, **kwargs)
        except TimeoutError as e:
            self._check_alive()  # prefer "it died" over "it was slow"
            if self.proc is None:  # someone else's engine: silence past the timeout counts as death
                raise EngineDied(f"engine at {self.endpoint} did not answer {method!r}: {e}") from e
            raise

    def submit(
        self,
        keys: list[str],
        prompts: list[list[int]],
        sampling: SamplingSpec,
        seeds: list[int] | None = None,
        images: list[list[bytes] | None] | None = None,
    ) -> int:
        """Queue prompts; returns the engine's load (requests in flight) after queueing. `images`: per prompt,
        the encoded bytes of its images (one per placeholder token), or None for a text prompt."""
        extra = {} if images is None else {"images": [None if im is None else [bytes(b) for b in im] for im in images]}
        out = self._call(
            "submit",
            client=self.client_id,
            keys=[str(k) for k in keys],
            prompts=[[int(t) for t in p] for p in prompts],
            sampling=sampling.to_dict(),
            seeds=None if seeds is None else [int(s) for s in seeds],
            **extra,
        )
        return int(out["load"])

    def poll(self, max_wait_s: float = 0.05) -> tuple[list[tuple[str, list[Completion]]], int, int]:
        """(finished [(key, completions)], this client's pending count, engine load)."""
        out = self._call("poll", client=self.client_id, max_wait_s=max_wait_s)
        done = [(str(key), [Completion.from_dict(c) for c in comps]) for key, comps in out["done"]]
        return done, int(out["pending"]), int(out["load"])

    def cancel(self) -> None:
        self._call("cancel", client=self.client_id)

    def interrupt(self) -> None:
        """End this client's pending requests early; `poll` returns them as generated so far ("interrupted")."""
        self._call("interrupt", client=self.client_id)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingSpec,
        seeds: list[int] | None = None,
        images: list[list[bytes] | None] | None = None,
    ) -> list[list[Completion]]:
        if not prompts:
            return []
        self.submit([str(i) for i in range(len(prompts))], prompts, sampling, seeds, images)
        results: dict[int, list[Completion]] = {}
        while len(results) < len(prompts):
            done, _, _ = self.poll(max_wait_s=0.2)
            results.update((int(key), comps) for key, comps in done)
        return [results[i] for i in range(len(prompts))]

    def update_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], versions: Versions | None = None
    ) -> dict[str, int]:
        """Send weights in layer-aligned buckets of at most ``weight_bucket_mb`` MB, one RPC each, through the
        weight transport (`weight_transport`: the tensors inside the message, or a shared-memory segment).

        Floating tensors are cast to the engine dtype on the way, so no more bytes travel than the
        engine keeps, except float64 ones (exact scalars such as a LoRA adapter's scaling: no weight is float64);
        each bucket is applied before the next is sent, bounding extra memory. Call `finish_sync` after the
        last bucket of a sync (shm keeps its one segment, at most a bucket, until `close`: yatt.transport.weights.shm).

        `versions` (yatt.tensors.WeightVersions: the trainer's version of each tensor): with `delta_sync` the
        tensors the engine already acknowledged at that version are left out (yatt.engines.delta), and what the
        engine applies is recorded at it. Returns the bytes sent and left out, in the engine's dtypes.
        """
        engine = DTYPES[self.cfg.dtype]
        cast = lambda t: engine if t.is_floating_point() and t.dtype != torch.float64 else t.dtype
        named_tensors = list(named_tensors)
        nbytes = lambda ts: sum(t.numel() * cast(t).itemsize for _, t in ts)
        if versions is not None and self.cfg.delta_sync:
            held = self.held.held(named_tensors, versions)
            skipped = nbytes(t for t in named_tensors if t[0] in held)
            named_tensors = [t for t in named_tensors if t[0] not in held]
        else:
            skipped = 0
        # bucketed by the bytes each tensor has in the engine's dtype (meta tensors: sizes without copies)
        sized = [(name, torch.empty(t.shape, dtype=cast(t), device="meta")) for name, t in named_tensors]
        buckets = list(weight_buckets(sized, self.cfg.weight_bucket_mb * (1 << 20)))
        if buckets:
            transport = self.weight_transport()
            transport.begin(buckets)
        start = 0
        for bucket in buckets:
            part, start = named_tensors[start : start + len(bucket)], start + len(bucket)
            names = [name for name, _ in part]
            self.held.sending(names)
            self._call("update_weights", **transport.pack(part, cast))
            self.held.acknowledged(names, versions)
        return {"sent_bytes": nbytes(named_tensors), "skipped_bytes": skipped}

    def finish_sync(self) -> None:
        """The sync is over: the weight transport frees what only a sync needs (shm: nothing, its segment is reused)."""
        if self._weights is not None:
            self._weights.finish()

    def weight_transport(self) -> WeightTransport:
        """The transport this client's updates use, chosen once: `cfg.weight_transport`, or for auto shm if the
        engine is on this host and maps a probe segment (a container with its own /dev/shm does not), else zmq."""
        if self._weights is None:
            choice = preferred(self.cfg.weight_transport, self.endpoint)
            transport = WEIGHT_TRANSPORTS.get(choice)()
            if self.cfg.weight_transport == AUTO and choice != "zmq" and not self._probe(transport):
                transport.close()
                transport = WEIGHT_TRANSPORTS.get("zmq")()
            self._weights = transport
        return self._weights

    def _probe(self, transport: WeightTransport) -> bool:
        """Whether the engine reads back, through `transport`, the random bytes this client wrote."""
        token = torch.randint(0, 256, (32,), dtype=torch.uint8)
        try:
            got = self._call("probe_weights", **transport.pack([("probe", token)], lambda t: t.dtype))
            ok = got == [bytes(token.numpy()).hex()]
        except (OSError, RemoteError) as e:
            ok, got = False, f"{type(e).__name__}: {e}"
        finally:
            transport.finish()
        if not ok:
            log.warning(
                "weight transport %s does not reach engine %s (%s); using zmq", transport.name, self.endpoint, got
            )
        return ok

    def sleep(self) -> dict[str, Any]:
        return self._call("sleep")

    def wake(self) -> dict[str, Any]:
        return self._call("wake")

    def health(self) -> dict[str, Any]:
        return self._call("health", timeout_s=30)

    def shutdown(self) -> None:
        self.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to shut down, then make sure its process is gone (terminate, kill)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._weights is not None:
            self._weights.close()
        if self.proc is None:  # not ours to stop
            self._rpc.close()
            return
        try:
            if self.proc.poll() is None:
                self._rpc.call("shutdown", timeout_s=timeout_s)
        except Exception:
            pass  # it is being torn down anyway
        finally:
            self._rpc.close()
        for stop in (None, self.proc.terminate, self.proc.kill):
            if stop is not None and self.proc.poll() is None:
                stop()
            try:
                self.proc.wait(timeout=timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_engine(
    model_path: str | Path,
    cfg: EngineConfig,
    seed: int,
    log_path: Path,
    secret: bytes | None = None,
    extra_env: dict[str, str] | None = None,
) -> EngineClient:
    """Start ``python -m yatt.engines.server`` and return a client once it serves.

    The spec (with the secret) goes through stdin, never argv/env, which other local users can
    read. ``extra_env`` is applied last (e.g. CUDA_VISIBLE_DEVICES for placement).
    """
    secret = secret or new_secret()
    if cfg.advertise is None and (address := advertised_address(cfg.bind, os.environ.get("MASTER_ADDR", "127.0.0.1"))):
        cfg = cfg.model_copy(update={"advertise": address})  # the child no longer sees torchrun's MASTER_ADDR
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ready_dir = Path(tempfile.mkdtemp(prefix="yatt-engine-"))
    ready_file = ready_dir / "endpoint"
    spec = {
        "model_path": str(model_path),
        "engine": cfg.model_dump(),
        "seed": int(seed),
        "secret_hex": secret.hex(),
        "ready_file": str(ready_file),
        "parent_pid": os.getpid(),
    }
    with open(log_path, "wb") as log_file:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "yatt.engines.server"],
            stdin=subprocess.PIPE,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=engine_env(cfg, extra_env),
            # Own session: torchrun signals a rank's whole process group on SIGTERM, and the rank must be
            # able to finish its step and checkpoint with its engine alive. The engine still exits when
            # its parent is gone (watch_parent in the server).
            start_new_session=True,
        )
    try:
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the child already died; the loop below reports it with the log tail
        deadline = time.monotonic() + cfg.startup_timeout_s
        while not ready_file.exists():
            rc = proc.poll()
            if rc is not None:
                raise EngineStartError(f"engine exited with code {rc} during startup:\n{log_tail(log_path)}")
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine not ready after {cfg.startup_timeout_s:.0f}s:\n{log_tail(log_path)}")
            time.sleep(0.05)
        endpoint = ready_file.read_text().strip()
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise
    finally:
        shutil.rmtree(ready_dir, ignore_errors=True)
    return EngineClient(proc, endpoint, secret, cfg, log_path)


def connect_engine(endpoint: str, secret: bytes, cfg: EngineConfig) -> EngineClient:
    """A client for an engine started by another process (e.g. another rank's device)."""
    return EngineClient(None, endpoint, secret, cfg, None)
