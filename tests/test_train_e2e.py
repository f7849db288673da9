"""A short real run through the launcher: torchrun, 2 ranks, vLLM engines, DDP trainer, weight sync."""

import json
import math

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, experiment, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    config = experiment(
        tmp,
        f"""
{ONE_TOKEN_GRPO}run: {{name: e2e, output_dir: {tmp / "runs"}, steps: 3, eval_every: 2}}
""",
    )
    return torchrun(config, "--placement", "full", cwd=tmp), tmp / "runs" / "e2e", tmp / "policy0"


def test_run_succeeds(run):
    proc, _, _ = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step    3/3" in proc.stdout


def test_metrics_are_finite_and_complete(run):
    _, run_dir, _ = run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[2] and "eval/accuracy" in records[3]
    for r in records[1:]:
        for key in ("actor/policy_loss", "actor/grad_norm", "actor/entropy", "reward/mean", "time/generate_s"):
            assert math.isfinite(r[key]), (key, r)
        assert r["rollout/samples"] == 64  # 8 prompts x 8 samples over both ranks
        # balancing off: nothing gathered or moved; the step's reductions still report the imbalance
        assert r["balance/moved_samples"] == 0 and r["balance/imbalance_after"] == r["balance/imbalance_before"]
        assert 1.0 <= r["balance/imbalance_before"] < 2.0
    assert any(r["reward/zero_variance_group_frac"] < 1 for r in records[1:]), "no step had a learning signal"


def test_engine_samples_from_the_trained_weights(run):
    """The policy moved (lr 1e-2), yet the engine's log-probs of each step's samples equal the trainer's:
    the engines were updated after every step."""
    _, run_dir, model = run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records[1:]:
        assert r["rollout/trainer_logprob_diff_max"] < 1e-3, r
    before, after = load_file(model / "model.safetensors"), load_file(run_dir / "policy" / "model.safetensors")
    assert set(before) == set(after)
    assert max((before[k] - after[k]).abs().max().item() for k in before) > 1e-3


def test_summary_and_exported_policy(run):
    _, run_dir, _ = run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2 and summary["samples_trained"] == 192
    assert 0.0 <= summary["start_accuracy"] <= 1.0 and 0.0 <= summary["end_accuracy"] <= 1.0
    assert summary["wall_seconds"] > 0 and summary["samples_per_second"] > 0
    assert (run_dir / "config.yaml").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(run_dir / "policy")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "policy")
    ids = tokenizer("3+4=", return_tensors="pt").input_ids
    assert torch.isfinite(policy(ids).logits).all()


def test_vllm_serves_the_exported_policy(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from yatt.engines.base import SamplingSpec
    from yatt.engines.client import spawn_engine
    from yatt.engines.config import EngineConfig

    _, run_dir, _ = run
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "policy")
    prompt = tokenizer("3+4=", add_special_tokens=False).input_ids
    policy = AutoModelForCausalLM.from_pretrained(run_dir / "policy")
    with torch.no_grad():
        expected = torch.log_softmax(policy(torch.tensor([prompt])).logits[0, -1], -1)
    with spawn_engine(
        run_dir / "policy",
        EngineConfig(max_model_len=16, vllm={"kv_cache_gib": 0.25}),
        seed=0,
        log_path=tmp_path / "engine.log",
    ) as engine:
        [[completion]] = engine.generate([prompt], SamplingSpec(n=1, temperature=0.0, max_tokens=1))
    token = completion.token_ids[0]
    assert token == int(expected.argmax())
    assert abs(completion.logprobs[0] - float(expected[token])) < 1e-4


def test_run_can_be_watched(run):
    """TensorBoard events next to metrics.jsonl, samples.jsonl at each eval, the plot, eval/score."""
    _, run_dir, _ = run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2, 3]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in (records[0], records[2], records[3]):
        assert 0.0 <= r["eval/accuracy"] <= r["eval/score"] <= 1.0  # full scores are a subset of the score
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({(s["step"], s["split"]) for s in samples}) == [
        (0, "eval"),
        (2, "eval"),
        (2, "train"),
        (3, "eval"),
        (3, "train"),
    ]
    train = [s for s in samples if s["split"] == "train"]
    assert all(len(s["responses"]) == 8 and "reward" in s["responses"][0] for s in train)
    from yatt.plot import plot_run

    assert plot_run(run_dir, run_dir / "curves.png").stat().st_size > 10_000
