"""Routing replay and the routing mismatch on the megatron backend: what yatt.trainers.moe does on the torch
backend, on megatron-core's MoE layers (yatt.trainers.megatron_moe).

megatron-core's router takes its top-k through the router's `router_replay` object when it has one (megatron's
own `RouterReplay`, which veRL and slime drive through process-wide lists). yatt gives each MoE layer's router a
`LayerReplay` of its own: it computes the router's own top-k, keeps it (to compare with the engine's), replaces
it where the micro-batch's routing is set (>= 0, per token), taking the replayed experts' scores from the same
logits as megatron's replay does (so the gate weights are the router's for those experts, as the torch
backend's replay gives them), and keeps what it used (to record).

Layout. A micro-batch's routing per sample ([B, L, layers x k], TokenBatch.routing) is laid out as the model's
input tokens (`yatt.trainers.moe.forced`: a packed row's N tokens, or B x L padded slots), then sequence-first as
megatron's hidden states are (padded rows: [L, B] flattened), then cut to the slice of tokens the TP rank's
MoE layer routes (`SlicedMoELayer`: TP-padded, split in TP parts). A pipeline stage's layers take their own
columns.

Recording (r2): what each of the stage's layers used, its TP slices gathered over the tensor-parallel group,
laid back per sample (`yatt.trainers.moe.per_sample`); the other stages' layers stay -1 in this rank's batch
(each stage replays only its own in the update).

The mismatch: per compared position (a response token's, where the batch's engine_routing is set), whether
this rank's layers and tokens differ from the engine's, and in how many layers. A position's tokens and layers
are spread over the model-parallel group (TP slices, PP stages), whose ranks see the same micro-batches in the
same order: `counts` takes the maximum of the flags and the sum of the layer counts over that group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from yatt.tensors import TokenBatch
from yatt.trainers.moe import ROUTING_COUNTS, forced, per_sample
from yatt.trainers.packing import ModelInputs


class LayerReplay:
    """One MoE layer's top-k, as megatron-core's router asks its `router_replay` (RouterReplay's interface)."""

    def __init__(self, routing: Routing, layer: int):
        self.routing, self.layer = routing, layer
        self.slice: tuple[int, int] = (0, 0)  # this rank's tokens of the micro-batch (set by the MoE layer)
        self.own: Tensor | None = None  # the router's own top-k of the last forward, [n, k]
        self.used: Tensor | None = None  # the experts it used, [n, k]

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.own = self.used = own.detach()
        target = self.routing.target(self.layer, self.slice, own.shape[0])
        if target is None:
            return probs, own
        self.used = used = torch.where(target[:, :1] >= 0, target.to(own.device), own)
        return scores.gather(1, used), used


class Routing:
    """The replay objects of one model's MoE layers on this rank, and what their forwards recorded and counted."""

    def __init__(self, layers: list[Any], hf: Any, first_layer: int, device: torch.device, measure: bool = True):
        """`measure`: count the mismatch (the policy's trainer; a reference model or critic is never asked, and
        its flags would pile up)."""
        self.layers, self.top_k = hf.num_hidden_layers, hf.num_experts_per_tok
        self.device, self.measure, self.replays = device, measure, []
        for i, layer in enumerate(layers):
            layer.router.router_replay = replay = LayerReplay(self, first_layer + i)
            layer.replay = replay
            self.replays.append(replay)
        self.forced: Tensor | None = None  # the micro-batch's routing, sequence-first [N, layers, k]
        self.recorded: list[tuple[list[int], Tensor]] | None = None  # a recording pass's (rows, routing used)
        self.flags: list[Tensor] = []  # per forward compared: whether each position differs in a layer here
        self.layers_differ = 0.0

    # ---- one micro-batch's forward -----------------------------------------------------------------------
    def begin(self, mb: TokenBatch | None, inputs: ModelInputs | None) -> None:
        """Before the forward of `mb` (None: a zero-loss pass): what its layers replay."""
        routing = forced(mb, inputs, self.layers, self.top_k) if mb is not None else None
        self.forced = None if routing is None else sequence_first(routing, mb, inputs)

    def target(self, layer: int, part: tuple[int, int], n: int) -> Tensor | None:
        """Layer `layer`'s experts to replay on this rank's tokens [start, stop) of the micro-batch, [n, k] with
        -1 rows where none is set (TP padding included); None: nothing to replay."""
        if self.forced is None:
            return None
        start, stop = part
        rows = self.forced[start : min(stop, self.forced.shape[0]), layer]
        if rows.shape[0] < n:
            rows = torch.cat([rows, rows.new_full((n - rows.shape[0], self.top_k), -1)])
        return rows

    def end(self, rows: list[int], mb: TokenBatch, inputs: ModelInputs) -> None:
        """After the forward of `mb` (the batch's `rows`): count its mismatch (where it carries engine_routing)
        and, in a recording pass, keep the routing it used per sample ([B, L, layers x k] on CPU; -1 off this
        stage's layers)."""
        from megatron.core import parallel_state as ps

        self.forced = None
        if self.measure and mb.engine_routing is not None:
            own = model_order(self.full([r.own for r in self.replays], inputs, None), mb, inputs)
            self.compare(per_sample(own, mb, inputs), mb.engine_routing)
        if self.recorded is not None:
            tp = ps.get_tensor_model_parallel_group()
            used = model_order(self.full([r.used for r in self.replays], inputs, tp), mb, inputs)
            self.recorded.append((rows, per_sample(used, mb, inputs).cpu()))

    def take(self) -> list[tuple[list[int], Tensor]]:
        """What the last recording pass kept (none: it was not one), and stop recording."""
        recorded, self.recorded = self.recorded or [], None
        return recorded

    def full(self, parts: list[Tensor], inputs: ModelInputs, tp_group: Any) -> Tensor:
        """The micro-batch's [N, layers, k] (sequence-first) from each of this stage's layers' slice: the slices
        gathered over `tp_group`, or this rank's alone (None: -1 elsewhere). Layers off this stage: -1."""
        n = inputs.kwargs["input_ids"].numel()
        start, stop = self.replays[0].slice
        out = torch.full((stop - start, self.layers, self.top_k), -1, dtype=torch.long, device=parts[0].device)
        for replay, part in zip(self.replays, parts):
            out[:, replay.layer] = part
        if tp_group is not None and dist.get_world_size(tp_group) > 1:  # every rank's slice, in TP rank order
            pieces = [torch.empty_like(out) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(pieces, out, group=tp_group)
            return torch.cat(pieces)[:n]
        whole = out.new_full((max(n, stop), self.layers, self.top_k), -1)
        whole[start:stop] = out
        return whole[:n]

    def compare(self, own: Tensor, engine: Tensor) -> None:
        """Mismatch flags of the positions where `engine` is set, on the layers and tokens this rank routed."""
        own = own.reshape(*own.shape[:2], self.layers, self.top_k)
        engine = engine.to(own.device).reshape(*engine.shape[:2], self.layers, self.top_k)
        compared = engine[:, :, 0, 0] >= 0
        own, engine = own[compared], engine[compared]  # [n, layers, k]
        mine = own[:, :, 0] >= 0
        differs = (own.sort(dim=-1).values != engine.sort(dim=-1).values).any(dim=-1) & mine
        self.flags.append(differs.any(dim=-1).cpu())
        self.layers_differ += float(differs.sum())

    def counts(self) -> dict[str, float]:
        """ROUTING_COUNTS since the last call, over the model-parallel group (a collective of its ranks), and
        reset."""
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        flags = torch.cat(self.flags).float() if self.flags else torch.zeros(0)
        differ = torch.tensor([self.layers_differ], dtype=torch.float64)
        if dist.get_world_size(group) > 1:  # the group's ranks hold as many flags
            flags, differ = flags.to(self.device), differ.to(self.device)
            if flags.numel():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(differ, group=group)
        self.flags, self.layers_differ = [], 0.0
        n = float(flags.numel())
        return dict(zip(ROUTING_COUNTS, [n, float(flags.sum()), n * self.layers, float(differ.sum())]))


def sequence_first(routing: Tensor, mb: TokenBatch, inputs: ModelInputs) -> Tensor:
    """[N, layers, k] in the model's input order -> megatron's hidden-state order: a packed row is the same;
    padded rows [B, L] become [L, B]."""
    if inputs.owner is not None:
        return routing
    count, width = mb.input_ids.shape
    return routing.reshape(count, width, *routing.shape[1:]).transpose(0, 1).reshape(routing.shape)


def model_order(routing: Tensor, mb: TokenBatch, inputs: ModelInputs) -> Tensor:
    """sequence_first's inverse: megatron's hidden-state order -> the model's input order."""
    if inputs.owner is not None:
        return routing
    count, width = mb.input_ids.shape
    return routing.reshape(width, count, *routing.shape[1:]).transpose(0, 1).reshape(routing.shape)
