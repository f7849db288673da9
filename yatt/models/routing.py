"""Mixture-of-experts routing of a transformers model: record which experts each token went to, force (replay)
them, and measure the load-balancing loss and the experts' load, as one patch of the model's routers.

Why: an MoE policy routes the same token to different experts in the engine and in the trainer (different
kernels, batch shapes, and in the update newer weights), so the importance ratio compares two different
networks. Routing replay (algorithm.routing_replay; veRL, slime and Megatron-Core call it router replay) runs
the trainer's forward with the experts chosen elsewhere: R2 those of the trainer's own old-log-prob pass, R3
those the rollout engine chose while sampling.

How: a forward hook on every router module (`Qwen3MoeTopKRouter`, the `gate` of a sparse MoE block, which
returns (logits [N, E], weights [N, k], indices [N, k]) for the N tokens of the block's flattened [batch, seq]
input). Inside `RoutingPatch.active(...)`:

- forced indices [N, layers, k] (-1: route this token as the router does) replace the router's top-k; the gate
  weights are recomputed from the router's own logits over the forced experts (softmax over all experts,
  gathered at the forced ones, renormalised when the model normalises its top-k), as Megatron-Core's and
  slime's replay do, so the router still gets a gradient;
- the indices used (forced or chosen) are recorded per layer (`RoutingPatch.routing()`: [N, layers, k]), and
  the router's own top-k before any replay (`RoutingPatch.own_routing()`: what it would have chosen, which the
  routing-mismatch metric compares with the engine's);
- per layer the Switch-Transformer load-balancing loss (transformers' `load_balancing_loss_func`: E x sum_e
  f_e P_e over the real tokens, f_e the share of top-k slots expert e got, P_e its mean router probability) and
  the tokens each expert got are kept (`aux_loss`, `expert_tokens`).

Outside `active` the hooks do nothing, so generation and every other forward are the model's own. A recompute
in backward (activation checkpointing) calls the hooks again: keep the backward inside the same `active` block.
The module is light on what it patches: a model without such routers is dense (`is_moe` False), and a router
whose output is not (logits, weights, indices) is refused by name when the patch is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# router classes whose forward returns (logits [N, E], top-k weights [N, k], top-k indices [N, k])
ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter")


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def is_moe(model: nn.Module) -> bool:
    return bool(moe_routers(model))


@dataclass
class _State:
    forced: Tensor | None  # [N, layers, k] long, -1: the router's own choice
    tokens: Tensor | None  # [N] bool, the real tokens (the loss and the load count only those); None: all
    chosen: dict[int, Tensor] = field(default_factory=dict)  # layer -> [N, k] indices used
    own: dict[int, Tensor] = field(default_factory=dict)  # layer -> [N, k] the router's own top-k (before replay)
    aux: dict[int, Tensor] = field(default_factory=dict)  # layer -> scalar load-balancing loss (with grad)
    load: dict[int, Tensor] = field(default_factory=dict)  # layer -> [E] tokens per expert (real tokens)


class RoutingPatch:
    """Hooks on `model`'s routers; forwards inside `active()` are recorded, replayed and measured."""

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts router ({', '.join(ROUTERS)})")
        first = self.routers[0]
        self.top_k, self.num_experts = int(first.top_k), int(first.num_experts)
        self.state: _State | None = None
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def active(self, forced: Tensor | None = None, tokens: Tensor | None = None) -> Iterator[RoutingPatch]:
        """Record (and with `forced` [N, layers, k], -1 for the router's own choice, replay) the forwards inside.
        `tokens` [N] bool marks the real tokens of a padded input (None: every token is real)."""
        if forced is not None and tuple(forced.shape[1:]) != (self.layers, self.top_k):
            raise ValueError(
                f"routing of shape {tuple(forced.shape)} for a model of {self.layers} MoE layers, top-{self.top_k}"
            )
        self.state = _State(forced, tokens)
        try:
            yield self
        finally:
            self.state = None

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            state = self.state
            if state is None:
                return None
            if not (isinstance(output, tuple) and len(output) == 3):
                raise ValueError(f"{type(module).__name__} does not return (logits, weights, indices)")
            logits, weights, indices = output
            state.own[layer] = indices.detach()
            if state.forced is not None:
                forced = state.forced[:, layer].to(indices.device)
                if forced.shape[0] != indices.shape[0]:
                    raise ValueError(f"routing for {forced.shape[0]} tokens, the forward has {indices.shape[0]}")
                indices = torch.where(forced >= 0, forced, indices)
                probs = F.softmax(logits, dim=-1, dtype=torch.float)
                weights = probs.gather(-1, indices)
                if getattr(module, "norm_topk_prob", False):
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                weights = weights.to(logits.dtype)
            state.chosen[layer] = indices.detach()
            state.aux[layer], state.load[layer] = self._balance(logits, indices, state.tokens)
            return logits, weights, indices

        return hook

    def _balance(self, logits: Tensor, indices: Tensor, tokens: Tensor | None) -> tuple[Tensor, Tensor]:
        """The layer's load-balancing loss (with grad through the router's probabilities) and tokens per expert."""
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        real = torch.ones(len(indices), device=indices.device) if tokens is None else tokens.float().to(indices.device)
        count = real.sum().clamp(min=1.0)
        slots = torch.zeros(self.num_experts, device=indices.device).scatter_add_(
            0, indices.reshape(-1), real.repeat_interleave(indices.shape[-1])
        )
        mean_prob = (probs * real[:, None]).sum(dim=0) / count
        return self.num_experts * (slots / count * mean_prob).sum(), slots

    def routing(self) -> Tensor:
        """The indices the last forward used, [N, layers, k] long."""
        return self._stacked("chosen")

    def own_routing(self) -> Tensor:
        """The router's own top-k in the last forward, before any replay replaced it, [N, layers, k] long."""
        return self._stacked("own")

    def _stacked(self, name: str) -> Tensor:
        state = self.state
        per_layer = getattr(state, name) if state is not None else {}
        if len(per_layer) != self.layers:
            raise RuntimeError("no forward of every MoE layer ran inside RoutingPatch.active()")
        return torch.stack([per_layer[i] for i in range(self.layers)], dim=1)

    def aux_loss(self) -> Tensor:
        """The load-balancing loss of the forwards so far, averaged over the MoE layers (0 without a forward)."""
        state = self.state
        if state is None or not state.aux:
            return torch.zeros(())
        return torch.stack(list(state.aux.values())).mean()

    def expert_tokens(self) -> Tensor:
        """[layers, E] tokens each expert got (top-k slots) in the last forward of each layer."""
        state = self.state
        if state is None or len(state.load) != self.layers:
            return torch.zeros(self.layers, self.num_experts)
        return torch.stack([state.load[i].cpu() for i in range(self.layers)])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
