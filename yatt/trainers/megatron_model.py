"""A megatron-core `GPTModel` from a Hugging Face Qwen2 / Llama / Qwen3 / Qwen3-MoE config, and the weight
mapping both ways.

megatron-bridge (NVIDIA's HF <-> megatron converter) does not run here (its releases for Python 3.11 pin
transformers < 5 and import Transformer Engine), and the mapping of these architectures is small, so it is
written out here:

- q/k/v are one fused `linear_qkv` whose rows are laid out per key-value group: for each group its query
  heads, then its key head, then its value head (`_fuse_qkv`). Tensor parallelism splits the groups, so a
  rank's shard is a contiguous block of those rows.
- gate/up are one `linear_fc1` = [gate; up]; megatron splits the fc1 output in two halves on each rank, so a
  TP shard is [gate shard; up shard] (`shard` / `unshard` treat fc1 apart).
- The vocabulary is padded to a multiple of the tensor-parallel size (megatron's vocab-parallel layers need
  equal shards) with zero rows; `yatt.trainers.megatron_scoring` masks the padded logits, and the mapping
  back to HF drops the padding.
- Tied embeddings: megatron keeps the word embedding on the first stage and, with pipeline parallelism, a
  copy as the output weight of the last stage (its gradients are summed by `finalize_model_grads`).
- Pipeline parallelism numbers layers per stage from 0: stage s holds global layers
  [s * L / PP, (s + 1) * L / PP).
- Qwen3's norm of each head's queries and keys (`q_norm` / `k_norm`, RMSNorm over the head dim, before rotary
  embeddings) is megatron's `qk_layernorm` (`q_layernorm` / `k_layernorm`), replicated over TP (megatron sums
  its gradient over TP ranks, each of which holds some heads); Qwen3's head_dim is its own field (kv_channels).
- A Qwen3-MoE layer's router and experts: `yatt.trainers.megatron_experts` (names, expert parallelism) and
  `yatt.trainers.megatron_moe` (megatron's MoE layer set up to route as Qwen3-MoE does).
- A value model (head="value", PPO's critic) has no output layer: the last stage holds `value_head`, a
  [1, H] linear with bias replacing it, HF's token-classification `score`. Without sequence parallelism the
  hidden states reaching it are whole on every TP rank, so the head is replicated (not split) over TP.

Names: HF layer names are `model.layers.{i}.*`; megatron's (local spec) `decoder.layers.{i}.*`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from yatt.trainers import megatron_experts as mx
from yatt.trainers.megatron_config import model_refusal

# per-layer names: HF suffix -> megatron suffix (the fused ones are handled apart)
_LAYER_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# how a megatron tensor is split over tensor-parallel ranks: the dim, or None (replicated)
_TP_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "decoder.final_layernorm.weight": None,
    "input_layernorm.weight": None,
    "pre_mlp_layernorm.weight": None,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
    "self_attention.q_layernorm.weight": None,
    "self_attention.k_layernorm.weight": None,
    mx.ROUTER: None,
    "value_head.weight": None,
    "value_head.bias": None,
}
HEADS = ("lm", "value")


def head_dim(hf: Any) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {params.get('rope_type')!r} is not mapped to megatron-core")
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def qkv_bias(hf: Any) -> bool:
    """Qwen2 always has q/k/v biases; Llama when attention_bias is set."""
    return hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))


def qk_norm(hf: Any) -> bool:
    """Qwen3 (dense and MoE) normalises each head's queries and keys."""
    return hf.model_type in ("qwen3", "qwen3_moe")


def check_supported(hf: Any, tp: int, pp: int, ep: int = 1) -> None:
    """The rules of yatt.trainers.megatron_config.model_refusal (checked before the ranks start too)."""
    if why := model_refusal(hf.to_dict(), tp, pp, ep):
        raise ValueError(why)
    rope_theta(hf)


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def transformer_config(hf: Any, tp: int, pp: int, dtype: torch.dtype, ep: int = 1, aux_loss_coef: float | None = None):
    """megatron's TransformerConfig for an HF config; CUDA-only fusions off, no dropout. `ep` and
    `aux_loss_coef` (None: the model config's) apply to a Qwen3-MoE."""
    from megatron.core.transformer import TransformerConfig

    from yatt.trainers.megatron_moe import moe_config

    check_supported(hf, tp, pp, ep)
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf),
        qk_layernorm=qk_norm(hf),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights come from the HF folder
        variable_seq_lengths=True,  # micro-batches have different lengths: pipeline p2p sends shapes first
        moe_token_dispatcher_type="alltoall",  # the default (allgather) refuses variable lengths
        calculate_per_token_loss=False,
        **moe_config(hf, ep, aux_loss_coef),
    )


