"""A short real run through the launcher with trainer.backend=megatron, tensor_parallel=2 on 2 ranks: one
data-parallel rank, so both ranks generate and train on the same samples (the trainer refuses otherwise),
the hf engine samples from the gathered weights after every step, and the policy exported from the shards."""

import json
import math

import pytest
from e2e import ONE_TOKEN_GRPO, experiment, torchrun
from megatron_ranks import needs_megatron
from safetensors.torch import load_file

from yatt.models.tiny import TinyModelConfig

pytestmark = needs_megatron
# 4 query / 2 key-value heads split over TP=2; vocabulary 15 padded to 16
DIGITS_TP = TinyModelConfig(
    alphabet="0123456789+=",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcore_e2e")
    config = experiment(
        tmp,
        f"""
{ONE_TOKEN_GRPO}run: {{name: tp2, output_dir: {tmp / "runs"}, steps: 3, eval_every: 0}}
""",
        model=DIGITS_TP,
    )
    overrides = [
        "trainer.backend=megatron",
        "trainer.megatron.tensor_parallel=2",
        "rollout.engine.backend=hf",
        "rollout.engine.vllm=null",
    ]
    return torchrun(config, "--placement", "full", *overrides, cwd=tmp), tmp / "runs" / "tp2", tmp / "policy0"


@pytest.mark.slow  # CI: the composition matrix's TP=2 runs (64 samples a step counted once, engine/trainer
# log-probs within 1e-3 after every sync, an export from the shards equal to the final policy)
def test_tp2_run_trains_on_one_data_parallel_slice(run):
    proc, run_dir, model = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        for key in ("actor/policy_loss", "actor/grad_norm", "reward/mean"):
            assert math.isfinite(r[key]), (key, r)
        assert r["rollout/samples"] == 64  # 8 prompts x 8 samples: one data-parallel rank, counted once
        assert r["rollout/trainer_logprob_diff_max"] < 1e-3, r  # the engine got the trained weights
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_trained"] == 3 * 64
    before, after = load_file(model / "model.safetensors"), load_file(run_dir / "policy" / "model.safetensors")
    assert set(before) == set(after)
    assert max((before[k] - after[k]).abs().max().item() for k in before) > 1e-3
