"""The engine interface the trainer programs against, independent of the inference backend."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class SamplingSpec:
    """Backend-neutral sampling settings for one generate call.

    The model's eos token always stops generation; ``stop_token_ids`` adds more stop tokens.
    Whatever token stopped generation is part of the completion (the trainer learns to emit it).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Completion:
    """One sampled continuation.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the engine's current weights,
    computed from the raw logits (before temperature/top-p), i.e. comparable to the trainer's
    ``log_softmax(logits)``. Empty when logprobs were not requested.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (eos or a stop token, included in token_ids) | "length"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Completion:
        return cls(token_ids=list(d["token_ids"]), logprobs=list(d["logprobs"]), finish_reason=str(d["finish_reason"]))


@runtime_checkable
class Engine(Protocol):
    """An inference engine; `VLLMEngine` runs in-process, `EngineClient` talks to a child process."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingSpec, seeds: list[int] | None = None
    ) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt; ``seeds`` (one per prompt) make sampling reproducible.

        vLLM samples completion j of a prompt with ``seed + j``: space the per-prompt seeds at
        least ``n`` apart (e.g. ``base + i * n``) or neighbouring prompts share random streams.
        """
        ...

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load new weights given by Hugging Face parameter names (any subset of the model)."""
        ...

    def sleep(self) -> dict[str, Any]:
        """Free device memory (weights + KV cache) where supported; says what was done."""
        ...

    def wake(self) -> dict[str, Any]:
        """Undo `sleep`; the engine must be awake to generate or update weights."""
        ...

    def health(self) -> dict[str, Any]:
        """``{"ok": True, "backend": ..., ...}`` when the engine is able to serve."""
        ...

    def shutdown(self) -> None:
        """Release all resources; the engine cannot be used afterwards."""
        ...
