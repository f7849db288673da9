"""PPO's critic on the megatron backend (head="value", float32): with TP=2, PP=2 and DP=2 on 2 gloo ranks, packed
with shared prompts (the defaults) on a batch of GRPO groups, the values of a saved value model and one update
with the clipped value loss equal the torch backend's (values, loss sums, grad norm and every updated weight,
head and decoder, within 1e-5); a value model built from a causal LM starts with the torch backend's new head
for the same seed; the head is in the checkpoint state."""

from __future__ import annotations

import pytest
import torch
from megatron_ranks import critic_step_body, grouped_sequences, needs_megatron, run_ranks

from yatt.config import TrainerConfig
from yatt.controllers.critic import Critic
from yatt.distributed import World
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.tensors import TokenBatch
from yatt.trainers.critic_config import CriticConfig
from yatt.trainers.torch_trainer import TorchTrainer, load_module

pytestmark = needs_megatron
TINY = TinyModelConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
# lr large enough that the update is far above the tolerance. The clip is hard (grad norm ~30 -> 1e-3): Adam's
# first step is lr * g / (|g| + eps), so an entry that cancels to ~eps (1e-8) turns float32 round-off (~1e-7
# of the typical entry, from another reduction order) into weight differences; small typical entries keep
# that round-off far below eps while the entries that matter stay far above it
TRAIN = dict(lr=1e-3, grad_clip=1e-3, micro_batch_size=3, warmup_steps=1, lr_schedule="cosine")
# a lone prompt and two groups of 3 (consecutive samples of one prompt): packed rows read shared prompts
GROUPS = [1, 3, 3]
SEED = 13  # the global seed before the value model is built from the causal LM


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny causal LM (tied embeddings, q/k/v biases) and a value model saved from it with a head scaled
    up, so the values and their gradients are far above the tolerance."""
    tmp = tmp_path_factory.mktemp("mcritic")
    policy = write_tiny_model(tmp / "policy", TINY, seed=5)
    torch.manual_seed(2)
    value = load_module(policy, "value", torch.float32)
    with torch.no_grad():
        value.score.weight.mul_(10.0)
        value.score.bias.fill_(0.3)
    value.save_pretrained(str(tmp / "value"))
    return policy, tmp / "value"


@pytest.fixture(scope="module")
def step_data(folders):
    """A ragged batch of GRPO groups with old values and returns, and the torch backend's critic update on it."""
    policy, folder = folders
    world = World(0, 1, 0, torch.device("cpu"))
    torch.manual_seed(SEED)
    new_head = load_module(policy, "value", torch.float32).score
    gen = torch.Generator().manual_seed(1)
    batch = TokenBatch.from_sequences(*grouped_sequences(gen, GROUPS), pad_id=0)
    critic = TorchTrainer(folder, TrainerConfig(**TRAIN), world, total_steps=4, head="value")
    values = critic.values(batch)
    batch.extras.update(
        values=values + 0.3 * torch.randn(batch.mask.shape, generator=gen) * batch.mask,
        returns=(values + torch.randn(batch.mask.shape, generator=gen)) * batch.mask,
    )
    denominators = (float(batch.mask.sum()), float(len(batch)), 8)
    loss = Critic(CriticConfig(), critic, world, "token-mean", 8).objective(*denominators[:2])
    stats = critic.train_mini_batch(batch, loss)
    return {
        "batch": batch,
        "denominators": denominators,
        "values": values,
        "stats": stats,
        "weights": dict(critic.named_weights()),
        "new_head": {f"score.{k}": v.detach() for k, v in new_head.named_parameters()},
    }


def test_torch_critic_update_is_far_above_the_tolerance(folders, step_data):
    """The comparison below can fail: the values are not ~0 and the update moves head and decoder."""
    start = {k: p.detach() for k, p in load_module(folders[1], "value", torch.float32).named_parameters()}
    assert float(step_data["values"].abs().max()) > 0.1
    for name in ("score.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert float((step_data["weights"][name] - start[name]).abs().max()) > 1e-4, name


# CI: TP=2; PP and DP split the value model as they split the policy (tests/test_megatron_trainer.py runs all three)
@pytest.mark.parametrize(
    "tp,pp,dp", [(2, 1, 1), *(pytest.param(*p, marks=pytest.mark.slow) for p in [(1, 2, 1), (1, 1, 2)])]
)
def test_megatron_critic_equals_the_torch_backend(tmp_path, folders, step_data, tp, pp, dp):
    policy, folder = folders
    batch = step_data["batch"]
    rows = [list(range(len(batch)))] if dp == 1 else [[0, 1, 2, 3], [4, 5, 6]]  # whole groups, uneven
    tokens, seqs, norm_length = step_data["denominators"]
    results = run_ranks(
        tp * pp * dp,
        critic_step_body,
        tmp_path,
        str(folder),
        str(policy),
        tp,
        pp,
        batch,
        rows,
        (tokens / dp, seqs / dp, norm_length),
        TRAIN,
        SEED,
    )
    want = step_data["stats"]
    by_dp = {r["dp_rank"]: r for r in results}
    for key in ("tokens", "value_loss", "vf_clipfrac", "value_pred_mean"):
        got = sum(by_dp[d]["stats"][key] for d in range(dp))
        assert abs(got - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (key, got, want[key])  # float32 sums
    for r in results:
        own = batch.select(rows[r["dp_rank"]])
        width = own.mask.shape[1]
        assert float((r["values"] - step_data["values"][rows[r["dp_rank"]], :width]).abs().max()) <= 1e-5
        assert abs(r["stats"]["grad_norm"] - want["grad_norm"]) <= 1e-5 * max(1.0, want["grad_norm"]), (
            r["stats"],
            want,
        )
        assert r["stats"]["skipped"] == 0.0
        assert set(r["weights"]) == set(step_data["weights"])
        for name, w in step_data["weights"].items():
            diff = float((r["weights"][name] - w).abs().max())
            assert diff <= 1e-5, (name, diff)
        # a new head from a causal LM: transformers' initialisation at the same RNG state, on every rank
        for name, w in step_data["new_head"].items():
            assert torch.equal(r["new_head"][name], w), name
        # the head is in the checkpoint state of the stage that holds it, and a fresh trainer resumes it
        assert ("value_head.weight" in r["state_keys"]) == r["last_stage"]
        assert "output_layer.weight" not in r["state_keys"]
        assert torch.equal(r["resumed"], r["after"]) and not torch.equal(r["after"], r["values"])
