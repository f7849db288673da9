"""model.lora.sync=adapter on a real vLLM engine (yatt.engines.vllm_lora): the engine serves the synced adapters with
vLLM's LoRA layers, and its log-probs of its own samples are the trainer's (the adapted policy's) after each sync,
whether the adapter comes whole, layer by layer, or with other weights in the same update."""

from __future__ import annotations

import pytest
import torch
from test_lora import flat, lora_trainer, step

from yatt.engines.base import SamplingSpec
from yatt.engines.client import EngineClient, spawn_engine
from yatt.engines.config import EngineConfig
from yatt.models.lora_config import LoRAConfig
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.tensors import TokenBatch
from yatt.trainers.torch_trainer import TorchTrainer

pytestmark = pytest.mark.engine
PROMPTS = [[4, 5, 6, 13, 7, 8], [9, 10, 11, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Qwen2 of 2 layers with head_dim 32 (vLLM's CPU attention takes no smaller)."""
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m",
        TinyModelConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        ),
    )


def sampled_vs_trainer(engine: EngineClient, policy: TorchTrainer) -> tuple[float, float]:
    """The largest difference between the engine's log-probs of its samples (temperature 1, 4 per prompt, seeded)
    and the policy's, and the largest between the engine's and the policy's with its adapter off."""
    rows = engine.generate(PROMPTS, SamplingSpec(n=4, temperature=1.0, max_tokens=8), seeds=[1, 100])
    samples = [(prompt, c) for prompt, group in zip(PROMPTS, rows) for c in group]
    batch = TokenBatch.from_sequences([p for p, _ in samples], [c.token_ids for _, c in samples], pad_id=0)
    batch.temperature = 1.0
    adapted, _ = policy.logprobs(batch)
    with policy.weights.disabled():
        base, _ = policy.logprobs(batch)
    got = [torch.tensor(c.logprobs) for _, c in samples]
    mask = batch.mask.bool()
    diff = lambda want: max(float((g - want[i][mask[i]]).abs().max()) for i, g in enumerate(got))  # noqa: E731
    return diff(adapted), diff(base)


def test_a_vllm_engine_serves_each_synced_adapter_as_the_trainer_scores_it(tiny, tmp_path):
    policy = lora_trainer(tiny, LoRAConfig(rank=4, alpha=8, sync="adapter"))
    cfg = EngineConfig(max_model_len=64, max_num_seqs=16, vllm={"kv_cache_gib": 0.25}, max_lora_rank=4)
    engine = spawn_engine(str(tiny), cfg, seed=0, log_path=tmp_path / "engine.log")
    try:
        assert engine.health()["adapter"] is None  # the base weights until the first sync
        # sync 1: the adapter whole, with a weight that is not adapted (the frozen final norm, changed here on the
        # trainer too) in the same update, which goes through vLLM's weight reload
        for i in range(2):
            step(policy, seed=i)
        norm = policy.module.model.norm.weight
        with torch.no_grad():
            norm.mul_(1.5)
        update = [*flat(policy.engine_weights(1 << 20)).items(), ("model.norm.weight", norm.detach())]
        engine.update_weights(update)
        assert engine.health()["adapter"] == "yatt-sync-1"
        adapted, base = sampled_vs_trainer(engine, policy)
        assert adapted < 1e-4 and base > 1e-3, (adapted, base)

        # sync 2: layer by layer (as weight buckets may split it); every module keeps the latest of its adapter
        for i in range(2, 4):
            step(policy, seed=i)
        adapter = flat(policy.engine_weights(1 << 20))
        for layer in range(2):
            engine.update_weights([(n, t) for n, t in adapter.items() if n.startswith(f"model.layers.{layer}.")])
        assert engine.health()["adapter"] == "yatt-sync-3"
        adapted, base = sampled_vs_trainer(engine, policy)
        assert adapted < 1e-4 and base > 1e-3, (adapted, base)
    finally:
        engine.close()
