"""Route a rank's generate calls to its least-loaded rollout engine (DESIGN.md, principle 3).

The router holds N engines and counts the sequences each is working on. A generate call's prompts
are dealt one by one to the engine with the fewest outstanding plus already-dealt sequences (ties:
lowest engine index), so a batch splits evenly over idle engines and avoids busy ones; the parts
run concurrently and the completions come back in prompt order. Seeds travel with their prompts,
so which engine samples a prompt does not change what it samples.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from yatt.engines.base import Completion, Engine, SamplingSpec


class EngineRouter:
    def __init__(self, engines: list[Engine]):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self.outstanding = [0] * len(engines)  # sequences requested and not yet returned, per engine
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(len(engines)) if len(engines) > 1 else None

    def assign(self, num_prompts: int, n: int) -> list[int]:
        """The engine for each prompt (each prompt is `n` sequences), given current outstanding counts."""
        load, choice = list(self.outstanding), []
        for _ in range(num_prompts):
            best = min(range(len(load)), key=lambda e: (load[e], e))
            choice.append(best)
            load[best] += n
        return choice

    def generate(self, prompts: list[list[int]], sampling: SamplingSpec,
                 seeds: list[int] | None = None) -> list[list[Completion]]:
        with self._lock:
            choice = self.assign(len(prompts), sampling.n)
            parts = {e: [i for i, c in enumerate(choice) if c == e] for e in sorted(set(choice))}
            for e, rows in parts.items():
                self.outstanding[e] += len(rows) * sampling.n

        def run(e: int) -> list[list[Completion]]:
            rows = parts[e]
            try:
                return self.engines[e].generate([prompts[i] for i in rows], sampling,
                                                None if seeds is None else [seeds[i] for i in rows])
            finally:
                with self._lock:
                    self.outstanding[e] -= len(rows) * sampling.n

        if self._pool is None or len(parts) == 1:
            results = {e: run(e) for e in parts}
        else:
            futures = {e: self._pool.submit(run, e) for e in parts}
            results = {e: f.result() for e, f in futures.items()}
        out: list[list[Completion]] = [[] for _ in prompts]
        for e, rows in parts.items():
            for i, completions in zip(rows, results[e]):
                out[i] = completions
        return out

    # ---- the rest of the Engine interface goes to every engine ----------------------------------
    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        for engine in self.engines:
            engine.update_weights(named_tensors)

    def sleep(self) -> dict[str, Any]:
        return _merge([engine.sleep() for engine in self.engines])

    def wake(self) -> dict[str, Any]:
        return _merge([engine.wake() for engine in self.engines])

    def health(self) -> dict[str, Any]:
        reports = [engine.health() for engine in self.engines]
        return {"ok": all(r.get("ok") for r in reports), "engines": reports}

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
        if self._pool is not None:
            self._pool.shutdown()

    def shutdown(self) -> None:
        self.close()


def _merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's report as is; several: numbers summed, the rest taken from the first."""
    if len(reports) == 1:
        return reports[0]
    merged = dict(reports[0])
    for key, value in merged.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = sum(r.get(key, 0) for r in reports)
    return merged
