"""Mixture-of-experts routing replay on a real tiny Qwen3-MoE folder (yatt.models.routing, yatt.trainers.moe):
the hf engine returns the experts of every token; the torch trainer replaying them gives the engine's log-probs
(R3), while with a perturbed router and no replay they differ; an R2 forward replaying a recorded pass equals
it exactly, packed with shared prompts or padded; balancing moves routing with its samples."""

from __future__ import annotations

import pytest
import torch

from yatt.controllers.policy import routing_of, token_batch
from yatt.data.rollout import Rollout
from yatt.distributed import World
from yatt.engines.base import Completion, SamplingSpec, generate
from yatt.engines.config import EngineConfig
from yatt.engines.hf_engine import HFEngine
from yatt.models.routing import RoutingPatch
from yatt.models.tiny import TinyModelConfig, build_tiny_model, write_tiny_model
from yatt.trainers.config import TrainerConfig
from yatt.trainers.torch_trainer import TorchTrainer

MOE = TinyModelConfig(
    architecture="qwen3_moe",
    alphabet="0123456789+=",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
WORLD = World(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("moe") / "policy", MOE, seed=3)


@pytest.fixture(scope="module")
def rollouts(folder):
    """Two prompts x 4 samples from the hf engine, with their routing."""
    engine = HFEngine(str(folder), EngineConfig(), seed=0)
    prompts = [[4, 5, 13, 6, 14], [7, 13, 8, 8, 14]]  # "1+2=", "4+55=" in the digit alphabet's ids
    sp = SamplingSpec(n=4, temperature=1.0, max_tokens=6, routed_experts=True)
    groups = generate(engine, prompts, sp, seeds=[1, 100])
    out = []
    for prompt, group in zip(prompts, groups):
        for c in group:
            out.append(Rollout(None, prompt, c.token_ids, c.logprobs, c.finish_reason, routed_experts=c.routed_experts))
    return out


def trainer(folder, **cfg) -> TorchTrainer:
    return TorchTrainer(folder, TrainerConfig(micro_batch_size=64, **cfg), WORLD, trainable=False)


def test_the_engine_returns_the_experts_of_every_token(rollouts):
    for r in rollouts:
        assert len(r.routed_experts) == len(r.prompt_ids) + len(r.response_ids)
        assert all(len(t) == 2 * 2 for t in r.routed_experts)  # layers x top-k
        assert r.routed_experts[-1] == [-1] * 4  # the last token is never fed back
        assert all(0 <= e < 4 for t in r.routed_experts[:-1] for e in t)


@pytest.mark.parametrize("share", [True, False])
def test_replaying_the_engines_routing_gives_its_logprobs(folder, rollouts, share):
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)
    engine = batch.extras["rollout_logprobs"]
    lp, _ = trainer(folder, share_prompts=share).logprobs(batch)
    assert (lp - engine).abs().max() < 1e-4


def test_a_perturbed_router_differs_without_replay_and_agrees_with_it(folder, rollouts):
    """The engine routed with one router; the trainer's is nudged so that its own top-k changes: replayed, the
    log-probs stay within float noise of what the same nudged model gives on the engine's experts."""
    t = trainer(folder)
    with torch.no_grad():
        for router in RoutingPatch(t.module).routers:
            router.weight.add_(torch.randn_like(router.weight) * 0.5, alpha=1.0)
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)
    replayed, _ = t.logprobs(batch)
    routing, batch.routing = batch.routing, None
    free, _ = t.logprobs(batch, record_routing=True)
    mask = batch.mask.bool()
    assert (free - replayed)[mask].abs().max() > 1e-3
    real = routing[:, :, 0] >= 0
    assert (batch.routing[real] != routing[real]).any()  # the nudged router chose other experts


@pytest.mark.parametrize("packed", [True, False])
def test_r2_replays_a_recorded_pass_exactly(folder, rollouts, packed):
    t = trainer(folder, pack_sequences=packed)
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)
    batch.routing = None
    recorded, _ = t.logprobs(batch, record_routing=True)
    assert batch.routing is not None
    # the rows in another order and grouping (a mini-batch's): the routing follows each row
    order = torch.tensor([5, 0, 7, 2])
    sub = batch.select(order)
    again, _ = t.logprobs(sub)
    assert torch.equal(again, recorded[order][:, : again.shape[1]])


