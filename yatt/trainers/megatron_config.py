"""`trainer.backend: megatron`: its own settings (`trainer.megatron`) and preflight checks.

Light on purpose (pydantic only): the config is checked without importing megatron-core or torch, which
`MEGATRON` builds (`yatt.trainers.megatron_trainer.MegatronTrainer`) only when the run starts.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from yatt.backends import Backend

if TYPE_CHECKING:
    from yatt.trainers.config import TrainerConfig


class MegatronConfig(BaseModel):
    """How the model is split. Data parallel = ranks / (tensor_parallel x pipeline_parallel); the ranks of one
    tensor/pipeline group train on the same samples. A mixture-of-experts policy's experts are split apart, over
    `expert_parallel` ranks (yatt.trainers.megatron_moe)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel: int = Field(
        1,
        gt=0,
        description="Split every layer's weights (attention heads, MLP, "
        "vocabulary) over this many ranks; divides the key-value heads.",
    )
    pipeline_parallel: int = Field(
        1,
        gt=0,
        description="Split the decoder layers into this many consecutive "
        "stages, one per rank; divides the number of layers.",
    )
    expert_parallel: int = Field(
        1,
        gt=0,
        description="A mixture-of-experts policy: split each MoE layer's experts over this many ranks, tokens "
        "sent to their experts' rank and back (all-to-all); divides the experts per layer and ranks / "
        "pipeline_parallel (tensor x data parallel: the expert ranks may be the tensor-parallel ones).",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0.0,
        description="A mixture-of-experts policy: the weight of the router's load-balancing loss, meant as "
        "trainer.torch's (Switch Transformer's, a balanced router giving top-k, averaged over the MoE layers); "
        "null: the model config's router_aux_loss_coef (0 without one). A dense policy ignores it.",
    )
    host_collectives: bool = Field(
        True,
        description="On CPU, tensor-parallel all-reduces among ranks of one host go through shared memory "
        "instead of gloo (yatt.trainers.megatron_collectives); the same sums. No effect on GPUs.",
    )

    @property
    def model_parallel(self) -> tuple[int, int]:
        """(tensor, pipeline) parallel sizes: `TrainerConfig.model_parallel` asks the backend's section."""
        return self.tensor_parallel, self.pipeline_parallel


# the model types yatt.trainers.megatron_model maps (qwen3: q/k norm; qwen3_moe: with megatron_experts' MoE)
SUPPORTED = ("qwen2", "llama", "qwen3", "qwen3_moe")


def model_refusal(config: dict, tp: int, pp: int, ep: int = 1) -> str | None:
    """Why the megatron backend cannot train a model (its config.json as a dict, a VL model's text_config), or
    None: read before any rank starts (yatt.refusals) and again when the model is built (megatron_model)."""
    hf = config.get("text_config") or config if "vision_config" in config else config
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        return f"the megatron backend maps {', '.join(SUPPORTED)} models, not {kind}"
    if why := _moe_refusal(hf, ep):
        return why
    if hf.get("use_sliding_window") or hf.get("mlp_bias"):
        return "sliding-window attention and MLP biases are not mapped to megatron-core"
    if (act := hf.get("hidden_act", "silu")) != "silu":
        return f"hidden_act {act} is not mapped (SwiGLU only)"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if (scaling := rope.get("rope_type", rope.get("type", "default"))) != "default":
        return f"rope scaling {scaling!r} is not mapped to megatron-core"
    heads = hf.get("num_attention_heads", 1)
    for what, count in (
        ("num_key_value_heads", hf.get("num_key_value_heads") or heads),
        ("num_attention_heads", heads),
    ):
        if count % tp:
            return f"{what}={count} does not split over tensor_parallel={tp}"
    if (layers := hf.get("num_hidden_layers", 1)) % pp:
        return f"num_hidden_layers={layers} does not split over pipeline_parallel={pp}"
    return None


def _moe_refusal(hf: dict, ep: int) -> str | None:
    """What of a mixture-of-experts config the mapping does not cover (yatt.trainers.megatron_moe)."""
    # transformers 5 writes num_local_experts (num_experts is its attribute alias)
    experts = hf.get("num_local_experts") or hf.get("num_experts") if hf.get("model_type") == "qwen3_moe" else None
    if not experts:
        return f"trainer.megatron.expert_parallel={ep} needs a mixture-of-experts model" if ep > 1 else None
    if experts % ep:
        return f"num_experts={experts} does not split over trainer.megatron.expert_parallel={ep}"
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        return "dense MLP layers among the MoE ones (mlp_only_layers, decoder_sparse_step) are not mapped"
    if hf.get("num_experts_per_tok", 1) == 1 and hf.get("norm_topk_prob", True):
        return "top-1 routing with norm_topk_prob is not mapped (megatron's router refuses it)"
    return None


def preflight(trainer: TrainerConfig, world_size: int) -> None:
    """What megatron needs of the launch (ValueError naming the fields)."""
    tp, pp = trainer.model_parallel
    if world_size % (tp * pp):
        raise ValueError(
            f"trainer.megatron.tensor_parallel x pipeline_parallel = {tp * pp} must divide "
            f"the {world_size} ranks launched (data parallel = ranks / that)"
        )
    ep = trainer.backend_config.expert_parallel
    if (world_size // pp) % ep:
        raise ValueError(
            f"trainer.megatron.expert_parallel={ep} must divide the {world_size // pp} ranks of a pipeline "
            f"stage (tensor x data parallel = ranks / pipeline_parallel)"
        )
    if importlib.util.find_spec("megatron") is None:
        raise ValueError("trainer.backend=megatron needs megatron-core: pip install 'yatt[megatron]'")


MEGATRON = Backend(
    "yatt.trainers.megatron_trainer:MegatronTrainer",
    section="megatron",
    config=MegatronConfig,
    preflight=preflight,
    lora="its layers are megatron-core's tensor-parallel linears, which peft does not adapt, and its weights "
    "reach engines and checkpoints as gathered shards, which know no adapters yet",
    routing_replay=True,  # yatt.trainers.megatron_routing
)
