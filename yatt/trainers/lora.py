"""LoRA on the torch backend: peft adapters injected into the policy in place, and what the trainer reads of them.

Read `Adapters` (the transform and its state), then `AdapterOff` (the reference model it gives for free).

`Adapters(module, cfg)` is the trainer's `Weights` (yatt.trainers.weights) when model.lora is on, one step of its
model chain (yatt.trainers.torch_trainer: load -> freeze -> weights -> checkpointing -> data parallel ->
optimizer): peft's `get_peft_model` replaces each target linear layer
inside `module` by a LoRA layer (the Hugging Face module object stays the one the scorer runs) and freezes every
other weight. What the rest of yatt sees:
- the trainable parameters: the A and B of each adapted layer, nothing else;
- `state()`: those tensors by module name (``model.layers.0.self_attn.q_proj.lora_A``), what a checkpoint holds;
- `hf_weights()`: the whole policy under Hugging Face names with the adapted layers merged (base + B A scaling,
  yatt.models.lora), what an export writes;
- `engine_weights()`: what the weight sync sends, per `model.lora.sync`: the merged weights of the adapted modules
  only (and the other members of a fused q/k/v or gate/up group, which an engine reloads whole), or the adapters;
  `versions()` their versions for a delta sync (a merged weight's are its A's and B's, the frozen base's never change);
- `save_adapter()`: peft's adapter folder (adapter_model.safetensors + adapter_config.json);
- `reference()`: the frozen reference, the same trainer with its adapter off (`AdapterOff`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from yatt.checkpoint.export import ADAPTER_DIR, export_hf
from yatt.models.lora import FUSED, SCALING, A, B, adapter_update, merged_weight
from yatt.models.lora_config import LoRAConfig
from yatt.tensors import NamedTensors
from yatt.trainers.sharding import full, local
from yatt.trainers.weights import WeightChanges

ADAPTER = "default"  # peft's name of the one adapter
PEFT_PREFIX = "base_model.model."  # where peft's PeftModel keeps the Hugging Face model


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name from its name inside an adapted model (``q_proj.base_layer.weight``)."""
    return name.replace(".base_layer.", ".")


def sent_modules(module: nn.Module, adapted: list[str]) -> list[str]:
    """The modules a merged sync sends, in model order: the adapted ones and the rest of any fused group (FUSED)
    one of them belongs to."""
    names, order = set(adapted), {name: i for i, (name, _) in enumerate(module.named_modules())}
    for name in adapted:
        parent, _, leaf = name.rpartition(".")
        for group in FUSED:
            if leaf in group:
                names.update(f"{parent}.{m}" for m in group if f"{parent}.{m}" in order)
    return sorted(names, key=order.__getitem__)


def linear_layers(module: nn.Module) -> list[str]:
    """ "all-linear": the names of the decoder's linear layers (not the output head). Listed here rather than by peft,
    whose shorthand also wraps an MoE's experts, fused 3-D parameters that are no linear layers (the merge and the
    engines' reload take linear weights); a Qwen3-MoE gets attention and the router adapted."""
    head = module.get_output_embeddings()
    return sorted(
        {n.rpartition(".")[2] for n, m in module.named_modules() if isinstance(m, nn.Linear) and m is not head}
    )


