"""The critic's layers without engines: the torch backend with head="value" on a real tiny model, and the
Critic's loss, update and metrics (yatt.controllers.critic)."""

import pytest
import torch
from e2e import DIGITS

from yatt.algorithms.aggregation import aggregate_loss
from yatt.config import TrainerConfig
from yatt.controllers.critic import Critic
from yatt.distributed import World
from yatt.models.tiny import write_tiny_model
from yatt.tensors import TokenBatch
from yatt.trainers.critic_config import CriticConfig
from yatt.trainers.torch_trainer import TorchTrainer

WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("critic") / "policy", DIGITS, seed=3)


def value_model(policy, seed=0, **cfg):
    torch.manual_seed(seed)  # the new value head's initialisation
    return TorchTrainer(policy, TrainerConfig(**{"lr": 1e-2, **cfg}), WORLD, head="value")


def batch():
    return TokenBatch.from_sequences([[3, 4, 5], [6, 7], [8]], [[8, 9], [10, 11, 12], [4]], pad_id=0)


def test_values_per_response_token_whatever_the_layout(policy):
    b = batch()
    want = value_model(policy).values(b)
    assert want.shape == b.mask.shape and (want[b.mask == 0] == 0).all() and (want[b.mask == 1] != 0).all()
    for cfg in ({"pack_sequences": False}, {"micro_batch_size": 1}, {"micro_batch_tokens": 4}):
        torch.testing.assert_close(value_model(policy, **cfg).values(b), want, atol=1e-6, rtol=0)


def test_a_value_depends_only_on_its_prefix(policy):
    """Column t is V(input_ids[:, :t+1]): changing the last token of a row changes none of its values."""
    model, b = value_model(policy), batch()
    changed = TokenBatch.from_sequences([[3, 4, 5], [6, 7], [8]], [[8, 3], [10, 11, 5], [9]], pad_id=0)
    torch.testing.assert_close(model.values(changed), model.values(b), atol=1e-6, rtol=0)
    changed = TokenBatch.from_sequences([[3, 4, 5], [6, 7], [8]], [[3, 9], [10, 11, 12], [4]], pad_id=0)
    assert not torch.equal(model.values(changed)[0], model.values(b)[0])


def test_heads_are_kept_apart(policy):
    with pytest.raises(ValueError, match="it has values"):
        value_model(policy).logprobs(batch())
    with pytest.raises(ValueError, match="it has logprobs"):
        TorchTrainer(policy, TrainerConfig(), WORLD).values(batch())
    with pytest.raises(ValueError, match="unknown trainer head"):
        TorchTrainer(policy, TrainerConfig(), WORLD, head="q")


def critic(policy, **cfg):
    return Critic(CriticConfig(**cfg), value_model(policy), WORLD, cfg.get("loss_agg") or "token-mean", norm_length=4)


def with_targets(b, values, returns):
    b.extras.update(values=values, returns=returns)
    return b


def test_the_value_loss_is_aggregated_like_the_policy_loss(policy):
    b = batch()
    values = b.mask * 0.5
    returns = b.mask * torch.tensor([[0.0], [1.0], [2.0]])  # errors .5, -.5, -1.5 -> token losses .125, .125, 1.125
    with_targets(b, torch.zeros_like(b.mask), returns)
    token = torch.tensor([0.125, 0.125, 1.125])
    lengths = torch.tensor([2.0, 3.0, 1.0])
    cases = {
        "token-mean": float((token * lengths).sum() / 6),
        "seq-mean-token-sum": float((token * lengths).sum() / 3),
        "seq-mean-token-mean": float(token.sum() / 3),
        "seq-mean-token-sum-norm": float((token * lengths / 4).sum() / 3),
    }
    for agg, want in cases.items():
        c = critic(policy, loss_agg=agg, value_clip=None)
        loss, sums = c.objective(num_tokens=6.0, num_seqs=3.0)(values, None, b)
        assert float(loss) == pytest.approx(want, abs=1e-6), agg
        assert sums["tokens"] == 6 and sums["value_loss"] == pytest.approx(2 * 0.125 + 3 * 0.125 + 1.125)
    assert float(aggregate_loss(b.mask, b.mask, "token-mean")) == 1.0  # the helper the critic reuses


