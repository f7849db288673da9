"""PPO with a critic through the launcher on the megatron backend: torchrun, 2 ranks, tensor_parallel=2, the hf
engine, GAE advantages from a value model split like the policy. Three steps (the first warms the critic up):
finite policy and critic metrics, the critic's values change as it trains, and each rank checkpoints its
shard of the critic with the value head."""

import json
import math

import pytest
from e2e import ONE_TOKEN_GRPO, experiment, torchrun
from megatron_ranks import needs_megatron
from safetensors.torch import load_file
from test_megatron_e2e import DIGITS_TP

pytestmark = needs_megatron
PPO = (
    ONE_TOKEN_GRPO.replace(
        "algorithm: {mini_batches: 2}", "algorithm: {mini_batches: 2, advantage: {kind: gae, lam: 0.95}}"
    )
    + """critic: {lr: 0.01, warmup_steps: 1}
checkpoint: {every: 3, keep: 1}
"""
)


@pytest.mark.slow  # CI: the composition matrix's PPO runs at TP=2 and PP=2 (critic warm-up, critic metrics and
# gradients), tests/test_megatron_critic.py's value head at TP=2
def test_ppo_with_a_critic_at_tp2(tmp_path):
    config = experiment(
        tmp_path, PPO + f"run: {{name: c, output_dir: {tmp_path / 'runs'}, steps: 3, eval_every: 0}}\n", model=DIGITS_TP
    )
    overrides = [
        "trainer.backend=megatron",
        "trainer.megatron.tensor_parallel=2",
        "rollout.engine.backend=hf",
        "rollout.engine.vllm=null",
    ]
    proc = torchrun(config, "--placement", "full", *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "c"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        for key in (
            "critic/value_loss",
            "critic/grad_norm",
            "critic/explained_var",
            "critic/value_mean",
            "reward/mean",
        ):
            assert math.isfinite(r[key]), (key, r)
        assert r["critic/skipped_steps"] == 0.0 and r["critic/lr"] > 0
        assert r["rollout/samples"] == 64  # one data-parallel rank: both TP ranks train on the same samples
    assert [r["critic/warmup"] for r in records[1:]] == [1.0, 0.0, 0.0]
    assert all(math.isfinite(r["actor/policy_loss"]) for r in records[2:])  # the policy trains after the warm-up
    assert len({r["critic/value_mean"] for r in records[1:]}) == 3  # the critic moves
    # each TP rank checkpoints its shard of the critic, the replicated value head included
    step = run_dir / "checkpoints" / "step-00000003"
    for rank in (0, 1):
        keys = load_file(str(step / f"rank{rank}.safetensors")).keys()
        assert {"critic/model/value_head.weight", "critic/model/value_head.bias"} <= keys, sorted(keys)[:8]
        assert not any(k.startswith("critic/model/output_layer") for k in keys)
