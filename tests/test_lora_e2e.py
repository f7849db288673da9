"""LoRA end to end (model.lora): 2 torchrun ranks, real engines, a tiny policy.

- vLLM engines with merged syncs and a KL term (the reference is the policy with its adapter off): finite metrics;
  checkpoints hold the adapters and their optimizer state only; the exports load with transformers and with peft;
- hf engines with adapter-only syncs: a run killed with kill -9 while a checkpoint is being written resumes to
  the uninterrupted run's metrics and weights;
- vLLM engines with adapter-only syncs (served by vLLM's LoRA layers), one engine killed as a sync starts: the
  restarted engine is given the current adapter, and the engines' log-probs agree with the trainer's at every step;
- LoRA composed with the other features (the composition matrix's combinations on the torch backend): partial
  placement, a GenRM judge, balancing, dynamic sampling, PPO's critic, checkpoint exports; the engines' log-probs
  agree with the trainer's, so what the sync gave them is the trained policy.
"""

import math
import os

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, REPO, experiment, torchrun
from safetensors.torch import load_file
from test_async_e2e import assert_same_run, records, run
from test_checkpoint_resume_e2e import finish, kill_while_saving, launch

pytestmark = pytest.mark.engine
STEPS = 4
LORA = ("model.lora.rank=2", "model.lora.alpha=4")
HF_ADAPTER = ("rollout.engine.backend=hf", "rollout.engine.vllm=null", "model.lora.sync=adapter")


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    return tmp, experiment(
        tmp,
        f"""
{ONE_TOKEN_GRPO}checkpoint: {{every: 2, keep: 2}}
run: {{name: r, steps: {STEPS}, eval_every: 2}}
""",
        name="lora.yaml",
    )


@pytest.mark.slow  # CI: LoRA runs in the composition matrix (hf engines, merged sync), a merged push reaches a
# vLLM engine whole in tests/test_lora.py, and tests/test_vllm_lora.py serves synced adapters
def test_lora_with_vllm_merged_syncs_and_a_kl_term(config):
    tmp, path = config
    run_dir = run(tmp, "vllm", path, *LORA, "algorithm.kl_coef=0.05", "checkpoint.export_hf=true")
    steps = [r for r in records(run_dir) if r["step"] > 0]
    assert len(steps) == STEPS
    assert all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, (int, float)))
    assert any(r["actor/kl_ref"] > 0 for r in steps)  # the policy moved away from its adapter-off self

    ckpt = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    tensors = load_file(ckpt / "shared.safetensors")
    assert tensors and all(k.startswith(("trainer/adapter/", "trainer/optimizer/")) for k in tensors), sorted(tensors)[
        :5
    ]
    model_bytes = sum(t.numel() * t.element_size() for t in load_file(tmp / "policy0" / "model.safetensors").values())
    assert (ckpt / "shared.safetensors").stat().st_size < 0.5 * model_bytes  # a full one: 3x the model

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[3, 4, 5, 6]])
    for policy in (ckpt / "policy", run_dir / "policy"):
        merged = AutoModelForCausalLM.from_pretrained(str(policy))
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(tmp / "policy0")), str(policy / "adapter")
        )
        assert torch.allclose(merged(ids).logits, adapted(ids).logits, atol=1e-5)
    final, saved = load_file(run_dir / "policy" / "model.safetensors"), load_file(ckpt / "policy" / "model.safetensors")
    assert set(final) == set(saved) and all(torch.equal(final[k], saved[k]) for k in final)


@pytest.mark.slow  # ~90 s on 2 cores; tests/test_vllm_lora.py checks the engine itself in the default suite
def test_lora_with_vllm_adapter_syncs_survives_an_engine_killed_at_a_sync(config):
    """Rank 0's rollout engine is SIGKILLed as step 2's weight sync starts (tests/faults/sitecustomize.py): the
    engine started in its place is pushed the policy's weights, which with sync=adapter are the adapters."""
    tmp, path = config
    faults = {
        "YATT_TEST_KILL": "sync@2",
        "YATT_TEST_KILL_LOG": str(tmp / "kills.log"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), str(REPO)]),
    }
    args = [f"run.output_dir={tmp / 'vllm-adapter'}", "model.lora.rank=8", "model.lora.sync=adapter"]
    proc = torchrun(path, *args, cwd=tmp, extra_env=faults)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp / "kills.log").read_text().split() == ["sync@2", "rollout"]
    steps = [r for r in records(tmp / "vllm-adapter" / "r") if r["step"] > 0]
    assert len(steps) == STEPS
    assert all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, (int, float)))
    assert sum(r.get("placement/engine_restarts", 0) for r in steps) == 1
    restarted = (tmp / "vllm-adapter" / "r" / "logs" / "engine-rollout-rank0-2.log").read_text()
    assert "serving LoRA adapter yatt-sync-1: 14 modules of rank 8" in restarted
    # the engines sample from the trainer's policy, the restarted one (steps 3 and 4) too
    assert all(r["rollout/trainer_logprob_diff_max"] < 1e-3 for r in steps), [
        r["rollout/trainer_logprob_diff_max"] for r in steps
    ]


