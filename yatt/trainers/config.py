"""The `trainer` section: the backend and the settings every backend reads (each backend's own section sits
beside `backend`: yatt.backends)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from yatt.backends import BackendChoice
from yatt.trainers import TRAINERS


class TrainerConfig(BackendChoice):
    """The training backend and the settings every backend reads; beside `backend` sits that backend's own
    section, e.g. ``torch: {activation_checkpointing: true}`` (`yatt.trainers.torch_config`) or
    ``megatron: {tensor_parallel: 2}`` (`yatt.trainers.megatron_config`), an error when set for a backend that is
    not selected."""

    backends = TRAINERS

    backend: str = Field(
        "torch",
        description="Training backend, a name in yatt.trainers.TRAINERS (torch; megatron, "
        "its section: megatron) or an import path 'package.module:Class'.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weights, gradients and optimizer state; log-probs and losses are float32 either way."
    )
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="Learning rate after warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine: final lr as a fraction of lr.")
    grad_clip: float = Field(1.0, gt=0.0, description="Max global gradient norm.")
    micro_batch_size: int = Field(64, gt=0, description="Sequences per forward/backward.")
    micro_batch_tokens: int = Field(
        2048,
        ge=0,
        description="If > 0, a micro-batch also holds at most this many "
        "tokens (real tokens when pack_sequences, else sequences x longest length): "
        "bounds activation memory whatever the lengths; raise it on GPUs with memory "
        "to spare. 0: micro_batch_size alone.",
    )
    pack_sequences: bool = Field(
        True,
        description="Lay a micro-batch's sequences end to end (no pad tokens in the "
        "linear layers; attention kept per sequence). False: right-padded rows.",
    )
    share_prompts: bool = Field(
        True,
        description="pack_sequences: consecutive samples of the same prompt (a GRPO "
        "group) run it through the model once per micro-batch, their responses attending "
        "to that one copy (exact; yatt.trainers.packing).",
    )

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        return TRAINERS.check(name)

    @property
    def model_parallel(self) -> tuple[int, int]:
        """(tensor, pipeline) parallel sizes the backend splits the model into: ranks per data-parallel rank.
        The backend's section answers (`model_parallel`); a backend without one holds the whole model per rank."""
        return getattr(self.backend_config, "model_parallel", (1, 1))
