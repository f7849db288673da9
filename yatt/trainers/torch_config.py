"""`trainer.backend: torch`: its own settings (`trainer.torch`), beside the settings every backend reads.

Light on purpose (pydantic only): the config is checked without importing torch, which `TORCH` builds
(`yatt.trainers.torch_trainer.TorchTrainer`) only when the run starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from yatt.backends import Backend


class TorchConfig(BaseModel):
    """How the torch backend runs a forward and backward: memory against compute, and the numerics."""

    model_config = ConfigDict(extra="forbid")

    logprob_chunk_tokens: int = Field(
        256,
        ge=0,
        description="Run the output head over this many scored tokens at a time (recomputed in backward), so "
        "full-vocabulary logits never exist; 0: all at once.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer in backward instead of keeping its activations: less memory, "
        "~1/3 more compute.",
    )
    parallel: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="How the ranks hold the model (yatt.trainers.sharding). ddp: a whole copy each (~16 bytes a "
        "parameter with AdamW in float32). fsdp2: a 1/N shard each of every weight, gradient and optimizer moment "
        "(torch's fully_shard, per decoder layer), gathered layer by layer for forward and backward.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp2: free each decoder layer's gathered weights after its forward and gather them again "
        "for backward (less memory); false: keep them until backward (less communication).",
    )
    cpu_offload: bool = Field(
        False,
        description="fsdp2 on GPUs: keep the shards and optimizer state in host memory, copied in for each layer "
        "(torch's CPUOffloadPolicy); an error on CPU.",
    )
    autocast: Literal["none", "bfloat16"] = Field(
        "none",
        description="Run forward/backward under bfloat16 autocast (weights stay trainer.dtype); fast on GPUs and on "
        "CPUs with AVX-512 BF16, slow on other CPUs; changes the numerics (the rollout-vs-trainer mismatch shows "
        "how much).",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0.0,
        description="A mixture-of-experts policy: the weight of the router's load-balancing loss (Switch "
        "Transformer's, averaged over the MoE layers) added to the update's loss; null: the model config's "
        "router_aux_loss_coef (0 without one). A dense policy ignores it.",
    )


TORCH = Backend(
    "yatt.trainers.torch_trainer:TorchTrainer",
    section="torch",
    config=TorchConfig,
    lora=True,
    routing_replay=True,  # yatt.trainers.moe
)
