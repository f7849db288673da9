"""LoRA on the torch backend (model.lora), one process on a tiny Qwen2: the reference with the adapter off, what
trains, the weight sync (merged and adapter-only into a real hf engine), checkpoints, exports and the config."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from yatt.algorithms.objective import Algorithm
from yatt.checkpoint.export import policy_writer
from yatt.checkpoint.snapshot import restore, snapshot
from yatt.config import AlgorithmConfig, TrainerConfig, load_experiment
from yatt.config_loading import ConfigError
from yatt.distributed import World
from yatt.engines.config import EngineConfig
from yatt.engines.hf_engine import HFEngine
from yatt.models.lora_config import LoRAConfig
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.tensors import TokenBatch
from yatt.trainers.torch_trainer import TorchTrainer

WORLD = World(rank=0, size=1, local_rank=0, device=torch.device("cpu"))
CFG = TrainerConfig(lr=1e-2)
LORA = LoRAConfig(rank=4, alpha=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m",
        TinyModelConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        ),
    )


def lora_trainer(path: Path, lora: LoRAConfig = LORA, seed: int = 0, **kwargs) -> TorchTrainer:
    torch.manual_seed(seed)
    return TorchTrainer(path, CFG, WORLD, total_steps=10, lora=lora, **kwargs)


def rl_batch(trainer: TorchTrainer, seed: int = 0) -> TokenBatch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 40, (4,), generator=gen).tolist() for _ in range(8)]
    responses = [torch.randint(3, 40, (1 + i % 4,), generator=gen).tolist() + [2] for i in range(8)]
    batch = TokenBatch.from_sequences(prompts, responses, pad_id=0)
    old, _ = trainer.logprobs(batch)
    batch.extras.update(old_logprobs=old, advantages=torch.tensor([1.0, -1.0] * 4))
    return batch


def step(trainer: TorchTrainer, seed: int = 0) -> dict[str, float]:
    batch = rl_batch(trainer, seed)
    loss_fn = Algorithm(AlgorithmConfig()).objective(int(batch.mask.sum()), len(batch), norm_length=8)
    return trainer.train_mini_batch(batch, loss_fn)


def flat(buckets) -> dict[str, torch.Tensor]:
    return {name: t for bucket in buckets for name, t in bucket}


def test_the_reference_is_the_base_model_exactly(tiny):
    """With the adapter off the trained LoRA policy gives the frozen base model's log-probs bit for bit."""
    policy, base = lora_trainer(tiny), TorchTrainer(tiny, CFG, WORLD, trainable=False)
    batch = rl_batch(policy)
    assert torch.equal(policy.logprobs(batch)[0], base.logprobs(batch)[0])  # B starts at zero: the base model
    for i in range(2):
        step(policy, seed=i)
    ref = policy.reference()
    lp, ent = ref.logprobs(batch, with_entropy=True)
    base_lp, base_ent = base.logprobs(batch, with_entropy=True)
    assert torch.equal(lp, base_lp) and torch.equal(ent, base_ent)
    assert not torch.equal(policy.logprobs(batch)[0], base_lp)  # the adapter is back on after the reference pass
    assert ref.offload()["moved_bytes"] == 0 and not hasattr(ref, "optimizer")


def test_the_factory_loads_no_second_model_for_the_reference(tiny, tmp_path, monkeypatch):
    """build_components with LoRA and a KL term: one model, whose adapter-off self is the reference (the engines,
    started last, are stopped before they start)."""
    from yatt.controllers.components import build_components
    from yatt.trainers.lora import AdapterOff

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"model: {{path: {tiny}}}\ndata:\n  train: {{kind: jsonl, files: [{data}]}}\n  prompts_per_step: 4\n"
    )
    cfg = load_experiment(path, ["model.lora.rank=4", "algorithm.kl_coef=0.1", "rollout.engine.backend=hf"])
    built: list = []
    for cls in (TorchTrainer, AdapterOff):
        init = cls.__init__
        monkeypatch.setattr(
            cls, "__init__", lambda self, *a, _init=init, **k: (built.append(self), _init(self, *a, **k))[1]
        )

    class EnginesStart(Exception):
        pass

    def spawn(*args, **kwargs):
        raise EnginesStart

    with pytest.raises(EnginesStart):
        build_components(cfg, WORLD, tmp_path / "run", spawn=spawn)
    policy, ref = built
    assert isinstance(policy, TorchTrainer) and isinstance(ref, AdapterOff) and ref.trainer is policy


