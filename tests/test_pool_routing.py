"""Least-loaded routing decisions of EnginePool, with fake engines that only record what they are sent
(a fake here tests the decision, not an engine; tests/test_engine_pool.py runs real engines)."""

from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.client import EngineDied
from yatt.engines.pool import EnginePool, Request


class RecordingEngine:
    def __init__(self, load: int = 0):
        self.load, self.sent, self.dead, self.closed = load, [], False, False

    def submit(self, keys, prompts, sampling, seeds=None):
        if self.dead:
            raise EngineDied("gone")
        self.sent.extend(keys)
        return self.load + len(self.sent) * sampling.n

    def poll(self, max_wait_s=0.0):
        if self.dead:
            raise EngineDied("gone")
        done = [(k, [Completion([1], [], "stop")]) for k in self.sent]
        self.sent = []
        return done, 0, self.load

    def close(self):
        self.closed = True


def reqs(keys, n=2):
    return [Request(k, [1], None, SamplingSpec(n=n)) for k in keys]


def test_requests_go_to_the_least_loaded_engine():
    busy, idle = RecordingEngine(), RecordingEngine()
    pool = EnginePool({"busy": busy, "idle": idle})
    pool.reported_load["busy"] = 8  # another controller keeps it busy
    pool.submit(reqs(["a", "b", "c", "d", "e"]))
    assert idle.sent == ["a", "b", "c", "d"] and busy.sent == ["e"]  # loads 8/0 -> 8/2 -> ... -> 8/8 -> 10/8


def test_each_key_answered_once_and_duplicates_rejected():
    a, b = RecordingEngine(), RecordingEngine()
    pool = EnginePool({"a": a, "b": b})
    pool.submit(reqs(["x", "y", "z"]))
    results = pool.drain()
    assert sorted(results) == ["x", "y", "z"] and pool.in_flight() == 0
    try:
        pool.submit(reqs(["x"]))
        raise AssertionError("a key may be submitted once")
    except ValueError:
        pass


def test_dead_engine_work_moves_to_a_live_one():
    a, b = RecordingEngine(), RecordingEngine()
    pool = EnginePool({"a": a, "b": b})
    pool.submit(reqs([f"k{i}" for i in range(6)]))
    b.dead = True
    results = pool.drain()
    assert sorted(results) == [f"k{i}" for i in range(6)]
    assert pool.rerouted == 3 and list(pool.engines) == ["a"] and b.closed


def test_respawn_when_no_engine_is_left():
    a, fresh = RecordingEngine(), RecordingEngine()
    pool = EnginePool({"a": a}, respawn=lambda name: fresh)
    pool.submit(reqs(["p", "q"]))
    a.dead = True
    assert sorted(pool.drain()) == ["p", "q"] and pool.respawned == 1 and pool.engines["a"] is fresh