class Adapters:
    """The LoRA adapters of one policy module (see the module docstring)."""

    key = "adapter"  # a checkpoint holds the adapters alone: the base is model.path's

    def __init__(self, module: nn.Module, cfg: LoRAConfig):
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer

        self.cfg, self.module = cfg, module
        head = module.get_output_embeddings()
        config = LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=linear_layers(module) if cfg.target_modules == "all-linear" else cfg.target_modules,
            bias="none",
            task_type="CAUSAL_LM",
        )
        try:
            self.peft = get_peft_model(module, config)
        except ValueError as err:  # e.g. no module matches target_modules
            raise ValueError(f"model.lora.target_modules: {str(err).splitlines()[0]}") from None
        assert self.peft.base_model.model is module, "peft must adapt the module in place"
        self.layers: dict[str, LoraLinear] = {}
        for name, layer in module.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            if not isinstance(layer, LoraLinear) or layer.fan_in_fan_out:
                raise ValueError(f"model.lora.target_modules: {name} is a {type(layer).__name__}; only linear layers")
            if layer is head or layer.get_base_layer() is head:
                raise ValueError(f"model.lora.target_modules: {name} is the output head, which is not adapted")
            self.layers[name] = layer
        self.scaling = {name: float(layer.scaling[ADAPTER]) for name, layer in self.layers.items()}
        self.sent = sent_modules(module, list(self.layers))

    # ---- what trains and what a checkpoint holds ----------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters (each layer's A, then B), in a fixed order: the optimizer's."""
        return [
            p for layer in self.layers.values() for p in (layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight)
        ]

    def state(self) -> dict[str, Tensor]:
        """Live references to every adapter tensor, by module name + ``.lora_A`` / ``.lora_B`` (with fsdp2 DTensors,
        which a checkpoint saves as this rank's rows)."""
        out = {}
        for name, layer in self.layers.items():
            out[name + A] = layer.lora_A[ADAPTER].weight.detach()
            out[name + B] = layer.lora_B[ADAPTER].weight.detach()
        return out

    @torch.no_grad()
    def load_state(self, state: dict[str, Tensor]) -> None:
        live = self.state()
        if set(live) != set(state):
            missing, extra = sorted(set(live) - set(state)), sorted(set(state) - set(live))
            raise ValueError(
                f"checkpoint adapters do not fit model.lora: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name, tensor in live.items():
            local(tensor).copy_(local(state[name]))

    # ---- the reference model -------------------------------------------------------------------
    def reference(self, trainer: Any) -> AdapterOff:
        return AdapterOff(trainer, self)

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Forwards inside run the base model: every LoRA layer computes its base layer alone (peft)."""
        with self.peft.disable_adapter():
            yield

    # ---- merged weights ------------------------------------------------------------------------
    def _merged(self, name: str, state: dict[str, Tensor], host: bool) -> Tensor:
        """An adapted layer's merged weight with the adapters of `state`, on the host (`host`: a snapshot's host
        copies) or on the model's device (the live adapters); with fsdp2 each piece gathered (a collective)."""
        base = full(self.layers[name].get_base_layer().weight.detach())
        a, b = full(state[name + A]), full(state[name + B])
        return merged_weight(base.to("cpu") if host else base, a, b, self.scaling[name])

    def base_weights(self, modules: set[str] | None = None) -> Iterator[tuple[str, Tensor]]:
        """The frozen base under Hugging Face names (tied weights once), detached, of `modules` only if given; with
        fsdp2 each gathered when it is reached (a collective: every rank asks for the same modules)."""
        for n, p in self.module.named_parameters():
            name = hf_name(n)
            if ".lora_" not in n and (modules is None or name.rpartition(".")[0] in modules):
                yield name, full(p.detach())

    def hf_weights(self, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The whole policy under Hugging Face names, adapted layers merged; `state`: adapters of a snapshot (the
        base never changes, so the live one is read), None: the live adapters. Merged tensors are new; the others
        are the live base weights."""
        weights, host = dict(self.base_weights()), state is not None
        state = self.state() if state is None else state
        for name in self.layers:
            weights[f"{name}.weight"] = self._merged(name, state, host)
        return weights

    def named_weights(self) -> NamedTensors:
        """The policy under Hugging Face names, adapted layers merged (`hf_weights`)."""
        return list(self.hf_weights().items())

    def engine_weights(self) -> NamedTensors:
        """What the weight sync sends (module docstring), in module order."""
        state = self.state()
        if self.cfg.sync == "adapter":
            return [
                t
                for name in self.layers
                for t in adapter_update(name, full(state[name + A]), full(state[name + B]), self.scaling[name])
            ]
        by_module: dict[str, NamedTensors] = {}
        for name, tensor in self.base_weights(set(self.sent)):
            by_module.setdefault(name.rpartition(".")[0], []).append((name, tensor))
        return [
            (name, self._merged(module, state, False) if module in self.layers and name == f"{module}.weight" else t)
            for module in self.sent
            for name, t in by_module[module]
        ]

    def versions(self, changes: WeightChanges) -> dict[str, int]:
        """The versions of what `engine_weights` sends: an adapter's A and B as they changed, a merged weight as its
        A or B last did; the base (and a scaling) never changes, version 0."""
        a = {name: changes.of(layer.lora_A[ADAPTER].weight) for name, layer in self.layers.items()}
        b = {name: changes.of(layer.lora_B[ADAPTER].weight) for name, layer in self.layers.items()}
        if self.cfg.sync == "adapter":
            return {k: v for m in self.layers for k, v in ((m + A, a[m]), (m + B, b[m]), (m + SCALING, 0))}
        sent = set(self.sent)
        names = [hf_name(n) for n, _ in self.module.named_parameters() if ".lora_" not in n]
        return {
            name: max(a[module], b[module]) if module in self.layers and name == f"{module}.weight" else 0
            for name in names
            if (module := name.rpartition(".")[0]) in sent
        }

    def save_hf(self, folder: str | Path, tokenizer: Any) -> None:
        """What save_pretrained writes, with the adapted layers merged, and peft's adapter folder in adapter/."""
        export_hf(Path(folder), self.hf_weights(), self.module.config, tokenizer)
        if self.module.can_generate():
            self.module.generation_config.save_pretrained(str(folder))
        self.save_adapter(Path(folder) / ADAPTER_DIR)

    # ---- peft's adapter folder -----------------------------------------------------------------
    def host_adapters(self) -> dict[str, Tensor]:
        return {k: full(t).to("cpu", copy=True) for k, t in self.state().items()}

    def save_adapter(self, folder: str | Path, state: dict[str, Tensor] | None = None, write: bool = True) -> None:
        """peft's adapter folder of `state` (a snapshot's adapters; None: the live ones), which
        `PeftModel.from_pretrained(base_model, folder)` loads. With fsdp2 every rank calls it (the live adapters are
        gathered) and the one with `write` writes it."""
        from peft import get_peft_model_state_dict

        state = self.state() if state is None else state
        named = {}
        for name in self.layers:
            named[f"{PEFT_PREFIX}{name}.lora_A.{ADAPTER}.weight"] = full(state[name + A])
            named[f"{PEFT_PREFIX}{name}.lora_B.{ADAPTER}.weight"] = full(state[name + B])
        if not write:
            return
        tensors = get_peft_model_state_dict(self.peft, state_dict=named, save_embedding_layers=False)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(folder / "adapter_model.safetensors"))
        self.peft.peft_config[ADAPTER].save_pretrained(str(folder))


class AdapterOff:
    """The reference model of a LoRA policy: the policy's own trainer with its adapter switched off, so no second
    copy of the model is loaded. Log-probs only (`yatt.trainers.base.Trainer`'s frozen side); its weights are the
    policy's, which offload and onload with the policy."""

    replicated, head, trainable = True, "lm", False

    def __init__(self, trainer: Any, adapters: Adapters):
        self.trainer, self.adapters = trainer, adapters

    def logprobs(self, batch: Any, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        with self.adapters.disabled():
            return self.trainer.logprobs(batch, with_entropy)

    def offload(self) -> dict[str, Any]:
        return {"moved_bytes": 0, "shared_with": "policy"}

    def onload(self) -> dict[str, Any]:
        return {"moved_bytes": 0, "shared_with": "policy"}
