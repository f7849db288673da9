"""Mixture-of-experts layers on the megatron backend: megatron-core's `MoELayer` (its `TopKRouter`, its
`SequentialMLP` experts, which run anywhere torch does, and its all-to-all token dispatcher) set up to route as
Qwen3-MoE does, tensor parallelism without sequence parallelism, the load-balancing loss's coefficient, and the
experts' load per step. The weight names are `yatt.trainers.megatron_experts`'.

Routing as Qwen3-MoE: HF takes the softmax over all experts, its top-k, and with `norm_topk_prob` divides them by
their sum; that is the softmax of the top-k logits, which megatron's router computes without
`moe_router_pre_softmax` (the same experts: softmax is monotonic). Without `norm_topk_prob` the router takes the
softmax first (`moe_router_pre_softmax`). No shared expert; experts are never split over TP (expert tensor
parallel size 1): expert parallelism shares them out, over ranks that may be the tensor-parallel ones.

Tensor parallelism without sequence parallelism (megatron's default here; yatt's scorer reads whole hidden
states): every TP rank holds the whole sequence. megatron's MoE layer assumes each TP rank holds a slice of it
(it refuses to train otherwise): fed whole copies, every expert would see each token TP times and get TP times
its gradient. `SlicedMoELayer` gives it a slice: the layer's tokens are split over the TP ranks (padded to a
multiple of TP; the pads are masked out of the router's loss and the load count), each rank routes and
dispatches its slice, and the outputs are all-gathered back (backward: each rank keeps its slice's gradient,
as every TP rank holds the whole gradient of a replicated activation). The router then sees a slice on each
rank, so its gradient is a part: `finalize` sums it over the TP group, as megatron does for sequence
parallelism's replicated weights.

The load-balancing loss: trainer.megatron.router_aux_loss_coef means what trainer.torch's does (transformers'
Switch-Transformer loss per layer, a balanced router giving top-k, averaged over the layers). megatron's per
layer loss is that divided by k, summed over the layers, so its coefficient is coef x k / layers. megatron
weighs each micro-batch's loss equally (its schedule scales it by 1 / micro-batches), where the torch backend
weighs them by tokens; a zero-loss pass that keeps data-parallel ranks in step adds none (`real`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from torch import Tensor, nn

from yatt.trainers.megatron_experts import is_moe

# megatron-core 0.16 imports Transformer Engine's GEMM for the router in a try block that, without Transformer
# Engine, leaves the name undefined instead of None, and the router's linear then raises NameError (on GPUs too)
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


def aux_loss_coef(hf: Any, coef: float | None) -> float:
    """trainer.megatron.router_aux_loss_coef, else the model config's (0 without one)."""
    return float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else float(coef)


def moe_config(hf: Any, ep: int, coef: float | None) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE config ({} for a dense one)."""
    if not is_moe(hf):
        return {}
    k = hf.num_experts_per_tok
    mcore_coef = aux_loss_coef(hf, coef) * k / hf.num_hidden_layers
    return dict(
        num_moe_experts=hf.num_experts,
        moe_router_topk=k,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not getattr(hf, "norm_topk_prob", True),
        moe_router_load_balancing_type="aux_loss" if mcore_coef > 0 else "none",
        moe_aux_loss_coeff=mcore_coef,
        moe_grouped_gemm=False,  # grouped GEMM needs CUDA kernels; SequentialMLP runs one expert at a time
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


class ExpertLoad:
    """What the MoE layers of one model routed during a step's real micro-batches: per global layer the top-k
    slots each expert got, the router's summed probabilities, and the tokens routed (pads never counted)."""

    def __init__(self, layers: int, experts: int):
        self.load = torch.zeros(layers, experts, dtype=torch.float64)
        self.probs = torch.zeros(layers, experts, dtype=torch.float64)
        self.tokens = torch.zeros(layers, dtype=torch.float64)
        self.real = True  # False during a zero-loss pass: no load counted, no load-balancing loss

    @torch.no_grad()
    def add(self, layer: int, hidden: Tensor, weight: Tensor, routing_map: Tensor, keep: Tensor | None) -> None:
        if not self.real:
            return
        hidden = hidden.reshape(-1, hidden.shape[-1])
        probs = F.softmax(F.linear(hidden, weight).float(), dim=-1)
        if keep is not None:
            probs, routing_map = probs[keep], routing_map[keep]
        self.load[layer] += routing_map.sum(0).double().cpu()
        self.probs[layer] += probs.sum(0).double().cpu()
        self.tokens[layer] += routing_map.shape[0]

    def stats(self, world: Any, top_k: int) -> dict[str, float]:
        """moe/ metrics over every rank (a collective), then reset: the load-balancing loss in the torch
        backend's convention (E x sum_e f_e P_e per layer, f_e the share of top-k slots, so a balanced router
        gives k; averaged over the layers), and tokens per expert max and mean, averaged over the layers. A
        token is counted once: TP ranks route disjoint slices, PP stages their own layers."""
        packed = torch.cat([self.load.flatten(), self.probs.flatten(), self.tokens])
        total = torch.tensor(world.sum(packed.tolist()), dtype=torch.float64)
        n_load = self.load.numel()
        load = total[:n_load].view_as(self.load)
        probs = total[n_load : 2 * n_load].view_as(self.probs)
        tokens = total[2 * n_load :].clamp(min=1)[:, None]
        experts = load.shape[1]
        aux = experts * ((load / tokens) * (probs / tokens)).sum(dim=1)
        for t in (self.load, self.probs, self.tokens):
            t.zero_()
        return {
            "moe/aux_loss": float(aux.mean()),
            "moe/tokens_per_expert_max": float(load.max(dim=1).values.mean()),
            "moe/tokens_per_expert_mean": float(load.mean(dim=1).mean()),
        }