@pytest.mark.slow  # ~55 s; CI: LoRA runs in the composition matrix, exact resumes after kill -9 of its main
# combination and of FSDP2 (tests/test_fsdp2_e2e.py)
def test_lora_with_adapter_syncs_resumes_exactly_after_kill_9(config):
    tmp, path = config
    uninterrupted = run(tmp, "full", path, *LORA, *HF_ADAPTER)
    assert all(math.isfinite(r["actor/grad_norm"]) for r in records(uninterrupted) if r["step"] > 0)

    ckpts = tmp / "chain" / "r" / "checkpoints"
    # step 2's checkpoint committed, step 4's being written
    saved = kill_while_saving(
        launch(tmp, path, "chain", *LORA, *HF_ADAPTER, "checkpoint.debug_write_delay_s=1.0"), ckpts
    )
    out = finish(launch(tmp, path, "chain", *LORA, *HF_ADAPTER))
    assert f"resuming from {saved}" in out and "done:" in out, out[-3000:]
    assert_same_run(uninterrupted, tmp / "chain" / "r")


@pytest.mark.parametrize(
    "sync, extra",
    [
        # slow: tests/test_composition_matrix.py composes LoRA with every other feature in CI
        pytest.param("adapter", [], id="partial-mixed-ppo-bal-exp-ds-adapter", marks=pytest.mark.slow),
        pytest.param("merged", ["algorithm.kl_coef=0.05"], id="full-genrm-grpo-exp-kl-merged", marks=pytest.mark.slow),
    ],
)
def test_lora_composes(tmp_path, sync, extra):
    from e2e import torchrun
    from test_composition_matrix import Combination, check_export, check_metrics, config_of, records, run_body

    c = (
        Combination("torch", "partial", "mixed", True, True, "ppo", True)
        if sync == "adapter"
        else Combination("torch", "full", "genrm", False, True, "grpo", False)
    )
    config, overrides = config_of(tmp_path, c, run_body(2, 2, 1))
    lora = [*LORA, f"model.lora.sync={sync}", *extra]
    proc = torchrun(config, *overrides, *lora, f"run.output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "m"
    check_metrics(c, records(run_dir))  # includes: engine and trainer log-probs within 1e-3
    check_export(run_dir)
    assert (run_dir / "checkpoints" / "step-00000002" / "policy" / "adapter" / "adapter_model.safetensors").is_file()
    if extra:
        assert records(run_dir)[-1]["actor/kl_ref"] > 0


@pytest.mark.slow  # a benchmark script at its smallest settings (20-120 s); the cheap ones run in CI
def test_the_benchmark_runs(tmp_path):
    """benchmarks/lora.py at its smallest (hf engines, 2 steps; the numbers mean nothing at this size), its results
    holding no machine paths. (With the others in test_benchmarks.py's spirit; kept here with LoRA's tests.)"""
    from test_benchmarks import results
    from test_benchmarks import run as run_script

    config = experiment(tmp_path, ONE_TOKEN_GRPO)
    out = run_script(
        "lora.py",
        "--config",
        str(config),
        "--steps",
        "2",
        "--warmup",
        "0",
        "--rank",
        "2",
        "--variants",
        "full (hf)",
        "LoRA adapter sync (hf)",
        "--out",
        str(tmp_path / "lora"),
        cwd=tmp_path,
    )
    rows = results(tmp_path / "lora.json", tmp_path)["variants"]
    assert [r["variant"] for r in rows] == ["full (hf)", "LoRA adapter sync (hf)"]
    full, lora = rows
    assert lora["sync_mib"] < 0.2 * full["sync_mib"]  # the adapters alone
    assert lora["checkpoint_mib"] < full["checkpoint_mib"] and all(r["sync_s"] > 0 and r["step_s"] > 0 for r in rows)
    assert "checkpoint_mib / full (hf)" in out
