"""Engine child process: ``python -m yatt.engines.server`` (started by `spawn_engine`).

Reads one JSON spec from stdin (never from argv, which other users can see in ``ps``)::

    {"model_path": ..., "engine": {EngineConfig, whose backend names the RolloutEngine}, "seed": 0,
     "secret_hex": ..., "ready_file": ...}

builds the engine, serves it over an `RpcServer` on a random port of ``engine.bind``, announces the
endpoint by atomically writing ``ready_file`` and exits 0 after the ``shutdown`` RPC.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from yatt.engines import ENGINES
from yatt.engines.base import RolloutEngine, SamplingSpec
from yatt.engines.config import EngineConfig
from yatt.transport.weights import WEIGHT_TRANSPORTS

log = logging.getLogger("yatt.engines.server")


class EngineService:
    """RPC adapter with a stepping thread: plain dicts/lists on the wire, dataclasses on the engine side.

    Generation is streamed: `submit` queues prompts (from any number of clients), one thread steps
    the engine whenever requests are pending, and each prompt's finished group waits in its client's
    mailbox for `poll`. A caller thus gets groups as they finish instead of after the slowest one,
    and several controllers can share one engine. Every vLLM call runs on the stepping thread
    (vLLM is not thread-safe); the RPC thread hands it commands and waits for their results.
    """

    RPC_METHODS = frozenset(
        {
            "submit",
            "poll",
            "cancel",
            "interrupt",
            "update_weights",
            "probe_weights",
            "sleep",
            "wake",
            "health",
            "shutdown",
        }
    )

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._mailbox: dict[str, list[list[Any]]] = {}  # client -> [[key, [completion dicts]], ...]
        self._owner: dict[str, tuple[str, str]] = {}  # request id -> (client, key)
        self._refused: dict[str, str] = {}  # client -> why the engine refused its last submit (raised at its poll)
        self._stop = threading.Event()
        self.busy_s = 0.0  # seconds spent stepping: the load measure for placement
        self.generated_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- the stepping thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._steps()
        except BaseException:  # a half-dead engine (process alive, nothing stepping) would hang its callers
            log.exception("the engine's stepping thread failed; the engine exits so that it is restarted")
            die(4)

    def _steps(self) -> None:
        while not self._stop.is_set():
            while not self._commands.empty():
                fn, fut = self._commands.get()
                try:
                    result = fn()
                except BaseException as e:
                    if fut is None:  # nobody waits to hear of it: the engine exits (_loop) and is restarted
                        raise
                    fut.set_exception(e)  # handed to the RPC thread, which reports it to the caller
                else:
                    if fut is not None:
                        fut.set_result(result)
            if self._owner and self.engine.num_unfinished():
                t0 = time.perf_counter()
                finished = self.engine.step()
                self.busy_s += time.perf_counter() - t0
                if finished:
                    self._deliver(finished)
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    def _deliver(self, finished: list[tuple[str, list[Any]]]) -> None:
        with self._done:
            for rid, completions in finished:
                client, key = self._owner.pop(rid)
                self.generated_tokens += sum(len(c.token_ids) for c in completions)
                self._mailbox.setdefault(client, []).append([key, [c.to_dict() for c in completions]])
            self._done.notify_all()

    def _on_loop(self, fn: Callable[[], Any]) -> Any:
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut.result()

    def _later(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the stepping thread, after the commands before it, without waiting for the step in progress
        (the hf engine's decodes a whole batch): meanwhile this, the only RPC thread, answers the other clients'
        polls and interrupts. Commands run in order, so a client's interrupt or cancel follows its submit."""
        self._commands.put((fn, None))
        self._wake.set()

    # ---- RPC methods ---------------------------------------------------------------------------
    def submit(
        self,
        client: str,
        keys: list[str],
        prompts: list[list[int]],
        sampling: dict[str, Any],
        seeds: list[int] | None = None,
        images: list[list[bytes] | None] | None = None,
    ) -> dict[str, int]:
        """Queue one request per prompt; its group comes back from `poll` under (client, key). `images`: per
        prompt, its images' encoded bytes or None (text); only image-capable backends take them."""
        if len(keys) != len(prompts) or (seeds is not None and len(seeds) != len(prompts)):
            raise ValueError(f"{len(keys)} keys, {len(prompts)} prompts, {len(seeds or [])} seeds")
        if images is not None and (
            len(images) != len(prompts)
            or not all(im is None or (isinstance(im, list) and all(isinstance(b, bytes) for b in im)) for im in images)
        ):
            raise ValueError("images must be one list of bytes (or null) per prompt")
        extra = {} if images is None else {"images": images}
        spec = SamplingSpec(**sampling)
        rids = [f"{client}/{key}" for key in keys]
        with self._done:
            clash = [rid for rid in rids if rid in self._owner]
            if clash:
                raise ValueError(f"request keys already pending: {clash[:3]}")
            self._owner.update({rid: (client, key) for rid, key in zip(rids, keys)})

        def add() -> None:
            try:
                self.engine.add_requests(rids, prompts, spec, seeds, **extra)
            except Exception as e:
                with self._done:
                    for rid in rids:
                        self._owner.pop(rid, None)
                    self._refused.setdefault(client, f"{type(e).__name__}: {e}")
                    self._done.notify_all()

        self._later(add)
        return {"queued": len(rids), "load": self.load()}

    def poll(self, client: str, max_wait_s: float = 0.05) -> dict[str, Any]:
        """Finished groups of `client` (waiting up to max_wait_s for the first), its pending count and the load.
        Raises what the engine said when it refused the client's last submit (its requests were dropped)."""
        with self._done:
            self._done.wait_for(
                lambda: self._mailbox.get(client) or client in self._refused, timeout=min(max(max_wait_s, 0.0), 1.0)
            )
            if client in self._refused:
                raise RuntimeError(f"the engine refused the submitted requests: {self._refused.pop(client)}")
            done = self._mailbox.pop(client, [])
            pending = sum(1 for c, _ in self._owner.values() if c == client)
        return {"done": done, "pending": pending, "load": self.load()}

    def cancel(self, client: str) -> dict[str, int]:
        """Drop a client's pending requests and undelivered results (it gave up on them)."""
        with self._done:
            rids = [rid for rid, (c, _) in self._owner.items() if c == client]
            for rid in rids:
                del self._owner[rid]
            self._mailbox.pop(client, None)
        if rids:
            self._later(lambda: self.engine.abort(rids))
        return {"cancelled": len(rids)}

    def interrupt(self, client: str) -> dict[str, int]:
        """End a client's pending requests early: each comes back from `poll` as generated so far (finish_reason
        "interrupted"; RolloutEngine.interrupt), e.g. so that its samples resume on new weights."""
        with self._done:
            rids = [rid for rid, (c, _) in self._owner.items() if c == client]
        self.engine.preempt(rids)  # a running multi-iteration step ends them at their next token

        def cut() -> None:  # after that step: the queued ones come back with nothing generated
            partial = self.engine.interrupt(rids)
            with self._done:  # a request the step finished meanwhile was delivered (and is no longer owned)
                partial = [(rid, comps) for rid, comps in partial if rid in self._owner]
            self._deliver(partial)

        self._later(cut)
        return {"interrupted": len(rids)}

    def load(self) -> int:
        """Requests in flight on this engine (all clients): what least-loaded routing compares."""
        return len(self._owner)

    def update_weights(self, transport: str = "zmq", **payload: Any) -> dict[str, Any]:
        """Apply one bucket of weights, carried by `transport` (`yatt.transport.weights`): its payload is checked
        whole before the engine sees it, and the engine checks names and shapes before it copies anything."""
        with receive(transport, payload) as pairs:
            count = len(pairs)
            t0 = time.perf_counter()
            try:
                self._on_loop(lambda: self.engine.update_weights(pairs))
            except BaseException:
                # A failed load may leave some layers new and some old (vLLM reloads module by module): such an
                # engine must not serve. The caller gets the error; the engine exits right after replying, and
                # the controller restarts it with the current weights.
                log.exception("weight update failed; the engine exits")
                threading.Timer(0.5, die, args=(5,)).start()
                raise
        return {"tensors": count, "seconds": time.perf_counter() - t0}

    def probe_weights(self, transport: str = "zmq", **payload: Any) -> list[str]:
        """The bytes (hex) of the small tensors a client sent through `transport`, the engine untouched: the client
        checks that the transport reaches this process before it relies on it."""
        with receive(transport, payload) as pairs:
            if sum(t.numel() * t.element_size() for _, t in pairs) > 4096:
                raise ValueError("a probe carries at most 4096 bytes")
            return [bytes(t.contiguous().view(torch.uint8).numpy()).hex() for _, t in pairs]

    def sleep(self) -> dict[str, Any]:
        return self._on_loop(self.engine.sleep)

    def wake(self) -> dict[str, Any]:
        return self._on_loop(self.engine.wake)

    def health(self) -> dict[str, Any]:
        info = self._on_loop(self.engine.health)
        info.update(busy_s=self.busy_s, generated_tokens=self.generated_tokens, load=self.load())
        return info

    def shutdown(self) -> None:
        self._on_loop(self.engine.shutdown)
        self._stop.set()


