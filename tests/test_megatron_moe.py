"""Qwen3 (q/k norm, a head dim of its own) and Qwen3-MoE on the megatron backend: the weight mapping round-trips
bit-exactly through TP shards and EP ranks, and the log-probs and the gradient of a weighted sum of them equal
the Hugging Face model's (float32, <= 1e-5) at TP=1 and TP=2, and for the MoE at EP=1, EP=2 and TP=2 x EP=2."""

from __future__ import annotations

import pytest
import torch
from megatron_ranks import grad_body, needs_megatron, run_ranks
from transformers import AutoConfig, AutoModelForCausalLM

from yatt.models.tiny import build_char_tokenizer

pytestmark = needs_megatron


def _write(folder, architecture: str, seed: int):
    """A tiny Qwen3 / Qwen3-MoE whose head_dim (24) is not hidden / heads (16), untied, random norms."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = build_char_tokenizer("0123456789+=abcdefghij")
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        tie_word_embeddings=architecture == "qwen3",
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    if architecture == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
    else:
        config = Qwen3MoeConfig(
            **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
        model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # norms away from 1 and a router that separates experts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "mlp.gate." in name:
                p.normal_(0.0, 0.5)
    model.float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("mcore") / "qwen3", "qwen3", 5)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("mcore") / "qwen3_moe", "qwen3_moe", 6)


def _hf(folder, ids, weights):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logits = model(ids).logits[:, :-1]
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    (logp * weights).sum().backward()
    return logp.detach(), {k: p.grad for k, p in model.named_parameters()}


def _inputs():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 25, (4, 9), generator=gen)
    return ids, torch.rand(4, 8, generator=gen)


def check_against_hf(folder, tmp_path, tp: int, ep: int, ranks: int) -> None:
    ids, weights = _inputs()
    want_logp, want_grads = _hf(folder, ids, weights)
    results = run_ranks(ranks, grad_body, tmp_path, str(folder), tp, ep, ids, weights)
    for r in results:
        assert float((r["logp"] - want_logp[r["rows"]]).abs().max()) <= 1e-5
        assert set(r["grads"]) == set(want_grads)
        for name, g in r["grads"].items():
            assert float((g - want_grads[name]).abs().max()) <= 1e-5, name


def test_round_trip_is_bit_exact_over_tp_and_ep(qwen3_moe):
    """HF -> (TP rank, EP rank) shards -> HF: the experts fused as transformers holds them in memory."""
    from yatt.trainers import megatron_model as mm
    from yatt.trainers.megatron_experts import globalise, is_expert
    from yatt.trainers.megatron_trainer import read_hf_weights

    hf = AutoConfig.from_pretrained(qwen3_moe)
    weights = read_hf_weights(qwen3_moe)
    want = AutoModelForCausalLM.from_pretrained(qwen3_moe, dtype=torch.float32).state_dict()
    tp, ep = 2, 2
    shards = {
        (t, e): mm.local_state_from_hf(weights, hf, tp, t, 1, 0, False, "lm", ep, e) for t in (0, 1) for e in (0, 1)
    }
    full: dict = {}
    for name in shards[0, 0]:
        if is_expert(name):
            for e in range(ep):
                full[globalise(name, hf, ep, e)] = shards[0, e][name]
        else:
            full[name] = mm.unshard(name, [shards[t, 0][name] for t in range(tp)])
    extras = {k: v for k, v in full.items() if not k.startswith("decoder.layers.")}
    layers = []
    for layer in range(hf.num_hidden_layers):
        prefix = f"decoder.layers.{layer}."
        layers.append((layer, {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}))
    back = mm.hf_from_full_mcore(layers, extras, hf)
    assert set(back) == set(want)
    for name, t in want.items():
        assert torch.equal(back[name], t), name


# TP=1 slow: TP=2 maps the same q/k norms and head size, sliced (CI keeps one real Qwen3 exactness run)
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_qwen3_logprobs_and_grads_equal_hf(qwen3, tmp_path, tp):
    check_against_hf(qwen3, tmp_path, tp, 1, tp)


def test_qwen3_moe_ep2_logprobs_and_grads_equal_hf(qwen3_moe, tmp_path):
    """The short MoE check: experts split over 2 ranks (data parallel 2), tokens sent all-to-all."""
    check_against_hf(qwen3_moe, tmp_path, 1, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,ranks", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (2, 2, 4)])
def test_qwen3_moe_logprobs_and_grads_equal_hf(qwen3_moe, tmp_path, tp, ep, ranks):
    """EP=1; TP=2 (each rank routing its slice of the tokens, every expert on both); TP=2 x EP=2 on 2 ranks
    (the experts shared out over the tensor-parallel ranks) and on 4 (data parallel 2)."""
    check_against_hf(qwen3_moe, tmp_path, tp, ep, ranks)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,ep,rows",
    [
        (1, 1, 2, [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]]),
        (2, 1, 2, None),
        (1, 2, 1, None),
        (1, 2, 1, [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]),
        # groups whole on each rank, as the reference's one rank holds them: a group split over ranks (balancing
        # with keep_groups off) has its shared prompt forwarded, so routed and counted, on each (rows 0-4 | 5-9
        # split GROUPS' third group: 4 more tokens per layer than the reference, which forwards its prompt once)
        (1, 2, 2, [[0, 1, 2, 3, 7], [4, 5, 6, 8, 9]]),
    ],
    ids=str,
)
def test_moe_rl_step_equals_the_torch_backend(tmp_path, tp, pp, ep, rows):
    """One RL step of a tiny Qwen3-MoE through the Trainer interface (megatron's DDP, distributed optimizer with
    its expert part, the router's TP sum in finalize) equals the torch backend's: grad norm, loss sums, every
    updated weight within 1e-5, and the experts' load metrics; EP=2 x DP=2 (uneven rows: zero-loss passes in
    the all-to-all), TP=2 x EP=2 on 2 ranks, PP=2 (one MoE layer per stage) alone and x DP=2 (uneven), and
    PP=2 x EP=2 x DP=2 on 4. The balancing loss is off on both (their weighting differs)."""
    from megatron_ranks import trainer_step_body
    from test_megatron_trainer import TRAIN, torch_step

    from yatt.models.tiny import TinyModelConfig, write_tiny_model

    tiny = TinyModelConfig(
        architecture="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, moe_intermediate_size=32, router_aux_loss_coef=0.0,
    )  # fmt: skip
    policy = write_tiny_model(tmp_path / "policy", tiny, seed=7)
    want = torch_step(policy, pack=True)
    batch, dp = want["batch"], 1 if rows is None else len(rows)
    rows = rows or [list(range(len(batch)))]
    tokens, seqs, norm_length = want["denominators"]
    results = run_ranks(
        tp * pp * dp, trainer_step_body, tmp_path / "ranks", str(policy), tp, pp, batch, rows,
        (tokens / dp, seqs / dp, norm_length), TRAIN, False, {"expert_parallel": ep},
    )  # fmt: skip
    for r in results:
        assert abs(r["stats"]["grad_norm"] - want["stats"]["grad_norm"]) <= 1e-5, (r["stats"], want["stats"])
        for key in ("moe/tokens_per_expert_max", "moe/tokens_per_expert_mean"):
            assert abs(r["stats"][key] - want["stats"][key]) <= 1e-9, key
        assert set(r["weights"]) == set(want["weights"])
        for name, w in want["weights"].items():
            assert float((r["weights"][name] - w).abs().max()) <= 1e-5, name
    by_dp = {r["dp_rank"]: r for r in results}
    for key in want["stats"]:
        if not key.startswith(("moe/", "grad_norm", "lr", "skipped")):
            assert abs(sum(by_dp[d]["stats"][key] for d in range(dp)) - want["stats"][key]) <= 1e-5, key


@pytest.fixture(scope="module")
def replay_case(tmp_path_factory):
    """Two prompts x 4 samples of a tiny Qwen3-MoE from the hf engine, with the experts it routed every token to
    (as the trainer reads them: token_batch), and a copy of the model with every router nudged, which both
    backends load: its own top-k differs from the engine's on some tokens, so replaying changes the log-probs."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_moe_routing import MOE

    from yatt.controllers.policy import token_batch
    from yatt.data.rollout import Rollout
    from yatt.engines.base import SamplingSpec, generate
    from yatt.engines.config import EngineConfig
    from yatt.engines.hf_engine import HFEngine
    from yatt.models.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("replay")
    # the balancing loss off on both backends (their weighting differs: test_moe_rl_step_equals_the_torch_backend)
    # 2 key-value heads (TP=2 splits them)
    tiny = MOE.model_copy(update={"router_aux_loss_coef": 0.0, "num_attention_heads": 4, "num_key_value_heads": 2})
    folder = write_tiny_model(root / "policy", tiny, seed=3)
    engine = HFEngine(str(folder), EngineConfig(), seed=0)
    prompts = [[4, 5, 13, 6, 14], [7, 13, 8, 8, 14]]  # "1+2=", "4+55="
    groups = generate(engine, prompts, SamplingSpec(n=4, temperature=1.0, max_tokens=6, routed_experts=True), [23, 123])
    rollouts = [
        Rollout(None, p, c.token_ids, c.logprobs, c.finish_reason, routed_experts=c.routed_experts)
        for p, group in zip(prompts, groups)
        for c in group
    ]
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)
    # seeds whose samples hold no pad token (id 0): transformers' embedding gives the pad row no gradient
    # (padding_idx), megatron's does, so an update on such a sample differs between the backends
    assert not (batch.input_ids[batch.attention_mask.bool()] == 0).any()
    gen = torch.Generator().manual_seed(2)
    batch.extras.update(old_logprobs=batch.extras["rollout_logprobs"].clone(), advantages=torch.randn(8, generator=gen))
    nudged = shutil.copytree(folder, root / "nudged")
    weights = load_file(nudged / "model.safetensors")
    for name in [n for n in weights if n.endswith("mlp.gate.weight")]:
        weights[name] = weights[name] + 0.5 * torch.randn(weights[name].shape, generator=gen)
    save_file(weights, nudged / "model.safetensors")
    return nudged, batch


