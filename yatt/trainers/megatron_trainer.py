"""The `megatron` training backend: a megatron-core GPTModel split by tensor and pipeline parallelism, with
megatron's DDP, distributed optimizer and pipeline schedules.

Implements `yatt.trainers.base.Trainer`. The world is split as megatron does (`initialize_model_parallel`):
TP x PP ranks hold one copy of the model between them, data parallel = world / (TP x PP). Each rank holds
its shard only (`replicated = False`): its layers' slices, and its 1/DP of the optimizer state. The ranks of
one TP/PP group must be handed the same batch; data-parallel ranks different ones.

The loss contract is the torch backend's: loss_fn is normalised by global denominators, micro-batch losses
are summed and gradients averaged over data-parallel ranks. Log-probs come from a vocabulary-parallel
reduction (`yatt.trainers.megatron_scoring`), never from gathered full-vocabulary logits.

Micro-batches are built and fed as the torch backend's: with `pack_sequences` (and `share_prompts`) one packed
row of real tokens per micro-batch (yatt.trainers.packing.model_inputs), its attention kept per sample by
`yatt.trainers.megatron_attention` (megatron's own packed attention needs Transformer Engine); without, right-
padded rows. Pipeline stages exchange rows of any length (megatron's `variable_seq_lengths`).
The torch backend's own settings (`trainer.torch`) do not apply.

head="value" (PPO's critic): the same decoder with `value_head` on the last stage in place of the output layer,
a [1, H] linear replicated over TP (yatt.trainers.megatron_model, yatt.trainers.megatron_scoring). It starts
from the folder's `score` when the folder is a saved value model (one-label token classification), else as
transformers initialises a new `score` (normal(0, initializer_range) from the global RNG, zero bias), so the
torch backend's critic and this one start equal for the same seed.

A vision-language folder: the GPTModel of its text config, with the folder's vision tower and connector as its
submodule `vision` on the first stage, replicated over TP (yatt.trainers.megatron_vision); its weights go out
under the folder's names.

A mixture-of-experts policy (Qwen3-MoE): megatron's MoE layers, experts shared out over
`trainer.megatron.expert_parallel` ranks, the router's load-balancing loss, and the experts' load per step in the
stats (`moe/...`): yatt.trainers.megatron_moe. Routing replay (r2, r3) and the routing mismatch on its routers:
yatt.trainers.megatron_routing.

bfloat16: the model's weights and gradients are bfloat16, and megatron's optimizer keeps float32 master
weights and Adam state (sharded over DP), as megatron always does for half-precision training.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

from yatt.balance.micro_batches import micro_batch_rows
from yatt.checkpoint.export import write_config, write_weights
from yatt.distributed import World
from yatt.models.vision import vision_parameter
from yatt.tensors import DTYPES, LossFn, NamedTensors, TokenBatch, WeightVersions
from yatt.trainers import megatron_compat as compat
from yatt.trainers import megatron_model as mm
from yatt.trainers import megatron_vision as mv
from yatt.trainers.config import TrainerConfig
from yatt.trainers.megatron_groups import check_same_batch, from_last_stage, outputs_from_last_stage
from yatt.trainers.megatron_scoring import MegatronScorer
from yatt.trainers.megatron_state import MegatronState
from yatt.trainers.megatron_weights import gathered_buckets, hf_units
from yatt.trainers.moe import ROUTING_COUNTS, keep_routing
from yatt.trainers.packing import model_inputs, shared_prompts
from yatt.trainers.scoring import image_slots
from yatt.trainers.torch_trainer import freeze_vision_tower, lr_factor


def init_model_parallel(tp: int, pp: int, ep: int = 1) -> None:
    """megatron's process groups over the torchrun world (once per process; policy and reference share them).
    Experts (ep > 1) are never split over TP: expert tensor parallel 1, EP ranks taken from TP x DP."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        )
        if have != (tp, pp, ep):
            raise ValueError(f"megatron is already split as TP, PP, EP = {have}, not {(tp, pp, ep)}")
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    model_parallel_cuda_manual_seed(1234)  # dropout streams (dropout is off; megatron still forks them)


