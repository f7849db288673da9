"""FSDP2 on the torch backend (trainer.torch.parallel=fsdp2), 2 gloo ranks on a tiny Qwen2: each rank holds half of
every weight; one RL step on unevenly split rows (rank 1 runs fewer micro-batches, so it pads its forwards) gives
the one-rank step's loss, grad norm, log-probs and weights (float32, <= 1e-5); weights leave gathered under their
Hugging Face names, one bucket at a time; a rank's checkpoint state is its shards, and a fresh trainer loaded
from it continues exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron_ranks import grouped_sequences, run_ranks

from yatt.algorithms.objective import Algorithm
from yatt.checkpoint.export import INDEX
from yatt.checkpoint.snapshot import ITEMS, snapshot
from yatt.checkpoint.snapshot import ROWS as ROW_COUNT
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
    tree = snapshot({"trainer": state}).tree["trainer"]  # what a checkpoint writes
    nodes = [*tree["model"].values(), *(v for _, st in tree["optimizer"]["state"][ITEMS]
                                        for k, v in st.items() if k != "step")]  # fmt: skip
    second = TorchTrainer(folder, cfg, world, total_steps=4)
    second.load_state_dict({**state, "model": saved})
    stats.append(second.train_mini_batch(mine, loss))
    buckets = [{k: v.clone() for k, v in bucket} for bucket in second.engine_weights(1 << 14)]
    import yatt.checkpoint.export as export

    export.SHARD_BYTES = 1 << 16  # several files, written one at a time as the weights are gathered
    second.save_hf(out, _tokenizer(folder))
    return {"local": local, "full": {n: p.numel() for n, p in first.module.named_parameters()}, "logp": logp,
            "stats": stats, "saved_as_rows": all(ROW_COUNT in node for node in nodes),
            "buckets": buckets, "replicated": first.replicated}  # fmt: skip


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
        assert r["saved_as_rows"]  # a checkpoint holds each rank's rows of the weights and moments
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
    from transformers import AutoModelForCausalLM

    # the export: safetensors files of at most one layer each (SHARD_BYTES), named by Hugging Face's index
    index = json.loads((tmp_path / "export" / INDEX).read_text())["weight_map"]
    assert set(index) == set(one_rank["weights"]) and len(set(index.values())) > 2
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(exported[k], v) for k, v in weights.items())


LORA = dict(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])


def lora_body(world, folder: str, batch, denominators: tuple, out: str) -> dict:
    """LoRA adapters under fsdp2: this rank's rows, two steps; what engines get (merged), the reference's log-probs
    (adapter off) and the export with its adapter folder."""
    from yatt.models.lora_config import LoRAConfig

    size = world.size
    cfg = TrainerConfig(**TRAIN, torch=TorchConfig(parallel="fsdp2" if size > 1 else "ddp"))
    torch.manual_seed(world.rank)  # the adapters start from rank 0's A on every rank, as under DDP
    trainer = TorchTrainer(folder, cfg, world, total_steps=4, lora=LoRAConfig(**LORA))
    mine = batch if size == 1 else batch.select(ROWS[world.rank])
    loss = Algorithm(AlgorithmConfig()).objective(denominators[0] / size, denominators[1] / size, denominators[2])
    stats = [trainer.train_mini_batch(mine, loss) for _ in range(2)]
    pushed = {k: v.clone() for bucket in trainer.engine_weights(1 << 14) for k, v in bucket}
    reference, _ = trainer.reference().logprobs(mine)
    trainer.save_hf(out, _tokenizer(folder))
    adapters = {n: p.to_local().numel() if size > 1 else p.numel() for n, p in trainer.weights.state().items()}
    return {"stats": stats, "pushed": pushed, "reference": reference, "adapters": adapters}


def test_lora_adapters_train_sharded_as_on_one_rank(tmp_path, policy, one_rank):
    """model.lora under fsdp2 at 2 ranks: each rank holds part of every adapter; two steps give the one-rank run's
    merged weights and grad norms (<= 1e-5); the reference is the base model; the export has peft's adapter."""
    args = (str(policy), one_rank["batch"], one_rank["denominators"])
    (alone,) = run_ranks(1, lora_body, tmp_path / "one", *args, str(tmp_path / "one-export"))
    sharded = run_ranks(2, lora_body, tmp_path / "two", *args, str(tmp_path / "two-export"))
    for name, count in alone["adapters"].items():
        assert sharded[0]["adapters"][name] + sharded[1]["adapters"][name] == count, name
    for r in sharded:
        assert set(r["pushed"]) == set(alone["pushed"])
        for name, want in alone["pushed"].items():
            assert float((r["pushed"][name] - want).abs().max()) <= 1e-5, name
        for step, want in zip(r["stats"], alone["stats"]):
            assert close(step["grad_norm"], want["grad_norm"]), (step, want)
    for rank, r in enumerate(sharded):  # the reference: the base model's log-probs
        want = one_rank["logp"][ROWS[rank], : r["reference"].shape[1]]
        assert float((r["reference"] - want).abs().max()) <= 1e-5
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (tmp_path / "two-export" / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "two-export").state_dict()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(policy), tmp_path / "two-export" / "adapter"
    )
    base = adapted.merge_and_unload().state_dict()
    assert all(float((merged[k] - base[k]).abs().max()) <= 1e-5 for k in merged)


