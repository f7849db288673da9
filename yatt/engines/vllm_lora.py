"""LoRA adapters served by vLLM's own LoRA layers: `model.lora.sync: adapter` on a vLLM engine (docs/lora.md).

Read `ServedAdapter`. A weight sync that carries adapters (yatt.models.lora's wire format: per module A, B and
scaling) becomes an adapter vLLM serves, not merged weights: vLLM applies ``x A^T B^T * scaling`` beside the base
weights, which stay as the model folder gave them. vLLM 0.32 takes an adapter only as a peft folder on disk, named by
a `LoRARequest` (its LoRA code has no in-memory path), so each sync is written as peft's adapter folder
(adapter_config.json, adapter_model.safetensors) into a temporary folder the engine owns, loaded into vLLM at once
(a bad adapter fails the update, not a later generation step) and made the current `LoRARequest`, which every
request added after it carries. Each sync gets a new id: vLLM caches adapters by id.

An older adapter stays on disk while a request in flight carries it (vLLM reloads an adapter it evicted from its
folder), and is dropped at a later sync; every folder goes at shutdown. The engine starts vLLM with `enable_lora`
and a `max_lora_rank` that fits `EngineConfig.max_lora_rank` (`lora_options`), which an experiment sets to
model.lora.rank: vLLM sizes its LoRA buffers at startup.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, get_args

from safetensors.torch import save_file

from yatt.models.lora import AdapterUpdate

log = logging.getLogger(__name__)
PEFT_PREFIX = "base_model.model."  # where peft's adapter files keep the Hugging Face model's names


def lora_options(max_rank: int | None) -> dict[str, Any]:
    """vLLM's LoRA arguments for adapters of rank <= `max_rank` (None: no LoRA): its max_lora_rank is one of a few
    sizes, so the smallest that fits; one adapter at a time (the current sync's)."""
    if not max_rank:
        return {}
    from vllm.config.lora import MaxLoRARanks

    sizes = sorted(get_args(MaxLoRARanks))
    fits = [size for size in sizes if size >= max_rank]
    if not fits:
        raise ValueError(
            f"max_lora_rank={max_rank}: vLLM serves LoRA adapters of rank <= {sizes[-1]}; use model.lora.sync=merged"
        )
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


class ServedAdapter:
    """The adapter a vLLM engine serves: the latest A, B and scaling of every adapted module and the `LoRARequest`
    of the latest sync (None before the first: requests run on the base weights). `engine` is vLLM's LLMEngine."""

    def __init__(self, engine: Any, max_rank: int | None) -> None:
        self.engine, self.max_rank = engine, max_rank
        self.modules: dict[str, AdapterUpdate] = {}  # a bucketed sync updates some modules per call
        self.current: Any = None  # vllm.lora.request.LoRARequest
        self.older: list[Any] = []  # earlier syncs' requests, kept while a request in flight carries them
        self.carried: dict[str, int] = {}  # request id -> the adapter id it carries
        self.root: Path | None = None  # made at the first sync
        self.syncs = 0

    def attach(self, request_id: str) -> Any:
        """The `LoRARequest` a request added now carries (None: no adapter yet)."""
        if self.current is not None:
            self.carried[request_id] = self.current.lora_int_id
        return self.current

    def release(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self.carried.pop(request_id, None)

    def update(self, adapters: dict[str, AdapterUpdate]) -> None:
        """Serve `adapters` (with the modules earlier calls gave) from now on, as a new adapter."""
        from vllm.lora.request import LoRARequest

        if not self.max_rank:
            raise ValueError(
                "update_weights: LoRA adapters for a vLLM engine started without max_lora_rank (an experiment sets "
                "it with model.lora.sync=adapter); nothing was updated"
            )
        # copies: a weight transport's tensors are only valid during the update (shm maps them from a segment the
        # next sync overwrites), and the modules kept here are written again with every later bucket's
        fresh = {m: AdapterUpdate(u.lora_a.clone(), u.lora_b.clone(), u.scaling) for m, u in adapters.items()}
        modules = {**self.modules, **fresh}
        ranks = {u.rank for u in modules.values()}
        scalings = {u.scaling for u in modules.values()}
        if len(ranks) > 1 or len(scalings) > 1:  # peft's adapter_config holds one r and one lora_alpha
            raise ValueError(f"update_weights: adapters of ranks {sorted(ranks)} and scalings {sorted(scalings)}")
        (rank,), (scaling,) = ranks, scalings
        if rank > self.max_rank:
            raise ValueError(f"update_weights: adapters of rank {rank} exceed the engine's max_lora_rank")
        self.syncs += 1
        folder = self._write(modules, rank, scaling, f"sync-{self.syncs}")
        request = LoRARequest(f"yatt-sync-{self.syncs}", self.syncs, str(folder))
        self.engine.add_lora(request)  # loaded now: a bad adapter fails this update
        log.info("serving LoRA adapter %s: %d modules of rank %d", request.lora_name, len(modules), rank)
        self.modules = modules
        self.older += [self.current] if self.current is not None else []
        self.current = request
        self._drop_unused()

    def _write(self, modules: dict[str, AdapterUpdate], rank: int, scaling: float, name: str) -> Path:
        """peft's adapter folder of `modules` (what `PeftModel.from_pretrained` and vLLM load)."""
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="yatt-vllm-lora-"))
        folder = self.root / name
        folder.mkdir()
        tensors = {}
        for module, u in modules.items():
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = u.lora_a.contiguous()
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = u.lora_b.contiguous()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": scaling * rank,  # peft's (and vLLM's) scaling is lora_alpha / r
            "target_modules": sorted({module.rpartition(".")[2] for module in modules}),
            "bias": "none",
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return folder

    def _drop_unused(self) -> None:
        carried, kept = set(self.carried.values()), []
        for request in self.older:
            if request.lora_int_id in carried:
                kept.append(request)
            else:
                self.engine.remove_lora(request.lora_int_id)
                shutil.rmtree(request.lora_path, ignore_errors=True)
        self.older = kept

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
