"""The trainer's efficient paths give the values of the plain one: packed vs padded sequences, prompts shared
by a group's samples vs repeated, the output head in chunks vs full-vocabulary logits, activation
checkpointing — same log-probs, entropies, loss and gradients in float32 (<= 1e-5), at any temperature."""

from __future__ import annotations

import pytest
import torch

from yatt.algorithms import entropy_from_logits, token_logprobs
from yatt.algorithms.objective import Algorithm
from yatt.balance.micro_batches import micro_batch_rows
from yatt.config import AlgorithmConfig, TrainerConfig
from yatt.distributed import World
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.tensors import TokenBatch
from yatt.trainers.packing import model_inputs, shared_prompts
from yatt.trainers.torch_trainer import TorchTrainer

WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
VARIANTS = {  # name: trainer settings
    "padded-full": dict(pack_sequences=False, torch={"logprob_chunk_tokens": 0}),
    "packed-full": dict(pack_sequences=True, torch={"logprob_chunk_tokens": 0}),
    "packed-unshared": dict(pack_sequences=True, share_prompts=False, torch={"logprob_chunk_tokens": 0}),
    "padded-chunked": dict(pack_sequences=False, torch={"logprob_chunk_tokens": 3}),
    "packed-chunked": dict(pack_sequences=True, torch={"logprob_chunk_tokens": 3}),
    "packed-chunked-checkpointed": dict(
        pack_sequences=True, torch={"logprob_chunk_tokens": 5, "activation_checkpointing": True}
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # vocabulary > hidden size and 2 query heads per key-value head: the GQA path of the packed attention
    return write_tiny_model(
        tmp_path_factory.mktemp("exact") / "m",
        TinyModelConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        ),
    )


def ragged_batch(temperature: float = 1.0) -> TokenBatch:
    """Prompts and responses of different lengths, one response empty: real padding to remove."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 40, (2 + i % 3,), generator=gen).tolist() for i in range(7)]
    responses = [torch.randint(3, 40, (i % 5,), generator=gen).tolist() for i in range(7)]
    batch = TokenBatch.from_sequences(prompts, responses, pad_id=0)
    batch.temperature = temperature
    return batch


def grouped_batch(temperature: float = 1.0) -> TokenBatch:
    """GRPO-shaped rows: consecutive samples of one prompt, with ragged responses. Also what must not share:
    an empty response inside a group, two groups whose prompts have the same length but other ids, and a
    prompt that extends the one before it."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, 40, (4,), generator=gen).tolist(), torch.randint(3, 40, (4,), generator=gen).tolist()
    groups = [(a, [3, 1, 0, 4, 2]), (b, [2, 5, 1]), (a + [7], [3]), ([5, 6, 7], [4, 4])]
    prompts, responses = [], []
    for prompt, lengths in groups:
        for n in lengths:
            prompts.append(prompt)
            responses.append(torch.randint(3, 40, (n,), generator=gen).tolist())
    batch = TokenBatch.from_sequences(prompts, responses, pad_id=0)
    batch.temperature = temperature
    return batch


def masked_batch(temperature: float = 1.0) -> TokenBatch:
    """GRPO-shaped rows of agent trajectories: inside each response, runs of tool tokens (loss mask 0, as
    yatt.controllers.policy.token_batch makes them) between model tokens, and a response that starts with them."""
    batch = grouped_batch(temperature)
    gen = torch.Generator().manual_seed(4)
    tool = (torch.rand(batch.mask.shape, generator=gen) < 0.4).float()
    batch.mask = batch.mask * (1 - tool)
    return batch


BATCHES = {"distinct": ragged_batch, "groups": grouped_batch, "masked": masked_batch}


def reference(trainer: TorchTrainer, batch: TokenBatch, weights: torch.Tensor | None = None):
    """Log-probs and entropies the textbook way: full padded logits from the Hugging Face forward."""
    logits = trainer.module(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logits = logits / batch.temperature
    logp = token_logprobs(logits, batch.input_ids[:, 1:]) * batch.mask
    ent = entropy_from_logits(logits) * batch.mask
    return logp, ent


def grads(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in trainer.module.named_parameters()}
    trainer.module.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_and_entropy_equal_full_logits(tiny, variant, temperature, kind):
    trainer = TorchTrainer(tiny, TrainerConfig(micro_batch_size=3, **VARIANTS[variant]), WORLD)
    batch = BATCHES[kind](temperature)
    logp, ent = trainer.logprobs(batch, with_entropy=True)
    with torch.no_grad():
        want_logp, want_ent = reference(trainer, batch)
    assert batch.mask.sum() > 10 and (batch.mask.sum(1) == 0).any()
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_and_gradients_equal_full_logits(tiny, variant, kind):
    """The PPO-clip loss plus an entropy term through each path: same loss, same gradient of every weight."""
    trainer = TorchTrainer(tiny, TrainerConfig(**VARIANTS[variant]), WORLD)
    batch = BATCHES[kind](0.7)
    gen = torch.Generator().manual_seed(2)
    batch.extras.update(
        old_logprobs=reference(trainer, batch)[0].detach()
        + 0.05 * torch.randn(batch.mask.shape, generator=gen) * batch.mask,
        advantages=torch.randn(len(batch), generator=gen),
    )
    loss_fn = Algorithm(AlgorithmConfig()).objective(float(batch.mask.sum()), float(len(batch)), 8)

    def total(logp, ent):
        loss, _ = loss_fn(logp, ent, batch)
        return loss + 0.01 * (ent * batch.mask).sum()

    want_loss = total(*reference(trainer, batch))
    want_loss.backward()
    want = grads(trainer)
    loss = total(*trainer._token_outputs(trainer.scorer, batch, with_entropy=True))
    loss.backward()
    got = grads(trainer)
    assert abs(float(loss.detach()) - float(want_loss.detach())) <= 1e-5
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-5, msg=name)


def test_micro_batches_do_not_change_packed_chunked_updates(tiny):
    """One optimizer step over 7 ragged rows: 1 micro-batch padded/full == 4 micro-batches packed/chunked."""
    results = []
    for micro, variant in ((8, "padded-full"), (2, "packed-chunked")):
        torch.manual_seed(0)
        trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-2, micro_batch_size=micro, **VARIANTS[variant]), WORLD)
        batch = ragged_batch()
        batch.extras.update(old_logprobs=trainer.logprobs(batch)[0], advantages=torch.linspace(-1, 1, len(batch)))
        stats = trainer.train_mini_batch(
            batch, Algorithm(AlgorithmConfig()).objective(float(batch.mask.sum()), float(len(batch)), 8)
        )
        results.append(stats)
    assert results[0]["grad_norm"] == pytest.approx(results[1]["grad_norm"], abs=1e-5)
    assert results[0]["policy_loss"] == pytest.approx(results[1]["policy_loss"], abs=1e-5)


