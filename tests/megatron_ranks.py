"""What the megatron tests run on several gloo ranks: a spawner, and the per-rank bodies.

Each body runs in a fresh process (torch.multiprocessing spawn) with one compute thread, joins a gloo group
over a free local port, and writes its results with torch.save to `out/rank{r}.pt`; the test reads them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

needs_megatron = pytest.mark.skipif(
    not HAVE_MEGATRON,
    reason="megatron-core is not installed (pip install 'yatt[megatron]'; scripts/setup.sh installs it on CPU)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, body: Callable, out: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from yatt.distributed import World

    result = body(World(rank, world, rank, torch.device("cpu")), *args)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world: int, body: Callable, out: Path, *args: Any) -> list[Any]:
    """body(World, *args) on `world` gloo ranks; the list of what each returned, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.multiprocessing.spawn(_entry, args=(world, _free_port(), body, str(out), args), nprocs=world)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def grouped_sequences(gen: torch.Generator, sizes: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and responses as an RL batch holds them: for each entry of sizes a prompt (2 to 4 tokens) and
    that many samples of it as consecutive rows (a GRPO group; 1: a lone prompt), responses of 1 to 4 tokens:
    ragged rows whose prompts trainer.share_prompts reads once."""
    prompts, responses = [], []
    for g, size in enumerate(sizes):
        prompt = torch.randint(3, 40, (2 + g % 3,), generator=gen).tolist()
        for _ in range(size):
            prompts.append(prompt)
            responses.append(torch.randint(3, 40, (1 + len(responses) % 4,), generator=gen).tolist())
    return prompts, responses


# ---- bodies --------------------------------------------------------------------------------------------------


def logits_body(world, folder: str, tp: int, pp: int, ids: torch.Tensor) -> dict:
    """Full-vocabulary logits of `ids` from the GPTModel mapped from `folder` (gathered over TP, on the last
    stage), and this rank's megatron shard mapped back to HF names."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoConfig

    from yatt.trainers import megatron_compat as compat
    from yatt.trainers import megatron_model as mm
    from yatt.trainers.megatron_trainer import init_model_parallel, read_hf_weights

    compat.apply()
    hf = AutoConfig.from_pretrained(folder)
    with compat.on_cpu():
        init_model_parallel(tp, pp)
        tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        gpt = mm.build_gpt(hf, tp, pp, pp_rank, torch.float32)
        tied = hf.tie_word_embeddings and pp > 1 and pp_rank == pp - 1
        gpt.load_state_dict(
            mm.local_state_from_hf(read_hf_weights(Path(folder)), hf, tp, tp_rank, pp, pp_rank, tied), strict=False
        )
        width = ids.shape[1]
        positions = torch.arange(width).expand_as(ids)
        mask = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]
        store = []

        def step(iterator, model):
            out = model(next(iterator), positions, mask)

            def loss(o):
                store.append(gather_from_tensor_model_parallel_region(o.detach())[..., : hf.vocab_size])
                return o.sum() * 0.0, {}

            return out, loss

        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter([ids]),
                model=[gpt],
                num_microbatches=1,
                seq_length=width,
                micro_batch_size=len(ids),
                forward_only=True,
            )
    return {"logits": store[0] if store else None, "tp_rank": tp_rank, "pp_rank": pp_rank}


def trainer_step_body(
    world,
    folder: str,
    tp: int,
    pp: int,
    batch,
    rows: list[list[int]],
    denominators: tuple,
    trainer_kwargs: dict,
    freeze_vision: bool = False,
    megatron_kwargs: dict | None = None,
) -> dict:
    """One MegatronTrainer.train_mini_batch on this rank's rows (by data-parallel rank) with the PPO loss:
    its stats, the weights after the step under HF names, and log-probs before the step. `megatron_kwargs`:
    more of trainer.megatron (expert_parallel, ...)."""
    from yatt.algorithms.objective import Algorithm
    from yatt.config import AlgorithmConfig, TrainerConfig
    from yatt.trainers.megatron_config import MegatronConfig
    from yatt.trainers.megatron_trainer import MegatronTrainer

    own = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, **(megatron_kwargs or {}))
    cfg = TrainerConfig(backend="megatron", megatron=own, **trainer_kwargs)
    trainer = MegatronTrainer(folder, cfg, world, total_steps=4, freeze_vision=freeze_vision)
    mine = batch.select(rows[trainer.dp_rank])  # extras (old log-probs, advantages) come along
    logp, ent = trainer.logprobs(mine, with_entropy=True)
    stats = trainer.train_mini_batch(mine, Algorithm(AlgorithmConfig()).objective(*denominators))
    weights = {k: v.clone() for bucket in trainer.engine_weights(1 << 16) for k, v in bucket}
    buckets = [[k for k, _ in bucket] for bucket in trainer.engine_weights(1 << 16)]
    return {
        "stats": stats,
        "weights": weights,
        "logp": logp,
        "entropy": ent,
        "dp_rank": trainer.dp_rank,
        "buckets": buckets,
        "state_keys": sorted(trainer.state_dict()["model"]),
        "micro_batches": trainer.micro_batches(mine),
    }


