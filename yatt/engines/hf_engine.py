"""A transformers causal LM behind the `RolloutEngine` interface (``rollout.engine.backend: hf``).

The engine for machines without vLLM (e.g. a GPU box with only torch) and a reference to check vLLM
against: a plain KV-cache decode loop over ``AutoModelForCausalLM``, no custom kernels. Batches are
left-padded (attention mask + explicit position ids); each prompt is prefilled once and its cache
repeated for its ``n`` samples; finished rows are dropped from the batch (and its cache) as they stop.

Sample j of a request with seed s draws its uniforms from its own CPU ``torch.Generator`` seeded
``s + j`` (inverse-CDF sampling, one uniform per token), so a seed gives the same sample whatever
else is in the batch, on CPU or GPU, up to float noise in the logits; that noise depends on the batch, so a
batch holds the requests of one ``add_requests`` call only (which requests share one never depends on when
several clients' calls arrive). Log-probs (float32) are of the
distribution sampled from: softmax(logits / temperature), renormalised over the top-p nucleus when
top_p < 1 (like `VLLMEngine` with vLLM's processed_logprobs; the trainer divides by the temperature too but
does not truncate to the nucleus); at temperature 0 (greedy) they are of the raw logits.

`SamplingSpec.prompt_logprobs` (a teacher scoring a student's ids) keeps the prefill's logits at every position
and returns log p(prompt token | the tokens before it) of the raw logits with the completions.

A vision-language folder (yatt.models.vision) is served too: a prompt's images come as encoded bytes with
one placeholder token each, are expanded here with the folder's processor (the same expansion the trainer
uses), and go into the prefill as pixel tensors; a batch holds prompts with the same image layout only.

A mixture-of-experts folder records, when a request asks (`SamplingSpec.routed_experts`: routing replay r3),
the experts each MoE layer routed every prompt and generated token to (yatt.models.routing), returned per token
in `Completion.routed_experts`: the prefill's for the prompt (shared by its samples), each decode step's for the
token it fed.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from yatt.engines.base import Completion, SamplingSpec
from yatt.engines.config import EngineConfig
from yatt.models.lora import is_adapter_tensor, merge_adapter_updates
from yatt.models.routing import RoutingPatch, is_moe
from yatt.models.vision import ImageInputs, Pixels, is_vision_model, load_policy
from yatt.tensors import DTYPES

log = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt: list[int]
    sampling: SamplingSpec
    seed: int  # sample j uses seed + j
    pixels: Pixels | None = None  # the expanded prompt's image tensors (VL models)
    call: int = 0  # the add_requests call it came with: a batch holds one call's requests

    @property
    def layout(self) -> tuple:
        """Prompts batch together only with the same image tensors' shapes (none for text)."""
        return () if self.pixels is None else tuple((k, tuple(v.shape[1:])) for k, v in sorted(self.pixels.items()))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class HFEngine:
    """`RolloutEngine` on Hugging Face transformers; `step` runs one batch of queued requests to the end.

    A batch is the oldest queued request plus later ones with the same `SamplingSpec`, up to
    ``cfg.max_num_seqs`` sequences (a request with more samples than that runs alone).
    """

    def __init__(self, model_path: str, cfg: EngineConfig, seed: int) -> None:
        from yatt.models.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        torch.set_num_threads(cfg.threads)
        self.model_path, self.cfg = str(model_path), cfg
        self.dtype = DTYPES[cfg.dtype]
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.sleep_supported = self.device.type != "cpu"
        self.model = load_policy(self.model_path, dtype=self.dtype).to(self.device).eval()
        self.images = ImageInputs(self.model_path) if is_vision_model(self.model_path) else None
        # an MoE model's routers, hooked (inert outside RoutingPatch.active) to record routing when asked; its
        # load-balancing loss is training's: transformers would compute it on every decode step (and, with a
        # cache and an attention mask longer than the step's tokens, fail to)
        self.routing = RoutingPatch(self.model) if is_moe(self.model) else None
        if getattr(self.model.config, "output_router_logits", False):
            self.model.config.output_router_logits = False
        config = self.model.config
        config = getattr(config, "text_config", None) or config  # a VL model: its decoder's vocabulary and positions
        self.vocab_size = int(config.vocab_size)
        positions = getattr(config, "max_position_embeddings", None)
        if cfg.max_model_len and positions and cfg.max_model_len > positions:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's {positions} positions")
        self.max_model_len = int(cfg.max_model_len or positions or 1 << 31)
        try:
            self.eos_token_id: int | None = load_tokenizer(self.model_path).eos_token_id
        except (OSError, ValueError):  # a folder without tokenizer files
            self.eos_token_id = None
        gen_eos = _as_ids(getattr(self.model.generation_config, "eos_token_id", None))
        if self.eos_token_id is None:
            self.eos_token_id = (gen_eos or _as_ids(config.eos_token_id) or [None])[0]
        self.eos_ids = sorted({*gen_eos, *_as_ids(self.eos_token_id)})
        self.pad_id = int(getattr(config, "pad_token_id", None) or (self.eos_ids or [0])[0])
        self._queue: OrderedDict[str, _Request] = OrderedDict()
        # requests `preempt` asked to end early: replaced whole (never mutated), so another thread may set it
        # while a batch decodes and the decode loop reads it each token
        self._preempted: frozenset[str] = frozenset()
        self._rng = random.Random(seed)  # seeds of unseeded requests
        self._calls = 0  # add_requests calls so far
        self.sleeping = False
        self.weight_updates = 0
        self.last_update_s = 0.0
        self._lora_bases: dict[str, torch.Tensor] = {}  # base weights of the modules adapters are merged into
        self.startup_s = time.perf_counter() - t0
        log.info("hf engine for %s ready on %s (%s) in %.1fs", model_path, self.device, cfg.dtype, self.startup_s)

    # ---- requests ------------------------------------------------------------------------------
    def add_requests(
        self,
        request_ids: list[str],
        prompts: list[list[int]],
        sampling: SamplingSpec,
        seeds: list[int] | None,
        images: list[list[bytes] | None] | None = None,
    ) -> None:
        if self.sleeping:
            raise RuntimeError("engine is asleep; call wake() first")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts")
        if images is not None and any(images) and self.images is None:
            raise ValueError(f"{self.model_path} is not a vision-language model; it cannot take images")
        if len(request_ids) != len(prompts):
            raise ValueError(f"{len(request_ids)} request ids for {len(prompts)} prompts")
        if sampling.n < 1 or sampling.max_tokens < 1:
            raise ValueError(f"need n >= 1 and max_tokens >= 1, got {sampling}")
        reqs, self._calls = [], self._calls + 1
        for i, (rid, prompt) in enumerate(zip(request_ids, prompts)):
            prompt, pixels = [int(t) for t in prompt], None
            if images is not None and images[i]:
                prompt, pixels = self.images.encode(prompt, images[i], f"request {rid}")
            if not prompt:
                raise ValueError(f"request {rid}: empty prompt")
            if len(prompt) + sampling.max_tokens > self.max_model_len:
                raise ValueError(
                    f"request {rid}: prompt of {len(prompt)} tokens + max_tokens {sampling.max_tokens}"
                    f" exceeds max_model_len {self.max_model_len}"
                )
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(f"request {rid}: token ids must lie in [0, {self.vocab_size})")
            if rid in self._queue:
                raise ValueError(f"request id {rid} is already queued")
            seed = int(seeds[i]) if seeds is not None else self._rng.getrandbits(62)
            reqs.append((rid, _Request(prompt, sampling, seed, pixels, self._calls)))
        self._queue.update(reqs)  # all or nothing

    def num_unfinished(self) -> int:
        return len(self._queue)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._queue.pop(rid, None)

    def preempt(self, request_ids: list[str]) -> None:
        self._preempted = self._preempted | set(request_ids)

    def interrupt(self, request_ids: list[str]) -> list[tuple[str, list[Completion]]]:
        """Queued requests come back with nothing generated (a running batch ends in `step`, see preempt)."""
        self._preempted = self._preempted - set(request_ids)
        out = []
        for rid in request_ids:
            req = self._queue.pop(rid, None)
            if req is not None:
                out.append((rid, [Completion([], [], "interrupted") for _ in range(req.sampling.n)]))
        return out

    def step(self) -> list[tuple[str, list[Completion]]]:
        """Run the next batch of queued requests to completion; returns their groups."""
        if not self._queue:
            return []
        if self.sleeping:
            raise RuntimeError("engine is asleep; call wake() first")
        head = next(iter(self._queue.values()))
        batch, seqs = [], 0
        for rid, req in self._queue.items():
            if (
                # one call's requests only: the logits' float noise depends on the batch, so which requests
                # share one must not depend on when calls arrive (several clients share an engine), for a
                # run to reproduce itself and a resumed run the uninterrupted one
                req.call == head.call
                and req.sampling == head.sampling
                and req.layout == head.layout
                and (not batch or seqs + req.sampling.n <= self.cfg.max_num_seqs)
            ):
                batch.append((rid, req))
                seqs += req.sampling.n
        for rid, _ in batch:
            del self._queue[rid]
        pixels = (
            None if head.pixels is None else {k: torch.cat([req.pixels[k] for _, req in batch]) for k in head.pixels}
        )
        rids = [rid for rid, _ in batch]
        preempted = lambda: [rid in self._preempted for rid in rids] if self._preempted else None  # noqa: E731
        groups = self._run(
            [req.prompt for _, req in batch], [req.seed for _, req in batch], head.sampling, pixels, preempted
        )
        self._preempted = self._preempted - set(rids)
        return list(zip(rids, groups))

    # ---- the decode loop -----------------------------------------------------------------------
    @torch.no_grad()
    def _run(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        sp: SamplingSpec,
        pixels: Pixels | None = None,
        preempted: Callable[[], list[bool] | None] = lambda: None,
    ) -> list[list[Completion]]:
        """Decode a batch to its end. `preempted()`: per prompt, whether its samples must end now (None: none);
        checked before each token, such samples end "interrupted" with the tokens they have."""
        dev, n, T = self.device, sp.n, sp.max_tokens
        from transformers import DynamicCache

        # Prefill each prompt once, left-padded; positions count real tokens only.
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=self.model.config)
        images = {
            k: v.to(dev, dtype=self.dtype if v.is_floating_point() else v.dtype) for k, v in (pixels or {}).items()
        }  # the prefill alone sees the images
        record = self.routing if sp.routed_experts else None  # routing replay r3: the experts of every token
        with record.active() if record else nullcontext():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if sp.prompt_logprobs else 1,  # 0: every position's, to score the prompt
                **images,
            )
            prompt_routes = (
                [r[width - len(p) :].flatten(1).tolist() for r, p in zip(self._routes(len(prompts)), prompts)]
                if record
                else None
            )
        scored = self._prompt_logprobs(out.logits, ids, [len(p) for p in prompts]) if sp.prompt_logprobs else None
        logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)  # rows: prompt-major, sample-minor
        cache.batch_repeat_interleave(n)
        mask = mask.repeat_interleave(n, dim=0)
        pos = torch.tensor([len(p) for p in prompts], device=dev).repeat_interleave(n)
        if sp.temperature > 0:  # one uniform per (sample, token), from the sample's own generator
            gens = [torch.Generator().manual_seed(s + j) for s in seeds for j in range(n)]
            uniforms = torch.stack([torch.rand(T, generator=g) for g in gens]).to(dev)
        stops = torch.tensor(sorted({*self.eos_ids, *sp.stop_token_ids}), dtype=torch.long, device=dev)
        B = len(prompts) * n
        tokens = torch.full((B, T), self.pad_id, dtype=torch.long, device=dev)
        logps = torch.zeros((B, T), dtype=torch.float32, device=dev)
        routes = torch.full((B, T, self.routing.layers * self.routing.top_k), -1) if record else None
        length = torch.full((B,), T, dtype=torch.long, device=dev)
        stopped = torch.zeros(B, dtype=torch.bool, device=dev)
        cut = torch.zeros(B, dtype=torch.bool, device=dev)  # preempted: "interrupted"
        rows = torch.arange(B, device=dev)  # original row of each live batch row
        for t in range(T):
            if (which := preempted()) is not None:
                ended = torch.tensor(which, device=dev).repeat_interleave(n)[rows]
                if ended.any():
                    length[rows[ended]], cut[rows[ended]] = t, True
                    live = (~ended).nonzero()[:, 0]
                    if live.numel() == 0:
                        break
                    rows, logits, mask, pos = rows[live], logits[live], mask[live], pos[live]
                    cache.batch_select_indices(live)
            tok = self._pick(logits, sp, uniforms[rows, t] if sp.temperature > 0 else None)
            tokens[rows, t] = tok
            if sp.logprobs:
                logps[rows, t] = self._logprob(logits, tok, sp)
            hit = torch.isin(tok, stops)
            if hit.any():
                length[rows[hit]], stopped[rows[hit]] = t + 1, True
                live = (~hit).nonzero()[:, 0]
                if live.numel() == 0:
                    break
                rows, tok, mask, pos = rows[live], tok[live], mask[live], pos[live]
                cache.batch_select_indices(live)
            if t == T - 1:
                break
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            with record.active() if record else nullcontext():
                out = self.model(
                    input_ids=tok[:, None],
                    attention_mask=mask,
                    position_ids=pos[:, None],
                    past_key_values=cache,
                    use_cache=True,
                )
                if record:  # the routing of the token fed at this step: response token t
                    routes[rows.cpu(), t] = self._routes(len(rows))[:, 0].flatten(1).cpu()
            logits, pos = out.logits[:, -1].float(), pos + 1
        del cache
        tokens, logps, length = tokens.tolist(), logps.tolist(), length.tolist()
        reasons = ["interrupted" if c else "stop" if s else "length" for c, s in zip(cut.tolist(), stopped.tolist())]
        done = [
            Completion(tokens[r][: length[r]], logps[r][: length[r]] if sp.logprobs else [], reasons[r])
            for r in range(B)
        ]
        if scored:
            for r, c in enumerate(done):
                c.prompt_logprobs = scored[r // n]
        if record:
            for r, c in enumerate(done):
                c.routed_experts = prompt_routes[r // n] + routes[r, : length[r]].tolist()
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, lengths: list[int]) -> list[list[float]]:
        """Per left-padded prompt, log p(token i | tokens before) for its tokens 1.. from the prefill's logits
        (raw: no temperature), as gather - logsumexp so no [B, L, vocab] log-softmax is kept."""
        width, logits = ids.shape[1], logits[:, :-1].float()
        scores = logits.gather(2, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, dim=-1)
        return [scores[i, width - length :].tolist() for i, length in enumerate(lengths)]

    def _routes(self, rows: int) -> torch.Tensor:
        """The last forward's routing as [rows, tokens per row, layers, k]."""
        routing = self.routing.routing()
        return routing.view(rows, -1, *routing.shape[1:])

    @staticmethod
    def _logprob(logits: torch.Tensor, tok: torch.Tensor, sp: SamplingSpec) -> torch.Tensor:
        """log-prob of `tok` under the distribution `_pick` sampled it from (vLLM's processed_logprobs)."""
        scaled = logits / sp.temperature if sp.temperature > 0 else logits
        logp = scaled.gather(1, tok[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
        if sp.temperature > 0 and sp.top_p < 1.0:  # renormalise over the nucleus: minus log of its mass
            probs = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True).values
            logp = logp - torch.log(probs.masked_fill(probs.cumsum(dim=-1) - probs > sp.top_p, 0.0).sum(dim=-1))
        return logp

    @staticmethod
    def _pick(logits: torch.Tensor, sp: SamplingSpec, u: torch.Tensor | None) -> torch.Tensor:
        """Greedy at temperature 0; else inverse-CDF sampling of softmax(logits / T), top-p filtered."""
        if u is None:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / sp.temperature, dim=-1)
        order = None
        if sp.top_p < 1.0:  # keep the smallest prefix of the sorted distribution reaching top_p
            probs, order = probs.sort(dim=-1, descending=True)
            probs = probs.masked_fill(probs.cumsum(dim=-1) - probs > sp.top_p, 0.0)
        cdf = probs.cumsum(dim=-1)
        idx = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).clamp(max=probs.shape[-1] - 1)
        ok = probs.gather(1, idx) > 0  # rounding at the top end could land on a zero-probability token
        idx = torch.where(ok, idx, probs.argmax(dim=-1, keepdim=True))
        return (idx if order is None else order.gather(1, idx))[:, 0]

    # ---- weights and memory --------------------------------------------------------------------
    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the parameters of the same Hugging Face name; all are checked before any copy.

        LoRA adapters (model.lora.sync=adapter, yatt.models.lora's format) are merged here into the base weights
        as the model folder gave them: the first adapter of a module keeps a copy of its base weight."""
        if self.sleeping:
            raise RuntimeError("engine is asleep; call wake() first")
        t0 = time.perf_counter()
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names resolve both ways
        if any(is_adapter_tensor(name) for name, _ in named_tensors):
            named_tensors = merge_adapter_updates(named_tensors, lambda name: self._lora_base(params, name))
        for name, tensor in named_tensors:
            if name not in params:
                raise ValueError(f"update_weights: unknown parameter {name!r}; nothing was updated")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is "
                    f"{tuple(params[name].shape)}; nothing was updated"
                )
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor.to(device=self.device, dtype=params[name].dtype))
        self.weight_updates += 1
        self.last_update_s = time.perf_counter() - t0

    def _lora_base(self, params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        """The base weight an adapter of `name` merges into: a copy taken before its first adapter was merged."""
        if name not in self._lora_bases:
            if name not in params:
                raise ValueError(f"update_weights: adapter for unknown parameter {name!r}; nothing was updated")
            self._lora_bases[name] = params[name].detach().clone()
        return self._lora_bases[name]

    def sleep(self) -> dict[str, Any]:
        """On an accelerator, move the weights to host and release cached memory; a no-op on CPU. Refused with
        requests queued on every device, so that a role switch under another rank's requests fails CPU tests too."""
        if self._queue:
            raise RuntimeError(f"{len(self._queue)} requests are queued; finish or abort them before sleep()")
        if not self.sleep_supported:
            return {"supported": False, "device": self.device.type, "freed_bytes": 0}
        if self.sleeping:
            return {"supported": True, "already": True, "freed_bytes": 0}
        torch.cuda.synchronize()
        before = torch.cuda.mem_get_info()[0]
        self.model.to("cpu")
        self._lora_bases = {k: v.to("cpu") for k, v in self._lora_bases.items()}
        torch.cuda.empty_cache()
        self.sleeping = True
        return {"supported": True, "freed_bytes": int(torch.cuda.mem_get_info()[0] - before)}

    def wake(self) -> dict[str, Any]:
        if not self.sleep_supported:
            return {"supported": False, "device": self.device.type}
        if not self.sleeping:
            return {"supported": True, "already": True}
        self.model.to(self.device)
        self._lora_bases = {k: v.to(self.device) for k, v in self._lora_bases.items()}
        self.sleeping = False
        return {"supported": True}

    def health(self) -> dict[str, Any]:
        return {
            "ok": self.model is not None,
            "backend": "hf",
            "model_path": self.model_path,
            "device": self.device.type,
            "pid": os.getpid(),
            "sleeping": self.sleeping,
            "sleep_supported": self.sleep_supported,
            "eos_token_id": self.eos_token_id,
            "weight_updates": self.weight_updates,
            "last_update_s": self.last_update_s,
            "startup_s": self.startup_s,
            "dtype": self.cfg.dtype,
        }

    def shutdown(self) -> None:
        self.model, self._queue = None, OrderedDict()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