def test_the_update_fits_the_returns_and_reports_its_metrics(policy):
    c, b = critic(policy, value_clip=None), batch()
    returns = b.mask * torch.tensor([[1.0], [0.0], [1.0]])
    before = c.values(b)
    with_targets(b, before, returns)
    epochs = [[torch.tensor([0, 1]), torch.tensor([2])]]
    first = c.update(b, epochs)
    assert first["optimizer_steps"] == 2 and first["grad_norm"] > 0 and first["skipped"] == 0
    for _ in range(20):
        with_targets(b, c.values(b), returns)
        last = c.update(b, epochs)
    assert last["value_loss"] < first["value_loss"] / 10
    metrics = c.metrics(with_targets(b, c.values(b), returns), last)
    assert metrics["critic/explained_var"] > 0.9
    assert metrics["critic/returns_mean"] == pytest.approx(3 / 6)
    assert set(metrics) >= {"critic/value_loss", "critic/vf_clipfrac", "critic/value_mean", "critic/grad_norm"}
    # by hand: returns are three 1s and three 0s (variance .25); values = returns / 2 leave the error returns / 2
    # (variance .0625): explained_var = 1 - .0625 / .25 = .75; a constant error explains everything
    m = c.metrics(with_targets(b, returns * 0.5, returns), last)
    assert m["critic/explained_var"] == pytest.approx(0.75, abs=1e-6) and m["critic/value_mean"] == pytest.approx(0.25)
    m = c.metrics(with_targets(b, returns - b.mask * 0.1, returns), last)
    assert m["critic/explained_var"] == pytest.approx(1.0, abs=1e-6)


def test_state_round_trip(policy):
    c = critic(policy)
    b = with_targets(batch(), torch.zeros_like(batch().mask), batch().mask)
    c.update(b, [[torch.tensor([0, 1, 2])]])
    other = critic(policy)
    other.load_state_dict(c.state_dict())
    torch.testing.assert_close(other.values(b), c.values(b), atol=0, rtol=0)
    assert other.trainer.optimizer_steps == 1 and other.trainer.optimizer.state_dict()["state"]


def test_the_console_line_shows_the_critic(tmp_path):
    from yatt.controllers.metrics import MetricsLogger

    m = {
        "reward/mean": 0.5,
        "response/length_mean": 2.0,
        "actor/entropy": 0.3,
        "actor/clip_frac": 0.0,
        "actor/grad_norm": 0.0,
        "time/generate_s": 1.0,
        "time/update_s": 1.0,
        "time/sync_s": 0.1,
        "perf/gen_tokens_per_s": 100.0,
        "critic/value_loss": 0.1234,
        "critic/explained_var": 0.5,
        "critic/warmup": 1.0,
    }
    line = MetricsLogger(tmp_path / "m.jsonl", 5, enabled=False).console_line(1, m, 1.0)
    assert "vloss 0.1234 ev 0.50 w |" in line
    assert "vloss" not in MetricsLogger(tmp_path / "m.jsonl", 5, enabled=False).console_line(
        1, {k: v for k, v in m.items() if not k.startswith("critic/")}, 1.0
    )


def test_a_saved_critic_folder_starts_the_next_critic(policy, tmp_path):
    """critic.model may name a folder a value model wrote (its trained head is loaded, not a new one)."""
    from transformers import AutoTokenizer

    trained = value_model(policy, seed=0)
    trained.save_hf(tmp_path / "critic", AutoTokenizer.from_pretrained(str(policy)))
    again = value_model(tmp_path / "critic", seed=1)  # another seed: a new head would differ
    torch.testing.assert_close(again.values(batch()), trained.values(batch()), atol=0, rtol=0)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_update_does_not_depend_on_micro_batching(policy, agg):
    results = []
    for size in (64, 1):
        c = Critic(CriticConfig(), value_model(policy, micro_batch_size=size), WORLD, agg, norm_length=4)
        b = batch()
        with_targets(b, c.values(b) + 0.3 * b.mask, b.mask * torch.tensor([[1.0], [0.0], [1.0]]))
        stats = c.update(b, [[torch.tensor([0, 1, 2])]])
        results.append((stats, c.values(b)))
    (a, va), (b, vb) = results
    assert a["value_loss"] == pytest.approx(b["value_loss"], abs=1e-6) and a["vf_clipfrac"] > 0
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    # the values after the step, not the weights: AdamW turns the float noise of a gradient that is 0 in exact
    # arithmetic (the key bias: softmax ignores a shift shared by all keys) into steps of up to lr either way
    torch.testing.assert_close(va, vb, atol=1e-5, rtol=0)