def test_routing_of_lays_rollouts_out_per_token(rollouts):
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)
    routing = routing_of(rollouts, batch)
    assert routing.shape == (*batch.input_ids.shape, 4)
    r = rollouts[0]
    assert routing[0, : len(r.routed_experts)].tolist() == r.routed_experts
    assert routing_of([Rollout(None, [1], [2], [0.0], "stop")], batch) is None


def test_the_patch_refuses_a_dense_model():
    dense = build_tiny_model(TinyModelConfig(architecture="qwen3"), 20, 2, 0, 0)
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        RoutingPatch(dense)


def test_train_steps_report_expert_load_and_the_aux_loss(folder, rollouts):
    from yatt.trainers.torch_config import TorchConfig

    t = TorchTrainer(
        folder,
        TrainerConfig(micro_batch_size=3, share_prompts=False, torch=TorchConfig(router_aux_loss_coef=0.1)),
        WORLD,
        total_steps=2,
    )
    assert t.moe.aux_loss_coef == 0.1
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)

    def loss_fn(logp, ent, mb):
        return -(logp * mb.mask).sum() / 100, {}

    stats = t.train_mini_batch(batch, loss_fn)
    assert stats["moe/aux_loss"] > 0
    tokens = sum(batch.lengths()) * 2  # every real token takes top-2 slots (no prompt shared within a row)
    assert stats["moe/tokens_per_expert_mean"] == pytest.approx(tokens / 4)
    assert stats["moe/tokens_per_expert_max"] >= stats["moe/tokens_per_expert_mean"]


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["rollout.engine.backend=vllm"], "does not return routed experts"),
        (["algorithm.routing_replay=r2", "algorithm.old_logprobs=rollout"], "skips"),
        # measured only (no replay): the engine must still return its experts, the trainer count them
        (
            ["algorithm.routing_replay=off", "algorithm.routing_mismatch=true", "rollout.engine.backend=vllm"],
            "routing_mismatch: rollout.engine.backend=vllm does not return",
        ),
    ],
)
def test_routing_replay_refusals_are_in_the_table(overrides, says):
    from pathlib import Path

    from yatt.config import ExperimentConfig
    from yatt.config_loading import ConfigError, load_config
    from yatt.refusals import REFUSALS

    assert sum("routing_replay" in r.fields for r in REFUSALS) == 3
    config = Path(__file__).resolve().parents[1] / "configs/quickstart_moe.yaml"
    with pytest.raises(ConfigError, match=says):
        load_config(ExperimentConfig, config, overrides)


def test_a_trainer_backend_that_does_not_declare_replay_is_refused():
    """Both built-in trainers replay; a plug-in trainer backend (yatt.backends) that does not declare
    routing_replay is refused, naming why."""
    from types import SimpleNamespace

    from yatt.refusals import _routing_trainer

    def cfg(replay: str, mismatch: bool, entry) -> SimpleNamespace:
        algorithm = SimpleNamespace(routing_replay=replay, routing_mismatch=mismatch)
        return SimpleNamespace(algorithm=algorithm, trainer=SimpleNamespace(backend="mine", backend_entry=entry))

    plain = SimpleNamespace()  # declares nothing
    assert "trainer.backend=mine does not replay MoE routing" in _routing_trainer(cfg("r2", False, plain))
    assert "does not measure MoE routing" in _routing_trainer(cfg("off", True, plain))
    assert _routing_trainer(cfg("r3", True, SimpleNamespace(routing_replay=True))) is None


def test_a_bare_off_is_off_in_a_file_and_on_the_command_line(tmp_path):
    """YAML reads `off` as false; routing_replay (and the sandbox's network_namespace) take it as the value named."""
    from pathlib import Path

    from yatt.config import ExperimentConfig
    from yatt.config_loading import load_config
    from yatt.tools.sandbox import PythonConfig

    config = Path(__file__).resolve().parents[1] / "configs/quickstart_moe.yaml"
    assert load_config(ExperimentConfig, config, ["algorithm.routing_replay=off"]).algorithm.routing_replay == "off"
    text = config.read_text().replace("routing_replay: r3", "routing_replay: off")
    (tmp_path / "moe.yaml").write_text(text)
    assert load_config(ExperimentConfig, tmp_path / "moe.yaml", []).algorithm.routing_replay == "off"
    assert PythonConfig.model_validate({"kind": "python", "network_namespace": False}).network_namespace == "off"


