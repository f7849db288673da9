"""Least-loaded routing over fake engines that only record what they are asked (the decision, not vLLM)."""

import threading

from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.router import EngineRouter


class RecordingEngine:
    def __init__(self, name: str, gate: threading.Event | None = None):
        self.name, self.gate, self.calls = name, gate, []

    def generate(self, prompts, sampling, seeds=None):
        self.calls.append((list(prompts), list(seeds or [])))
        if self.gate is not None:
            self.gate.wait(5)
        return [[Completion([p[0], s], [], "stop") for s in range(sampling.n)] for p in prompts]

    def update_weights(self, named_tensors):
        self.calls.append(("update", len(named_tensors)))

    def sleep(self):
        return {"freed_bytes": 3, "backend": self.name}

    def wake(self):
        return {}

    def health(self):
        return {"ok": True}

    def shutdown(self):
        self.calls.append("shutdown")


def test_one_engine_gets_everything():
    engine = RecordingEngine("a")
    router = EngineRouter([engine])
    out = router.generate([[1], [2]], SamplingSpec(n=2), seeds=[10, 20])
    assert engine.calls == [([[1], [2]], [10, 20])]
    assert [[c.token_ids for c in row] for row in out] == [[[1, 0], [1, 1]], [[2, 0], [2, 1]]]
    assert router.outstanding == [0]


def test_prompts_split_evenly_and_come_back_in_order_with_their_seeds():
    a, b = RecordingEngine("a"), RecordingEngine("b")
    router = EngineRouter([a, b])
    out = router.generate([[1], [2], [3], [4], [5]], SamplingSpec(n=4), seeds=[11, 12, 13, 14, 15])
    assert a.calls == [([[1], [3], [5]], [11, 13, 15])] and b.calls == [([[2], [4]], [12, 14])]
    assert [row[0].token_ids[0] for row in out] == [1, 2, 3, 4, 5]
    assert router.outstanding == [0, 0]


def test_a_busy_engine_gets_fewer_prompts():
    router = EngineRouter([RecordingEngine("a"), RecordingEngine("b"), RecordingEngine("c")])
    router.outstanding = [8, 0, 2]  # sequences still in flight
    assert router.assign(5, n=2) == [1, 1, 2, 1, 2]  # loads 8,0,2 -> 8,2,2 -> 8,4,2 -> 8,4,4 -> 8,6,4 -> 8,6,6


def test_outstanding_counts_while_in_flight():
    gate = threading.Event()
    a, b = RecordingEngine("a", gate), RecordingEngine("b")
    router = EngineRouter([a, b])
    worker = threading.Thread(target=router.generate, args=([[1]], SamplingSpec(n=8)))
    worker.start()
    while router.outstanding[0] != 8:
        pass
    router.generate([[2], [3]], SamplingSpec(n=1))  # both go to the idle engine b
    assert b.calls == [([[2], [3]], [])]
    gate.set()
    worker.join()
    assert router.outstanding == [0, 0]


def test_other_calls_go_to_every_engine():
    a, b = RecordingEngine("a"), RecordingEngine("b")
    router = EngineRouter([a, b])
    router.update_weights([("w", None)])
    assert router.sleep() == {"freed_bytes": 6, "backend": "a"} and router.health()["ok"]
    router.close()
    assert a.calls == b.calls == [("update", 1), "shutdown"]