def routing_body(
    world, folder: str, tp: int, pp: int, ep: int, batch, rows: list[list[int]], denominators: tuple, kwargs: dict
) -> dict:
    """Routing replay on one rank of a MegatronTrainer (yatt.trainers.megatron_routing), this data-parallel rank's
    rows of `batch` (the engine's routing to replay and to compare with): a log-prob pass replaying it (r3) and
    recording what it used, with the mismatch counts; a pass without replay recording the router's own choice
    (r2's record); an update replaying it (routing_passes)."""
    from yatt.config import TrainerConfig
    from yatt.trainers.megatron_config import MegatronConfig
    from yatt.trainers.megatron_trainer import MegatronTrainer

    own = MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
    trainer = MegatronTrainer(folder, TrainerConfig(backend="megatron", megatron=own, **kwargs), world, total_steps=4)
    out = routing_passes(trainer, batch.select(rows[trainer.dp_rank]), denominators)
    return {**out, "dp_rank": trainer.dp_rank, "pp_rank": trainer.pp_rank, "tp_rank": trainer.tp_rank}


def routing_passes(trainer, mine, denominators: tuple) -> dict:
    """routing_body's passes on any trainer (the torch backend's too)."""
    from yatt.algorithms.objective import Algorithm
    from yatt.config import AlgorithmConfig

    replayed, _ = trainer.logprobs(mine, record_routing=True)
    counts = trainer.routing_counts()
    used = mine.routing.clone()
    free = mine.select(torch.arange(len(mine)))
    free.routing = free.engine_routing = None
    own_lp, _ = trainer.logprobs(free, record_routing=True)
    stats = trainer.train_mini_batch(mine, Algorithm(AlgorithmConfig()).objective(*denominators))
    weights = {k: v.clone() for bucket in trainer.engine_weights(1 << 16) for k, v in bucket}
    return {"replayed": replayed, "counts": counts, "used": used, "own_lp": own_lp, "own": free.routing,
            "stats": stats, "weights": weights}  # fmt: skip


def resume_body(world, folder: str, tp: int, pp: int, batch, denominators: tuple, trainer_kwargs: dict) -> dict:
    """Two steps in one trainer vs step 1, state_dict copied, a fresh trainer loading it, step 2: the
    second steps' stats and weights, and the shard's size against the whole model's."""
    import copy

    from yatt.algorithms.objective import Algorithm
    from yatt.config import AlgorithmConfig, TrainerConfig
    from yatt.trainers.megatron_config import MegatronConfig
    from yatt.trainers.megatron_trainer import MegatronTrainer

    cfg = TrainerConfig(
        backend="megatron", megatron=MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp), **trainer_kwargs
    )
    loss = Algorithm(AlgorithmConfig()).objective(*denominators)
    first = MegatronTrainer(folder, cfg, world, total_steps=4)
    first.train_mini_batch(batch, loss)
    saved = copy.deepcopy(first.state_dict())
    straight = first.train_mini_batch(batch, loss)
    straight_weights = {k: v.clone() for bucket in first.engine_weights(1 << 20) for k, v in bucket}
    second = MegatronTrainer(folder, cfg, world, total_steps=4)
    second.load_state_dict(saved)
    resumed = second.train_mini_batch(batch, loss)
    resumed_weights = {k: v.clone() for bucket in second.engine_weights(1 << 20) for k, v in bucket}
    shard = sum(t.numel() for t in saved["model"].values())
    return {
        "straight": straight,
        "resumed": resumed,
        "straight_weights": straight_weights,
        "resumed_weights": resumed_weights,
        "shard_numel": shard,
        "model_numel": sum(t.numel() for t in straight_weights.values()),
    }


def critic_step_body(
    world,
    folder: str,
    policy: str,
    tp: int,
    pp: int,
    batch,
    rows: list[list[int]],
    denominators: tuple,
    trainer_kwargs: dict,
    seed: int,
) -> dict:
    """PPO's critic on megatron (head="value"): a value model built from the causal LM `policy` after
    torch.manual_seed(seed) (its new head), and one from the saved value model `folder`: its values before one
    train_mini_batch with the clipped value loss on this rank's rows, the stats, the weights after it under HF
    names, and the values of a fresh trainer loaded from the trained one's state_dict."""
    import copy

    from yatt.config import TrainerConfig
    from yatt.controllers.critic import Critic
    from yatt.trainers.critic_config import CriticConfig
    from yatt.trainers.megatron_config import MegatronConfig
    from yatt.trainers.megatron_trainer import MegatronTrainer

    cfg = TrainerConfig(
        backend="megatron", megatron=MegatronConfig(tensor_parallel=tp, pipeline_parallel=pp), **trainer_kwargs
    )
    torch.manual_seed(seed)
    new = MegatronTrainer(policy, cfg, world, trainable=False, head="value")
    new_head = {k: v.clone() for bucket in new.engine_weights(1 << 20) for k, v in bucket if k.startswith("score.")}
    trainer = MegatronTrainer(folder, cfg, world, total_steps=4, head="value")
    mine = batch.select(rows[trainer.dp_rank])  # extras (old values, returns) come along
    values = trainer.values(mine)
    tokens, seqs, norm_length = denominators
    loss = Critic(CriticConfig(), trainer, world, "token-mean", norm_length).objective(tokens, seqs)
    stats = trainer.train_mini_batch(mine, loss)
    weights = {k: v.clone() for bucket in trainer.engine_weights(1 << 16) for k, v in bucket}
    saved = copy.deepcopy(trainer.state_dict())
    resumed = MegatronTrainer(folder, cfg, world, total_steps=4, head="value")
    resumed.load_state_dict(saved)
    return {
        "new_head": new_head,
        "values": values,
        "stats": stats,
        "weights": weights,
        "after": trainer.values(mine),
        "resumed": resumed.values(mine),
        "state_keys": sorted(saved["model"]),
        "dp_rank": trainer.dp_rank,
        "last_stage": trainer.pp_rank == pp - 1,
    }


