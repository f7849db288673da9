"""kill -9 of an engine in every phase of a run is survived: the run completes with the metrics and the
policy of an uninterrupted run, and only the restart counters tell them apart.

Two real 2-rank runs (hf engines, a tiny judge, GenRM mixed with the rule, full placement, 4 steps, evals
after steps 0, 2 and 4): one undisturbed, one in which rank 0's engines are SIGKILLed during generation
(step 1), judging (step 2), training while the rollout engine sleeps (step 3), the weight sync (step 4) and
the evaluation after step 2 (tests/faults/sitecustomize.py does the killing). The same pair again with
rollout.schedule.mode=one_step_off (slow suite): there the producer thread generates (and loses engines) while the
trainer trains, and a restarted engine gets the weights its batch is generated with."""

import json
import math
import os

import pytest
from e2e import JUDGE_TINY, REPO, experiment, genrm_reward, torchrun
from safetensors.torch import load_file

pytestmark = pytest.mark.engine
KILLS = ["generate@1", "judge@2", "train@3", "sync@4", "eval@2"]
# what an engine restart may change: timings, throughput, restart/re-route counters, idle fractions
VOLATILE = (
    "elapsed_s",
    "time/",
    "perf/",
    "load/",
    "device",
    "placement/switch_s",
    "placement/idle_frac",
    "placement/engine_restarts",
    "sync/",  # what the weight syncs sent: a restarted engine is sent the whole policy
    "async/wait_s",
    "async/producer_busy_s",
    "async/queue_depth",
)


# the ahead schedule's pair only in the slow suite: the sync pair is CI's real run of engine recovery
@pytest.fixture(scope="module", params=["", pytest.param("_ahead", marks=pytest.mark.slow)])
def runs(tmp_path_factory, request):
    """(calm run, killed run, the kill log) for one schedule: each run its metrics, final policy and stdout."""
    schedule = request.param
    tmp = tmp_path_factory.mktemp("kill")
    config = experiment(
        tmp,
        f"""
rollout: {{group_size: 8, max_new_tokens: 2, engine: {{backend: hf}}}}
{genrm_reward(tmp, "{backend: hf}")}algorithm: {{mini_batches: 2}}
trainer: {{lr: 0.01, micro_batch_size: 32}}
run: {{output_dir: {tmp / "runs"}, steps: 4, eval_every: 2}}
""",
        model=JUDGE_TINY,
        name="kill.yaml",
    )
    faults = {
        "YATT_TEST_KILL": ",".join(KILLS),
        "YATT_TEST_KILL_LOG": str(tmp / "kills.log"),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "faults"), str(REPO)]),
    }
    args = ["rollout.schedule.mode=one_step_off"] if schedule else []
    out = []
    for name, extra in (("calm", {}), ("killed", faults)):
        proc = torchrun(config, "--placement", "full", f"run.name={name}", *args, cwd=tmp, extra_env=extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run_dir = tmp / "runs" / name
        out.append(
            (
                [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
                load_file(run_dir / "policy" / "model.safetensors"),
            )
        )
    return out[0], out[1], (tmp / "kills.log").read_text().splitlines()


def test_every_phase_had_its_engine_killed(runs):
    kills = runs[2]
    assert sorted(line.split()[0] for line in kills) == sorted(KILLS), kills
    assert [line.split()[1] for line in kills if line.startswith("judge")] == ["genrm-j"]


def test_the_killed_run_equals_the_calm_one_but_for_restart_counters(runs):
    (calm, calm_policy), (killed, killed_policy), _ = runs
    assert [r["step"] for r in killed] == [r["step"] for r in calm] == [0, 1, 2, 3, 4]
    for a, b in zip(calm, killed):
        assert set(a) == set(b)
        for key in a:
            if key.startswith(VOLATILE) or key.endswith(
                ("/rerouted", "/respawned", "/duplicates_dropped", "/max_queue", "judged_per_busy_s")
            ):
                continue
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (a["step"], key, a[key], b[key])
    assert calm_policy.keys() == killed_policy.keys()
    assert max(float((calm_policy[k] - killed_policy[k]).abs().max()) for k in calm_policy) < 1e-6


def test_every_restart_is_counted(runs):
    calm, killed = runs[0][0], runs[1][0]
    assert sum(r.get("placement/engine_restarts", 0) for r in calm) == 0
    # each in the step it happened in (the evaluation's in the next step); generation's and judging's dead
    # engines are respawned by their pools, which count them too
    assert sum(r.get("placement/engine_restarts", 0) for r in killed) == len(KILLS)
    assert (
        sum(r.get("rollout/respawned", 0) for r in killed) >= 1
        and sum(r.get("genrm/j/respawned", 0) for r in killed) >= 1
    )
