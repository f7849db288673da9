"""vLLM behind the `RolloutEngine` interface, running in the current process.

Meant to run inside the engine child (`yatt.engines.server`), never inside a torchrun rank:
an in-process vLLM adopts torchrun's default process group, destroys it on shutdown, reseeds
the global RNG and pins torch's thread count. LoRA adapters (model.lora.sync=adapter) are served by vLLM's LoRA
layers (yatt.engines.vllm_lora).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.config import EngineConfig
from yatt.engines.vllm_lora import ServedAdapter, lora_options
from yatt.models.lora import split_adapter_updates

log = logging.getLogger(__name__)

GIB = 1 << 30
# vLLM warns about every module a partial reload does not touch; with per-layer buckets that is
# all other layers on every call, which buries real problems in the log.
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.model_executor.model_loader.reload.inplace",
)


@contextlib.contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _refresh_tied_lm_head(worker: Any) -> bool:
    """Re-derive the CPU lm_head kernel from the (just reloaded) tied input embedding.

    Runs inside the vLLM worker via ``collective_rpc``. On CPU, ``lm_head`` keeps a packed
    (oneDNN/sgl) copy of its weight made at load time; with tied embeddings the checkpoint has no
    ``lm_head.weight``, so ``reload_weights`` updates the shared embedding but leaves that packed
    copy stale: the model would read new embeddings and score with old ones.
    """
    w = getattr(worker, "worker", worker)
    model = w.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or getattr(lm_head, "weight", None) is not getattr(embed, "weight", 0):
        return False
    lm_head.quant_method.process_weights_after_loading(lm_head)
    return True


class VLLMEngine:
    """One `vllm.LLM` serving token-id prompts, with in-place weight reloads.

    Weight updates go through vLLM's ``reload_weights`` (the worker's checkpoint-format loader),
    because on CPU the model's parameters are repacked into kernel layouts and
    ``model.load_weights`` into them directly fails. vLLM reloads layer by layer: each call to
    `update_weights` must contain every tensor of a vLLM (fused) module it touches, e.g. all of
    q/k/v_proj of one attention block; `EngineClient` buckets per decoder layer for that reason.
    LoRA adapters in an update (yatt.models.lora's format) are not merged: they become the adapter every request
    added afterwards carries (`ServedAdapter`), for an engine started with ``cfg.max_lora_rank``.
    """

    def __init__(self, model_path: str, cfg: EngineConfig, seed: int) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        self.model_path = model_path
        self.cfg = cfg
        own = cfg.backend_config  # rollout.engine.vllm (yatt.engines.vllm_config.VLLMConfig)
        self.device = str(current_platform.device_type)
        self.sleep_supported = bool(current_platform.is_sleep_mode_available())
        kwargs: dict[str, Any] = dict(
            model=model_path,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            enforce_eager=own.enforce_eager,
            seed=seed,
            # log-probs of the distribution sampled from (after temperature and top-p), like the hf engine's;
            # the default raw_logprobs ignores the temperature the trainer divides by
            logprobs_mode="processed_logprobs",
        )
        if current_platform.is_cpu():
            # Explicit bytes (fractional GiB allowed); VLLM_CPU_KVCACHE_SPACE would override it.
            kwargs["kv_cache_memory_bytes"] = int(own.kv_cache_gib * GIB)
            # A prompt whose prefill is split over steps (chunked prefill: image prompts reach vLLM's per-step
            # token or encoder budget) has its sampled token discarded and its seeded generator rewound with
            # Generator.set_offset, which CPU generators do not have ("CPU Generator does not use offset"): the
            # engine died. Unsplit, a prompt waits for a step with room for all of it.
            kwargs["enable_chunked_prefill"] = False
        else:
            kwargs["gpu_memory_utilization"] = own.gpu_memory_utilization
        if self.sleep_supported:
            kwargs["enable_sleep_mode"] = True
        kwargs.update(lora_options(cfg.max_lora_rank))
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.eos_token_id: int | None = self.llm.get_tokenizer().eos_token_id
        self.multimodal = bool(self.llm.llm_engine.model_config.is_multimodal_model)
        self.startup_s = time.perf_counter() - t0
        self.sleeping = False
        self._want_logprobs: dict[str, bool] = {}
        self.adapter = ServedAdapter(self.llm.llm_engine, cfg.max_lora_rank)
        self.weight_updates = 0
        self.last_update_s = 0.0
        log.info("vLLM engine for %s ready on %s in %.1fs", model_path, self.device, self.startup_s)

    def _sampling_params(self, sampling: SamplingSpec, seed: int | None) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            logprobs=0 if sampling.logprobs else None,  # 0 = only the sampled token's logprob
            # 0 = each prompt token's own log-prob; vLLM computes them from the raw logits in every logprobs_mode
            prompt_logprobs=0 if sampling.prompt_logprobs else None,
            seed=seed,
            detokenize=False,  # the trainer works on token ids; text would only cost time
        )

    # ---- streaming: requests are added, the engine is stepped, finished groups come out -------
    def add_requests(
        self,
        request_ids: list[str],
        prompts: list[list[int]],
        sampling: SamplingSpec,
        seeds: list[int] | None,
        images: list[list[bytes] | None] | None = None,
    ) -> None:
        """Queue prompts without running them; `step` advances all queued requests together.

        A prompt's images (encoded bytes) go in as multi_modal_data; vLLM expands each placeholder token with
        the model's processor itself (ids that are already expanded would be expanded again)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from yatt.data.images import decode_image

        if self.sleeping:
            raise RuntimeError("engine is asleep; call wake() first")
        for i, (rid, prompt) in enumerate(zip(request_ids, prompts, strict=True)):
            params = self._sampling_params(sampling, None if seeds is None else int(seeds[i]))
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per prompt, all n samples
            request = TokensPrompt(prompt_token_ids=list(prompt))
            if images is not None and images[i]:
                request["multi_modal_data"] = {
                    "image": [decode_image(b, "image bytes", f"request {rid}") for b in images[i]]
                }
            self.llm.llm_engine.add_request(rid, request, params, lora_request=self.adapter.attach(rid))
        self._want_logprobs.update({rid: sampling.logprobs for rid in request_ids})

    def step(self) -> list[tuple[str, list[Completion]]]:
        """One engine iteration; returns the requests (all their samples) that finished in it."""
        finished = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                want = self._want_logprobs.pop(out.request_id, True)
                self.adapter.release(out.request_id)
                completions = [self._completion(o, want) for o in out.outputs]
                if out.prompt_logprobs is not None:
                    scored = self._prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs)
                    for c in completions:
                        c.prompt_logprobs = scored
                finished.append((out.request_id, completions))
        return finished

    def abort(self, request_ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(list(request_ids))
        for rid in request_ids:
            self._want_logprobs.pop(rid, None)
            self.adapter.release(rid)

    def preempt(self, request_ids: list[str]) -> None:
        pass  # a step is one iteration: `interrupt` runs right after it

    def interrupt(self, request_ids: list[str]) -> list[tuple[str, list[Completion]]]:
        """Each request's samples so far, read from vLLM's per-request output state (the tokens and
        log-probs it accumulates for the final output), then the requests are aborted."""
        processor, out = self.llm.llm_engine.output_processor, []
        for rid in request_ids:
            states = [processor.request_states.get(i) for i in processor.external_req_ids.get(rid, [])]
            states = [st for st in states if st is not None]
            if not states:
                continue
            want = self._want_logprobs.get(rid, True)
            n = states[0].parent_req.n if states[0].parent_req is not None else 1
            # samples that finished before the others wait in the parent's aggregator; the rest are running
            finished = states[0].parent_req.output_aggregator if states[0].parent_req is not None else []
            samples = [self._completion(o, want) if o is not None else None for o in finished] or [None] * n
            for st in states:
                tokens = [int(t) for t in st.detokenizer.output_token_ids]
                logprobs = st.logprobs_processor.logprobs or []
                lps = [float(pos[tok].logprob) for tok, pos in zip(tokens, logprobs)] if want else []
                samples[st.request_index] = Completion(tokens, lps, "interrupted")
            out.append((rid, [c if c is not None else Completion([], [], "interrupted") for c in samples]))
        self.abort([rid for rid, _ in out])
        return out

    def num_unfinished(self) -> int:
        return self.llm.llm_engine.get_num_unfinished_requests()

    @staticmethod
    def _completion(o: Any, want_logprobs: bool) -> Completion:
        token_ids = [int(t) for t in o.token_ids]
        logprobs: list[float] = []
        if want_logprobs:
            logprobs = [float(pos[tok].logprob) for tok, pos in zip(token_ids, o.logprobs)]
            if len(logprobs) != len(token_ids):
                raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=str(o.finish_reason))

    @staticmethod
    def _prompt_logprobs(prompt: list[int], scored: list[Any]) -> list[float]:
        """vLLM's per-position dicts (None for the first token, which nothing predicts) -> each token's log-prob."""
        out = [float(pos[tok].logprob) for tok, pos in zip(prompt[1:], scored[1:])]
        if len(out) != len(prompt) - 1:
            raise RuntimeError(f"vLLM returned {len(out)} prompt logprobs for {len(prompt)} prompt tokens")
        return out

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights (HF names, whole fused modules per call) into the running model; LoRA adapters among
        them become the served adapter."""
        if self.sleeping:
            raise RuntimeError("engine is asleep; call wake() first")
        if not named_tensors:
            return
        t0 = time.perf_counter()
        adapters, named_tensors = split_adapter_updates(named_tensors)
        if adapters:
            self.adapter.update(adapters)
        if named_tensors:
            self._reload(named_tensors)
        self.weight_updates += 1
        self.last_update_s = time.perf_counter() - t0

    def _reload(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        with _quiet_partial_reload():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})
        if self.device == "cpu" and any("embed_tokens" in name for name, _ in named_tensors):
            self.llm.collective_rpc(_refresh_tied_lm_head)
        # Cached KV blocks were computed with the old weights; without this, prompts sharing a
        # cached prefix would be continued from stale keys/values.
        self.llm.reset_prefix_cache()
        if self.multimodal:
            # Cached vision embeddings were computed with the old weights too; reloading weights leaves the
            # scheduler's encoder-cache bookkeeping out of step with the runner's storage ("Encoder cache
            # miss" on the next image prompt, measured): reset both, and the front end's processor cache.
            self.llm.llm_engine.reset_encoder_cache()
            self.llm.reset_mm_cache()

    def sleep(self) -> dict[str, Any]:
        """Offload weights and drop the KV cache (level 1) where vLLM supports sleep mode."""
        if not self.sleep_supported:
            return {"supported": False, "device": self.device, "freed_bytes": 0}
        if self.sleeping:
            return {"supported": True, "already": True, "freed_bytes": 0}
        before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        self.llm.sleep(level=1)
        self.sleeping = True
        after = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        return {"supported": True, "level": 1, "freed_bytes": int(after - before)}

    def wake(self) -> dict[str, Any]:
        if not self.sleep_supported:
            return {"supported": False, "device": self.device}
        if not self.sleeping:
            return {"supported": True, "already": True}
        self.llm.wake_up()
        self.llm.reset_prefix_cache()
        self.sleeping = False
        return {"supported": True}

    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "backend": "vllm",
            "model_path": self.model_path,
            "device": self.device,
            "pid": os.getpid(),
            "sleeping": self.sleeping,
            "sleep_supported": self.sleep_supported,
            "eos_token_id": self.eos_token_id,
            "weight_updates": self.weight_updates,
            "last_update_s": self.last_update_s,
            "startup_s": self.startup_s,
            "adapter": None if self.adapter.current is None else self.adapter.current.lora_name,
        }

    def shutdown(self) -> None:
        """Drop the LLM; the process exits right after, which frees everything else."""
        adapter, self.adapter = getattr(self, "adapter", None), None
        if adapter is not None:
            adapter.close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            del llm
