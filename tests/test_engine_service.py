"""The engine process's RPC side (`EngineService`) over a real socket, with an engine whose step the test holds:
several clients share an engine (partial placement), so one client's submit must not leave the others' polls and
interrupts waiting for a step, which for the hf engine decodes a whole batch."""

from __future__ import annotations

import threading
import time

import pytest

from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.server import EngineService
from yatt.transport import RemoteError, RpcClient, RpcServer, new_secret

SECRET = new_secret()
SAMPLING = SamplingSpec(n=1, max_tokens=2).to_dict()


class HeldEngine:
    """A `RolloutEngine` whose step returns one token per request once the test releases it. A prompt [0] is
    refused, as an engine refuses a prompt longer than its context."""

    def __init__(self) -> None:
        self.queued: list[str] = []
        self.stepping, self.release = threading.Event(), threading.Event()

    def add_requests(self, request_ids, prompts, sampling, seeds):
        if [0] in prompts:
            raise ValueError("prompt [0] is too long")
        self.queued += request_ids

    def num_unfinished(self) -> int:
        return len(self.queued)

    def preempt(self, request_ids) -> None:
        self.preempted = list(request_ids)  # the held step does not look: the test only needs the call

    def interrupt(self, request_ids):
        cut = [rid for rid in self.queued if rid in request_ids]
        self.queued = [rid for rid in self.queued if rid not in cut]
        return [(rid, [Completion([], [], "interrupted")]) for rid in cut]

    def step(self):
        batch, self.queued = self.queued, []
        self.stepping.set()
        assert self.release.wait(30), "the test never released the step"
        return [(rid, [Completion([7], [-1.0], "length")]) for rid in batch]


@pytest.fixture
def served():
    engine = HeldEngine()
    server = RpcServer(EngineService(engine), SECRET)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    a, b = RpcClient(server.endpoint, SECRET, timeout_s=20), RpcClient(server.endpoint, SECRET, timeout_s=20)
    try:
        yield engine, a, b
    finally:
        engine.release.set()
        a.close(), b.close()
        server.stop()
        thread.join(5)
        server.close()


def poll_until(client: RpcClient, name: str, deadline_s: float = 10.0) -> list:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if done := client.call("poll", client=name, max_wait_s=0.1)["done"]:
            return done
    raise AssertionError(f"{name} got nothing back within {deadline_s} s")


def test_a_submit_during_a_long_step_leaves_the_other_clients_answered(served):
    engine, a, b = served
    a.call("submit", client="a", keys=["k"], prompts=[[1, 2]], sampling=SAMPLING)
    assert engine.stepping.wait(10)  # a's request is being decoded, and the step is held
    began = time.monotonic()
    b.call("submit", client="b", keys=["k"], prompts=[[3]], sampling=SAMPLING)  # waits for no step
    out = a.call("poll", client="a", max_wait_s=0.0)
    assert out["done"] == [] and out["pending"] == 1 and out["load"] == 2
    b.call("interrupt", client="b")  # nor does an interrupt: a's would otherwise wait behind it
    assert a.call("interrupt", client="a") == {"interrupted": 1} and engine.preempted == ["a/k"]
    assert time.monotonic() - began < 5.0
    engine.release.set()
    [(key, [sample])] = poll_until(b, "b")  # b's request never ran: it comes back with nothing
    assert key == "k" and sample["token_ids"] == [] and sample["finish_reason"] == "interrupted"
    assert [key for key, _ in poll_until(a, "a")] == ["k"]  # a's, running, ends as the step returns it


def test_requests_the_engine_refuses_are_reported_at_the_clients_next_poll(served):
    engine, a, b = served
    engine.release.set()
    a.call("submit", client="a", keys=["bad"], prompts=[[0]], sampling=SAMPLING)
    with pytest.raises(RemoteError, match="refused the submitted requests: ValueError: prompt \\[0\\] is too long"):
        poll_until(a, "a")
    assert a.call("poll", client="a", max_wait_s=0.0)["pending"] == 0  # dropped, not left pending forever
    b.call("submit", client="b", keys=["ok"], prompts=[[1]], sampling=SAMPLING)  # the engine serves on
    assert [key for key, _ in poll_until(b, "b")] == ["ok"]
