"""A mixture-of-experts policy on the torch backend: routing replay in the trainer's layout, the router's
load-balancing loss and the experts' load per step.

`yatt.models.routing.RoutingPatch` works in the model's input layout: the N tokens of the decoder's flattened
input (a padded micro-batch's B x L, a packed one's N real tokens, a shared prompt once). A `TokenBatch` keeps
routing per sample ([B, L, layers x k], `TokenBatch.routing`), so it follows each sample through balancing,
mini-batches and packing; `forced` lays a micro-batch's routing out as the model reads it and `per_sample` lays
what a forward recorded back per sample (a shared prompt's tokens take the routing of the one copy the packed
row holds).

The routing mismatch: a micro-batch carrying `TokenBatch.engine_routing` (the engine's experts at the positions
that predict its response tokens) has each such position's router's own top-k (before any replay) compared with
the engine's, as sets per MoE layer, per sample (a shared prompt's last token counts for each of its samples);
`MoE.routing_counts` gives the positions compared and those that differ (in any layer, and per layer) since it
was last asked.

Read: `MoE.active` (one micro-batch: replay, record, measure), `MoE.mini_batch_stats` and `MoE.routing_counts`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from yatt.distributed import World
from yatt.models.routing import RoutingPatch
from yatt.tensors import TokenBatch
from yatt.trainers.packing import ModelInputs

# MoE.routing_counts' names: tokens compared, those whose top-k differs in any MoE layer, token-layers compared
# (tokens x MoE layers), those that differ
ROUTING_COUNTS = ("routing/tokens", "routing/tokens_differ", "routing/layers", "routing/layers_differ")


def forced(mb: TokenBatch, inputs: ModelInputs, layers: int, top_k: int) -> Tensor | None:
    """mb.routing in the model's layout, [N, layers, k] (None: no routing to replay)."""
    if mb.routing is None:
        return None
    routing = mb.routing[inputs.owner] if inputs.owner is not None else mb.routing  # packed: the row's tokens
    return routing.reshape(-1, layers, top_k)


def mismatch_counts(own: Tensor, engine: Tensor) -> Tensor:
    """ROUTING_COUNTS of the tokens where `engine` [N, layers, k] is set (>= 0), against `own` [N, layers, k]:
    the top-k as sets, so the order within it does not count."""
    compared = engine[:, 0, 0].to(own.device) >= 0
    own, engine = own[compared].sort(dim=-1).values, engine.to(own.device)[compared].sort(dim=-1).values
    differs = (own != engine).any(dim=-1)  # [n, layers]
    n = float(compared.sum())
    return torch.tensor([n, float(differs.any(dim=-1).sum()), n * own.shape[1], float(differs.sum())])


def keep_routing(batch: TokenBatch, rows: Tensor, routing: Tensor) -> None:
    """batch.routing's `rows` (created, -1 elsewhere, if the batch had none) := `routing` [len(rows), L', ...]."""
    if batch.routing is None:
        batch.routing = torch.full((*batch.input_ids.shape, *routing.shape[2:]), -1, dtype=torch.long)
    batch.routing[rows[:, None], torch.arange(routing.shape[1])] = routing


def real_tokens(mb: TokenBatch, inputs: ModelInputs) -> Tensor | None:
    """[N] bool, the model input's real tokens (None: all of them, as a packed row's)."""
    return None if inputs.owner is not None else mb.attention_mask.reshape(-1).bool()


def per_sample(recorded: Tensor, mb: TokenBatch, inputs: ModelInputs) -> Tensor:
    """A forward's routing [N, layers, k] as mb's [B, L, layers x k], -1 at padding."""
    count, width = mb.input_ids.shape
    recorded = recorded.flatten(1)
    tail = recorded.shape[1:]
    if inputs.index is not None:
        index = inputs.index
        out = recorded.new_full((count, width, *tail), -1)
        real = index >= 0
        out[real] = recorded[index[real]]
        return out
    out = recorded.reshape(count, width, *tail).clone()
    out[~mb.attention_mask.bool()] = -1
    return out


class MoE:
    """The routing patch of one MoE policy and its load-balancing coefficient."""

    def __init__(self, module: nn.Module, aux_loss_coef: float | None):
        self.patch = RoutingPatch(module)
        # trainer.torch.router_aux_loss_coef, else the model config's (transformers' own default)
        default = getattr(module.config, "router_aux_loss_coef", 0.0)
        self.aux_loss_coef = float(default if aux_loss_coef is None else aux_loss_coef)
        self.load = torch.zeros(self.patch.layers, self.patch.num_experts)
        self.aux = 0.0
        self.mismatch = torch.zeros(len(ROUTING_COUNTS))  # since routing_counts was last asked

    @contextmanager
    def active(self, mb: TokenBatch, inputs: ModelInputs) -> Iterator[RoutingPatch]:
        """Replay mb's routing (where set) and record this forward's; keep backward inside too (a recompute).
        With mb.engine_routing, count the tokens whose router chose other experts than the engine's."""
        layers, k = self.patch.layers, self.patch.top_k
        with self.patch.active(forced(mb, inputs, layers, k), real_tokens(mb, inputs)) as patch:
            yield patch
            if mb.engine_routing is not None and len(patch.state.own) == layers:  # a forward ran
                # per sample: a shared prompt's last token predicts each sample's first response token
                own = per_sample(patch.own_routing(), mb, inputs).reshape(-1, layers, k)
                self.mismatch += mismatch_counts(own, mb.engine_routing.reshape(-1, layers, k))

    def routing_counts(self) -> dict[str, float]:
        """This rank's ROUTING_COUNTS since the last call (and reset): tokens compared with the engine's routing,
        those whose router's own top-k differs in any MoE layer; token-layers compared, and those that differ."""
        counts = dict(zip(ROUTING_COUNTS, self.mismatch.tolist()))
        self.mismatch.zero_()
        return counts

    def recorded(self, mb: TokenBatch, inputs: ModelInputs) -> Tensor:
        """The routing the last forward used, per sample [B, L, layers x k] on CPU."""
        return per_sample(self.patch.routing(), mb, inputs).cpu()

    def aux_loss(self, share: float) -> Tensor:
        """This micro-batch's load-balancing loss times the coefficient and its `share` of the rank's tokens
        (the mini-batch's loss is then the token-weighted mean); counts its load for the step's metrics."""
        self.load += self.patch.expert_tokens()
        aux = self.patch.aux_loss()
        self.aux += float(aux.detach()) * share
        return aux * (self.aux_loss_coef * share)

    def mini_batch_stats(self, world: World) -> dict[str, float]:
        """moe/ metrics of the mini-batch (summed over ranks: a collective), and reset: the load-balancing loss
        (this rank's), tokens per expert (top-k slots) max and mean, averaged over the MoE layers."""
        load = torch.tensor(world.sum(self.load.flatten().tolist())).view_as(self.load)
        stats = {
            "moe/aux_loss": self.aux,
            "moe/tokens_per_expert_max": float(load.max(dim=1).values.mean()),
            "moe/tokens_per_expert_mean": float(load.mean(dim=1).mean()),
        }
        self.load.zero_()
        self.aux = 0.0
        return stats