@pytest.mark.parametrize("sync, rank", [("adapter", 4), ("merged", None)])
def test_the_rollout_engines_are_started_for_the_adapters_they_are_sent(tiny, tmp_path, sync, rank):
    """With sync=adapter each rollout engine (a restarted one too: it is started from the same spec) is sized for
    adapters of model.lora.rank (EngineConfig.max_lora_rank); with merged syncs it takes weights only."""
    from yatt.controllers.components import build_components

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"model: {{path: {tiny}}}\ndata:\n  train: {{kind: jsonl, files: [{data}]}}\n  prompts_per_step: 4\n"
    )
    cfg = load_experiment(path, ["model.lora.rank=4", f"model.lora.sync={sync}"])
    started: list[EngineConfig] = []

    class EnginesStart(Exception):
        pass

    def spawn(model, engine_cfg, **kwargs):
        started.append(engine_cfg)
        raise EnginesStart

    with pytest.raises(EnginesStart):
        build_components(cfg, WORLD, tmp_path / "run", spawn=spawn)
    assert [c.max_lora_rank for c in started] == [rank] and cfg.rollout.engine.max_lora_rank is None


def test_only_the_adapters_train(tiny):
    policy = lora_trainer(tiny)
    trainable = [n for n, p in policy.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    held = [p for group in policy.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in policy.weights.parameters()}
    # 2 layers x 7 linear layers (q, k, v, o, gate, up, down) x (A, B)
    assert len(held) == 2 * 7 * 2
    before = {n: p.detach().clone() for n, p in policy.module.named_parameters()}
    # the gradients of one backward land on the adapters only
    batch = rl_batch(policy)
    loss_fn = Algorithm(AlgorithmConfig()).objective(int(batch.mask.sum()), len(batch), norm_length=8)
    loss, _ = loss_fn(*policy._token_outputs(policy.model, batch, False), batch)
    loss.backward()
    assert {n for n, p in policy.module.named_parameters() if p.grad is not None} == set(trainable)
    policy.optimizer.zero_grad(set_to_none=True)
    stats = step(policy)
    assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0
    moved = {n for n, p in policy.module.named_parameters() if not torch.equal(before[n], p.detach())}
    # B starts at zero, so the first step moves every B and nothing else (A's gradient is B^T times something)
    assert moved == {n for n in trainable if ".lora_B." in n}


def test_the_merged_push_is_peft_s_merge_of_the_adapted_modules_only(tiny):
    policy = lora_trainer(tiny, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "o_proj"]))
    step(policy)
    merged = copy.deepcopy(policy.weights.peft).merge_and_unload().state_dict()
    sent = flat(policy.engine_weights(1 << 20))
    # q_proj is adapted; k_proj and v_proj go with it (an engine reloads the fused q/k/v whole), biases included
    assert {n.split(".", 3)[3] for n in sent} == {
        f"self_attn.{m}.{p}" for m in ("q_proj", "k_proj", "v_proj") for p in ("weight", "bias")
    } | {"self_attn.o_proj.weight"}
    for name, tensor in sent.items():
        assert torch.equal(tensor, merged[name]), name
    assert not torch.equal(
        sent["model.layers.0.self_attn.q_proj.weight"],
        policy.weights.layers["model.layers.0.self_attn.q_proj"].get_base_layer().weight,
    )
    whole = sum(t.numel() for _, t in TorchTrainer(tiny, CFG, WORLD, trainable=False).named_weights())
    assert sum(t.numel() for t in sent.values()) < 0.5 * whole  # no MLP, no embeddings, no norms
    # every weight of the policy's export equals peft's merge too
    hf = dict(policy.named_weights())
    assert set(hf) == set(merged) - {"lm_head.weight"} and all(torch.equal(hf[k], merged[k]) for k in hf)


