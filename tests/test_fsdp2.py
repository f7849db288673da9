"""FSDP2 on the torch backend (trainer.torch.parallel=fsdp2), 2 gloo ranks on a tiny Qwen2: each rank holds half of
every weight; one RL step on unevenly split rows (rank 1 runs fewer micro-batches, so it pads its forwards) gives
the one-rank step's loss, grad norm, log-probs and weights (float32, <= 1e-5); weights leave gathered under their
Hugging Face names, one bucket at a time; a rank's checkpoint state is its shards, and a fresh trainer loaded
from it continues exactly."""

from __future__ import annotations

import pytest
import torch
from megatron_ranks import grouped_sequences, run_ranks

from yatt.algorithms.objective import Algorithm
from yatt.config import AlgorithmConfig, TrainerConfig
from yatt.distributed import World
from yatt.models.tiny import TinyModelConfig, write_tiny_model
from yatt.tensors import TokenBatch
from yatt.trainers.torch_config import TorchConfig
from yatt.trainers.torch_trainer import TorchTrainer
from yatt.transport.codec import encode

TINY = TinyModelConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
TRAIN = dict(lr=1e-3, grad_clip=0.5, micro_batch_size=3, warmup_steps=1, lr_schedule="cosine")
GROUPS = [1, 3, 3, 1, 2]
ROWS = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]]  # whole groups per rank, uneven: 3 micro-batches and 1


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fsdp2") / "policy", TINY, seed=5)


@pytest.fixture(scope="module")
def one_rank(policy):
    """The batch, and one rank's two steps on all of it (the reference)."""
    gen = torch.Generator().manual_seed(1)
    batch = TokenBatch.from_sequences(*grouped_sequences(gen, GROUPS), pad_id=0)
    batch.temperature = 0.8
    trainer = TorchTrainer(policy, TrainerConfig(**TRAIN), World(0, 1, 0, torch.device("cpu")), total_steps=4)
    logp, _ = trainer.logprobs(batch)
    batch.extras.update(
        old_logprobs=logp + 0.05 * torch.randn(batch.mask.shape, generator=gen) * batch.mask,
        advantages=torch.randn(len(batch), generator=gen),
    )
    denominators = (float(batch.mask.sum()), float(len(batch)), 8)
    loss = Algorithm(AlgorithmConfig()).objective(*denominators)
    stats = [trainer.train_mini_batch(batch, loss) for _ in range(2)]
    return {"batch": batch, "denominators": denominators, "logp": logp, "stats": stats,
            "weights": dict(trainer.named_weights())}  # fmt: skip


def fsdp2_body(world, folder: str, batch, denominators: tuple, out: str) -> dict:
    """This rank's rows through an fsdp2 trainer: log-probs, a step, its state saved; then a fresh trainer loaded
    from that state takes the second step, and its weights leave gathered."""
    cfg = TrainerConfig(**TRAIN, torch=TorchConfig(parallel="fsdp2"))
    mine = batch.select(ROWS[world.rank])
    loss = Algorithm(AlgorithmConfig()).objective(denominators[0] / 2, denominators[1] / 2, denominators[2])
    first = TorchTrainer(folder, cfg, world, total_steps=4)
    local = {n: p.to_local().numel() for n, p in first.module.named_parameters()}
    logp, _ = first.logprobs(mine)
    # a step that does not train the policy (a critic's warm-up) still syncs the engines: the passes without
    # backward must leave every weight sharded again, or the next backward fails to free them
    for bucket in first.engine_weights(1 << 14):  # encoded for the wire, as a weight sync sends them
        encode({"weights": dict(bucket)}, b"k" * 32)
    first.logprobs(mine)
    stats = [first.train_mini_batch(mine, loss)]
    state = first.state_dict()
    saved = {k: v.clone() for k, v in state["model"].items()}
    moments = [v for st in state["optimizer"]["state"].values() for k, v in st.items() if k != "step"]
    second = TorchTrainer(folder, cfg, world, total_steps=4)
    second.load_state_dict({**state, "model": saved})
    stats.append(second.train_mini_batch(mine, loss))
    buckets = [{k: v.clone() for k, v in bucket} for bucket in second.engine_weights(1 << 14)]
    gathered = second.gather_hf_weights()
    second.save_hf(out, _tokenizer(folder))
    return {"local": local, "full": {n: p.numel() for n, p in first.module.named_parameters()}, "logp": logp,
            "stats": stats, "moments_plain": all(type(m) is torch.Tensor for m in moments),
            "buckets": buckets, "gathered": gathered, "replicated": first.replicated}  # fmt: skip


def _tokenizer(folder: str):
    from yatt.models.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def test_two_shards_train_as_one_rank_and_resume_exactly(tmp_path, policy, one_rank):
    batch = one_rank["batch"]
    results = run_ranks(2, fsdp2_body, tmp_path / "ranks", str(policy), batch, one_rank["denominators"],
                        str(tmp_path / "export"))  # fmt: skip
    # each rank holds its part of every weight (dim 0 split in two): together the whole, each about half
    for name, full in results[0]["full"].items():
        assert results[0]["local"][name] + results[1]["local"][name] == full, name
    for r in results:
        assert r["replicated"] is False
        assert all(0 < r["local"][n] < full for n, full in r["full"].items())
        assert sum(r["local"].values()) < 0.6 * sum(r["full"].values())
        for step, want in zip(r["stats"], one_rank["stats"]):
            assert close(step["grad_norm"], want["grad_norm"]), (step, want)
            assert close(step["lr"], want["lr"]) and step["skipped"] == 0.0
        assert r["moments_plain"]  # a checkpoint holds plain tensors: each rank's shard
        weights = {k: v for bucket in r["buckets"] for k, v in bucket.items()}
        assert set(weights) == set(one_rank["weights"])
        for name, w in one_rank["weights"].items():  # two steps, the second by a trainer loaded from the first
            assert float((weights[name] - w).abs().max()) <= 1e-5, name
        layers = [{k.split(".")[2] for k in b if k.startswith("model.layers.")} for b in r["buckets"]]
        assert len(r["buckets"]) > 1 and all(len(found) <= 1 for found in layers)  # one layer a bucket at most
    for r in results:
        mine = batch.select(ROWS[results.index(r)])
        want = one_rank["logp"][ROWS[results.index(r)], : mine.mask.shape[1]]
        assert float((r["logp"] - want).abs().max()) <= 1e-5
    gathered = results[0]["gathered"]
    assert results[1]["gathered"] is None and set(gathered) == set(one_rank["weights"])
    assert all(torch.equal(gathered[k], v) for k, v in weights.items())
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in gathered.items())


def test_lora_under_fsdp2_is_refused_in_one_line(tmp_path, policy):
    from yatt.models.lora_config import LoRAConfig

    cfg = TrainerConfig(torch=TorchConfig(parallel="fsdp2"))
    world = World(0, 2, 0, torch.device("cpu"))  # grouped: 2 ranks (nothing is sharded before the refusal)
    with pytest.raises(ValueError, match="model.lora with trainer.torch.parallel=fsdp2 is not supported yet"):
        TorchTrainer(policy, cfg, world, lora=LoRAConfig(rank=4))
