"""Engine child process: ``python -m yatt.engines.server`` (started by `spawn_engine`).

Reads one JSON spec from stdin (never from argv, which other users can see in ``ps``)::

    {"backend": "vllm", "model_path": ..., "engine": {EngineConfig}, "seed": 0,
     "secret_hex": ..., "ready_file": ...}

builds the engine, serves it over an `RpcServer` on a random loopback port, announces the
endpoint by atomically writing ``ready_file`` and exits 0 after the ``shutdown`` RPC.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

import torch

from yatt.engines.base import SamplingSpec
from yatt.engines.config import EngineConfig

log = logging.getLogger("yatt.engines.server")


class EngineService:
    """RPC adapter: plain dicts/lists on the wire, dataclasses on the engine side."""

    RPC_METHODS = frozenset({"generate", "update_weights", "sleep", "wake", "health", "shutdown"})

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(
        self, prompts: list[list[int]], sampling: dict[str, Any], seeds: list[int] | None = None
    ) -> list[list[dict[str, Any]]]:
        spec = SamplingSpec(**sampling)
        return [[c.to_dict() for c in row] for row in self.engine.generate(prompts, spec, seeds)]

    def update_weights(self, named_tensors: list[list[Any]]) -> dict[str, Any]:
        pairs: list[tuple[str, torch.Tensor]] = []
        for item in named_tensors:
            if len(item) != 2 or not isinstance(item[0], str) or not isinstance(item[1], torch.Tensor):
                raise TypeError("named_tensors must be a list of [name, tensor] pairs")
            pairs.append((item[0], item[1]))
        t0 = time.perf_counter()
        self.engine.update_weights(pairs)
        return {"tensors": len(pairs), "seconds": time.perf_counter() - t0}

    def sleep(self) -> dict[str, Any]:
        return self.engine.sleep()

    def wake(self) -> dict[str, Any]:
        return self.engine.wake()

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    def shutdown(self) -> None:
        self.engine.shutdown()


def build_engine(spec: dict[str, Any]) -> Any:
    cfg = EngineConfig(**spec.get("engine", {}))
    backend = spec.get("backend", cfg.backend)
    if backend != "vllm":
        raise ValueError(f"unknown engine backend {backend!r}")
    from yatt.engines.vllm_engine import VLLMEngine

    return VLLMEngine(str(spec["model_path"]), cfg, int(spec["seed"]))


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
    service = EngineService(build_engine(spec))
    server = RpcServer(service, secret)
    write_ready_file(spec["ready_file"], server.endpoint)
    log.info("serving on %s", server.endpoint)
    try:
        server.serve_forever()
    finally:
        server.close()
    log.info("engine server exits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