def mismatch_body(world, folder: str, batch) -> str:
    """TP=2 ranks handed different rows: the trainer refuses instead of mixing them in one forward."""
    from yatt.config import TrainerConfig
    from yatt.trainers.megatron_config import MegatronConfig
    from yatt.trainers.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(
        folder, TrainerConfig(backend="megatron", megatron=MegatronConfig(tensor_parallel=2)), world, trainable=False
    )
    trainer.logprobs(batch)  # the same rows: fine
    try:
        trainer.logprobs(batch.select([world.rank]))
    except RuntimeError as err:
        return str(err)
    return "no error"


def data_world_body(world, tp: int, pp: int) -> dict:
    """Every World op on the data-parallel view of a TP x PP split world."""
    from yatt.distributed import data_parallel_world

    view = data_parallel_world(world, tp, pp)
    out = {"rank": view.rank, "size": view.size, "members": view.members}
    out["sum"] = view.sum([float(view.rank + 1), 1.0])
    out["max"] = view.max([float(world.rank)])
    out["gathered"] = [t.tolist() for t in view.all_gather(torch.full((view.rank + 1, 2), float(world.rank)))]
    out["broadcast"] = view.broadcast_object(("from", world.rank))
    peer = 1 - view.rank if view.size == 2 else None
    if peer is not None:
        got = torch.zeros(3)
        view.exchange({peer: [torch.full((3,), float(world.rank))]}, {peer: [got]})
        out["exchanged"] = got.tolist()
    view.barrier()
    return out


def grad_body(world, folder: str, tp: int, ep: int, ids: torch.Tensor, weights: torch.Tensor) -> dict:
    """Log-probs of `ids` (padded rows, every next token scored) from the megatron model of `folder` at TP x EP
    (data parallel = the rest; data-parallel rank d takes rows d::DP), and the gradient of sum(weights * logp)
    over all rows under HF names: each rank's backward, then the reductions megatron's DDP and yatt's finalize
    make (router weights summed over TP by `megatron_moe.finalize`, q/k norms over TP, dense weights over DP,
    experts over their data-parallel replicas), summed rather than averaged, then gathered as the engines'
    weights are (the gradients put in place of the weights)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from yatt.config import TrainerConfig
    from yatt.trainers.megatron_config import MegatronConfig
    from yatt.trainers.megatron_experts import is_expert
    from yatt.trainers.megatron_moe import finalize
    from yatt.trainers.megatron_trainer import MegatronTrainer

    cfg = TrainerConfig(
        backend="megatron", megatron=MegatronConfig(tensor_parallel=tp, expert_parallel=ep, router_aux_loss_coef=0.0)
    )
    trainer = MegatronTrainer(folder, cfg, world, trainable=False)
    gpt = trainer.gpt.train().requires_grad_(True)
    dp, dp_rank = trainer.dp_size, trainer.dp_rank
    mine = ids[dp_rank::dp]
    width = mine.shape[1]
    select = (torch.arange(len(mine))[:, None] * width + torch.arange(width - 1)).reshape(-1)
    logp, _ = trainer.scorer(mine, select, mine[:, 1:].reshape(-1), 1.0, False)
    (logp * weights[dp_rank::dp].reshape(-1)).sum().backward()
    for p in gpt.parameters():
        p.main_grad = p.grad
    finalize(lambda *args, **kwargs: None)([gpt])
    for name, p in gpt.named_parameters():
        if ("q_layernorm" in name or "k_layernorm" in name) and tp > 1:
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        group = ps.get_expert_data_parallel_group() if is_expert(name) else ps.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(p.grad)
    grads = {k: v.clone() for bucket in trainer.engine_weights(1 << 30) for k, v in bucket}
    return {
        "logp": logp.detach().view(len(mine), width - 1),
        "rows": list(range(dp_rank, len(ids), dp)),
        "grads": grads,
    }
