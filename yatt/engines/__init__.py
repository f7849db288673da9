"""Inference engines as services: each runs in a child process and is driven over ZMQ RPC.

`ENGINES` names the backends (`rollout.engine.backend`); each implements `RolloutEngine` and is served by
`yatt.engines.server.EngineService` in its own process. Controllers reach engines through `EngineClient`
(`spawn_engine`, `connect_engine`) and route among several with `EnginePool`.
"""

from yatt.registry import Registry

ENGINES: Registry = Registry("rollout.engine.backend", {
    "vllm": "yatt.engines.vllm_engine:VLLMEngine",
    "hf": "yatt.engines.hf_engine:HFEngine",
})
