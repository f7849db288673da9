"""LoRA arithmetic shared by the trainer and the engines: the merged weight, and the adapter as a weight update.

The merged weight of an adapted linear layer is ``W + (B @ A) * scaling``, computed exactly as peft's own merge
(`lora_delta` is peft's `get_delta_weight`), so weights merged here equal peft's `merge_and_unload` bit for bit.

With `model.lora.sync: adapter` the weight sync sends, per adapted module ``m`` (e.g.
``model.layers.0.self_attn.q_proj``), three tensors in one `update_weights` call:
``m.lora_A`` [rank, in], ``m.lora_B`` [out, rank] and ``m.lora_scaling`` (one float64, which the engine client
does not cast). An engine that declares ``adapters`` (its registry entry, yatt.backends) takes them itself: the hf
engine merges them into its own copy of ``m.weight`` as the model folder gave it (`merge_adapter_updates`), so its
weights equal the trainer's merged ones when both run float32; the vLLM engine serves them through vLLM's LoRA layers
(yatt.engines.vllm_lora). Both read an update with `split_adapter_updates`. Weight buckets keep a decoder layer
whole, so a module's three tensors always arrive together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

A, B, SCALING = ".lora_A", ".lora_B", ".lora_scaling"
# modules an engine may fuse into one (vLLM's qkv_proj, gate_up_proj) and reload only whole: a merged sync sends
# every member of a group one of whose members is adapted
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

NamedTensors = list[tuple[str, Tensor]]


def lora_delta(lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """(B @ A) * scaling in B's dtype; half-precision on CPU is multiplied in float32 (as peft does)."""
    upcast = lora_b.device.type == "cpu" and lora_b.dtype in (torch.float16, torch.bfloat16)
    if upcast:
        lora_a, lora_b = lora_a.float(), lora_b.float()
    delta = (lora_b @ lora_a) * scaling
    return delta.to(lora_b.dtype) if upcast else delta


def merged_weight(base: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """The adapted layer's weight: base + (B @ A) * scaling, a new tensor (peft's merge adds in place)."""
    out = base.detach().clone()
    out += lora_delta(lora_a, lora_b, scaling)
    return out


def adapter_update(module: str, lora_a: Tensor, lora_b: Tensor, scaling: float) -> NamedTensors:
    """One adapted module as the tensors of a weight update (the module docstring's wire format)."""
    return [
        (module + A, lora_a),
        (module + B, lora_b),
        (module + SCALING, torch.tensor([scaling], dtype=torch.float64)),
    ]


def is_adapter_tensor(name: str) -> bool:
    return name.endswith((A, B, SCALING))


@dataclass(frozen=True)
class AdapterUpdate:
    """One module's adapter as a weight update carries it: ``W + (lora_b @ lora_a) * scaling``."""

    lora_a: Tensor  # [rank, in]
    lora_b: Tensor  # [out, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


def split_adapter_updates(named_tensors: NamedTensors) -> tuple[dict[str, AdapterUpdate], NamedTensors]:
    """The adapters of a weight update by module (``model.layers.0.self_attn.q_proj``) and its other tensors, in
    order. Raises ValueError for a module whose A, B or scaling is missing, or whose A and B are not matrices of one
    rank."""
    parts: dict[str, dict[str, Tensor]] = {}
    rest: NamedTensors = []
    for name, tensor in named_tensors:
        suffix = next((s for s in (A, B, SCALING) if name.endswith(s)), None)
        if suffix is None:
            rest.append((name, tensor))
        else:
            parts.setdefault(name[: -len(suffix)], {})[suffix] = tensor
    adapters = {}
    for module, got in parts.items():
        missing = [s for s in (A, B, SCALING) if s not in got]
        if missing:
            raise ValueError(f"adapter update of {module!r} lacks {', '.join(module + s for s in missing)}")
        lora_a, lora_b = got[A], got[B]
        if lora_a.dim() != 2 or lora_b.dim() != 2:
            raise ValueError(
                f"adapter update of {module!r}: A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} are not matrices"
            )
        if lora_a.shape[0] != lora_b.shape[1]:
            raise ValueError(f"adapter update of {module!r}: A's rank {lora_a.shape[0]}, B's {lora_b.shape[1]}")
        adapters[module] = AdapterUpdate(lora_a, lora_b, float(got[SCALING].reshape(-1)[0]))
    return adapters, rest


def merge_adapter_updates(named_tensors: NamedTensors, base: Callable[[str], Tensor]) -> NamedTensors:
    """A weight update with its adapter tensors replaced by the merged weights they stand for (``m.weight``); the
    other tensors pass through. `base(name)` is the engine's base weight of that name. Raises ValueError (before
    anything is changed) for a module whose A, B or scaling is missing or whose shapes do not fit."""
    adapters, out = split_adapter_updates(named_tensors)
    for module, update in adapters.items():
        weight = base(f"{module}.weight")
        lora_a, lora_b = update.lora_a.to(weight.device, weight.dtype), update.lora_b.to(weight.device, weight.dtype)
        if (lora_b.shape[0], lora_a.shape[1]) != tuple(weight.shape):
            raise ValueError(
                f"adapter update of {module!r}: A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit "
                f"its weight {tuple(weight.shape)}"
            )
        out.append((f"{module}.weight", merged_weight(weight, lora_a, lora_b, update.scaling)))
    return out
