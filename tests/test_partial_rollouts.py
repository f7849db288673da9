"""Partial rollouts (rollout.schedule.in_flight: resume): requests interrupted at a weight push and resumed on
the new weights, on real engines (no mocks): the hf engine in-process and as a service, and `ResumingPool`
over a real engine process whose weights change from tiny model A to B mid-generation.

What must hold whatever the cut point: an interrupted sample's tokens and log-probs are exactly the first
tokens of the uninterrupted sample with the same seed, a resumed sample's later tokens are exactly what the
new weights generate from the prompt plus its earlier tokens (with the resume seed), and every token carries
the version of the weights that sampled it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_refs import TEXTS, PushAfter, load_policies, two_policies
from transformers import AutoTokenizer

from yatt.engines.base import SamplingSpec, generate
from yatt.engines.client import spawn_engine
from yatt.engines.config import EngineConfig
from yatt.engines.hf_engine import HFEngine
from yatt.engines.pool import EnginePool, Request
from yatt.engines.resume import ResumingPool, resume_seed

pytestmark = pytest.mark.engine

CFG = EngineConfig(backend="hf", max_model_len=256, max_num_seqs=64, weight_bucket_mb=1, startup_timeout_s=120)
SAMPLING = SamplingSpec(n=3, temperature=1.0, max_tokens=24)
SEEDS = [0, 10, 20, 30]
LONG = SamplingSpec(n=3, temperature=1.0, max_tokens=160)  # a batch decodes long enough for a push to land in it


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return two_policies(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def prompts(folders: dict[str, Path]) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(folders["A"])
    return [tok(t, add_special_tokens=False).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def engines(folders: dict[str, Path]) -> dict[str, HFEngine]:
    """In-process references: what A and B generate uninterrupted."""
    out = {k: HFEngine(str(v), CFG, seed=0) for k, v in folders.items()}
    yield out
    for e in out.values():
        e.shutdown()


def assert_prefix(part, whole) -> None:
    """`part` (an interrupted sample) is the start of `whole` (the same sample, uninterrupted)."""
    k = len(part.token_ids)
    assert part.token_ids == whole.token_ids[:k]
    torch.testing.assert_close(torch.tensor(part.logprobs), torch.tensor(whole.logprobs[:k]), rtol=0, atol=1e-5)


def test_hf_preempt_ends_a_running_batch_at_the_next_token(engines, prompts) -> None:
    engine = engines["A"]
    whole = generate(engine, prompts[:2], SAMPLING, SEEDS[:2])
    pick, calls = engine._pick, []

    def pick_then_preempt(*args):  # a fault: the preemption arrives while token 4 is picked
        calls.append(1)
        if len(calls) == 4:
            engine.preempt(["a"])
        return pick(*args)

    engine._pick = pick_then_preempt
    try:
        engine.add_requests(["a", "b"], prompts[:2], SAMPLING, SEEDS[:2])
        done = dict(engine.step())
    finally:
        engine._pick = pick
    assert engine.num_unfinished() == 0 and not engine._preempted
    for c, w in zip(done["a"], whole[0]):  # `a` ends after 4 tokens (unless it stopped before)
        assert c.finish_reason == ("interrupted" if len(w.token_ids) > 4 else w.finish_reason)
        assert len(c.token_ids) == min(4, len(w.token_ids))
        assert_prefix(c, w)
    for c, w in zip(done["b"], whole[1]):  # `b`, in the same batch, is untouched (float noise from the batch aside)
        assert c.finish_reason == w.finish_reason and len(c.token_ids) == len(w.token_ids)
        assert_prefix(c, w)


def test_hf_interrupt_returns_queued_requests_with_nothing_generated(engines, prompts) -> None:
    engine = engines["A"]
    engine.add_requests(["q"], prompts[:1], SAMPLING, SEEDS[:1])
    out = engine.interrupt(["q", "unknown"])
    assert out == [("q", [type(out[0][1][0])([], [], "interrupted")] * SAMPLING.n)]
    assert engine.num_unfinished() == 0 and engine.interrupt(["q"]) == []


def whole_and_resumed(engines, prompt, seed, comp, j):
    """What sample j (seed + j) is without interruption on A, and what B continues from its A tokens."""
    k = comp.versions.count(0)
    head = generate(engines["A"], [prompt], LONG, [seed])[0][j]
    if k == len(comp.token_ids):
        return k, head, None
    rest = SamplingSpec(n=1, temperature=LONG.temperature, max_tokens=LONG.max_tokens - k)
    tail = generate(engines["B"], [prompt + comp.token_ids[:k]], rest, [resume_seed(seed + j, j, k)])[0][0]
    return k, head, tail


@pytest.mark.slow  # CI: tests/test_async_e2e.py's partial rollouts on vLLM engines, end to end (every token's
# version kept, samples resumed on the new weights, a checkpoint of them resumed after kill -9)
def test_resuming_pool_interrupts_pushes_and_resumes_on_the_new_weights(folders, engines, prompts, tmp_path) -> None:
    # max_num_seqs 3: one request at a time, so the push finds requests running and requests queued
    cfg = CFG.model_copy(update={"max_num_seqs": 3})
    client = spawn_engine(folders["A"], cfg, seed=0, log_path=tmp_path / "engine.log")
    b = load_policies({"B": folders["B"]})["B"]
    try:
        preemption = PushAfter(client, [(n, p.detach()) for n, p in b.named_parameters()], requests=8)
        pool = preemption.pool = ResumingPool(EnginePool({"e": client}), preemption)
        pool.submit([Request(f"g{i}", p, s, LONG) for i, (p, s) in enumerate(zip(prompts * 2, SEEDS * 2))])
        done = pool.drain()
    finally:
        client.close()
    assert preemption.version == 1 and sorted(done) == [f"g{i}" for i in range(8)]
    mixed = 0
    for i, (prompt, seed) in enumerate(zip(prompts * 2, SEEDS * 2)):
        assert len(done[f"g{i}"]) == SAMPLING.n
        for j, c in enumerate(done[f"g{i}"]):
            assert len(c.versions) == len(c.token_ids) == len(c.logprobs)
            assert c.versions == sorted(c.versions) and set(c.versions) <= {0, 1}
            assert c.finish_reason in ("stop", "length")
            k, head, tail = whole_and_resumed(engines, prompt, seed, c, j)
            if k == len(c.token_ids):  # finished on A
                assert c.token_ids == head.token_ids
                continue
            assert_prefix(type(c)(c.token_ids[:k], c.logprobs[:k], "interrupted"), head)
            assert c.token_ids[k:] == tail.token_ids and c.finish_reason == tail.finish_reason
            torch.testing.assert_close(torch.tensor(c.logprobs[k:]), torch.tensor(tail.logprobs), rtol=0, atol=1e-5)
            mixed += 0 < k
    assert any(1 in c.versions for g in done.values() for c in g)  # the queued requests ran on B
    assert mixed  # the request decoding at the push was cut and resumed


def test_an_engine_process_is_pinned_to_its_cores(folders, tmp_path) -> None:
    """rollout.engine.cores: the engine keeps to its own cores (apart from the trainer's, for an ahead schedule)."""
    core = max(os.sched_getaffinity(0))
    client = spawn_engine(folders["A"], CFG.model_copy(update={"cores": [core]}), seed=0, log_path=tmp_path / "e.log")
    try:
        assert os.sched_getaffinity(client.pid) == {core}
    finally:
        client.close()


def test_service_interrupt_returns_what_each_sample_has(folders, engines, prompts, tmp_path) -> None:
    cfg = CFG.model_copy(update={"max_num_seqs": 3})
    client = spawn_engine(folders["A"], cfg, seed=0, log_path=tmp_path / "engine.log")
    try:
        client.submit([str(i) for i in range(4)], prompts, SAMPLING, SEEDS)
        time.sleep(0.05)
        client.interrupt()
        got: dict[str, list] = {}
        deadline = time.monotonic() + 60
        while len(got) < 4 and time.monotonic() < deadline:
            got.update(client.poll(0.2)[0])
        assert client.poll(0.1)[1] == 0  # nothing left pending
    finally:
        client.close()
    assert sorted(got) == ["0", "1", "2", "3"]
    whole = generate(engines["A"], prompts, SAMPLING, SEEDS)
    assert any(c.finish_reason == "interrupted" for g in got.values() for c in g)
    for i in range(4):
        for c, w in zip(got[str(i)], whole[i]):
            assert_prefix(c, w)
            assert c.finish_reason in ("interrupted", w.finish_reason)


def test_preempt_from_another_thread_while_a_batch_decodes(engines, prompts) -> None:
    """The server's path: preempt on the RPC thread while `step` decodes on the stepping thread."""
    engine = engines["A"]
    many = SamplingSpec(n=8, temperature=1.0, max_tokens=200)
    engine.add_requests(["x"], prompts[:1], many, [7])
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(engine.step()))
    t.start()
    time.sleep(0.02)
    engine.preempt(["x"])
    t.join(60)
    whole = generate(engine, prompts[:1], many, [7])[0]
    for c, w in zip(out["x"], whole):
        assert_prefix(c, w)
