"""The `torch` training backend: a Hugging Face causal LM (or, head="value", a value model), DDP or FSDP2 across
ranks, AdamW, micro-batches.

Implements `yatt.trainers.base.Trainer`. With DDP every rank holds the whole model and optimizer state (DDP keeps
them identical), so checkpoints store them once and weights go to engines from the local copy; with FSDP2
(trainer.torch.parallel, yatt.trainers.sharding) each rank holds a shard, checkpoints its own, and weights leave
gathered one at a time.

A vision-language policy (yatt.models.vision) packs like a text one: its micro-batches carry each distinct
image prompt's pixels once (TokenBatch.pixels, .image_index), the vision tower encodes each of them once per
micro-batch, and each row's image slots take their prompt's features (yatt.trainers.scoring.ImageSlots); with
shared prompts a group's prompt, image tokens included, goes through the decoder once. The packed attention is
the decoder's only; the vision tower trains unless `freeze_vision`.

A mixture-of-experts policy (yatt.trainers.moe) replays a batch's `routing` where it is set, leaves the routing
of a log-prob pass in `batch.routing` (routing replay R2 replays it in the update), adds the router's
load-balancing loss (trainer.torch.router_aux_loss_coef), reports the experts' load per mini-batch, and counts
the tokens whose router chose other experts than the engine (a batch's `engine_routing`; `routing_counts`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoConfig, AutoModelForTokenClassification

from yatt.balance.micro_batches import micro_batch_rows
from yatt.checkpoint.export import ADAPTER_DIR, write_config, write_weights
from yatt.distributed import World
from yatt.models.lora_config import LoRAConfig
from yatt.models.routing import is_moe
from yatt.models.vision import is_vision_model, load_policy, vision_parameter
from yatt.tensors import DTYPES, LossFn, NamedTensors, TokenBatch, WeightVersions, weight_buckets
from yatt.trainers.base import Trainer
from yatt.trainers.config import TrainerConfig
from yatt.trainers.lora import Adapters
from yatt.trainers.moe import ROUTING_COUNTS, MoE, keep_routing
from yatt.trainers.packing import ModelInputs, attention_implementation, model_inputs, shared_prompts
from yatt.trainers.scoring import TokenScorer, ValueScorer, image_slots
from yatt.trainers.sharding import full, fully_shard_model, like, local
from yatt.trainers.torch_config import TorchConfig
from yatt.trainers.weights import HOLDS, FullWeights, WeightChanges, Weights

HEADS = ("lm", "value")


def load_module(model_path: str | Path, head: str, dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
    """The Hugging Face model of a head: the causal LM, or for "value" the same folder's decoder with a one-label
    token-classification head (new, transformers' initialisation, unless the folder is such a model already).
    The head's dropout is off: values computed before the update must be the update's own at its first step."""
    if head not in HEADS:
        raise ValueError(f"unknown trainer head {head!r}; one of: {', '.join(HEADS)}")
    if head == "lm":
        return load_policy(model_path, dtype=dtype, **kwargs)
    if is_vision_model(model_path):
        raise ValueError(f"{model_path}: a value model of a vision-language policy is not supported")
    config = AutoConfig.from_pretrained(str(model_path), num_labels=1)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(str(model_path), config=config, dtype=dtype, **kwargs)


def freeze_vision_tower(module: torch.nn.Module) -> set[str]:
    """model.freeze_vision: the vision tower's parameters stop training; their names."""
    frozen = set()
    for name, p in module.named_parameters():
        if vision_parameter(name):
            p.requires_grad_(False)
            frozen.add(name)
    return frozen


def lr_factor(step: int, cfg: TrainerConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warm-up, then constant or cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TorchTrainer:
    """Owns one model (trainable with an optimizer, or frozen as a reference) on this rank's device.

    trainer.dtype is the dtype of the weights, gradients and optimizer state (bfloat16 halves memory; the
    log-probs and the loss are still computed in float32 from the logits). Forward passes go through a
    `TokenScorer` (yatt.trainers.scoring): packed sequences (yatt.trainers.packing) in, one log-prob per
    response token out; with head="value" through a `ValueScorer`, one value per response token out.
    """

    replicated = True  # DDP; an fsdp2 instance sets its own (False)
    reshard_refusal = None  # DDP's state is whole on every rank; fsdp2's DTensor rows are cut again on resume
    # its own section, trainer.torch; a subclass plugged in by import path inherits it (or declares its own)
    section, config = "torch", TorchConfig

    def __init__(
        self,
        model_path: str | Path,
        cfg: TrainerConfig,
        world: World,
        trainable: bool = True,
        total_steps: int = 1,
        head: str = "lm",
        freeze_vision: bool = False,
        lora: LoRAConfig | None = None,
    ):
        self.cfg, self.world, self.trainable, self.head = cfg, world, trainable, head
        # trainer.torch (a subclass with a section of its own runs with the torch defaults)
        own = cfg.backend_config if isinstance(cfg.backend_config, TorchConfig) else TorchConfig()
        self.autocast = own.autocast == "bfloat16"
        self.vision = is_vision_model(model_path)
        self.packed = cfg.pack_sequences
        self.share_prompts = self.packed and cfg.share_prompts
        extra = (
            {"attn_implementation": attention_implementation(world.device, self.share_prompts, self.vision)}
            if self.packed
            else {}
        )
        # the model chain: load -> freeze -> weights (all, or LoRA's) -> checkpointing -> ddp or fsdp2 -> optimizer
        self.module = load_module(model_path, head, DTYPES[cfg.dtype], **extra).to(world.device)
        self.frozen = freeze_vision_tower(self.module) if self.vision and freeze_vision else set()
        self.weights = self._weights(lora if trainable else None)
        self.scorer = TokenScorer(self.module, own.logprob_chunk_tokens) if head == "lm" else ValueScorer(self.module)
        # an MoE policy: routing replay, its load-balancing loss and load (hooks on its routers, before sharding)
        self.moe = MoE(self.module, own.router_aux_loss_coef) if head == "lm" and is_moe(self.module) else None
        self.model: torch.nn.Module = self.scorer  # what forward/backward runs: the scorer, or DDP around it
        self.optimizer = self.scheduler = None
        self.optimizer_steps = 0
        self.changes = WeightChanges()  # which weights changed when (weight_versions: the delta sync)
        # fsdp2: each rank a shard of every weight (yatt.trainers.sharding); a frozen reference too
        self.sharded = own.parallel == "fsdp2" and world.grouped
        self.replicated = not self.sharded
        if trainable:
            self.module.train()
        else:
            self.module.eval().requires_grad_(False)
        if trainable and own.activation_checkpointing:  # recompute each decoder layer in backward, not store it
            self.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.sharded:
            fully_shard_model(self.module, self.scorer, world, own)
        if not trainable:
            return
        if world.grouped and not self.sharded:  # also one-GPU torchrun: its gradients go through NCCL like any other
            device_ids = [world.local_rank] if world.device.type == "cuda" else None
            # gradients as views into DDP's all-reduce buckets: one copy of the gradients, not two
            # buffers (e.g. rotary frequencies) never change: no sync before every forward
            self.model = DistributedDataParallel(
                self.scorer, device_ids=device_ids, gradient_as_bucket_view=True, forward_sync_buffers=False
            )
        self.optimizer = torch.optim.AdamW(
            self.weights.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, cfg, total_steps)
        )

    def _weights(self, lora: LoRAConfig | None) -> Weights:
        """What trains (yatt.trainers.weights): every weight, or model.lora's peft adapters (yatt.trainers.lora)."""
        if lora is None or not lora.enabled:
            return FullWeights(self.module, self.frozen)
        if self.head != "lm" or self.vision:
            what = "a value model" if self.head != "lm" else "a vision-language policy"
            raise ValueError(f"model.lora: LoRA on {what} is not supported yet")
        return Adapters(self.module, lora)

    def reference(self) -> Trainer | None:
        """A frozen reference for free (LoRA: this trainer with its adapter off, no second copy), or None."""
        return self.weights.reference(self)

    def micro_batches(self, batch: TokenBatch) -> list[list[int]]:
        """Row indices per micro-batch: at most micro_batch_size rows and micro_batch_tokens tokens (the packed
        row's tokens when packed, a shared prompt once; padded slots when not)."""
        return micro_batch_rows(
            batch.lengths(),
            self.cfg.micro_batch_size,
            self.cfg.micro_batch_tokens,
            padded=not self.packed,
            shared=shared_prompts(batch) if self.share_prompts else None,
        )

    def _inputs(self, mb: TokenBatch) -> ModelInputs:
        return model_inputs(mb, self.packed, self.share_prompts)

    def _token_outputs(
        self, model: torch.nn.Module, mb: TokenBatch, with_entropy: bool, inputs: ModelInputs | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (and entropies) of mb's response tokens under softmax(logits / mb.temperature): [B, L-1],
        zero outside mb.mask. `inputs`: mb's model inputs if the caller laid them out already."""
        inputs = inputs or self._inputs(mb)
        if mb.pixels:
            inputs.kwargs["images"] = image_slots(
                mb, inputs, self.module.config.image_token_id, next(self.module.parameters()).dtype
            )
        autocast = torch.autocast(self.world.device.type, dtype=torch.bfloat16) if self.autocast else nullcontext()
        with autocast:
            logp, ent = model(inputs.kwargs, inputs.select, inputs.targets, mb.temperature, with_entropy)

        def place(values: Tensor) -> Tensor:
            return mb.mask.new_zeros(mb.mask.shape).index_put((inputs.rows, inputs.cols), values)

        return place(logp), place(ent) if with_entropy else None

    def _routing(self, mb: TokenBatch, inputs: ModelInputs):
        """An MoE policy's routing patch around one micro-batch's forward (and backward): replays mb.routing where
        set, records and measures the rest; nothing for a dense model."""
        return nullcontext() if self.moe is None else self.moe.active(mb, inputs)

    def logprobs(
        self, batch: TokenBatch, with_entropy: bool = False, record_routing: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs of the batch's own tokens ([B, L-1], zero outside the mask). `record_routing`
        (an MoE policy): leave the experts this pass used in batch.routing."""
        if self.head != "lm":
            raise ValueError(f"logprobs() of a {self.head}-head model; it has values()")
        return self._per_token(batch, with_entropy, record_routing)

    def routing_counts(self) -> dict[str, float]:
        """An MoE policy's routing-mismatch counts since the last call (yatt.trainers.moe.MoE.routing_counts; 0
        for a dense model)."""
        return self.moe.routing_counts() if self.moe is not None else dict.fromkeys(ROUTING_COUNTS, 0.0)

    def values(self, batch: TokenBatch) -> Tensor:
        """Per-token values ([B, L-1], zero outside the mask) of a head="value" model."""
        if self.head != "value":
            raise ValueError(f"values() of a {self.head}-head model; it has logprobs()")
        return self._per_token(batch, False)[0]

    @torch.no_grad()
    def _per_token(
        self, batch: TokenBatch, with_entropy: bool, record_routing: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """The scorer's per-token outputs (log-probs or values, and entropies) over micro-batches, on CPU."""
        logps, ents = torch.zeros_like(batch.mask), torch.zeros_like(batch.mask) if with_entropy else None
        micro = self.micro_batches(batch)
        if self.sharded:  # every forward gathers weights with the other ranks: run as many as the busiest rank
            for _ in range(int(self.world.max([float(len(micro))])[0]) - len(micro)):
                empty = self._empty()
                inputs = self._inputs(empty)
                with self._routing(empty, inputs):
                    self._token_outputs(self.scorer, empty, False, inputs)
        for rows in micro:
            mb = batch.select(rows).to(self.world.device)
            # the bare scorer: no DDP hooks for a forward without backward
            inputs = self._inputs(mb)
            with self._routing(mb, inputs):
                logp, ent = self._token_outputs(self.scorer, mb, with_entropy, inputs)
                if self.moe is not None and record_routing:  # what this pass routed to, replayed or not
                    keep_routing(batch, torch.tensor(rows), self.moe.recorded(mb, inputs))
            rows, width = torch.tensor(rows)[:, None], torch.arange(logp.shape[1])
            logps[rows, width] = logp.cpu()
            if with_entropy:
                ents[rows, width] = ent.cpu()
        if self.sharded:  # no backward frees the root's gathered weights (FSDP2 keeps a root's for its backward)
            self.scorer.reshard()
        return logps, ents

    def train_mini_batch(self, batch: TokenBatch, loss_fn: LossFn, with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over `batch`, accumulating gradients over micro-batches.

        loss_fn must already be normalised by the global (all micro-batches, all ranks) denominators:
        micro-batch losses are summed, and DDP averages gradients over ranks.

        Ranks may hold different amounts of data (load balancing, dynamic sampling), but DDP reduces
        gradients in the backward of the last micro-batch, which every rank must run together: all
        ranks run the largest micro-batch count, padding theirs with zero-loss passes.
        """
        assert self.trainable, "a frozen model cannot be trained"
        micro = self.micro_batches(batch)
        count = int(self.world.max([float(len(micro))])[0])
        sums: dict[str, float] = {}
        tokens = max(1, sum(int(batch.attention_mask[rows].sum()) for rows in micro))
        for i in range(count):
            last = i == count - 1
            sync = nullcontext() if (last or self.model is self.scorer) else self.model.no_sync()
            mb = batch.select(micro[i]).to(self.world.device) if i < len(micro) else self._empty()
            inputs = self._inputs(mb)
            with sync, self._routing(mb, inputs):
                if i < len(micro):
                    loss, stats = loss_fn(*self._token_outputs(self.model, mb, with_entropy, inputs), mb)
                    if self.moe is not None:  # the router's load-balancing loss, weighted by the tokens
                        loss = loss + self.moe.aux_loss(float(mb.attention_mask.sum()) / tokens)
                else:
                    loss, stats = self._zero_loss(mb, inputs), {}
                loss.backward()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.module.parameters() if p.requires_grad], self.cfg.grad_clip
        )
        grad_norm = float(full(norm))  # fsdp2: the norm over every rank's shards
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.changes.stepped(self.weights.parameters())  # those with a gradient: the others are untouched
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.optimizer_steps += 1
        if self.moe is not None:
            sums.update(self.moe.mini_batch_stats(self.world))
        return {
            **sums,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "skipped": float(not math.isfinite(grad_norm)),
        }

    def _empty(self) -> TokenBatch:
        return TokenBatch.from_sequences([[0]], [[0]], pad_id=0).to(self.world.device)

    def _zero_loss(self, mb: TokenBatch, inputs: ModelInputs) -> Tensor:
        """A pass through every parameter with zero gradient (`mb`: `_empty()`): keeps DDP in step on a rank out
        of data."""
        loss = self._token_outputs(self.model, mb, False, inputs)[0].sum() * 0.0
        if self.vision:  # a text pass leaves the vision tower out of the graph; DDP needs every trained weight in it
            loss = loss + sum(p.reshape(-1)[0] for p in self.module.parameters() if p.requires_grad) * 0.0
        return loss

    def _state_tensors(self) -> list[Tensor]:
        """This rank's weights and optimizer state (its shards with fsdp2)."""
        tensors = [local(p.data) for p in self.module.parameters()]
        if self.optimizer is not None:
            tensors += [
                local(t) for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)
            ]
        return tensors

    def offload(self) -> dict:
        """Hand the device to another role: weights and optimizer state move to host memory.

        On CPU they already live there; the report says what a GPU would have freed. With fsdp2 the shards
        move (FSDP2's modules re-register their sharded views when moved), or stay where cpu_offload keeps them.
        """
        nbytes = sum(t.numel() * t.element_size() for t in self._state_tensors())
        if self.world.device.type == "cpu" or self._host_resident:
            return {"moved_bytes": 0, "resident_bytes": nbytes, "freed_bytes": 0}
        before = torch.cuda.memory_allocated(self.world.device)
        self._move_state(torch.device("cpu"))
        torch.cuda.empty_cache()
        return {"moved_bytes": nbytes, "freed_bytes": before - torch.cuda.memory_allocated(self.world.device)}

    @property
    def _host_resident(self) -> bool:
        """fsdp2 with cpu_offload: shards and optimizer state live in host memory, only gathers use the GPU."""
        return self.sharded and self.cfg.torch.cpu_offload

    def onload(self) -> dict:
        if self.world.device.type == "cpu" or self._host_resident:
            return {"moved_bytes": 0}
        self._move_state(self.world.device)
        return {"moved_bytes": sum(t.numel() * t.element_size() for t in self._state_tensors())}

    def _move_state(self, device: torch.device) -> None:
        self.module.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v) and k != "step":
                        state[k] = v.to(device, non_blocking=True)

    def named_weights(self) -> NamedTensors:
        """The policy under its Hugging Face names (tied weights once): the parameters, detached; with LoRA the
        adapted layers merged (new tensors)."""
        return list(self.weights.named_weights())

    def engine_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """What engines must reload (yatt.trainers.weights): every weight but the frozen ones; with LoRA the merged
        adapted modules or the adapters alone (model.lora.sync)."""
        return weight_buckets(self.weights.engine_weights(), bucket_bytes)

    def weight_versions(self) -> WeightVersions:
        """The versions of what `engine_weights` sends (yatt.trainers.weights.WeightChanges): a trained weight's
        changes at each optimizer step that gave it a gradient, every weight's at a checkpoint load."""
        return WeightVersions(self.weights.versions(self.changes))

    def state_dict(self) -> dict:
        """Live references (no copies) to what resuming needs: the weights' piece under its key ("model": under
        HF names, tied weights once; "adapter": LoRA's alone, the base is model.path's), AdamW state, the lr
        schedule's position."""
        state: dict = {self.weights.key: self.weights.state(), "optimizer_steps": self.optimizer_steps}
        if self.trainable:
            # fsdp2: the moments are DTensors, saved as this rank's rows (yatt.checkpoint.snapshot)
            state.update(optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict())
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if self.weights.key not in state:
            saved = next((HOLDS[k] for k in HOLDS if k in state), "no weights")
            raise ValueError(f"the checkpoint holds {saved}, but this policy trains {HOLDS[self.weights.key]} "
                             "(model.lora)")  # fmt: skip
        self.weights.load_state(state[self.weights.key])
        self.changes.all_changed()
        self.optimizer_steps = state["optimizer_steps"]
        if self.trainable:
            self.optimizer.load_state_dict(state["optimizer"])
            for p, st in self.optimizer.state.items():  # fsdp2: each moment's shard sharded as its parameter
                for k, v in st.items():
                    if torch.is_tensor(v) and k != "step":
                        st[k] = like(p, v)
            self.scheduler.load_state_dict(state["scheduler"])

    def hf_weights(self, state: dict[str, Any]) -> dict[str, Tensor]:
        """A snapshot's policy under HF names (with LoRA its adapters merged into the never changing base)."""
        return self.weights.hf_weights(state[self.weights.key])

    def save_adapter(self, folder: str | Path, state: dict[str, Any] | None = None) -> None:
        """LoRA: peft's adapter folder of a snapshot's `state` (None: the live adapters); nothing without LoRA."""
        self.weights.save_adapter(folder, None if state is None else state[self.weights.key])

    def gather_adapter(self) -> dict[str, Any] | None:
        """LoRA: the adapters as a snapshot holds them (`save_adapter`'s `state`), a host copy on rank 0 (with
        fsdp2 every rank calls it); None elsewhere and without adapters."""
        adapters = self.weights.host_adapters()
        return {self.weights.key: adapters} if adapters is not None and self.world.is_main else None

    def stream_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The policy one weight at a time (fsdp2: a gather per parameter, on every rank)."""
        if self.replicated and not self.world.is_main:
            return iter(())
        return iter(self.weights.named_weights())

    @property
    def hf_config(self) -> Any:
        return self.module.config

    def save_hf(self, folder: str | Path, tokenizer: Any) -> None:
        """The policy as a Hugging Face folder (with LoRA its layers merged, and its adapter in adapter/); with
        fsdp2 a collective, gathered one weight at a time and written file by file by rank 0."""
        if self.replicated:
            self.weights.save_hf(folder, tokenizer)
            return
        folder = Path(folder)
        write_weights(folder if self.world.is_main else None, self.stream_hf_weights())
        if self.world.is_main:
            write_config(folder, self.module.config, tokenizer)
            if self.module.can_generate():
                self.module.generation_config.save_pretrained(str(folder))
        self.weights.save_adapter(folder / ADAPTER_DIR, write=self.world.is_main)