class SlicedMoELayer(MoELayer):
    """megatron's MoELayer fed each TP rank's slice of the tokens (module docstring), recording the load."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        self.tp = ps.get_tensor_model_parallel_world_size()
        if self.tp > 1:
            # the layer sees sequence-parallel slices: its own config says so (the model's does not)
            config = copy.copy(config)
            config.sequence_parallel = True
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.recorder: ExpertLoad | None = None
        self.global_layer = 0
        self._keep: Tensor | None = None
        self.replay = None  # its router's top-k under routing replay (yatt.trainers.megatron_routing.LayerReplay)
        self.router.weight.yatt_sum_over_tp = self.tp > 1  # a slice's gradient (finalize)

    def route(self, hidden_states: Tensor, padding_mask: Tensor | None = None):
        real = self.recorder is None or self.recorder.real
        self.router.train(self.training and real)  # no load-balancing loss on a zero-loss pass
        probs, routing_map = super().route(hidden_states, padding_mask)
        if self.recorder is not None and self.training and torch.is_grad_enabled():  # updates only
            self.recorder.add(self.global_layer, hidden_states, self.router.weight, routing_map, self._keep)
        return probs, routing_map

    def forward(self, hidden_states: Tensor, intermediate_tensors=None, padding_mask: Tensor | None = None):
        if self.tp == 1:
            self._keep = None
            if self.replay is not None:  # every token of the micro-batch
                self.replay.slice = (0, hidden_states.shape[0] * hidden_states.shape[1])
            return super().forward(hidden_states)
        group = ps.get_tensor_model_parallel_group()
        s, b, h = hidden_states.shape
        n = s * b
        per = -(-n // self.tp)
        flat = hidden_states.reshape(n, 1, h)
        if per * self.tp > n:
            flat = torch.cat([flat, flat.new_zeros(per * self.tp - n, 1, h)])
        mine = scatter_to_sequence_parallel_region(flat, group=group)  # backward: all-gather
        rank = ps.get_tensor_model_parallel_rank()
        pads = torch.arange(per, device=flat.device) + per * rank >= n
        if self.replay is not None:
            self.replay.slice = (per * rank, per * (rank + 1))
        self._keep = ~pads
        out, bias = super().forward(mine, padding_mask=pads[None] if bool(pads.any()) else None)
        # backward: each rank keeps its slice of the (whole, replicated) gradient
        full = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False, group=group)
        return full[:n].reshape(s, b, h), bias


def moe_layers(gpt: nn.Module) -> list[SlicedMoELayer]:
    return [m for m in gpt.modules() if isinstance(m, SlicedMoELayer)]


def attach(gpt: nn.Module, hf: Any, first_layer: int) -> ExpertLoad | None:
    """Number the stage's MoE layers globally (its first is `first_layer`) and give them one recorder."""
    layers = moe_layers(gpt)
    if not layers:
        return None
    recorder = ExpertLoad(hf.num_hidden_layers, hf.num_experts)
    for i, layer in enumerate(layers):
        layer.recorder, layer.global_layer = recorder, first_layer + i
    return recorder


def routing(gpt: nn.Module, hf: Any, first_layer: int, device: torch.device, measure: bool):
    """The stage's MoE layers' routing replay (yatt.trainers.megatron_routing.Routing); None for a dense model."""
    from yatt.trainers.megatron_routing import Routing

    layers = moe_layers(gpt)
    return Routing(layers, hf, first_layer, device, measure) if layers else None


def finalize(inner: Callable) -> Callable:
    """megatron's finalize_model_grads, then the router weights' gradients (a TP slice's each) summed over
    the tensor-parallel group, as megatron sums sequence-parallel weights' (its own condition, the model's
    `sequence_parallel`, is off here)."""

    def finalize_model_grads(model, *args, **kwargs):
        inner(model, *args, **kwargs)
        grads = [
            p.main_grad
            for chunk in model
            for p in chunk.parameters()
            if getattr(p, "yatt_sum_over_tp", False) and getattr(p, "main_grad", None) is not None
        ]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    return finalize_model_grads


def moe_spec(spec: Any) -> Any:
    """megatron's local layer spec (built with num_experts) with SlicedMoELayer as its MLP."""
    spec.submodules.mlp.module = SlicedMoELayer
    return spec