def receive(transport: Any, payload: dict[str, Any]) -> Any:
    """The transport's context manager over the tensors of `payload`; only registered names, never an import
    path from the wire."""
    if not isinstance(transport, str) or transport not in WEIGHT_TRANSPORTS.names():
        raise ValueError(f"unknown weight transport {str(transport)[:40]!r}; known: {WEIGHT_TRANSPORTS.names()}")
    return WEIGHT_TRANSPORTS.get(transport).unpack(payload)


def die(code: int) -> None:
    """End the process now, from any thread (the RPC thread may be blocked waiting on the dead one)."""
    logging.shutdown()
    os._exit(code)


def build_engine(spec: dict[str, Any]) -> RolloutEngine:
    cfg = EngineConfig(**spec.get("engine", {}))
    return ENGINES.get(cfg.backend)(str(spec["model_path"]), cfg, int(spec["seed"]))


def advertised_address(bind: str, master: str) -> str | None:
    """The address other nodes reach a wildcard-bound engine at: this node's source address on the route to
    torchrun's MASTER_ADDR (the one address every node is known to reach); None for a specific bind address."""
    if bind not in ("0.0.0.0", "::", "*"):
        return None
    import socket

    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))  # UDP connect sends nothing; it only picks the route and source address
        return s.getsockname()[0]