def build_gpt(
    hf: Any,
    tp: int,
    pp: int,
    pp_rank: int,
    dtype: torch.dtype,
    head: str = "lm",
    ep: int = 1,
    aux_loss_coef: float | None = None,
):
    """This pipeline stage's GPTModel (parallel state must be initialised), weights uninitialised. head="value":
    the last stage's output layer is replaced by `value_head` (nothing shares the embedding then). A Qwen3-MoE's
    MoE layers are `yatt.trainers.megatron_moe.SlicedMoELayer`s (their load recorder: `megatron_moe.attach`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from yatt.trainers.megatron_attention import packed_layer_spec
    from yatt.trainers.megatron_moe import moe_spec

    if head not in HEADS:
        raise ValueError(f"unknown trainer head {head!r}; one of: {', '.join(HEADS)}")

    moe = mx.is_moe(hf)
    spec = get_gpt_layer_local_spec(
        num_experts=hf.num_experts if moe else None, qk_layernorm=qk_norm(hf), normalization="RMSNorm"
    )
    gpt = GPTModel(
        config=transformer_config(hf, tp, pp, dtype, ep, aux_loss_coef),
        # megatron's local layers; core attention also takes packed rows (yatt.trainers.megatron_attention)
        transformer_layer_spec=packed_layer_spec(moe_spec(spec) if moe else spec),
        vocab_size=padded_vocab(hf.vocab_size, tp),
        max_sequence_length=hf.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings) and head == "lm",
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
        rotary_percent=1.0,
    )
    if head == "value" and gpt.post_process:
        gpt.output_layer = None  # no vocabulary-sized weights (nor their Adam state) in a value model
        # skip_init: no draw from the global RNG here (the trainer initialises it as transformers does)
        gpt.value_head = torch.nn.utils.skip_init(torch.nn.Linear, hf.hidden_size, 1, bias=True, dtype=dtype)
    mark_tensor_parallel(gpt)
    return gpt


def mark_tensor_parallel(gpt) -> None:
    """Tag each split weight as megatron's initialisers would. With perform_initialization=False, megatron
    0.16's parallel linear layers never tag their weights (only biases), and the optimizer's gradient norm
    then counts a split weight as a replicated one: on TP rank 0 only, half the norm lost at TP=2."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, p in gpt.named_parameters():
        # an expert is one EP rank's own, never a TP duplicate: counted wherever it is (megatron asks the dense
        # TP rank, so an expert held by TP rank 1 would be left out of the norm)
        dim = 0 if mx.is_expert(name) else tp_dim(name)
        if dim is not None and not getattr(p, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(p, True, dim, 1)


# ---- full (unsharded) tensors: HF <-> megatron names -------------------------------------------------------


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, hf: Any) -> Tensor:
    """[q; k; v] rows regrouped per key-value group: [(q heads of g, k of g, v of g) for g in groups]."""
    groups, d = hf.num_key_value_heads, head_dim(hf)
    per = hf.num_attention_heads // groups
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, per * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    ).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, hf: Any) -> tuple[Tensor, Tensor, Tensor]:
    groups, d = hf.num_key_value_heads, head_dim(hf)
    per = hf.num_attention_heads // groups
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _plain(hf: Any) -> dict[str, str]:
    """The layer's one-to-one names, HF -> megatron: a dense MLP's down projection, Qwen3's q/k norms."""
    names = dict(_LAYER_PLAIN)
    if mx.is_moe(hf):
        del names["mlp.down_proj.weight"]
    if qk_norm(hf):
        names.update({f"self_attn.{x}_norm.weight": f"self_attention.{x}_layernorm.weight" for x in "qk"})
    return names


def hf_layer_to_mcore(hf_layer: dict[str, Tensor], hf: Any, ep: int = 1, ep_rank: int = 0) -> dict[str, Tensor]:
    """One decoder layer, HF suffixes (`self_attn.q_proj.weight`, ...) -> megatron suffixes, full tensors (of a
    MoE layer the router and EP rank `ep_rank`'s experts)."""
    out = {mc: hf_layer[h] for h, mc in _plain(hf).items()}
    a = "self_attn."
    out["self_attention.linear_qkv.weight"] = _fuse_qkv(
        hf_layer[a + "q_proj.weight"], hf_layer[a + "k_proj.weight"], hf_layer[a + "v_proj.weight"], hf
    )
    if qkv_bias(hf):
        out["self_attention.linear_qkv.bias"] = _fuse_qkv(
            hf_layer[a + "q_proj.bias"], hf_layer[a + "k_proj.bias"], hf_layer[a + "v_proj.bias"], hf
        )
    if mx.is_moe(hf):
        return out | mx.hf_moe_to_mcore(hf_layer, hf, ep, ep_rank)
    out["mlp.linear_fc1.weight"] = torch.cat([hf_layer["mlp.gate_proj.weight"], hf_layer["mlp.up_proj.weight"]])
    return out


def mcore_layer_to_hf(mc_layer: dict[str, Tensor], hf: Any) -> dict[str, Tensor]:
    """The inverse of hf_layer_to_mcore; a MoE layer's experts all of them, numbered globally."""
    out = {h: mc_layer[mc] for h, mc in _plain(hf).items()}
    a = "self_attn."
    for kind in ("weight", "bias") if qkv_bias(hf) else ("weight",):
        q, k, v = _split_qkv(mc_layer[f"self_attention.linear_qkv.{kind}"], hf)
        out.update({f"{a}q_proj.{kind}": q, f"{a}k_proj.{kind}": k, f"{a}v_proj.{kind}": v})
    if mx.is_moe(hf):
        return out | mx.mcore_moe_to_hf(mc_layer, hf)
    gate, up = mc_layer["mlp.linear_fc1.weight"].chunk(2)
    out.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
    return out


