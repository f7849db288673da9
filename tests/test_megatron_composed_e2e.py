"""The composed configuration on 4 CPU ranks: megatron TP=2 x DP=2 with balancing across the data-parallel
groups, partial placement and a GenRM judge, against the same run on the torch backend at DP=2 (2 ranks).

Both runs shard the data over 2 data-parallel ranks, draw the same per-sample seeds and judge with the same
per-group seeds, so they generate the same rollouts (the megatron run splits each group's prompts over its 2
ranks and gathers them); balancing then moves the same groups between the data-parallel ranks. Rewards, losses
and the trained weights must agree within 1e-4 (all but a few weights: see the test): the check that the groups are
right."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from e2e import REPO, env, experiment, genrm_reward, torchrun
from megatron_ranks import needs_megatron
from safetensors.torch import load_file
from test_megatron_e2e import DIGITS_TP

pytestmark = needs_megatron

# lr 1e-3: AdamW divides by the gradient's root mean square, so an element whose gradient is near 0 carries the
# float32 summation-order difference of the two backends into its update; that stays well below 1e-4 here
BODY = """rollout: {group_size: 8, max_new_tokens: 1, engine: {backend: hf, vllm: null}}
algorithm: {mini_batches: 2}
trainer: {lr: 0.001, micro_batch_size: 16}
balance: {enabled: true}
"""
COMPARED = ("reward/mean", "actor/policy_loss", "response/length_mean", "genrm/judged")


def varied_rows(path, count: int) -> None:
    """Sums of 1- to 3-digit numbers: prompts of 4 to 8 tokens, so ranks draw different work to balance."""
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(10 ** rng.randint(1, 3)), rng.randrange(10 ** rng.randint(1, 3))
        rows.append({"prompt": f"{a}+{b}=", "answer": str((a + b) % 10), "data_source": "exact_match"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("composed")
    run = f"run: {{name: torch, output_dir: {tmp / 'runs'}, steps: 3, eval_every: 0}}\n"
    config = experiment(tmp, BODY + genrm_reward(tmp, "{backend: hf}") + run, model=DIGITS_TP)
    varied_rows(tmp / "train.jsonl", 64)
    torch_run = torchrun(config, "--placement", "partial", cwd=tmp)
    assert torch_run.returncode == 0, torch_run.stdout[-3000:] + torch_run.stderr[-3000:]
    megatron = ["trainer.backend=megatron", "trainer.megatron.tensor_parallel=2", "run.name=megatron"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", str(REPO / "launch/train.py")]
    proc = subprocess.run(
        [*cmd, "--config", str(config), "--placement", "partial", *megatron],
        capture_output=True, text=True, timeout=1200, env=env(), cwd=tmp,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: tmp / "runs" / name for name in ("torch", "megatron")}


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~80 s; CI: TP/PP runs composed in tests/test_composition_matrix.py, each parallel layout's step
# equal to the torch backend's in tests/test_megatron_trainer.py
def test_tp2_dp2_composed_equals_torch_dp2(runs):
    torch_records, megatron_records = records(runs["torch"]), records(runs["megatron"])
    assert [r["step"] for r in megatron_records] == [0, 1, 2, 3]
    for a, b in zip(torch_records[1:], megatron_records[1:]):
        assert b["placement/rollout_devices"] + b["placement/genrm_devices"] == 4
        assert b["rollout/samples"] == a["rollout/samples"] == 64  # 8 prompts x 8 samples, counted once
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], abs=1e-4), (a["step"], key, a[key], b[key])
        # the norm sums the squares of every gradient element: the most sensitive number, so compared relatively
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-3)
    assert sum(r["actor/grad_norm"] > 0 for r in megatron_records[1:]) >= 2  # steps with reward variance trained
    moved = [r["balance/moved_samples"] for r in megatron_records[1:]]
    assert moved == [r["balance/moved_samples"] for r in torch_records[1:]] and sum(moved) > 0
    start = load_file(runs["torch"].parents[1] / "policy0/model.safetensors")
    torch_w, megatron_w = (load_file(runs[n] / "policy/model.safetensors") for n in ("torch", "megatron"))
    assert set(torch_w) == set(megatron_w) == set(start)
    # AdamW divides each update by the gradient's running RMS, so an element whose gradient crosses 0 turns the
    # backends' float32 summation-order difference into a visible update difference: a few such elements may
    # pass 1e-4, every tensor's update must agree within 1% (a wrong grouping moves it by 100%)
    far = sum(int(((torch_w[k] - megatron_w[k]).abs() > 1e-4).sum()) for k in start)
    assert far <= sum(t.numel() for t in start.values()) // 10_000, far
    for k in start:
        update = (torch_w[k] - start[k]).norm()
        assert update > 0 and (torch_w[k] - megatron_w[k]).norm() < 1e-2 * update, k