def test_adapter_only_sync_gives_the_hf_engine_the_merged_weights(tiny):
    """model.lora.sync=adapter: the engine merges A and B into its copy of the base weights itself and ends with
    the weights a merged push would give it, exactly (same dtype), for a fraction of the bytes."""
    engine = HFEngine(str(tiny), EngineConfig(backend="hf", max_model_len=64), seed=0)
    policy = lora_trainer(tiny, LORA.model_copy(update={"sync": "adapter"}))
    merged_policy = lora_trainer(tiny)
    for i in range(2):  # two syncs: the second merges into the base, not into the first merge
        step(policy, seed=i)
        step(merged_policy, seed=i)
        adapter = flat(policy.engine_weights(1 << 20))
        for bucket in policy.engine_weights(1 << 20):
            engine.update_weights(bucket)
        params = dict(engine.model.named_parameters())
        merged = flat(merged_policy.engine_weights(1 << 20))
        for name, tensor in merged.items():
            assert torch.equal(params[name], tensor), name
    assert all(n.endswith((".lora_A", ".lora_B", ".lora_scaling")) for n in adapter)
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert adapter_bytes < 0.2 * sum(t.numel() * t.element_size() for t in merged.values())
    with pytest.raises(ValueError, match="lacks model.layers.0.self_attn.q_proj.lora_B"):
        engine.update_weights(
            [
                (n, t)
                for n, t in adapter.items()
                if n.startswith("model.layers.0.self_attn.q_proj.") and not n.endswith("lora_B")
            ]
        )


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_and_resumes_exactly(tiny, tmp_path):
    a = lora_trainer(tiny)
    for i in range(2):
        step(a, seed=i)
    snap = snapshot({"trainer": a.state_dict()})
    save_file(snap.tensors, str(tmp_path / "shared.safetensors"))
    names = set(snap.tensors)
    assert names and all(n.startswith(("trainer/adapter/", "trainer/optimizer/")) for n in names), sorted(names)[:5]
    full = TorchTrainer(tiny, CFG, WORLD)
    step(full)
    assert snap.nbytes < 0.25 * snapshot({"trainer": full.state_dict()}).nbytes  # the bound, at rank 4

    b = lora_trainer(tiny, seed=1)  # other random A matrices: the checkpoint must overwrite them
    b.load_state_dict(restore(snap.tree, load_file(str(tmp_path / "shared.safetensors")))["trainer"])
    assert b.optimizer_steps == a.optimizer_steps == 2
    for trainer in (a, b):
        step(trainer, seed=5)
    wa, wb = dict(a.named_weights()), dict(b.named_weights())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    batch = rl_batch(a, seed=9)
    assert torch.equal(a.logprobs(batch)[0], b.logprobs(batch)[0])
    with pytest.raises(
        ValueError, match=r"the checkpoint holds LoRA adapters, but this policy trains all weights \(model.lora\)"
    ):
        full.load_state_dict(a.state_dict())


