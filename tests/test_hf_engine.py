"""The transformers backend (`HFEngine`) checked against plain Hugging Face calls, in-process and as a service.

In-process tests share one module-scoped engine on tiny model A; the service test spawns a real engine
child (`spawn_engine`, backend hf) and replaces A's weights with B's through the client.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_refs import (
    EOS,
    TEXTS,
    hf_greedy,
    hf_logprobs,
    load_policies,
    nucleus_log_mass,
    trainer_logprobs,
    two_policies,
)
from transformers import AutoTokenizer

from yatt.engines.base import SamplingSpec, generate
from yatt.engines.client import EngineDied, spawn_engine
from yatt.engines.config import EngineConfig
from yatt.engines.hf_engine import HFEngine
from yatt.transport.rpc import RemoteError

pytestmark = pytest.mark.engine

CFG = EngineConfig(backend="hf", max_model_len=256, max_num_seqs=64, weight_bucket_mb=1, startup_timeout_s=120)
GREEDY = SamplingSpec(n=1, temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return two_policies(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def hf(folders: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return load_policies(folders)


@pytest.fixture(scope="module")
def prompts(folders: dict[str, Path]) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(folders["A"])
    ids = [tok(t, add_special_tokens=False).input_ids for t in TEXTS]
    return [*ids, (ids[0] * 20)[:150]]  # lengths 4..150: heavy left padding in one batch


@pytest.fixture(scope="module")
def engine(folders: dict[str, Path]) -> HFEngine:
    eng = HFEngine(str(folders["A"]), CFG, seed=0)
    yield eng
    eng.shutdown()


def assert_matches_hf(rows, model, prompts, max_new: int = 12) -> None:
    for prompt, (c,) in zip(prompts, rows):
        assert c.token_ids == hf_greedy(model, prompt, max_new)
        assert len(c.logprobs) == len(c.token_ids)
        torch.testing.assert_close(torch.tensor(c.logprobs), hf_logprobs(model, prompt, c.token_ids), atol=1e-4, rtol=0)


def test_greedy_and_logprobs_match_hf(engine: HFEngine, hf, prompts) -> None:
    assert_matches_hf(generate(engine, prompts, GREEDY), hf["A"], prompts)


def test_sampled_logprobs_match_the_trainer_at_temperature(engine: HFEngine, folders, prompts) -> None:
    # T = 0.7, top_p = 1: the engine's log-probs are of softmax(logits / T), as the torch trainer's are
    spec = SamplingSpec(n=3, temperature=0.7, max_tokens=20)
    rows = generate(engine, prompts, spec, seeds=[0, 10, 20, 30, 40])
    for prompt, row in zip(prompts, rows):
        assert len(row) == 3
        ref = trainer_logprobs(folders["A"], prompt, [c.token_ids for c in row], 0.7)
        for c, r in zip(row, ref):
            assert (torch.tensor(c.logprobs) - r).abs().max() < 1e-3
    assert generate(engine, prompts[:1], SamplingSpec(max_tokens=4, logprobs=False))[0][0].logprobs == []


def test_top_p_logprobs_are_renormalised_over_the_nucleus(engine: HFEngine, hf, folders, prompts) -> None:
    # top_p < 1: engine = trainer - log(nucleus mass) >= trainer; the trainer does not truncate
    rows = generate(engine, prompts[:3], SamplingSpec(n=2, temperature=0.7, top_p=0.9, max_tokens=20), seeds=[1, 2, 3])
    for prompt, row in zip(prompts, rows):
        ref = trainer_logprobs(folders["A"], prompt, [c.token_ids for c in row], 0.7)
        for c, r in zip(row, ref):
            mass = nucleus_log_mass(hf["A"], prompt, c.token_ids, 0.7, 0.9)
            assert (torch.tensor(c.logprobs) - (r - mass)).abs().max() < 1e-3
            assert (torch.tensor(c.logprobs) >= r - 1e-5).all()


def test_prompt_logprobs_of_given_tokens_match_a_transformers_forward(engine: HFEngine, hf, prompts) -> None:
    # a teacher's scoring call (on-policy distillation): whatever the sampling settings, the raw logits' log-probs
    # of every prompt token after the first, in a left-padded batch of very different lengths
    spec = SamplingSpec(n=2, temperature=0.7, max_tokens=1, prompt_logprobs=True)
    for prompt, row in zip(prompts, generate(engine, prompts, spec, seeds=[0, 2, 4, 6, 8])):
        ref = hf_logprobs(hf["A"], prompt[:1], prompt[1:])
        for c in row:
            torch.testing.assert_close(torch.tensor(c.prompt_logprobs), ref, atol=1e-4, rtol=0)
    assert generate(engine, prompts[:1], GREEDY)[0][0].prompt_logprobs == []


def test_tiny_top_p_is_greedy(engine: HFEngine, prompts) -> None:
    greedy = [row[0].token_ids for row in generate(engine, prompts, GREEDY)]
    narrow = generate(engine, prompts, SamplingSpec(n=2, temperature=1.0, top_p=1e-6, max_tokens=12), seeds=[1] * 5)
    assert [[c.token_ids for c in row] for row in narrow] == [[g, g] for g in greedy]


def test_seeds_give_the_same_samples_whatever_the_batch(engine: HFEngine, prompts) -> None:
    spec = SamplingSpec(n=4, temperature=1.0, max_tokens=16)
    seeds = [100 + 4 * i for i in range(len(prompts))]
    tokens = lambda rows: [[c.token_ids for c in row] for row in rows]  # noqa: E731
    first = tokens(generate(engine, prompts, spec, seeds))
    assert tokens(generate(engine, prompts, spec, seeds)) == first
    assert tokens(generate(engine, prompts[2:3], spec, seeds[2:3])) == first[2:3]  # alone = in a batch
    assert tokens(generate(engine, prompts[::-1], spec, seeds[::-1])) == first[::-1]
    assert len(set(map(tuple, first[0]))) > 1  # the n samples of one prompt differ
    assert tokens(generate(engine, prompts, spec, [s + 1000 for s in seeds])) != first
    unseeded = [tokens(generate(engine, prompts[:1], spec)) for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # drawn from the engine's seed, fresh per request


def test_eos_stop_tokens_and_length(engine: HFEngine, hf, prompts) -> None:
    rows = generate(engine, prompts[:2], SamplingSpec(n=32, temperature=1.0, max_tokens=40), seeds=[5, 6])
    done = [(p, c) for p, row in zip(prompts, rows) for c in row]
    stopped = [(p, c) for p, c in done if c.finish_reason == "stop"]
    assert stopped and len(stopped) < len(done), "the test needs both eos stops and length cut-offs"
    for _, c in done:
        assert len(c.logprobs) == len(c.token_ids)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40 and EOS not in c.token_ids
    for p, c in stopped[:4]:  # the eos logprob is the model's, like every other position
        torch.testing.assert_close(torch.tensor(c.logprobs), hf_logprobs(hf["A"], p, c.token_ids), atol=1e-4, rtol=0)
    stop_tok = 10
    rows = generate(engine, prompts[:1], SamplingSpec(n=32, max_tokens=40, stop_token_ids=[stop_tok]), seeds=[7])
    by_stop = [c for c in rows[0] if c.finish_reason == "stop" and c.token_ids[-1] == stop_tok]
    assert by_stop and all(stop_tok not in c.token_ids[:-1] for c in by_stop)
    short = generate(engine, prompts, SamplingSpec(n=2, max_tokens=1), seeds=[0] * 5)
    assert all(len(c.token_ids) == 1 and c.finish_reason in ("stop", "length") for row in short for c in row)


def test_batches_respect_max_num_seqs_sampling_and_calls(folders) -> None:
    eng = HFEngine(str(folders["A"]), CFG.model_copy(update={"max_num_seqs": 4}), seed=0)
    two, other = SamplingSpec(n=2, max_tokens=3), SamplingSpec(n=2, max_tokens=3, temperature=0.5)
    eng.add_requests(["a", "b", "c"], [[4, 5], [6], [7, 8, 9]], two, None)
    eng.add_requests(["x"], [[4]], other, None)
    eng.add_requests(["d"], [[5]], two, None)
    assert eng.num_unfinished() == 5
    eng.abort(["b", "no-such-id"])
    batches = []
    while eng.num_unfinished():
        batches.append([rid for rid, group in eng.step() if len(group) == 2])
    assert batches == [["a", "c"], ["x"], ["d"]]  # <= 4 sequences, one SamplingSpec per batch, oldest first
    eng.add_requests(["e"], [[4]], two, None)
    eng.add_requests(["f"], [[5]], two, None)  # would fit beside e, but came with another call (another client)
    assert [[rid for rid, _ in eng.step()] for _ in range(2)] == [["e"], ["f"]]
    assert eng.step() == []
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_requests(["long"], [[4] * 250], SamplingSpec(max_tokens=7), None)
    with pytest.raises(ValueError, match="token ids"):
        eng.add_requests(["oov"], [[4, 10_000]], two, None)
    assert eng.num_unfinished() == 0


def test_update_weights_refuses_bad_names_and_shapes_untouched(engine: HFEngine, hf, prompts) -> None:
    before = generate(engine, prompts, GREEDY)
    snapshot = {n: p.clone() for n, p in engine.model.state_dict().items()}
    good = [(n, p.detach() * 0) for n, p in hf["B"].named_parameters()]
    bad_name = [*good[:3], ("model.layers.0.mlp.nope.weight", torch.zeros(2))]
    bad_shape = [*good[:3], ("model.norm.weight", torch.zeros(7))]
    with pytest.raises(ValueError, match="nope"):
        engine.update_weights(bad_name)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(7,\)"):
        engine.update_weights(bad_shape)
    assert all(torch.equal(snapshot[n], p) for n, p in engine.model.state_dict().items())
    assert generate(engine, prompts, GREEDY) == before and engine.weight_updates == 0


def test_cpu_sleep_is_unsupported_and_generation_goes_on(engine: HFEngine, prompts) -> None:
    assert engine.sleep() == {"supported": False, "device": "cpu", "freed_bytes": 0}
    assert engine.wake()["supported"] is False
    assert generate(engine, prompts[:1], GREEDY)[0][0].token_ids
    h = engine.health()
    assert h["ok"] and h["backend"] == "hf" and h["eos_token_id"] == EOS and h["dtype"] == "float32"
    assert h["device"] == "cpu" and h["sleep_supported"] is False and h["sleeping"] is False
    # refused under queued requests on CPU as on an accelerator: a role switch under another rank's requests
    # (partial placement) fails in CPU tests, not only on a GPU
    engine.add_requests(["queued"], [prompts[0]], GREEDY, None)
    with pytest.raises(RuntimeError, match="1 requests are queued"):
        engine.sleep()
    engine.abort(["queued"])
    assert engine.sleep()["supported"] is False


def test_bfloat16_engine_runs(folders, prompts) -> None:
    eng = HFEngine(str(folders["A"]), CFG.model_copy(update={"dtype": "bfloat16"}), seed=0)
    assert next(eng.model.parameters()).dtype == torch.bfloat16
    rows = generate(eng, prompts, SamplingSpec(n=2, max_tokens=8), seeds=[0] * 5)
    assert all(len(c.token_ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs) for r in rows for c in r)


def test_service_generates_and_switches_to_model_b(folders, hf, prompts, tmp_path: Path) -> None:
    client = spawn_engine(folders["A"], CFG, seed=0, log_path=tmp_path / "engine.log")
    try:
        h = client.health()
        assert h["backend"] == "hf" and h["pid"] == client.pid and h["eos_token_id"] == EOS
        greedy_a = client.generate(prompts, GREEDY)
        assert_matches_hf(greedy_a, hf["A"], prompts)
        assert client.sleep()["supported"] is False and client.wake()["supported"] is False
        # B's parameters without the tied lm_head name (named_parameters drops duplicates), bucketed by layer
        client.update_weights([(n, p.detach()) for n, p in hf["B"].named_parameters()])
        greedy_b = client.generate(prompts, GREEDY)
        assert_matches_hf(greedy_b, hf["B"], prompts)
        assert [r[0].token_ids for r in greedy_b] != [r[0].token_ids for r in greedy_a]
        assert client.health()["weight_updates"] > 1  # several buckets arrived
        sampled = client.generate(prompts, SamplingSpec(n=3, max_tokens=10), seeds=[0, 3, 6, 9, 12])
        assert [len(r) for r in sampled] == [3] * len(prompts)
        # a failed update ends the engine (exit 5): an engine never serves with weights the trainer did not send
        with pytest.raises((RemoteError, EngineDied), match="nope"):
            client.update_weights([("model.nope.weight", torch.zeros(3))])
        client.proc.wait(10)
    finally:
        client.close()
    assert client.proc.returncode == 5, (tmp_path / "engine.log").read_text()[-3000:]
