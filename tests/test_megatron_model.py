"""The megatron-core GPTModel built from a Hugging Face Qwen2/Llama folder: the weight mapping round-trips
bit-exactly through every TP shard / PP stage, and the logits equal the HF model's (float32, <= 1e-5) in one
process and split over 2 gloo ranks by tensor or pipeline parallelism."""

from __future__ import annotations

import pytest
import torch
from megatron_ranks import logits_body, needs_megatron, run_ranks
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from yatt.models.tiny import TinyModelConfig, write_tiny_model

pytestmark = needs_megatron
# head counts and layers divide by 2; vocabulary 47 does not (padded to 48 under TP=2); head_dim 16
TINY = TinyModelConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mcore") / "qwen2", TINY, seed=3)


@pytest.fixture(scope="module")
def llama_untied(tmp_path_factory):
    """A Llama without q/k/v biases and with an untied output head."""
    torch.manual_seed(4)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        )
    )
    folder = tmp_path_factory.mktemp("mcore") / "llama"
    model.save_pretrained(folder)
    return folder


def round_trip(folder, tp: int, pp: int) -> tuple[dict, dict]:
    from yatt.trainers import megatron_model as mm
    from yatt.trainers.megatron_trainer import read_hf_weights

    hf = AutoConfig.from_pretrained(folder)
    weights = read_hf_weights(folder)
    stages = {
        (t, p): mm.local_state_from_hf(weights, hf, tp, t, pp, p, hf.tie_word_embeddings and pp > 1 and p == pp - 1)
        for t in range(tp)
        for p in range(pp)
    }
    extras = {}
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"):
        for p in range(pp):
            if name in stages[0, p] and not (name == "output_layer.weight" and hf.tie_word_embeddings):
                extras[name] = mm.unshard(name, [stages[t, p][name] for t in range(tp)])
    layers = []
    for layer in range(hf.num_hidden_layers):
        p = mm.layer_owner(hf, pp, layer)
        prefix = f"decoder.layers.{layer - mm.stage_layers(hf, pp, p).start}."
        names = [k for k in stages[0, p] if k.startswith(prefix)]
        layers.append((layer, {k[len(prefix) :]: mm.unshard(k, [stages[t, p][k] for t in range(tp)]) for k in names}))
    return weights, mm.hf_from_full_mcore(layers, extras, hf)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("model", ["qwen2", "llama_untied"])
def test_hf_to_megatron_to_hf_is_bit_exact(request, model, tp, pp):
    weights, back = round_trip(request.getfixturevalue(model), tp, pp)
    assert set(back) == set(weights)
    for name, t in weights.items():
        assert torch.equal(back[name], t), name


def test_tp_shards_split_fused_modules_per_group():
    """A TP shard of linear_qkv holds whole key-value groups; of linear_fc1 [its gate rows; its up rows]."""
    from yatt.trainers import megatron_model as mm

    hf = AutoConfig.for_model(
        "qwen2", hidden_size=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=6, head_dim=2
    )
    q, k, v = (
        torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) + base for n, base in ((8, 0), (4, 1000), (4, 2000))
    )
    fused = mm._fuse_qkv(q, k, v, hf)
    first = mm.shard("decoder.layers.0.self_attention.linear_qkv.weight", fused, 0, 2)
    torch.testing.assert_close(first, torch.cat([q[:4], k[:2], v[:2]]))  # group 0: 2 q heads, its k, its v
    gate, up = torch.zeros(6, 8), torch.ones(6, 8)
    fc1 = mm.shard("decoder.layers.0.mlp.linear_fc1.weight", torch.cat([gate, up]), 1, 2)
    torch.testing.assert_close(fc1, torch.cat([gate[3:], up[3:]]))


# the other layouts of each model run in the slow suite (the round trip above runs all of them in CI)
SLOW_LOGITS = [("qwen2", 1, 1), ("qwen2", 1, 2), ("llama_untied", 1, 1), ("llama_untied", 2, 1)]


@pytest.mark.parametrize(
    "model,tp,pp",
    [("qwen2", 2, 1), ("llama_untied", 1, 2), *(pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_LOGITS)],
)
def test_logits_equal_the_hf_model(request, tmp_path, model, tp, pp):
    folder = request.getfixturevalue(model)
    ids = torch.randint(3, 40, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits
    results = run_ranks(tp * pp, logits_body, tmp_path, str(folder), tp, pp, ids)
    last = [r for r in results if r["pp_rank"] == pp - 1]
    assert len(last) == tp and all(r["logits"] is not None for r in last)
    for r in last:
        assert float((r["logits"] - want).abs().max()) <= 1e-5
