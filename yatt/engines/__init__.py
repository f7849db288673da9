"""Inference engines as services: each runs in a child process and is driven over ZMQ RPC.

`ENGINES` names the backends (`rollout.engine.backend`); each implements `RolloutEngine` and is served by
`yatt.engines.server.EngineService` in its own process. Controllers reach engines through `EngineClient`
(`spawn_engine`, `connect_engine`) and route among several with `EnginePool`.

An entry may own a section beside `backend` and declare hooks (`yatt.backends`): `preflight(engine:
EngineConfig)` raises ValueError for what the config alone cannot tell, `env(section)` gives the engine
process's environment variables (None: removed), `adapters` says whether its `update_weights` takes LoRA
adapters (yatt.models.lora): hf merges them, vllm serves them with its LoRA layers. A plug-in by import path is
imported by that path in the engine process too, found where the parent found it (`yatt.engines.client.engine_env`).
"""

from yatt.backends import Backend
from yatt.registry import Registry

ENGINES: Registry = Registry(
    "rollout.engine.backend",
    {
        "vllm": "yatt.engines.vllm_config:VLLM",
        "hf": Backend("yatt.engines.hf_engine:HFEngine", adapters=True, routing_replay=True),
    },
)