def write_ready_file(path: str, endpoint: str) -> None:
    """Write then rename, so the parent never reads a half-written endpoint."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(endpoint)
    os.replace(tmp, path)


def watch_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """Exit when the parent dies, even by SIGKILL (when its atexit hooks cannot run).

    A reparented engine would otherwise serve nobody forever while holding RAM or GPU memory.
    """

    def loop() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent_pid:
                log.error("parent %d is gone; engine exits", parent_pid)
                from yatt.transport.weights.shm import sweep

                sweep(dead_pid=parent_pid)  # a sync's shared memory it left (a killed trainer runs no cleanup)
                os._exit(3)

    threading.Thread(target=loop, name="watch-parent", daemon=True).start()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from yatt.transport.rpc import RpcServer

    spec = json.loads(sys.stdin.read())
    secret = bytes.fromhex(spec.pop("secret_hex"))
    if spec.get("parent_pid"):
        watch_parent(int(spec["parent_pid"]))
    log.info("engine server pid=%d spec=%s", os.getpid(), {k: v for k, v in spec.items()})
    cfg = EngineConfig(**spec.get("engine", {}))
    if cfg.cores:  # before the backend starts its threads, which inherit the mask
        os.sched_setaffinity(0, cfg.cores)
    service = EngineService(build_engine(spec))
    server = RpcServer(
        service,
        secret,
        host=cfg.bind,
        advertise=cfg.advertise,
        max_frames=cfg.max_frames,
        max_message_bytes=cfg.max_message_mb << 20,
    )
    write_ready_file(spec["ready_file"], server.endpoint)
    log.info("serving on %s", server.endpoint)
    try:
        server.serve_forever()
    finally:
        server.close()
    log.info("engine server exits")
    return 0


if __name__ == "__main__":
    from yatt.quick_exit import quick_exit

    quick_exit(main())
