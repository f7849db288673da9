"""A vision-language policy on the megatron backend: the folder's own vision tower and connector (its Hugging
Face modules) on the first pipeline stage, in front of the GPTModel built from the folder's text config.

The GPTModel holds the tower as its submodule `vision` (so the trainer's parameter walks, megatron's DDP and
distributed optimizer, checkpoints and weight gathering see it like any other weight), and the scorer puts the
tower's features in the prompts' image slots of the decoder input (yatt.trainers.scoring.place_image_features).

The tower is replicated over TP ranks, not split: every TP rank encodes the same pixels with the same weights,
and the gradient reaching the decoder input is the same on every TP rank (the first column-parallel layer
all-reduces its input's gradient in backward), so the replicas' gradients agree; megatron's gradient norm counts
a replicated weight on TP rank 0 only. A vision tower is small next to its decoder (SigLIP-400M before a 7B
Llama), and its cost grows with images, not tokens; splitting it (megatron-core's multimodal encoders) is for
towers too large to replicate.

Names: the folder's language model lives under a prefix (`model.text_model.` for Idefics3), which maps to the
causal-LM names `model.*` that yatt.trainers.megatron_model reads; the rest of the folder but `lm_head` is
the tower's, `model.<name>` in the folder and `vision.<name>` in the GPTModel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# model_type -> (the inner model's attribute holding the language model, the folder's prefix of its weights)
LANGUAGE = {"idefics3": ("text_model", "model.text_model.")}
TOWER = "vision."  # the GPTModel's submodule holding the tower; "model." in the folder


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def text_config(config: Any) -> Any:
    """The config the GPTModel is built from: a VL folder's text config, or the folder's own."""
    if not is_vision_config(config):
        return config
    if config.model_type not in LANGUAGE:
        raise ValueError(
            f"the megatron backend maps the vision-language families {', '.join(LANGUAGE)}, not {config.model_type}"
        )
    return config.text_config


def split_state(hf_state: dict[str, Tensor], config: Any) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A VL folder's weights -> (the language model's under causal-LM names, the tower's under GPTModel names)."""
    prefix = LANGUAGE[config.model_type][1]
    text, tower = {}, {}
    for name, t in hf_state.items():
        if name.startswith(prefix):
            text["model." + name[len(prefix) :]] = t
        elif name.startswith("lm_head."):
            text[name] = t
        elif name.startswith("model."):
            tower[TOWER + name[len("model.") :]] = t
        else:
            raise ValueError(f"{name}: a weight of neither the language model nor the vision tower")
    return text, tower


def folder_name(name: str, config: Any) -> str:
    """A causal-LM name (yatt.trainers.megatron_model) or a GPTModel tower name -> the VL folder's name."""
    if name.startswith(TOWER):
        return "model." + name[len(TOWER) :]
    if name.startswith("model."):
        return LANGUAGE[config.model_type][1] + name[len("model.") :]
    return name


def build_tower(config: Any, dtype: torch.dtype) -> nn.Module:
    """The folder's inner VL model without its language model: `get_image_features` (vision tower and
    connector) is what the scorer calls. Its weights are loaded with the rest of the GPTModel's."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):  # no memory, no draw from the RNG: the weights come from the folder's state
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    inner = model.model
    setattr(inner, LANGUAGE[config.model_type][0], None)
    if any(True for _ in inner.buffers()):  # a folder holds no buffers: an empty build would leave them unset
        raise ValueError(f"the {config.model_type} vision tower has buffers, which the megatron backend does not set")
    return inner.to_empty(device="cpu")