def hf_extras_to_mcore(hf_state: dict[str, Tensor], hf: Any, tp: int, head: str = "lm") -> dict[str, Tensor]:
    """Embedding, final norm and (untied) output head, full tensors, vocabulary padded. head="value": the
    folder's token-classification `score` as the value head if it has one (a causal LM's folder has not: the
    trainer initialises a new head), never an output layer."""
    rows = padded_vocab(hf.vocab_size, tp)
    out = {
        "embedding.word_embeddings.weight": _pad_rows(hf_state["model.embed_tokens.weight"], rows),
        "decoder.final_layernorm.weight": hf_state["model.norm.weight"],
    }
    if head == "value":
        out.update({f"value_head.{k}": hf_state[f"score.{k}"] for k in ("weight", "bias") if f"score.{k}" in hf_state})
    elif not hf.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(hf_state["lm_head.weight"], rows)
    return out


def mcore_extras_to_hf(mc: dict[str, Tensor], hf: Any) -> dict[str, Tensor]:
    """The inverse of hf_extras_to_mcore: a value model's head becomes `score` (HF's token classification)."""
    out = {
        "model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][: hf.vocab_size],
        "model.norm.weight": mc["decoder.final_layernorm.weight"],
    }
    if "value_head.weight" in mc:
        out.update({f"score.{k}": mc[f"value_head.{k}"] for k in ("weight", "bias")})
    elif not hf.tie_word_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"][: hf.vocab_size]
    return out


# ---- tensor-parallel shards ----------------------------------------------------------------------------------


def tp_dim(name: str) -> int | None:
    """The dim `name` (a megatron name, with or without its layer prefix) is split on over TP ranks."""
    if mx.is_expert(name):  # experts are shared out by expert parallelism, never split over TP
        return None
    for suffix, dim in _TP_DIM.items():
        if name.endswith(suffix):
            return dim
    raise KeyError(f"no tensor-parallel layout known for {name}")


def shard(name: str, full: Tensor, tp_rank: int, tp: int) -> Tensor:
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return full
    if name.endswith("mlp.linear_fc1.weight"):  # [gate; up] -> [gate shard; up shard]
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard(name: str, shards: list[Tensor]) -> Tensor:
    dim = tp_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("mlp.linear_fc1.weight"):
        gates, ups = zip(*(s.chunk(2) for s in shards))
        return torch.cat([*gates, *ups])
    return torch.cat(shards, dim=dim)


# ---- pipeline stages -----------------------------------------------------------------------------------------


def stage_layers(hf: Any, pp: int, pp_rank: int) -> range:
    """Global layer indices held by pipeline stage pp_rank."""
    per = hf.num_hidden_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def layer_owner(hf: Any, pp: int, layer: int) -> int:
    return layer // (hf.num_hidden_layers // pp)


def hf_layer_tensors(hf_state: dict[str, Tensor], layer: int) -> dict[str, Tensor]:
    prefix = f"model.layers.{layer}."
    return {k[len(prefix) :]: v for k, v in hf_state.items() if k.startswith(prefix)}


def local_state_from_hf(
    hf_state: dict[str, Tensor],
    hf: Any,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    tied_output: bool,
    head: str = "lm",
    ep: int = 1,
    ep_rank: int = 0,
) -> dict[str, Tensor]:
    """This (TP rank, PP stage, EP rank)'s megatron state dict from full HF weights. `tied_output`: the stage
    holds the tied output weight (`output_layer.weight` on the last stage when the first is another one)."""
    out: dict[str, Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp - 1
    extras = hf_extras_to_mcore(hf_state, hf, tp, head)
    for name, full in extras.items():
        if (
            name.startswith("embedding.")
            and first
            or name.startswith(("decoder.", "output_layer.", "value_head."))
            and last
        ):
            out[name] = shard(name, full, tp_rank, tp)
    if tied_output:
        out["output_layer.weight"] = shard(
            "output_layer.weight", extras["embedding.word_embeddings.weight"], tp_rank, tp
        )
    for local, layer in enumerate(stage_layers(hf, pp, pp_rank)):
        for suffix, full in hf_layer_to_mcore(hf_layer_tensors(hf_state, layer), hf, ep, ep_rank).items():
            name = f"decoder.layers.{local}.{suffix}"
            out[name] = shard(name, full, tp_rank, tp)
    return out


def hf_from_full_mcore(
    layers: Iterable[tuple[int, dict[str, Tensor]]], extras: dict[str, Tensor], hf: Any
) -> dict[str, Tensor]:
    """HF weights from full (unsharded) megatron tensors: (global layer, {suffix: tensor}) and the extras."""
    out = mcore_extras_to_hf(extras, hf)
    for layer, tensors in layers:
        out.update({f"model.layers.{layer}.{k}": v for k, v in mcore_layer_to_hf(tensors, hf).items()})
    return out
