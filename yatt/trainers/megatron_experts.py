"""A Qwen3-MoE layer's router and experts, Hugging Face <-> megatron-core names, and how expert parallelism
splits them. The rest of the layer (attention, norms) is `yatt.trainers.megatron_model`'s.

- The router: HF `mlp.gate.weight` [E, H] is megatron's `mlp.router.weight`, replicated on every rank.
- Expert e: HF's gate and up rows ([I, H] each) are megatron's `linear_fc1` = [gate; up] and its down [H, I] is
  `linear_fc2`, as in a dense layer. Experts are never split by tensor parallelism here (megatron's expert
  tensor parallel size is 1), only shared out by expert parallelism: EP rank r holds experts
  [r * E / EP, (r + 1) * E / EP) as its `mlp.experts.local_experts.{0..E/EP-1}`.
- HF folders hold the experts one by one on disk (`mlp.experts.{e}.gate_proj.weight`, ...), transformers 5's
  modules fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H] = per expert [gate; up], `mlp.experts.down_proj`
  [E, H, I]); both are read, and weights go out fused, under the names the torch backend's policy sends engines
  and writes in exports (`model.load_state_dict` takes them).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

ROUTER = "mlp.router.weight"
_LOCAL = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")


def is_moe(hf: Any) -> bool:
    return bool(getattr(hf, "num_experts", None)) and hf.model_type == "qwen3_moe"


def is_expert(name: str) -> bool:
    """A megatron name of an expert's weight (held by one EP rank, never split over TP)."""
    return ".local_experts." in name


def local_experts(hf: Any, ep: int, ep_rank: int) -> range:
    """Global indices of the experts EP rank `ep_rank` holds."""
    per = hf.num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def _hf_expert(hf_layer: dict[str, Tensor], e: int) -> tuple[Tensor, Tensor]:
    """Expert e's fc1 ([gate; up]) and fc2 from an HF layer in either layout (per expert on disk, fused)."""
    if "mlp.experts.gate_up_proj" in hf_layer:
        return hf_layer["mlp.experts.gate_up_proj"][e], hf_layer["mlp.experts.down_proj"][e]
    p = f"mlp.experts.{e}."
    fc1 = torch.cat([hf_layer[p + "gate_proj.weight"], hf_layer[p + "up_proj.weight"]])
    return fc1, hf_layer[p + "down_proj.weight"]


def hf_moe_to_mcore(hf_layer: dict[str, Tensor], hf: Any, ep: int = 1, ep_rank: int = 0) -> dict[str, Tensor]:
    """One layer's router and this EP rank's experts, megatron suffixes."""
    out = {ROUTER: hf_layer["mlp.gate.weight"]}
    for local, e in enumerate(local_experts(hf, ep, ep_rank)):
        fc1, fc2 = _hf_expert(hf_layer, e)
        out[f"mlp.experts.local_experts.{local}.linear_fc1.weight"] = fc1
        out[f"mlp.experts.local_experts.{local}.linear_fc2.weight"] = fc2
    return out


def mcore_moe_to_hf(mc_layer: dict[str, Tensor], hf: Any) -> dict[str, Tensor]:
    """One layer's router and every expert (numbered globally: `globalise` first under EP), HF's fused names."""
    fc1 = [mc_layer[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(hf.num_experts)]
    fc2 = [mc_layer[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(hf.num_experts)]
    return {
        "mlp.gate.weight": mc_layer[ROUTER],
        "mlp.experts.gate_up_proj": torch.stack(fc1),
        "mlp.experts.down_proj": torch.stack(fc2),
    }


def globalise(name: str, hf: Any, ep: int, ep_rank: int) -> str:
    """A local expert's megatron name on EP rank `ep_rank` -> the same name numbered among all experts."""
    m = _LOCAL.search(name)
    if m is None:
        return name
    index = local_experts(hf, ep, ep_rank)[int(m.group(1))]
    return name[: m.start()] + f"mlp.experts.local_experts.{index}.{m.group(2)}"
