"""Fault injection for tests/test_engine_kill_e2e.py (not a test).

Python imports `sitecustomize` at start-up from the path, so a run whose PYTHONPATH begins with this folder
loads it in every process. In rank 0 only (engine processes are spawned without torchrun's RANK) it wraps
the seams the controller calls and SIGKILLs one of the rank's own engines at each phase listed in
YATT_TEST_KILL, e.g. "generate@1,judge@2,train@2,sync@3,eval@2" (phase@step, each once):

- generate / judge: right after the step's rollout / judge requests were submitted to the engine (the step
  whose batch is being made: with rollout.schedule ahead of the trainer, a producer thread makes it earlier);
- train: when the policy update starts (the shard's `policy_update`), while the rollout engine sleeps (it is
  found dead at the next wake);
- sync: when the weight push starts (the engine dies under the update);
- eval: just before the held-out evaluation that follows step N.

Each kill is logged to YATT_TEST_KILL_LOG, so the test can check that every one happened.

YATT_TEST_HOLD="rank@step:path" (tests/test_multinode_e2e.py) stops that rank at the start of that step: it
creates `path` and sleeps until it is killed, so the test kills a node at a known point, mid-run, while the other
node goes on into the step and waits on it.
"""

import os
import signal

_HOLD = os.environ.get("YATT_TEST_HOLD", "")

if _HOLD and os.environ.get("RANK") == _HOLD.split("@")[0]:
    import time

    from yatt.controllers.shard import ControllerShard

    _hold_step, _hold_path = _HOLD.split("@", 1)[1].split(":", 1)
    _step = ControllerShard.step

    def held_step(self, n):
        if n == int(_hold_step):
            open(_hold_path, "w").close()
            while True:
                time.sleep(60)
        return _step(self, n)

    ControllerShard.step = held_step

_SPEC = os.environ.get("YATT_TEST_KILL", "")

if _SPEC and os.environ.get("RANK") == "0":
    from yatt.controllers import shard as shard_module
    from yatt.controllers.shard import ControllerShard
    from yatt.engines.pool import EnginePool
    from yatt.placement.engine_lifecycle import ROLLOUT, EngineServices

    pending = {tuple((p.split("@")[0], int(p.split("@")[1]))) for p in _SPEC.split(",")}
    state = {"step": 0, "services": None, "evaluating": False, "producing": 0}

    def kill(phase: str, role_prefix: str, at: int | None = None) -> None:
        at = state["step"] if at is None else at
        if (phase, at) not in pending:
            return
        pending.discard((phase, at))
        services = state["services"]
        role = next(r for r in services.local if r.startswith(role_prefix))
        os.kill(services.local[role].pid, signal.SIGKILL)
        with open(os.environ["YATT_TEST_KILL_LOG"], "a") as log:
            log.write(f"{phase}@{at} {role}\n")

    step, evaluate, produce = ControllerShard.step, ControllerShard.evaluate, ControllerShard.produce

    def traced_produce(self, n, timer):
        state["producing"], state["services"] = n, self.engines
        return produce(self, n, timer)

    def traced_step(self, n):
        state["step"], state["services"] = n, self.engines
        return step(self, n)

    def traced_evaluate(self):
        state["step"], state["services"] = self.progress.step, self.engines
        kill("eval", ROLLOUT)
        state["evaluating"] = True
        try:
            return evaluate(self)
        finally:
            state["evaluating"] = False

    submit = EnginePool.submit

    def traced_submit(self, requests):
        submit(self, requests)
        if state["services"] is not None and not state["evaluating"]:
            judging = any(name.startswith("genrm-") for name in self.engines)
            at = state["producing"]
            kill("judge", "genrm-", at) if judging else kill("generate", ROLLOUT, at)

    update, push_weights = shard_module.policy_update, EngineServices.push_weights

    def traced_update(*args, **kwargs):
        kill("train", ROLLOUT)
        return update(*args, **kwargs)

    def traced_push_weights(self, buckets, versions=None):
        kill("sync", ROLLOUT)
        return push_weights(self, buckets, versions)

    ControllerShard.step, ControllerShard.evaluate = traced_step, traced_evaluate
    ControllerShard.produce = traced_produce
    shard_module.policy_update = traced_update
    EnginePool.submit, EngineServices.push_weights = traced_submit, traced_push_weights