def test_mismatch_counts_compare_top_k_sets_where_the_engine_routed():
    from yatt.trainers.moe import mismatch_counts

    engine = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[-1, -1], [-1, -1]]])  # 2 tokens x 2 layers, 1 unset
    same = torch.tensor([[[1, 0], [2, 3]], [[2, 1], [3, 0]], [[3, 2], [1, 0]]])  # the same sets in another order
    assert mismatch_counts(same, engine).tolist() == [2.0, 0.0, 4.0, 0.0]
    other = same.clone()
    other[1, 1] = torch.tensor([0, 2])  # token 1, layer 1: {0, 2} against the engine's {0, 3}
    other[2] = torch.tensor([[0, 1], [2, 3]])  # a token the engine did not route: not compared
    assert mismatch_counts(other, engine).tolist() == [2.0, 1.0, 4.0, 1.0]


def test_token_batch_keeps_the_engines_routing_to_compare_without_replaying_it(rollouts):
    batch = token_batch(rollouts, pad_id=0, temperature=1.0, replay=False)
    assert batch.routing is None
    replayed = token_batch(rollouts, pad_id=0, temperature=1.0)
    assert torch.equal(batch.engine_routing, replayed.engine_routing)
    r = rollouts[0]
    compared = batch.engine_routing[0, :, 0] >= 0
    # the positions that predicted the response tokens: the last prompt token's and every response token's but the
    # last (which predicts nothing)
    assert compared.nonzero().flatten().tolist() == list(range(len(r.prompt_ids) - 1, len(r.routed_experts) - 1))
    assert batch.engine_routing[0, compared].tolist() == r.routed_experts[len(r.prompt_ids) - 1 : -1]


def nudged(t: TorchTrainer, scale: float = 0.5) -> TorchTrainer:
    torch.manual_seed(0)
    with torch.no_grad():
        for router in RoutingPatch(t.module).routers:
            router.weight.add_(torch.randn_like(router.weight) * scale)
    return t


@pytest.mark.parametrize("nudge", [False, True])
def test_the_log_prob_pass_counts_the_routers_own_choice_before_replay(folder, rollouts, nudge):
    """R3: the pass replays the engine's experts (the routing it used is the engine's), while the mismatch counts
    the router's own top-k: none differ on the engine's weights, some once the router is nudged."""
    t = trainer(folder)
    if nudge:
        nudged(t)
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)
    engine = batch.routing.clone()
    t.logprobs(batch, record_routing=True)
    set_ = engine[:, :, 0] >= 0
    assert torch.equal(batch.routing[set_], engine[set_])  # replayed
    counts = t.routing_counts()
    assert counts["routing/tokens"] == sum(len(r.response_ids) for r in rollouts)  # one per generated token
    assert counts["routing/layers"] == 2 * counts["routing/tokens"]
    if nudge:
        assert 0 < counts["routing/tokens_differ"] <= counts["routing/tokens"]
        assert counts["routing/tokens_differ"] <= counts["routing/layers_differ"] <= counts["routing/layers"]
    else:
        assert counts["routing/tokens_differ"] == counts["routing/layers_differ"] == 0
    assert t.routing_counts()["routing/tokens"] == 0  # reset when read


