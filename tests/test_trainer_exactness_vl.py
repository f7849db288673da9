"""Image prompts on the trainer's efficient paths give the values of the plain one (tests/test_trainer_exactness.py
for text): the batch holds each prompt's pixels once, the vision tower encodes each distinct prompt once per
micro-batch, and packed rows with shared prompts (image tokens included) give the log-probs, entropies, loss and
gradients of Hugging Face's own padded forward with every row's pixels (float32, <= 1e-5)."""

from __future__ import annotations

import pytest
import torch
from vl_batches import batch_of, rollouts, vl_setup

from yatt.algorithms import entropy_from_logits, token_logprobs
from yatt.algorithms.objective import Algorithm
from yatt.config import AlgorithmConfig, TrainerConfig
from yatt.distributed import World
from yatt.tensors import TokenBatch
from yatt.trainers.packing import shared_prompts
from yatt.trainers.torch_trainer import TorchTrainer

WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
VARIANTS = {  # name: trainer settings
    "padded-full": dict(pack_sequences=False, torch={"logprob_chunk_tokens": 0}),
    "packed-full": dict(pack_sequences=True, torch={"logprob_chunk_tokens": 0}),
    "packed-unshared": dict(pack_sequences=True, share_prompts=False, torch={"logprob_chunk_tokens": 0}),
    "packed-chunked-checkpointed": dict(
        pack_sequences=True, torch={"logprob_chunk_tokens": 5, "activation_checkpointing": True}
    ),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return vl_setup(tmp_path_factory.mktemp("exact_vl"))


def reference(trainer: TorchTrainer, batch: TokenBatch):
    """Log-probs and entropies the textbook way: Hugging Face's padded forward with full logits, every row
    carrying its own copy of its prompt's pixels (text rows all-zero pixels, which the model drops)."""
    index = batch.image_index.clamp(min=0)
    pixels = {k: v[index] * (batch.image_index >= 0).view(-1, *[1] * (v.dim() - 1)) for k, v in batch.pixels.items()}
    logits = trainer.module(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **pixels).logits
    logits = logits[:, :-1].float() / batch.temperature
    return token_logprobs(logits, batch.input_ids[:, 1:]) * batch.mask, entropy_from_logits(logits) * batch.mask


def grads(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in trainer.module.named_parameters()}
    trainer.module.zero_grad(set_to_none=True)
    return out


def test_the_batch_holds_each_prompts_pixels_once_with_bool_masks(setup):
    folder, images, text = setup
    batch = batch_of(rollouts(images, text))
    assert batch.pixels["pixel_values"].shape[0] == len(images) and len(batch) == 10 + len(text)
    assert batch.pixels["pixel_attention_mask"].dtype == torch.bool
    assert all(im.pixels["pixel_attention_mask"].dtype == torch.bool for im in images)
    assert batch.image_index.tolist() == [0, 0, 0, -1, 1, -1, 2, 2, 2, 2, 3, 3]
    # a sub-batch keeps the pixels of its own prompts only, re-indexed
    sub = batch.select([3, 7, 5, 10])
    assert sub.image_index.tolist() == [-1, 0, -1, 1]
    assert torch.equal(sub.pixels["pixel_values"], batch.pixels["pixel_values"][[2, 3]])
    assert batch.select([3, 5]).pixels == {} and batch.select([3, 5]).image_index is None
    # same ids, other images: never a shared prompt; same prompt and pixels: shared
    n = len(images[0].prompt_ids)
    assert all(im.prompt_ids == images[0].prompt_ids for im in images)
    assert shared_prompts(batch) == [0, 0, 0, 0, 0, 0, 0, n, n, n, 0, n]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_and_entropy_equal_the_padded_forward(setup, variant, temperature):
    folder, images, text = setup
    trainer = TorchTrainer(folder, TrainerConfig(micro_batch_size=5, **VARIANTS[variant]), WORLD)
    batch = batch_of(rollouts(images, text), temperature)
    logp, ent = trainer.logprobs(batch, with_entropy=True)
    with torch.no_grad():
        want_logp, want_ent = reference(trainer, batch)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_and_gradients_equal_the_padded_forward(setup, variant):
    """The PPO-clip loss plus an entropy term: same loss, same gradient of every weight, the vision tower's
    included (the sum over the samples that read a prompt's features)."""
    folder, images, text = setup
    trainer = TorchTrainer(folder, TrainerConfig(**VARIANTS[variant]), WORLD)
    batch = batch_of(rollouts(images, text), 0.7)
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
    assert any("vision_model" in name and g.abs().max() > 0 for name, g in got.items())
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("variant", ["padded-full", "packed-full"])
def test_the_vision_tower_encodes_each_prompt_once_per_micro_batch(setup, variant):
    """A forward hook counts the images through the vision tower: the log-prob pass and the update encode each
    distinct prompt once per micro-batch that holds its rows, not once per sample."""
    folder, images, text = setup
    trainer = TorchTrainer(folder, TrainerConfig(micro_batch_size=16, **VARIANTS[variant]), WORLD)
    encoded = []
    trainer.module.model.vision_model.register_forward_hook(
        lambda m, args, kw, out: encoded.append(kw["pixel_values"].shape[0]), with_kwargs=True
    )
    batch = batch_of(rollouts(images, text))
    logp, _ = trainer.logprobs(batch)
    assert encoded == [len(images)]  # one micro-batch: 4 prompts, 10 image samples
    batch.extras.update(old_logprobs=logp, advantages=torch.linspace(-1, 1, len(batch)))
    trainer.train_mini_batch(batch, Algorithm(AlgorithmConfig()).objective(float(batch.mask.sum()), len(batch), 8))
    assert encoded == [len(images)] * 2
    encoded.clear()
    trainer.cfg = trainer.cfg.model_copy(update={"micro_batch_size": 3})
    trainer.logprobs(batch)
    micro = trainer.micro_batches(batch)
    want = [len({int(batch.image_index[i]) for i in rows} - {-1}) for rows in micro]
    assert encoded == [n for n in want if n] and sum(encoded) < int((batch.image_index >= 0).sum())
