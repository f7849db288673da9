"""What every inference backend implements (`RolloutEngine`) and the backend-neutral types it speaks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

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
    # a mixture-of-experts model: return the experts each prompt and response token was routed to
    # (Completion.routed_experts; routing replay r3), where the backend declares routing_replay (yatt.backends)
    routed_experts: bool = False
    # also score the prompt: Completion.prompt_logprobs, the log-prob of every prompt token after the first given
    # the tokens before it, of the raw logits (temperature 1, no top-p), whatever the sampling settings. A teacher
    # (on-policy distillation) asks for this with max_tokens=1 to score a student's prompt + response ids.
    prompt_logprobs: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Completion:
    """One sampled continuation.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the engine's current weights, in
    the distribution it was sampled from: softmax(logits / temperature), renormalised over the top-p
    nucleus (vLLM's processed_logprobs), i.e. comparable to the trainer's log-probs at the same
    temperature when top_p = 1 (the raw logits at temperature 0). Empty when logprobs were not requested.
    """

    token_ids: list[int]
    logprobs: list[float]
    # "stop" (eos or a stop token, included in token_ids) | "length" | "interrupted" (`RolloutEngine.interrupt`
    # ended it early: token_ids are what it had generated)
    finish_reason: str
    # the weights version each token was sampled with, when a pool resumed an interrupted sample on newer
    # weights (yatt.engines.resume); engines leave it empty
    versions: list[int] = field(default_factory=list)
    # SamplingSpec.routed_experts on an MoE model: per prompt token then per response token, the experts each MoE
    # layer routed it to (layers x k ints, layer-major); the last response token, never fed back, has -1s
    routed_experts: list[list[int]] = field(default_factory=list)
    # SamplingSpec.prompt_logprobs: log p(prompt[i] | prompt[:i]) for i = 1 .. len(prompt) - 1 (float32, raw
    # logits); the same list in every sample of the request; empty when not asked
    prompt_logprobs: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Completion:
        return cls(
            token_ids=list(d["token_ids"]),
            logprobs=list(d["logprobs"]),
            finish_reason=str(d["finish_reason"]),
            versions=list(d.get("versions", [])),
            routed_experts=[list(t) for t in d.get("routed_experts", [])],
            prompt_logprobs=[float(x) for x in d.get("prompt_logprobs", [])],
        )


class RolloutEngine(Protocol):
    """An inference backend as the engine service drives it (`yatt.engines.server.EngineService`).

    One instance lives in an engine process and is only ever called from the service's stepping thread.
    Generation is streamed: `add_requests` queues prompts, each `step` advances every queued request by
    one engine iteration and returns the requests whose ``n`` samples all finished. Backends are
    registered in `yatt.engines.ENGINES` under the name `rollout.engine.backend` selects; each is built
    as ``Backend(model_path, cfg: EngineConfig, seed)``.
    """

    def add_requests(
        self,
        request_ids: list[str],
        prompts: list[list[int]],
        sampling: SamplingSpec,
        seeds: list[int] | None,
        images: list[list[bytes] | None] | None = None,
    ) -> None:
        """Queue one request per prompt (``sampling.n`` samples each). With a seed, sample j of a request
        uses ``seed + j``, so the same seed gives the same samples; space per-prompt seeds >= n apart.
        ``images`` (vision-language models): per prompt, the encoded bytes of its images, one per image
        placeholder token in the prompt, which the backend expands with the model's processor; the
        completions are of the expanded prompt. Raising refuses them: the engine service has already answered
        the submit, so it reports the error at the submitting client's next poll."""
        ...

    def step(self) -> list[tuple[str, list[Completion]]]:
        """One engine iteration; the requests (all their samples, in sample order) that finished in it."""
        ...

    def num_unfinished(self) -> int:
        """Requests queued or running."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests (unknown or finished ids are ignored)."""
        ...

    def preempt(self, request_ids: list[str]) -> None:
        """Called from any thread while `step` may be running: a `step` that runs many iterations (the hf
        engine runs a batch to its end) ends these requests' samples at their next token, as "interrupted"
        completions it returns. A backend whose `step` is one iteration does nothing."""
        ...

    def interrupt(self, request_ids: list[str]) -> list[tuple[str, list[Completion]]]:
        """End these requests now (unknown or finished ids are ignored): each one's samples as generated so
        far, finish_reason "interrupted" (a sample that already finished keeps its own), and forget them. For
        a pool that resumes them on new weights (yatt.engines.resume)."""
        ...

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load new weights given by Hugging Face parameter names, in place (any subset of the model,
        whole decoder layers per call)."""
        ...

    def sleep(self) -> dict[str, Any]:
        """Free accelerator memory (weights + KV cache) where the backend can; says what was done."""
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


def generate(
    engine: RolloutEngine,
    prompts: list[list[int]],
    sampling: SamplingSpec,
    seeds: list[int] | None = None,
    images: list[list[bytes] | None] | None = None,
) -> list[list[Completion]]:
    """Drive an in-process engine until every prompt's group is back (tests, benchmarks, tools)."""
    ids = [f"g{i}" for i in range(len(prompts))]
    engine.add_requests(ids, prompts, sampling, seeds, **({"images": images} if images is not None else {}))
    done: dict[str, list[Completion]] = {}
    while len(done) < len(ids):
        done.update(engine.step())
    return [done[i] for i in ids]
