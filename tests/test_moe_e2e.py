"""A tiny Qwen3-MoE policy end to end: 2 torchrun ranks, hf engines, GRPO on one-digit addition, balancing on,
with routing replay R3 under DDP and R2 under FSDP2 (Qwen3-MoE's decoder layers are the FSDP2 units). Each run
finishes, logs the MoE metrics (the load-balancing loss, tokens per expert, the routing mismatch: measured under
R3, and under R2 with algorithm.routing_mismatch), and under R3 the trainer's log-probs equal the engine's within
float noise (the same experts in both)."""

from __future__ import annotations

import json

import pytest
from e2e import DIGITS, ONE_TOKEN_GRPO, experiment
from test_checkpoint_resume_e2e import finish, launch

pytestmark = pytest.mark.engine
MOE = DIGITS.model_copy(
    update={"architecture": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
)
HF = ("rollout.engine.backend=hf", "rollout.engine.vllm=null")


# r3-ddp slow: tests/test_composition_matrix.py runs r3 under DDP and FSDP2 in CI
@pytest.mark.parametrize(
    "replay, parallel",
    [pytest.param("r3", "ddp", id="r3-ddp", marks=pytest.mark.slow), pytest.param("r2", "fsdp2", id="r2-fsdp2")],
)
def test_a_tiny_moe_trains_with_routing_replay(tmp_path, replay, parallel):
    body = f"{ONE_TOKEN_GRPO}run: {{name: r, steps: 2, eval_every: 2}}\n"
    config = experiment(tmp_path, body, model=MOE, name="moe.yaml")
    args = (*HF, f"algorithm.routing_replay={replay}", f"trainer.torch.parallel={parallel}", "balance.enabled=true")
    args += ("algorithm.routing_mismatch=true",) if replay == "r2" else ()
    out = finish(launch(tmp_path, config, "out", *args, "algorithm.old_logprobs=recompute"))
    assert "done:" in out, out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "r" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "moe/aux_loss" in r]
    assert trained, rows[-1].keys()
    for r in trained:
        assert r["moe/aux_loss"] > 0
        assert r["moe/tokens_per_expert_max"] >= r["moe/tokens_per_expert_mean"] > 0
        # the engine and the trainer's first pass hold the same weights: their routers agree but for float noise
        # at near-ties (a misaligned comparison would disagree on most tokens)
        assert 0 <= r["moe/routing_mismatch"] < 0.05 and r["moe/routing_mismatch_layers"] <= r["moe/routing_mismatch"]
        if replay == "r3":  # before the update the trainer is the engine's network, on the engine's experts
            assert r["rollout/trainer_logprob_diff_max"] < 1e-4, r