def read_hf_weights(folder: Path) -> dict[str, Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


class MegatronTrainer(MegatronState):
    replicated = False
    reshard_refusal = ("its checkpoints hold each rank's tensor- and pipeline-parallel slices and its part of the "
                       "distributed optimizer, in megatron's layout, which yatt does not cut again")  # fmt: skip

    def __init__(
        self,
        model_path: str | Path,
        cfg: TrainerConfig,
        world: World,
        trainable: bool = True,
        total_steps: int = 1,
        head: str = "lm",
        freeze_vision: bool = False,
    ):
        if head not in mm.HEADS:
            raise ValueError(f"unknown trainer head {head!r}; one of: {', '.join(mm.HEADS)}")
        self.head = head
        if not dist.is_initialized():
            raise RuntimeError("trainer.backend=megatron runs under torchrun (it needs a process group)")
        compat.apply()
        from megatron.core import parallel_state as ps

        self.cfg, self.world, self.trainable, self.total_steps = cfg, world, trainable, total_steps
        self.tp, self.pp = cfg.model_parallel  # trainer.megatron (yatt.trainers.megatron_config)
        self.ep = cfg.backend_config.expert_parallel
        # a value model's config says one label, as the torch backend's (save_hf writes a value model)
        self._hf_config = AutoConfig.from_pretrained(str(model_path), **({"num_labels": 1} if head == "value" else {}))
        # a VL folder: the GPTModel is its language model, the tower its submodule (yatt.trainers.megatron_vision)
        self.vision = mv.is_vision_config(self._hf_config)
        if self.vision and head != "lm":
            raise ValueError(f"{model_path}: a value model of a vision-language policy is not supported")
        self._text = mv.text_config(self._hf_config)
        self.dtype = DTYPES[cfg.dtype]
        # packed micro-batches, as the torch backend's (yatt.trainers.packing, yatt.trainers.megatron_attention)
        self.packed = cfg.pack_sequences
        self.share_prompts = self.packed and cfg.share_prompts
        self.optimizer = None
        self.optimizer_steps = 0
        # the weights' version (weight_versions): every weight changes at an optimizer step (megatron's optimizer
        # writes the whole parameter buffer) and at a checkpoint load
        self.weight_changes = 0
        with compat.on_cpu():
            init_model_parallel(self.tp, self.pp, self.ep)
            if cfg.backend_config.host_collectives and self.tp > 1:
                compat.use_host_collectives(ps.get_tensor_model_parallel_group())
                if self.pp == 1:  # the same ranks (grad norms, the same-batch check)
                    compat.use_host_collectives(ps.get_model_parallel_group())
            self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
            self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
            self.ep_rank = ps.get_expert_model_parallel_rank()
            # the controller shards data by yatt.distributed.data_parallel_world, which assumes this order
            if self.dp_rank != (world.rank // self.tp) % self.dp_size:
                raise RuntimeError(
                    f"megatron placed rank {world.rank} at data-parallel rank {self.dp_rank}, not "
                    f"{(world.rank // self.tp) % self.dp_size} as yatt's data view assumes"
                )
            self.gpt = mm.build_gpt(
                self._text, self.tp, self.pp, self.pp_rank, self.dtype, head, self.ep,
                cfg.backend_config.router_aux_loss_coef,
            )  # fmt: skip
            from yatt.trainers import megatron_moe as moe  # imports megatron-core

            # a MoE policy's experts' load, per step (yatt.trainers.megatron_moe)
            first_layer = mm.stage_layers(self._text, self.pp, self.pp_rank).start
            self.expert_load = moe.attach(self.gpt, self._text, first_layer)
            # and its routing replay and mismatch (yatt.trainers.megatron_routing; only the policy is asked for it)
            self.routing = moe.routing(self.gpt, self._text, first_layer, world.device, trainable and head == "lm")
            last = self.pp_rank == self.pp - 1
            tied_output = self._text.tie_word_embeddings and self.pp > 1 and last and head == "lm"
            hf_state, tower = read_hf_weights(Path(model_path)), {}
            if self.vision:
                hf_state, tower = mv.split_state(hf_state, self._hf_config)
            state = mm.local_state_from_hf(
                hf_state, self._text, self.tp, self.tp_rank, self.pp, self.pp_rank, tied_output, head, self.ep,
                self.ep_rank,
            )  # fmt: skip
            if self.vision and self.gpt.pre_process:
                self.gpt.vision = mv.build_tower(self._hf_config, self.dtype)
                state.update(tower)
            new_head = head == "value" and "score.weight" not in hf_state
            if new_head:  # every rank draws, so the global RNG moves alike on every rank (as with torch's critic)
                fresh = self._new_value_head()
                state.update(fresh if last else {})
            del hf_state, tower
            self.gpt.load_state_dict({k: v.to(self.dtype) for k, v in state.items()}, strict=False)
            self._check_loaded(state)
            self.frozen_vision = self.vision and freeze_vision  # the same on every stage, tower or not
            if self.frozen_vision:
                freeze_vision_tower(self.gpt)
            # megatron's parallel linears take params_dtype, its norms (torch RMSNorm) do not: cast the rest
            # as megatron's Float16Module would
            self.gpt.to(world.device, self.dtype)
            if new_head and last:
                self._agree_value_head()
            self.scorer = MegatronScorer(self.gpt, self._text.vocab_size)
            self.model: torch.nn.Module = self.scorer
            if trainable:
                self._build_optimizer()
            else:
                self.gpt.eval().requires_grad_(False)

    def _new_value_head(self) -> dict[str, Tensor]:
        """A new value head as transformers initialises a token-classification `score` missing from a folder
        (`_init_weights` of a Linear: normal(0, initializer_range) weight, zero bias), drawn in the weights'
        dtype from the global RNG: the torch backend's critic built at the same RNG state gets the same head."""
        hidden, std = self._text.hidden_size, self._text.initializer_range
        return {
            "value_head.weight": torch.empty(1, hidden, dtype=self.dtype).normal_(0.0, std),
            "value_head.bias": torch.zeros(1, dtype=self.dtype),
        }

    @torch.no_grad()
    def _agree_value_head(self) -> None:
        """A freshly drawn head is the same on every last-stage rank only if their RNGs were seeded alike;
        the ranks holding it (this TP group, then this data-parallel group) take the first rank's, so a
        replicated parameter never starts different across replicas."""
        from megatron.core import parallel_state as ps

        groups = [ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()]
        for group in groups:
            if dist.get_world_size(group) > 1:
                for p in self.gpt.value_head.parameters():
                    dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)

    def _check_loaded(self, state: dict[str, Tensor]) -> None:
        params = {k for k, _ in self.gpt.named_parameters()}
        if params != set(state):
            raise ValueError(
                f"HF -> megatron mapping mismatch: missing {sorted(params - set(state))[:4]}, "
                f"unexpected {sorted(set(state) - params)[:4]}"
            )

    def _build_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg, config = self.cfg, self.gpt.config
        self.gpt.train()
        self.model = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                overlap_grad_reduce=False, use_distributed_optimizer=True, grad_reduce_in_fp32=True
            ),
            self.scorer,
        )
        # without these the data-parallel gradient all-reduce never runs (finalize) or runs every micro-batch
        from yatt.trainers.megatron_moe import finalize

        # a MoE layer's router sees a TP slice of the tokens: its gradient is summed over TP (megatron_moe)
        config.finalize_model_grads_func = finalize(finalize_model_grads) if self.expert_load else finalize_model_grads
        config.no_sync_func = self.model.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                min_lr=0.0,
                weight_decay=cfg.weight_decay,
                adam_beta1=cfg.betas[0],
                adam_beta2=cfg.betas[1],
                adam_eps=1e-8,
                clip_grad=cfg.grad_clip,
                bf16=self.dtype == torch.bfloat16,
                params_dtype=self.dtype,
                use_distributed_optimizer=True,
            ),
            [self.model],
        )
        self._set_lr(0)

    def _set_lr(self, step: int) -> float:
        """The torch backend's schedule; weight decay on every tensor as torch's AdamW (megatron's default
        groups exempt biases and norms)."""
        lr = self.cfg.lr * lr_factor(step, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = lr, self.cfg.weight_decay
        return lr

    # ---- forward / backward ------------------------------------------------------------------------------
    def micro_batches(self, batch: TokenBatch) -> list[list[int]]:
        """Row indices per micro-batch, as the torch backend's: at most micro_batch_size rows and
        micro_batch_tokens tokens (the packed row's tokens when packed, a shared prompt once; padded slots when
        not)."""
        return micro_batch_rows(
            batch.lengths(),
            self.cfg.micro_batch_size,
            self.cfg.micro_batch_tokens,
            padded=not self.packed,
            shared=shared_prompts(batch) if self.share_prompts else None,
        )

    def _schedule(
        self, batch: TokenBatch, micro: list[list[int]], count: int, with_entropy: bool, loss_fn: LossFn | None
    ) -> tuple[list[tuple[list[int], Tensor, Tensor | None]], dict[str, float]]:
        """Run `count` micro-batches (those past len(micro) are zero-loss passes that keep data-parallel ranks
        in step) through megatron's schedule; forward-only without loss_fn. Returns, on the last pipeline
        stage, (rows, logp [b, l-1], entropy) per real micro-batch (detached) and the loss_fn sums. An MoE
        policy replays and records each micro-batch's routing (yatt.trainers.megatron_routing)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        outputs: list[tuple[list[int], Tensor, Tensor | None]] = []
        sums: dict[str, float] = {}
        dummy = TokenBatch.from_sequences([[0]], [[0]], pad_id=0)

        def step(iterator, model):
            # yatt's code and the model's forward name no CUDA device: patch 4's mode (~3 us a torch call) off
            with compat.off_cpu():
                return forward(next(iterator), model)

        def forward(i, model):
            rows = micro[i] if i < len(micro) else None
            if self.expert_load is not None:  # a zero-loss pass routes no load and adds no load-balancing loss
                self.expert_load.real = rows is not None
            mb = (batch.select(rows) if rows is not None else dummy).to(self.world.device)
            inputs = model_inputs(mb, self.packed, self.share_prompts)
            kw = inputs.kwargs
            extra = {"position_ids": kw["position_ids"], "packed_layout": kw["packed_layout"]} if self.packed else {}
            if mb.pixels and self.gpt.pre_process:  # the tower is the first stage's
                extra["images"] = image_slots(mb, inputs, self._hf_config.image_token_id, self.dtype)
            if self.routing is not None:
                self.routing.begin(mb if rows is not None else None, inputs)
            out = model(kw["input_ids"], inputs.select, inputs.targets, mb.temperature, with_entropy, **extra)
            if self.routing is not None and rows is not None:  # the stage's layers ran: what they routed
                self.routing.end(rows, mb, inputs)

            def loss_func(scores):
                with compat.off_cpu():  # megatron calls it under the mode
                    return loss_terms(*scores)

            def loss_terms(logp, ent):
                def place(values: Tensor) -> Tensor:
                    return mb.mask.new_zeros(mb.mask.shape).index_put((inputs.rows, inputs.cols), values)

                logp, ent = place(logp), place(ent) if with_entropy else None
                if loss_fn is None:
                    if rows is not None:
                        outputs.append((rows, logp.detach(), ent.detach() if with_entropy else None))
                    return logp.sum() * 0.0, {}
                if rows is None:
                    return logp.sum() * 0.0, {}
                outputs.append((rows, logp.detach(), ent.detach() if with_entropy else None))  # for _replay
                loss, stats = loss_fn(logp, ent, mb)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                # the schedule divides each micro-batch's loss by their count; yatt's losses are already
                # normalised by global denominators and summed over micro-batches
                return loss * count, {}

            return out, loss_func

        width = max((len(batch.select(r).input_ids[0]) for r in micro), default=2)
        with compat.on_cpu():
            get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(range(count)),
                model=[self.model],
                num_microbatches=count,
                seq_length=width,
                micro_batch_size=max(map(len, micro), default=1),
                forward_only=loss_fn is None,
            )
        return outputs, sums

    def _count(self, micro: list[list[int]]) -> int:
        """Micro-batches every rank runs: the most any data-parallel rank has (a model-parallel group's ranks
        hold one batch, so with one data-parallel rank there is nothing to agree on)."""
        if self.dp_size == 1:
            return max(1, len(micro))
        return max(1, int(self.world.max([float(len(micro))])[0]))

    def logprobs(
        self, batch: TokenBatch, with_entropy: bool = False, record_routing: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs (and entropies), [B, L-1] on CPU on every rank (head="lm"). `record_routing` (an
        MoE policy): leave the experts this pass used in batch.routing (this stage's layers; -1 in the others)."""
        if self.head != "lm":
            raise ValueError(f"logprobs() of a {self.head}-head model; it has values()")
        return self._per_token(batch, with_entropy, record_routing)

    def routing_counts(self) -> dict[str, float]:
        """An MoE policy's routing-mismatch counts since the last call, those of its model-parallel group (a
        collective of the group's ranks; yatt.trainers.megatron_routing); 0 for a dense model."""
        return self.routing.counts() if self.routing is not None else dict.fromkeys(ROUTING_COUNTS, 0.0)

    def values(self, batch: TokenBatch) -> Tensor:
        """Per-token values, [B, L-1] on CPU on every rank, 0 outside the mask (head="value")."""
        if self.head != "value":
            raise ValueError(f"values() of a {self.head}-head model; it has logprobs()")
        return self._per_token(batch, False)[0]

    def _per_token(
        self, batch: TokenBatch, with_entropy: bool, record_routing: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """The scorer's per-token outputs (log-probs or values, and entropies) from the last stage."""
        check_same_batch(batch, self.tp * self.pp, self.world.device)
        micro = self.micro_batches(batch)
        if self.routing is not None:
            self.routing.recorded = [] if record_routing else None
        with torch.no_grad():
            outputs, _ = self._schedule(batch, micro, self._count(micro), with_entropy, None)
        for rows, used in self.routing.take() if self.routing is not None else []:
            keep_routing(batch, torch.tensor(rows), used)
        logps, ents = torch.zeros_like(batch.mask), torch.zeros_like(batch.mask) if with_entropy else None
        for rows, logp, ent in outputs_from_last_stage(self.pp, self.world.device, outputs):
            index, width = torch.tensor(rows)[:, None], torch.arange(logp.shape[1])
            logps[index, width] = logp
            if with_entropy:
                ents[index, width] = ent
        return logps, ents

    def train_mini_batch(self, batch: TokenBatch, loss_fn: LossFn, with_entropy: bool = False) -> dict[str, float]:
        assert self.trainable, "a frozen model cannot be trained"
        check_same_batch(batch, self.tp * self.pp, self.world.device)
        micro = self.micro_batches(batch)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs, sums = self._schedule(batch, micro, self._count(micro), with_entropy, loss_fn)
        sums = from_last_stage(self.pp, self.world.device, sums)
        self._replay(batch, outputs, loss_fn)
        with compat.on_cpu():
            grad_norm = self._clip_and_step()
        self.weight_changes += math.isfinite(grad_norm)  # a non-finite norm skipped the update: nothing changed
        self.optimizer_steps += 1
        lr = self._set_lr(self.optimizer_steps)
        if self.expert_load is not None:  # a collective over every rank
            sums.update(self.expert_load.stats(self.world, self._text.num_experts_per_tok))
        return {**sums, "grad_norm": grad_norm, "lr": lr, "skipped": float(not math.isfinite(grad_norm))}

    @torch.no_grad()
    def _replay(self, batch: TokenBatch, outputs: list, loss_fn: LossFn) -> None:
        """loss_fn on the earlier pipeline stages too, with the last stage's log-probs and entropies (no grad, the
        loss dropped). A loss function may record what it is handed (yatt.controllers.policy._recording fills in
        the on-policy rows' old log-probs and every row's entropy for the step's metrics), and only the last
        stage computes them: without this, the first stage (rank 0, which logs) reported the first mini-batch's
        old log-probs as 0 at PP=2 (rollout/trainer_logprob_diff of |logp|, rollout_is ratios of 1/p) and
        half the entropy."""
        if self.pp == 1:
            return
        from megatron.core import parallel_state as ps

        outputs = outputs_from_last_stage(self.pp, self.world.device, outputs)
        if ps.is_pipeline_last_stage():
            return
        for rows, logp, ent in outputs:
            loss_fn(logp, ent, batch.select(rows))

    @torch.no_grad()
    def _clip_and_step(self) -> float:
        """megatron's optimizer step (ChainedOptimizer.step), except that a non-finite gradient norm skips the
        update as in the torch backend. The norm is over the whole model (all TP/PP shards, once each)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(grad_norm):
            return grad_norm
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if opt.get_parameters():
                clip_grad_by_total_norm_fp32(opt.get_parameters(), max_norm=self.cfg.grad_clip, total_norm=grad_norm)
        with compat.off_cpu():  # the update names no CUDA device
            self.optimizer.step_with_ready_grads()
        return grad_norm

    # ---- weights out -------------------------------------------------------------------------------------
    def engine_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """Collective over the model-parallel group: every rank gets the whole policy, one bucket at a time; a
        frozen vision tower (model.freeze_vision) never changes, so engines are not sent it."""
        buckets = gathered_buckets(
            self.gpt, self._hf_config, self.tp, self.pp, self.pp_rank, bucket_bytes, self.world.device, self.ep
        )
        if not self.frozen_vision:
            return buckets
        return (kept for b in buckets if (kept := [(k, t) for k, t in b if not vision_parameter(k)]))

    def weight_versions(self) -> WeightVersions:
        """One version for every weight (`weight_changes`): a delta sync skips only a sync with no step before it."""
        return WeightVersions(default=self.weight_changes)

    @property
    def hf_config(self) -> Any:
        return self._hf_config

    def stream_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The policy unit by unit as for the engines (TP shards all-gathered, PP stages broadcast) by the
        model-parallel group of rank 0 (data-parallel rank 0); the other groups hold the same weights and get
        nothing."""
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_rank() != 0 and self.ep == 1:  # EP groups span data-parallel ranks: all gather
            return
        for unit in hf_units(self.gpt, self._hf_config, self.tp, self.pp, self.pp_rank, self.world.device, self.ep):
            yield from unit.items()

    def save_hf(self, folder: str | Path, tokenizer: Any) -> None:
        """Collective (every rank calls it): the shards gathered unit by unit (stream_hf_weights) and written by
        rank 0 file by file, with the config of the transformers class that loads them (a value model as a
        one-label token-classification model, the torch backend's critic)."""
        folder = Path(folder)
        write_weights(folder if self.world.is_main else None, self.stream_hf_weights())
        if not self.world.is_main:
            return
        auto = AutoModelForTokenClassification if self.head == "value" else AutoModelForCausalLM
        auto = AutoModelForImageTextToText if self.vision else auto
        with torch.device("meta"):  # the class's config and generation config, without its weights
            model = auto.from_config(self._hf_config, dtype=self.dtype)
        model.config.architectures = [type(model).__name__]
        write_config(folder, model.config, tokenizer)
        if model.can_generate():
            model.generation_config.save_pretrained(str(folder))

    def save_adapter(self, folder: str | Path, state: dict[str, Any] | None = None) -> None:
        """No adapters (its registry entry says why not: yatt.trainers.megatron_config)."""

    def gather_adapter(self) -> None:
        return None

    def reference(self) -> None:
        """None: the reference is a frozen copy."""
        return None
