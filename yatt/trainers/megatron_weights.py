"""The policy's weights out of a megatron-core model split over TP ranks and PP stages, under Hugging Face
names, in buckets that never split a decoder layer (engines reload fused q/k/v and gate/up modules whole).

Unit by unit (the embedding / final norm / head, then each decoder layer): the stage that holds the unit
all-gathers its TP shards into full tensors, maps them to HF names, and (PP > 1) broadcasts them to the other
stages, so every rank ends with every unit while holding at most one bucket of gathered weights beyond its
own shard. Across stages the units travel as pickled objects (on `device`: megatron's groups are NCCL-only
on GPUs); tensor broadcasts of known shapes would avoid the pickling on large models. A MoE layer's experts
are all-gathered over the expert-parallel group as well (every EP rank holds some of them), in one collective
per layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from yatt.tensors import NamedTensors
from yatt.trainers import megatron_experts as mx
from yatt.trainers import megatron_model as mm
from yatt.trainers import megatron_vision as mv

_EXTRAS = (
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
    "value_head.weight",  # a value model's (head="value"), replicated over TP
    "value_head.bias",
)


def tp_gather(name: str, t: Tensor, tp: int) -> Tensor:
    """The full tensor of megatron parameter `name` from this rank's shard (a collective over TP)."""
    from megatron.core import parallel_state as ps

    if tp == 1 or mm.tp_dim(name) is None:
        return t.detach()
    shards = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(shards, t.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return mm.unshard(name, shards)


def ep_gather(tensors: dict[str, Tensor], hf: Any, ep: int) -> dict[str, Tensor]:
    """One layer's megatron tensors with its experts from every EP rank, numbered globally (a collective over
    the expert-parallel group: the same local names on every rank, so one flat all-gather)."""
    names = sorted(k for k in tensors if mx.is_expert(k))
    if ep == 1 or not names:
        return tensors
    from megatron.core import parallel_state as ps

    flat = torch.cat([tensors[k].reshape(-1) for k in names])
    parts = [torch.empty_like(flat) for _ in range(ep)]
    dist.all_gather(parts, flat, group=ps.get_expert_model_parallel_group())
    out = {k: v for k, v in tensors.items() if not mx.is_expert(k)}
    sizes = [tensors[k].numel() for k in names]
    for rank, part in enumerate(parts):
        for k, t in zip(names, part.split(sizes)):
            out[mx.globalise(k, hf, ep, rank)] = t.view_as(tensors[k])
    return out


def _units(
    gpt: nn.Module, hf: Any, tp: int, pp: int, pp_rank: int, vision: bool, ep: int = 1
) -> Iterator[tuple[int, int, dict[str, Tensor] | None]]:
    """(owner stage, global layer, full megatron tensors or None if another stage owns them): the
    embedding, final norm and head first (owner and layer -1: every stage holds some), a VL policy's vision
    tower (layer -2: the first stage's, replicated over TP), then each layer."""
    params = dict(gpt.named_parameters())
    yield (
        -1,
        -1,
        {
            name: tp_gather(name, params[name], tp)
            for name in _EXTRAS
            if name in params and not (name == "output_layer.weight" and hf.tie_word_embeddings)
        },
    )
    if vision:
        yield 0, -2, {k: p.detach() for k, p in params.items() if k.startswith(mv.TOWER)} if pp_rank == 0 else None
    for layer in range(hf.num_hidden_layers):
        owner = mm.layer_owner(hf, pp, layer)
        if owner != pp_rank:
            yield owner, layer, None
            continue
        prefix = f"decoder.layers.{layer - mm.stage_layers(hf, pp, owner).start}."
        mine = {k[len(prefix) :]: tp_gather(k, p, tp) for k, p in params.items() if k.startswith(prefix)}
        yield owner, layer, ep_gather(mine, hf, ep)


def hf_units(
    gpt: nn.Module, config: Any, tp: int, pp: int, pp_rank: int, device: torch.device, ep: int = 1
) -> Iterator[dict[str, Tensor]]:
    """The policy as HF tensors (under the names of `config`'s folder, a VL one's included), one unit at a
    time, on every rank of the model-parallel group (and of the expert-parallel group: ep > 1)."""
    from megatron.core import parallel_state as ps

    hf, vision = mv.text_config(config), mv.is_vision_config(config)
    group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
    ranks = dist.get_process_group_ranks(group) if pp > 1 else None
    for owner, layer, tensors in _units(gpt, hf, tp, pp, pp_rank, vision, ep):
        if owner == -1:  # every stage holds some of the extras: each contributes its own
            parts = [tensors]
            if pp > 1:
                parts = [None] * pp
                dist.all_gather_object(parts, {k: v.cpu() for k, v in tensors.items()}, group=group)
            unit = mm.mcore_extras_to_hf({k: v for part in parts for k, v in part.items()}, hf)
        else:
            if pp > 1:
                box = [None if tensors is None else {k: v.cpu() for k, v in tensors.items()}]
                dist.broadcast_object_list(box, src=ranks[owner], group=group, device=device)
                tensors = box[0]
            if layer == -2:  # the vision tower: HF modules, their own names
                unit = tensors
            else:
                unit = {f"model.layers.{layer}.{k}": v for k, v in mm.mcore_layer_to_hf(tensors, hf).items()}
        yield {mv.folder_name(k, config): v for k, v in unit.items()} if vision else unit


def gathered_buckets(
    gpt: nn.Module, config: Any, tp: int, pp: int, pp_rank: int, bucket_bytes: int, device: torch.device, ep: int = 1
) -> Iterator[NamedTensors]:
    """Buckets of about `bucket_bytes` of whole units (a unit larger than that is a bucket alone)."""
    bucket: NamedTensors = []
    size = 0
    for unit in hf_units(gpt, config, tp, pp, pp_rank, device, ep):
        n = sum(t.numel() * t.element_size() for t in unit.values())
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(unit.items())
        size += n
    if bucket:
        yield bucket