def test_shared_prompts_are_laid_down_once_per_micro_batch():
    """The packed row holds each group's prompt once, then every response; the rows that must not share
    (after an empty response, other ids, a longer prompt) lay their prompt down again."""
    batch = grouped_batch()
    assert shared_prompts(batch) == [0, 4, 0, 0, 4, 0, 4, 4, 0, 0, 3]
    lengths = batch.attention_mask.sum(dim=1)
    shared = model_inputs(batch, packed=True, share_prompts=True)
    assert shared.kwargs["input_ids"].shape[1] == int(lengths.sum()) - 4 * 4 - 3
    assert "cu_seq_lens_q" not in shared.kwargs  # flash-attention's varlen layout cannot express the sharing
    repeated = model_inputs(batch, packed=True, share_prompts=False)
    assert repeated.kwargs["input_ids"].shape[1] == int(lengths.sum())


def test_a_token_budget_that_cuts_groups_does_not_change_the_update(tiny):
    """Micro-batches of at most 9 packed tokens cut the groups into pieces (each lays its prompt down
    again): the same update as one padded micro-batch with repeated prompts."""
    lengths, shared = grouped_batch().lengths(), shared_prompts(grouped_batch())
    pieces = micro_batch_rows(lengths, 64, 9, padded=False, shared=shared)
    assert any(len(p) > 1 for p in pieces) and len(pieces) > 4
    results = []
    for settings in (
        dict(micro_batch_size=64, **VARIANTS["padded-full"]),
        dict(micro_batch_size=64, micro_batch_tokens=9, pack_sequences=True, torch={"logprob_chunk_tokens": 2}),
    ):
        torch.manual_seed(0)
        trainer = TorchTrainer(tiny, TrainerConfig(lr=1e-2, **settings), WORLD)
        batch = grouped_batch()
        batch.extras.update(old_logprobs=trainer.logprobs(batch)[0], advantages=torch.linspace(-1, 1, len(batch)))
        results.append(
            trainer.train_mini_batch(
                batch, Algorithm(AlgorithmConfig()).objective(float(batch.mask.sum()), float(len(batch)), 8)
            )
        )
        results[-1]["weights"] = torch.cat([p.detach().flatten() for p in trainer.module.parameters()])
    assert results[0]["grad_norm"] == pytest.approx(results[1]["grad_norm"], abs=1e-5)
    assert results[0]["policy_loss"] == pytest.approx(results[1]["policy_loss"], abs=1e-5)
    torch.testing.assert_close(results[1]["weights"], results[0]["weights"], rtol=0, atol=1e-5)


def test_bfloat16_autocast_stays_close_to_float32(tiny):
    """Autocast changes numerics (that is its point); the log-prob drift is small and reported by the
    rollout-vs-trainer mismatch metric in a run."""
    batch = ragged_batch()
    exact = TorchTrainer(tiny, TrainerConfig(), WORLD).logprobs(batch)[0]
    fast = TorchTrainer(tiny, TrainerConfig(torch={"autocast": "bfloat16"}), WORLD).logprobs(batch)[0]
    drift = float((fast - exact).abs().max())
    assert 0 < drift < 0.05


def test_the_packed_attention_never_leaks_across_sequences(tiny):
    """A sequence's log-probs do not depend on its neighbours in the packed row."""
    trainer = TorchTrainer(tiny, TrainerConfig(), WORLD)
    batch = ragged_batch()
    alone = [trainer.logprobs(batch.select([i]))[0][0] for i in range(len(batch))]
    together = trainer.logprobs(batch)[0]
    for i in range(len(batch)):
        width = alone[i].shape[0]
        torch.testing.assert_close(together[i, :width], alone[i], rtol=0, atol=1e-5)