@pytest.mark.parametrize("old_logprobs_mode", ["reuse", "recompute", "rollout"])
def test_a_step_counts_every_sample_once_with_the_pre_update_weights(folder, rollouts, old_logprobs_mode):
    """old_logprobs, then a 2-mini-batch update, routing_replay off: the counts cover each response token once,
    from the log-prob pass or (reuse) the update's first forward, and equal those of one pass of the same weights
    over all samples; with old_logprobs=rollout (no pass) those of the first mini-batch, the update's only forward
    on the pre-update weights."""
    from yatt.algorithms.objective import Algorithm
    from yatt.config import AlgorithmConfig
    from yatt.controllers.policy import old_logprobs, policy_update

    cfg = AlgorithmConfig(old_logprobs=old_logprobs_mode, mini_batches=2, routing_mismatch=True)
    algorithm = Algorithm(cfg)
    t = nudged(TorchTrainer(folder, TrainerConfig(micro_batch_size=3), WORLD, total_steps=2))
    expected = nudged(trainer(folder))  # the same nudge, frozen: one pass over every sample
    epochs = [[torch.arange(0, 4), torch.arange(4, 8)]]
    counted = epochs[0][0] if old_logprobs_mode == "rollout" else torch.arange(8)
    expected.logprobs(token_batch(rollouts, pad_id=0, temperature=1.0, replay=False).select(counted))
    want = expected.routing_counts()
    batch = token_batch(rollouts, pad_id=0, temperature=1.0, replay=False)
    old, entropy = old_logprobs(t, algorithm, batch, epochs[0], has_ref=False)
    batch.extras.update(old_logprobs=old, advantages=torch.randn(len(batch))[:, None] * batch.mask)
    totals = policy_update(t, algorithm, WORLD, batch, epochs, entropy, norm_length=6)
    got = {k: v for k, v in totals.items() if k.startswith("routing/")}
    assert got == want and want["routing/tokens_differ"] > 0


