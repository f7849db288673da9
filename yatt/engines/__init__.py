"""Inference engines as services: each runs in a child process and is driven over ZMQ RPC.

`spawn_engine` starts one and returns an `EngineClient`; both it and the in-process
`VLLMEngine` (imported lazily, it pulls in vLLM) implement the `Engine` protocol.
"""

from yatt.engines.base import Completion, Engine, SamplingSpec
from yatt.engines.client import EngineClient, EngineDied, EngineStartError, spawn_engine
from yatt.engines.config import EngineConfig

__all__ = [
    "Completion",
    "Engine",
    "EngineClient",
    "EngineConfig",
    "EngineDied",
    "EngineStartError",
    "SamplingSpec",
    "spawn_engine",
]