def per_layer(routing: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """[B, L, layers x k] routing's columns of `layers` (k = 2)."""
    return routing.reshape(*routing.shape[:2], -1, 2)[:, :, layers]


@pytest.mark.parametrize(
    "tp,pp,ep,rows,pack",
    [
        (1, 1, 2, [[0, 1, 2, 3], [4, 5, 6, 7]], True),
        pytest.param(2, 1, 2, None, False, marks=pytest.mark.slow),
        pytest.param(1, 2, 1, None, True, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_megatron_replays_and_records_routing_as_the_torch_backend(tmp_path, replay_case, tp, pp, ep, rows, pack):
    """Routing replay on megatron's MoE layers (yatt.trainers.megatron_routing) against the torch backend's
    (yatt.trainers.moe), on the hf engine's routing of real samples and a nudged router: a log-prob pass replaying
    the engine's experts (r3) gives the same log-probs, records the same experts and counts the same routing
    mismatch; a pass without replay records the router's own experts (r2's record), as the torch backend does;
    an update replaying the engine's experts gives the same grad norm and weights. EP=2 x DP=2 (packed, shared
    prompts), TP=2 x EP=2 (padded rows: megatron's sequence-first order, TP slices), PP=2 (a layer per stage)."""
    from megatron_ranks import routing_body, routing_passes

    from yatt.distributed import World
    from yatt.trainers.config import TrainerConfig
    from yatt.trainers.torch_trainer import TorchTrainer

    folder, batch = replay_case
    kwargs = dict(lr=1e-3, micro_batch_size=3, pack_sequences=pack)
    tokens, seqs = float(batch.mask.sum()), float(len(batch))
    world = World(0, 1, 0, torch.device("cpu"))
    want = routing_passes(TorchTrainer(folder, TrainerConfig(**kwargs), world, total_steps=4), batch, (tokens, seqs, 6))
    assert want["counts"]["routing/tokens_differ"] > 0  # the nudge moved some tokens' experts
    assert (want["replayed"] - want["own_lp"]).abs().max() > 1e-3  # so replaying them matters
    dp = 1 if rows is None else len(rows)
    rows = rows or [list(range(len(batch)))]
    results = run_ranks(
        tp * pp * dp, routing_body, tmp_path / "ranks", str(folder), tp, pp, ep, batch, rows,
        (tokens / dp, seqs / dp, 6), kwargs,
    )  # fmt: skip
    for r in results:
        mine = torch.tensor(rows[r["dp_rank"]])
        width = r["replayed"].shape[1]
        assert (r["replayed"] - want["replayed"][mine, :width]).abs().max() <= 1e-5
        assert (r["own_lp"] - want["own_lp"][mine, :width]).abs().max() <= 1e-5
        layers = [r["pp_rank"]] if pp == 2 else [0, 1]  # each stage records its own layers (-1 in the others')
        for key in ("used", "own"):
            width = r[key].shape[1]
            assert torch.equal(per_layer(r[key], layers), per_layer(want[key][mine, :width], layers)), key
            assert (per_layer(r[key], [x for x in (0, 1) if x not in layers]) == -1).all(), key
        assert abs(r["stats"]["grad_norm"] - want["stats"]["grad_norm"]) <= 1e-5
        for name, w in want["weights"].items():
            assert float((r["weights"][name] - w).abs().max()) <= 1e-5, name
    # the mismatch: every rank of a model-parallel group holds its group's counts; summed over data parallel
    counted = {r["dp_rank"]: r["counts"] for r in results}
    assert all(r["counts"] == counted[r["dp_rank"]] for r in results)
    assert {k: sum(c[k] for c in counted.values()) for k in want["counts"]} == want["counts"]