def test_a_resumed_sample_replays_the_forward_that_sampled_its_last_tokens(folder, tmp_path):
    """Partial rollouts with r3 (rollout.schedule.in_flight: resume): requests cut by a push of new weights (every
    router nudged) resume on them in a real engine process. Each sample's routing covers its prompt and tokens, and
    the trainer replaying it gives the engine's log-probs of every token sampled after the push, on the new
    weights, as it does on the old weights for the samples finished before it."""
    import shutil

    from engine_refs import PushAfter
    from transformers import AutoModelForCausalLM

    from yatt.engines.client import spawn_engine
    from yatt.engines.pool import EnginePool, Request
    from yatt.engines.resume import ResumingPool

    # samples that run to max_tokens, so the push lands while one decodes: the eos row of the head is zeroed and
    # every other logit scaled up 30x (the final norm), leaving eos a probability of ~1e-4 a token
    long, nudged = tmp_path / "long", tmp_path / "nudged"
    shutil.copytree(folder, long)
    model = AutoModelForCausalLM.from_pretrained(long, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[model.config.eos_token_id] = 0.0
        model.model.norm.weight.mul_(30.0)
    model.save_pretrained(long)
    original = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    shutil.copytree(long, nudged)
    torch.manual_seed(0)
    with torch.no_grad():
        for router in RoutingPatch(model).routers:
            router.weight.add_(torch.randn_like(router.weight) * 0.5)
    model.save_pretrained(nudged)
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    prompts = [[4, 5, 13, 6, 14], [7, 13, 8, 8, 14]] * 4
    sp = SamplingSpec(n=3, temperature=1.0, max_tokens=100, routed_experts=True)
    cfg = EngineConfig(backend="hf", max_num_seqs=3, startup_timeout_s=120)  # one request per engine batch
    client = spawn_engine(long, cfg, seed=0, log_path=tmp_path / "engine.log")
    try:
        for _ in range(3):  # where the cut falls is the threads' timing: until a sample is cut mid-decode
            client.update_weights(original)
            preemption = PushAfter(client, weights, requests=len(prompts))
            pool = preemption.pool = ResumingPool(EnginePool({"e": client}), preemption)
            pool.submit([Request(f"g{i}", p, 10 * i, sp) for i, p in enumerate(prompts)])
            done = pool.drain()
            samples = [(prompts[i], c) for i in range(len(prompts)) for c in done[f"g{i}"]]
            if any(0 < c.versions.count(0) < len(c.token_ids) for _, c in samples):
                break
    finally:
        client.close()
    assert any(0 < c.versions.count(0) < len(c.token_ids) for _, c in samples), "no sample was cut mid-decode"
    for weights_of, version in ((long, 0), (nudged, 1)):
        rows = [(p, c) for p, c in samples if version in c.versions and (version or 1 not in c.versions)]
        for prompt, c in rows:
            assert len(c.routed_experts) == len(prompt) + len(c.token_ids)
        rollouts = [Rollout(None, p, c.token_ids, c.logprobs, c.finish_reason, routed_experts=c.routed_experts)
                    for p, c in rows]  # fmt: skip
        batch = token_batch(rollouts, pad_id=0, temperature=1.0)
        sampled_so = batch.per_token([[float(v == version) for v in c.versions] for _, c in rows]).bool()
        t = trainer(weights_of)
        lp, _ = t.logprobs(batch)
        gap = (lp - batch.extras["rollout_logprobs"])[sampled_so & batch.mask.bool()]
        assert gap.numel() and gap.abs().max() < 1e-4, (version, gap.abs().max())
        # the routing carried is the one these weights' own forward chooses at every token, the earlier tokens'
        # included (near-deterministic samples would hide a wrong join from the log-probs alone)
        carried, batch.routing = batch.routing, None
        t.logprobs(batch, record_routing=True)
        real = carried[:, :, 0] >= 0
        differ = float((batch.routing[real] != carried[real]).any(-1).float().mean())
        assert differ < 0.01, (version, differ)  # ~0.09 at version 1 when the earlier tokens keep the old routing


class TwoTurns:
    """An agent loop that always converses: a model turn, environment ids, a second model turn on all of it."""

    def run(self, prompt_ids, generate, max_new_tokens, seed):
        from yatt.agents.base import Trajectory

        t = Trajectory(list(prompt_ids))
        for turn, tool in enumerate(([4, 13, 5, 14], [6, 6])):
            ids, lps, t.finish_reason = generate(t.prompt_ids + t.response_ids, 8, seed + turn)
            t.append(ids, lps)
            t.append(tool, None)  # the last environment ids follow the last model turn
            t.num_turns += 1
        return t


def test_a_conversation_replays_its_last_turns_forward(folder, tmp_path):
    """r3 with an agent loop: each trajectory carries the routing of its last turn, whose prefill saw the earlier
    turns and environment ids (-1 after it); the trainer replaying it gives the engine's log-probs of the model
    tokens of every turn. A loop whose last prompt is not its trajectory's start is refused in one line."""
    from yatt.controllers.conversations import ConversationPool, agent_rollouts, last_turn_routing
    from yatt.data.rows import PromptRow
    from yatt.engines.client import spawn_engine
    from yatt.engines.pool import EnginePool, Request

    prompts = [[4, 5, 13, 6, 14], [7, 13, 8, 8, 14]]
    sp = SamplingSpec(n=3, temperature=1.0, max_tokens=40, routed_experts=True)
    client = spawn_engine(folder, EngineConfig(backend="hf", startup_timeout_s=120), seed=0, log_path=tmp_path / "log")
    try:
        pool = ConversationPool(EnginePool({"e": client}), TwoTurns())
        pool.submit([Request(f"g{i}", p, 10 * i, sp) for i, p in enumerate(prompts)])
        done = pool.drain(timeout_s=120)
    finally:
        client.close()
    rollouts = [
        r for i, p in enumerate(prompts) for r in agent_rollouts(PromptRow(i, "p", None, "", "x"), p, done[f"g{i}"])
    ]
    for r in rollouts:
        assert len(r.routed_experts) == len(r.prompt_ids) + len(r.response_ids)
        assert r.routed_experts[-3:] == [[-1] * 4] * 3  # the last model token and the two environment ids after it
        assert all(0 <= e < 4 for t in r.routed_experts[:-3] for e in t)
    batch = token_batch(rollouts, pad_id=0, temperature=1.0)
    lp, _ = trainer(folder).logprobs(batch)
    model = batch.mask.bool()
    assert model.sum() > batch.mask.shape[0] * 2  # both turns' tokens are in the loss
    assert (lp - batch.extras["rollout_logprobs"])[model].abs().max() < 1e-4
    t = done["g0"][0]
    with pytest.raises(ValueError, match="not the start of the trajectory"):
        last_turn_routing(t, [9] + t.prompt_ids, Completion([], [], "stop", routed_experts=[[0, 1, 0, 1]]))
