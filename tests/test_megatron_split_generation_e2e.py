"""Generation split within a model-parallel group (yatt.controllers.generation.GroupShare): with the megatron
backend at TP=2 (or PP=2) on 2 ranks, each rank generates, judges and scores half of the data-parallel rank's
prompts on its own engine, and the group gathers them (also ahead of the trainer, rollout.schedule.mode=
one_step_off, over the producer's own process groups). The batch must be the one a single rank generates alone
(YATT_UNSPLIT_GENERATION=1: both ranks generate all prompts), so the runs' rewards, losses and trained weights are
the same; only timings, the judge queue and per-device engine work may differ."""

from __future__ import annotations

import json
import math

import pytest
from e2e import ONE_TOKEN_GRPO, experiment, genrm_reward, torchrun
from megatron_ranks import needs_megatron
from safetensors.torch import load_file
from test_megatron_e2e import DIGITS_TP

from yatt.controllers.run import UNSPLIT_ENV

pytestmark = needs_megatron

HF = ["rollout.engine.backend=hf", "rollout.engine.vllm=null", "trainer.backend=megatron"]
# what may differ between a split and an unsplit run: wall times, device time per role, engine work per device,
# and the judge queue (a rank submits half as many groups)
PER_DEVICE = (
    "elapsed_s",
    "time/",
    "perf/",
    "placement/",
    "load/",
    "device",
    "genrm/max_queue",
    "genrm/judged_per_busy_s",
    "async/wait_s",
    "async/producer_busy_s",
    "async/queue_depth",
)

CASES = {
    "tp2_grpo": ("", ["trainer.megatron.tensor_parallel=2"], "full"),
    "tp2_partial_genrm_dynamic": (
        "algorithm: {dynamic_sampling: {enabled: true, max_rounds: 2}}\n",
        ["trainer.megatron.tensor_parallel=2"],
        "partial",
    ),
    "tp2_remax": (
        "algorithm: {advantage: {kind: remax}, mini_batches: 2}\n",
        ["trainer.megatron.tensor_parallel=2"],
        "full",
    ),
    "pp2_grpo": ("", ["trainer.megatron.pipeline_parallel=2"], "full"),
    # ahead of the trainer: the producer thread's split and gather go over process groups of its own
    "tp2_one_step_off_genrm_dynamic": (
        "algorithm: {dynamic_sampling: {enabled: true, max_rounds: 2}}\n",
        ["trainer.megatron.tensor_parallel=2", "rollout.schedule.mode=one_step_off"],
        "full",
    ),
}
# tp2_grpo: the other tp2 cases split the same generation; tp2_one_step_off_genrm_dynamic: the partial case splits
# it in CI, and tests/test_composition_matrix.py runs TP=2 with one_step_off
# tp2_partial_genrm_dynamic: the composition matrix's TP=2 runs split generation (the default) under partial
# placement with GenRM, and their engine/trainer log-probs agree only if each rank trains its own prompts' samples
SLOW = {"tp2_remax", "pp2_grpo", "tp2_grpo", "tp2_one_step_off_genrm_dynamic", "tp2_partial_genrm_dynamic"}


def run_pair(tmp, name: str) -> tuple[list, list, dict, dict]:
    body, overrides, placement = CASES[name]
    reward = genrm_reward(tmp, "{backend: hf}") if "genrm" in name else ""
    runs = {}
    for mode, extra in (("split", {}), ("unsplit", {UNSPLIT_ENV: "1"})):
        run = f"run: {{name: {mode}, output_dir: {tmp / 'runs'}, steps: 3, eval_every: 3}}\n"
        config = experiment(tmp, f"{ONE_TOKEN_GRPO}{body}{reward}{run}", model=DIGITS_TP)
        proc = torchrun(config, "--placement", placement, *HF, *overrides, cwd=tmp, extra_env=extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        records = [json.loads(line) for line in (tmp / "runs" / mode / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = (records, load_file(tmp / "runs" / mode / "policy" / "model.safetensors"))
    (split, split_w), (unsplit, unsplit_w) = runs["split"], runs["unsplit"]
    return split, unsplit, split_w, unsplit_w


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES])
def test_split_generation_trains_on_the_unsplit_batch(tmp_path, name):
    split, unsplit, split_w, unsplit_w = run_pair(tmp_path, name)
    assert [r["step"] for r in split] == [r["step"] for r in unsplit] == [0, 1, 2, 3]
    for a, b in zip(split, unsplit):
        kept = {k for k in a if not k.startswith(PER_DEVICE)}
        assert kept == {k for k in b if not k.startswith(PER_DEVICE)}
        for key in sorted(kept):
            assert math.isfinite(a[key]) or math.isnan(b[key]), (key, a[key])
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6, nan_ok=True), (a["step"], key, a[key], b[key])
    assert split[-1]["eval/count"] == 16  # the held-out rows split over the group, each counted once
    # 8 prompts x 8 samples, one data-parallel rank (dynamic sampling keeps the groups with reward variance)
    assert all(r["rollout/samples"] == 64 or "dynamic" in name for r in split[1:])
    if "genrm" in name:
        # every fresh sample judged once; dynamic sampling may start a step from its queue and judge fewer
        least = 8 if "dynamic" in name else 64
        assert all(r["genrm/judged"] >= least and r["genrm/judged"] % 8 == 0 for r in split[1:])
    assert set(split_w) == set(unsplit_w)
    assert max((split_w[k] - unsplit_w[k]).abs().max().item() for k in split_w) == 0.0