class _Trained:
    """The trainer as the checkpointer's Stateful, the way yatt.controllers.shard_state hands it over."""

    replicated = ()

    def __init__(self, trainer: TorchTrainer, step: int):
        self.trainer, self.step = trainer, step

    def state_dict(self) -> dict:
        return {"trainer": self.trainer.state_dict(), "progress": {"step": self.step}}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state["trainer"])


def _whole(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    """Every weight and AdamW moment gathered whole, by parameter (a collective)."""
    from yatt.trainers.sharding import full

    out = {f"weight/{n}": full(p.detach()).clone() for n, p in trainer.module.named_parameters()}
    for i, p in enumerate(trainer.module.parameters()):
        for k, v in trainer.optimizer.state[p].items():
            out[f"moment/{i}/{k}"] = full(v).clone()
    return out


def reshard_body(world, folder: str, batch, denominators: tuple, root: str, step: int) -> dict:
    """Resume from the newest checkpoint under `root` (saved by however many ranks), take step `step` on this
    rank's rows of `batch` (all of them alone, ROWS' halves at two ranks), and save it."""
    from yatt.checkpoint.checkpointer import Checkpointer
    from yatt.checkpoint.config import CheckpointConfig

    cfg = TrainerConfig(**TRAIN, torch=TorchConfig(parallel="fsdp2"))
    trainer = TorchTrainer(folder, cfg, world, total_steps=4)
    checkpoints = Checkpointer(CheckpointConfig(dir=root, async_write=False), Path(root), {}, world)
    loaded = {}
    if (found := checkpoints.find("auto")) is not None:
        checkpoints.load(found[0], _Trained(trainer, found[1]))
        loaded = _whole(trainer)
    mine = batch if world.size == 1 else batch.select(ROWS[world.rank])
    size = world.size  # gradients are averaged over the ranks: each normalises by its share of the denominators
    loss = Algorithm(AlgorithmConfig()).objective(denominators[0] / size, denominators[1] / size, denominators[2])
    stats = trainer.train_mini_batch(mine, loss)
    checkpoints.save(step, _Trained(trainer, step))
    checkpoints.finish()
    return {"loaded": loaded, "saved": _whole(trainer), "stats": stats}


def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path, policy, one_rank):
    """2 -> 1 -> 2 ranks: after each reshard the gathered weights and moments are the saved ones exactly, and the
    step taken on 1 rank continues the run (the one-rank reference's second step, <= 1e-5)."""
    args = (str(policy), one_rank["batch"], one_rank["denominators"], str(tmp_path / "ck"))
    first = run_ranks(2, reshard_body, tmp_path / "a", *args, 1)
    second = run_ranks(1, reshard_body, tmp_path / "b", *args, 2)
    third = run_ranks(2, reshard_body, tmp_path / "c", *args, 3)
    for before, after in ((first[0]["saved"], second[0]["loaded"]), (second[0]["saved"], third[1]["loaded"])):
        assert set(before) == set(after) and any(k.startswith("moment/") for k in before)
        for key, value in before.items():
            assert torch.equal(after[key], value), key
    assert third[0]["loaded"].keys() == third[1]["loaded"].keys()
    for name, want in one_rank["weights"].items():
        assert float((second[0]["saved"][f"weight/{name}"] - want).abs().max()) <= 1e-5, name
    assert close(second[0]["stats"]["grad_norm"], one_rank["stats"][1]["grad_norm"])
    assert close(second[0]["stats"]["policy_loss"], one_rank["stats"][1]["policy_loss"])
