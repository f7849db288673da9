"""Exact resume under TP=2, and under EP=2 with a tiny Qwen3-MoE whose experts are split over the ranks
(torchrun, 2 ranks, trainer.backend=megatron, hf engines): each rank checkpoints its own shard; a run stopped by
SIGTERM, resumed, killed with kill -9 during a background checkpoint write and resumed again logs the same
per-step metrics and ends with the same weights as an uninterrupted run."""

import os
import signal

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, experiment
from megatron_ranks import needs_megatron
from safetensors.torch import load_file
from test_checkpoint_resume_e2e import comparable, finish, launch, logged_steps, process_tree, wait_for
from test_megatron_e2e import DIGITS_TP

pytestmark = [needs_megatron, pytest.mark.slow]
STEPS = 6
HF = ("trainer.backend=megatron", "rollout.engine.backend=hf", "rollout.engine.vllm=null")
MOE = DIGITS_TP.model_copy(
    update={"architecture": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
)


@pytest.mark.parametrize(
    "model, parallel",
    [
        pytest.param(DIGITS_TP, "trainer.megatron.tensor_parallel=2", id="tp2"),
        pytest.param(MOE, "trainer.megatron.expert_parallel=2", id="ep2-moe"),
    ],
)
def test_kill_9_during_a_shard_write_resumes_exactly(tmp_path, model, parallel):
    megatron = (*HF, parallel)
    config = experiment(
        tmp_path,
        f"""
{ONE_TOKEN_GRPO}checkpoint: {{every: 2, keep: 2}}
run: {{name: r, steps: {STEPS}, eval_every: 3}}
""",
        model=model,
        name="resume.yaml",
    )
    out = finish(launch(tmp_path, config, "full", *megatron))
    assert "done:" in out, out[-3000:]
    uninterrupted = tmp_path / "full" / "r"

    run_dir = tmp_path / "chain" / "r"
    ckpts = run_dir / "checkpoints"
    proc = launch(tmp_path, config, "chain", *megatron, "checkpoint.debug_write_delay_s=0.5")
    wait_for(proc, lambda: max(logged_steps(run_dir), default=0) >= 2)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert "received SIGTERM at step" in out, out[-3000:]
    stopped = int(out.split("received SIGTERM at step ")[1].split(":")[0])
    assert 2 <= stopped < STEPS

    proc = launch(tmp_path, config, "chain", *megatron, "--resume", "auto", "checkpoint.debug_write_delay_s=1.0")
    wait_for(proc, lambda: any(".tmp-" in p.name for p in ckpts.iterdir()))
    staging = [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]
    for pid in process_tree(proc.pid):
        os.kill(pid, signal.SIGKILL)
    out = finish(proc)
    assert f"resuming from {ckpts / f'step-{stopped:08d}'}" in out, out[-3000:]
    assert all((ckpts / name).exists() for name in staging), "the kill did not land during the write"

    out = finish(launch(tmp_path, config, "chain", *megatron))
    assert "warning: skipping partial checkpoint" in out and "done:" in out, out[-3000:]
    assert logged_steps(run_dir) == list(range(STEPS + 1))
    for want, have in zip(comparable(uninterrupted), comparable(run_dir)):
        assert want == have, {
            k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)
        }
    a = load_file(uninterrupted / "policy" / "model.safetensors")
    b = load_file(run_dir / "policy" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