def test_exports_load_with_transformers_and_with_peft(tiny, tmp_path):
    from peft import PeftModel

    policy = lora_trainer(tiny)
    step(policy)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    batch = rl_batch(policy, seed=3)
    want = policy.logprobs(batch)[0]

    # the run's export (save_hf) and a checkpoint's (from the snapshot, on the writer thread)
    policy.save_hf(tmp_path / "final", tokenizer)
    snap = snapshot({"trainer": policy.state_dict()})
    policy_writer(policy, snap, tmp_path / "ckpt", "trainer", tokenizer)(tmp_path / "ckpt")
    for folder in (tmp_path / "final", tmp_path / "ckpt"):
        loaded = TorchTrainer(folder, CFG, WORLD, trainable=False)
        assert torch.allclose(loaded.logprobs(batch)[0], want, atol=1e-5)
        assert {(folder / "adapter" / f).is_file() for f in ("adapter_model.safetensors", "adapter_config.json")} == {
            True
        }
        hf = AutoModelForCausalLM.from_pretrained(str(folder))
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(folder / "adapter"))
        ids = batch.input_ids[:2]
        assert torch.allclose(peft(ids).logits, hf(ids).logits, atol=1e-5)
        assert peft.peft_config["default"].r == LORA.rank
    assert (tmp_path / "final" / "generation_config.json").is_file()  # as save_pretrained writes it without LoRA
    a, b = load_file(str(tmp_path / "final/model.safetensors")), load_file(str(tmp_path / "ckpt/model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_config(tmp_path, tiny):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"model: {{path: {tiny}}}\ndata:\n  train: {{kind: jsonl, files: [{data}]}}\n  prompts_per_step: 4\n"
    )
    assert not load_experiment(path).model.lora.enabled  # off unless a rank is given
    cfg = load_experiment(path, ["model.lora.rank=16"])
    assert cfg.model.lora.enabled and cfg.model.lora.scaling == 2.0 and cfg.model.lora.target_modules == "all-linear"
    with pytest.raises(ConfigError, match="trainer.backend=megatron does not train LoRA adapters yet: its layers"):
        load_experiment(path, ["model.lora.rank=16", "trainer.backend=megatron"])
    for backend in ("vllm", "hf"):  # both take adapters (vLLM serves them, hf merges them)
        load_experiment(path, ["model.lora.rank=16", "model.lora.sync=adapter", f"rollout.engine.backend={backend}"])
    plugin = "rollout.engine.backend=tests.plugins.counting_engine:CountingEngine"
    with pytest.raises(
        ConfigError, match="model.lora.sync=adapter: rollout.engine.backend=tests.plugins.*does not take"
    ):
        load_experiment(path, ["model.lora.rank=16", "model.lora.sync=adapter", plugin])
    with pytest.raises(ConfigError, match="rollout.engine.max_lora_rank=8 is below model.lora.rank=16"):
        load_experiment(path, ["model.lora.rank=16", "model.lora.sync=adapter", "rollout.engine.max_lora_rank=8"])
    with pytest.raises(ConfigError, match="model.lora.ranks"):
        load_experiment(path, ["model.lora.ranks=16"])
    with pytest.raises(ConfigError, match="target_modules is empty"):
        load_experiment(path, ["model.lora.rank=16", "model.lora.target_modules=[]"])
    with pytest.raises(ValueError, match="model.lora.target_modules: .*nope"):
        lora_trainer(tiny, LoRAConfig(rank=4, target_modules=["nope"]))


@pytest.mark.engine
def test_a_merged_push_of_some_modules_reaches_a_vllm_engine_whole(tiny, tmp_path):
    """vLLM reloads fused modules (q/k/v, gate/up) whole: a sync of q_proj, o_proj and up_proj alone (with their
    fused siblings, unchanged) gives the engine the merged policy, the rest of each layer left as it was."""
    from engine_refs import hf_logprobs

    from yatt.engines.base import SamplingSpec
    from yatt.engines.client import spawn_engine

    policy = lora_trainer(tiny, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "o_proj", "up_proj"]))
    for i in range(3):
        step(policy, seed=i)
    merged = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    base = copy.deepcopy(merged)
    merged.load_state_dict(dict(policy.named_weights()), strict=False)
    cfg = EngineConfig(max_model_len=64, max_num_seqs=16, vllm={"kv_cache_gib": 0.25}, weight_bucket_mb=1)
    engine = spawn_engine(str(tiny), cfg, seed=0, log_path=tmp_path / "engine.log")
    try:
        for bucket in policy.engine_weights(1 << 20):
            engine.update_weights(bucket)
        prompts = [[4, 5, 6, 13, 7, 8], [9, 10, 11, 3]]
        rows = engine.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=8))
    finally:
        engine.close()
    moved = 0.0
    for prompt, (completion,) in zip(prompts, rows):
        got = torch.tensor(completion.logprobs)
        torch.testing.assert_close(got, hf_logprobs(merged, prompt, completion.token_ids), atol=1e-4, rtol=0)
        moved = max(moved, float((got - hf_logprobs(base, prompt, completion.token_ids)).abs().max()))
    assert moved > 1e-3  # the engine generates from the adapted policy, not the base
