"""FSDP2 end to end (trainer.torch.parallel=fsdp2): 2 torchrun ranks, hf engines, a tiny policy, a critic-free GRPO
run with HF export in its checkpoints. Each rank's checkpoint files hold its own shards (a sharded trainer is not
saved once from rank 0); a run killed with kill -9 during a background checkpoint write resumes and ends with the
metrics and weights of the uninterrupted run; the exported policy (gathered from the shards) loads with
transformers and is the run's final policy; a checkpoint resumes on 1 rank and back on 2, continuing the run."""

from __future__ import annotations

import subprocess

import pytest
import torch
from e2e import ONE_TOKEN_GRPO, env, experiment, torchrun_args
from safetensors.torch import load_file
from test_checkpoint_resume_e2e import comparable, finish, kill_while_saving, launch, logged_steps

pytestmark = pytest.mark.engine
STEPS = 4
FSDP2 = ("trainer.torch.parallel=fsdp2", "rollout.engine.backend=hf", "rollout.engine.vllm=null")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    run = f"run: {{name: r, steps: {STEPS}, eval_every: 2}}\n"
    body = f"{ONE_TOKEN_GRPO}checkpoint: {{every: 2, keep: 3, export_hf: true}}\n{run}"
    config = experiment(tmp, body, name="fsdp2.yaml")
    out = finish(launch(tmp, config, "calm", *FSDP2))
    assert "done:" in out, out[-3000:]
    run_dir = tmp / "killed" / "r"
    saved = kill_while_saving(launch(tmp, config, "killed", *FSDP2, "checkpoint.debug_write_delay_s=1.0"),
                              run_dir / "checkpoints")  # fmt: skip
    out = finish(launch(tmp, config, "killed", *FSDP2))
    assert f"resuming from {saved}" in out and "done:" in out, out[-3000:]
    return tmp / "calm" / "r", run_dir


def test_each_rank_checkpoints_its_own_shards(runs):
    calm, _ = runs
    step = calm / "checkpoints" / f"step-{STEPS:08d}"
    parts = [load_file(str(step / f"rank{r}.safetensors")) for r in (0, 1)]
    final = load_file(str(calm / "policy" / "model.safetensors"))
    for name, weight in final.items():
        key = next(k for k in parts[0] if k.endswith(f"model.{name}") or k.endswith(f"model/{name}"))
        halves = [p[key] for p in parts]
        assert halves[0].shape[0] + halves[1].shape[0] == weight.shape[0], name
        assert torch.equal(torch.cat(halves), weight), name
    assert not any("model.embed_tokens" in k for k in load_file(str(step / "shared.safetensors")))


def test_kill_9_resume_equals_the_uninterrupted_run(runs):
    calm, killed = runs
    assert logged_steps(killed) == list(range(STEPS + 1))
    for want, have in zip(comparable(calm), comparable(killed)):
        assert want == have, {
            k: (want.get(k), have.get(k)) for k in set(want) | set(have) if want.get(k) != have.get(k)
        }
    a, b = (load_file(str(d / "policy" / "model.safetensors")) for d in (calm, killed))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_export_is_the_gathered_policy(runs):
    calm, _ = runs
    from transformers import AutoModelForCausalLM

    exported = calm / "checkpoints" / f"step-{STEPS:08d}" / "policy"
    model = AutoModelForCausalLM.from_pretrained(exported)
    final = load_file(str(calm / "policy" / "model.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items())


def _on(ranks: int, args: list[str]) -> list[str]:
    """torchrun_args' command line with `ranks` ranks a node."""
    at = args.index("--nproc_per_node")
    return [*args[: at + 1], str(ranks), *args[at + 2 :]]


def test_resumes_on_one_rank_and_back_on_two_continuing_the_run(runs, tmp_path):
    """The calm run's step-2 checkpoint resumed on 1 rank (to step 4), whose step-3 checkpoint is resumed on 2 ranks:
    each resumed step draws the same prompts and samples as the run it continues, from the same weights (entropy
    and engine/trainer log-prob gap within 1e-5). The updates differ only in how groups fall into mini-batches,
    which are drawn per rank."""
    calm, _ = runs
    config = calm.parent.parent / "fsdp2.yaml"
    one, two = tmp_path / "one" / "r", tmp_path / "two" / "r"
    legs = [(1, one, calm / "checkpoints" / "step-00000002"), (2, two, one / "checkpoints" / "step-00000003")]
    for ranks, run_dir, checkpoint in legs:
        args = torchrun_args(config, f"run.output_dir={run_dir.parent}", *FSDP2, "--resume", str(checkpoint),
                             "checkpoint.every=1")  # fmt: skip
        out = subprocess.run(_on(ranks, args), capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=600)
        assert f"resuming from {checkpoint}" in out.stdout and "done:" in out.stdout, (out.stdout + out.stderr)[-3000:]
    for before, after, step in ((calm, one, 3), (one, two, 4)):
        want, have = (next(r for r in comparable(d) if r["step"] == step) for d in (before, after))
        for key in ("reward/mean", "response/length_mean", "rollout/samples"):
            assert have[key] == want[key], (step, key)
        for key in ("actor/entropy", "rollout/trainer_logprob_diff_mean"):
            assert abs(have[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (step, key)
