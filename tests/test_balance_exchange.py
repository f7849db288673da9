"""DP rebalancing: the plan (pure) and the exchange under real torch.distributed (2 gloo processes)."""

import json
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yatt.balance.exchange import plan_rebalance, rebalance, restore_order
from yatt.balance.partition import imbalance
from yatt.data.rollout import Rollout
from yatt.distributed import World


def make_samples(rank: int, groups: int, unit: int, long: bool) -> list[Rollout]:
    """Deterministic samples with random tokens, double-precision logprobs and group-shared prompts; every other
    sample an agent loop's, with tool tokens (response mask 0) among its model tokens; every third a teacher's
    log-probs."""
    rng = random.Random(rank * 1000 + groups)
    out = []
    for _g in range(groups):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(2, 6))]
        for _ in range(unit):
            n = rng.randrange(40, 90) if long else rng.randrange(1, 12)
            mask = [0] + [rng.randrange(2) for _ in range(n - 1)] if len(out) % 2 else []
            out.append(
                Rollout(
                    None,
                    prompt,
                    [rng.randrange(3, 50) for _ in range(n)],
                    [-rng.random() * 3 for _ in range(n)],
                    rng.choice(["stop", "length"]),
                    reward=float(rng.random() < 0.5),
                    baseline=rng.random(),
                    origin=(rank, len(out)),
                    response_mask=mask[::-1],
                    # a distillation teacher's log-probs on every third sample (the others carry none)
                    teacher_logprobs=[-rng.random() * 3 for _ in range(n)] if len(out) % 3 == 0 else [],
                )
            )
    return out


# ---- the plan: pure ------------------------------------------------------------------------------


def test_plan_balances_moves_little_and_covers_every_sample_once():
    lengths = [[(4, 80)] * 8 + [(4, 5)] * 8, [(4, 5)] * 8]  # rank 0: 4 groups of 4, two long; rank 1: 2 short
    plan = plan_rebalance(lengths, unit_size=4)
    assert plan.imbalance(after=True) < 1.05 < plan.imbalance(after=False)
    held = plan.held_after(0) + plan.held_after(1)
    assert sorted(held) == [(r, i) for r in range(2) for i in range(len(lengths[r]))]
    assert plan.moved_samples == sum(len(plan.moves(s, d)) for s in range(2) for d in range(2) if s != d)
    assert plan.imbalance(after=True) == 1.0 and plan.moved_samples == 4  # one long group moving over is enough
    assert plan == plan_rebalance(lengths, unit_size=4)  # every rank computes the same plan
    for rank in range(2):  # whole groups move
        for src, i in plan.held_after(rank):
            assert plan.dest[src][i // 4] == rank


def test_plan_keeps_placement_when_it_cannot_improve_or_is_disabled():
    lengths = [[(2, 10)] * 4, [(2, 10)] * 4]
    assert plan_rebalance(lengths, unit_size=2).moved_samples == 0
    skewed = [[(2, 90)] * 4, [(2, 1)] * 4]
    assert plan_rebalance(skewed, unit_size=1, enabled=False).moved_samples == 0
    assert plan_rebalance(skewed, unit_size=1, enabled=False).metrics()["balance/imbalance_before"] > 1.5


def test_plan_quality_matches_the_partitioner_and_rejects_split_groups():
    rng = random.Random(0)
    lengths = [[(3, rng.randrange(1, 200)) for _ in range(24)], [(3, rng.randrange(1, 20)) for _ in range(8)]]
    for partitioner in ("kk", "greedy"):
        plan = plan_rebalance(lengths, unit_size=1, attention_coef=0.01, partitioner=partitioner)
        weights = [w for units in plan.workloads for w in units]
        flat_dest = [d for units in plan.dest for d in units]
        parts = [[i for i, d in enumerate(flat_dest) if d == r] for r in range(2)]
        assert plan.imbalance(after=True) == pytest.approx(imbalance(weights, parts)) and plan.imbalance(True) < 1.02
    with pytest.raises(ValueError, match="multiple of the unit size"):
        plan_rebalance([[(1, 1)] * 3, []], unit_size=2)


# ---- under torch.distributed ---------------------------------------------------------------------


def _worker(rank: int, tmp: str, model_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    world = World(rank, 2, rank, torch.device("cpu"))
    results = {}
    # groups of 4, uneven counts (rank 0: 5 long groups, rank 1: 1 short), then samples with rank 1 empty
    for name, unit, groups in (("groups", 4, (5, 1)), ("samples", 1, (7, 0))):
        mine = make_samples(rank, groups[rank], unit, long=rank == 0)
        held, plan = rebalance(world, mine, unit_size=unit)
        values = torch.tensor([[s.origin[0], s.origin[1], s.reward] for s in held], dtype=torch.float64).view(-1, 3)
        restored = restore_order(world, plan, values)
        results[name] = {
            "held": [vars(s) for s in held],
            "plan_dest": plan.dest,
            "restored": restored.tolist(),
            "after": plan.imbalance(after=True),
            "before": plan.imbalance(after=False),
        }
    results["lockstep"] = _train_uneven(world, model_path)
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _uneven_batch(rows: range):
    from yatt.tensors import TokenBatch

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (4,), generator=gen).tolist() for _ in range(4)]  # 2 samples each
    responses = [torch.randint(3, 40, (1 + i % 5,), generator=gen).tolist() for i in range(8)]
    batch = TokenBatch.from_sequences([prompts[i // 2] for i in rows], [responses[i] for i in rows], pad_id=0)
    batch.extras["advantages"] = torch.tensor([1.0, -1.0] * 4)[list(rows)]
    return batch


def _train_step(world: World, model_path: str, rows: range, micro: int, **settings) -> dict:
    """One optimizer step on `rows` of a fixed batch, as the shard does it (global denominators)."""
    from yatt.algorithms.objective import Algorithm
    from yatt.config import AlgorithmConfig, TrainerConfig
    from yatt.trainers.torch_trainer import TorchTrainer

    torch.manual_seed(0)
    trainer = TorchTrainer(model_path, TrainerConfig(lr=1e-2, micro_batch_size=micro, **settings), world)
    batch = _uneven_batch(rows)
    batch.extras["old_logprobs"] = trainer.logprobs(batch)[0]
    tokens, seqs = world.sum([float(batch.mask.sum()), float(len(batch))])
    stats = trainer.train_mini_batch(
        batch, Algorithm(AlgorithmConfig()).objective(tokens / world.size, seqs / world.size, 8)
    )
    return {"grad_norm": stats["grad_norm"], "weights": {k: v.tolist() for k, v in trainer.named_weights()}}


def _train_uneven(world: World, model_path: str) -> dict:
    # rank 0 trains 7 rows in 4 micro-batches, rank 1 one row in 1: DDP must stay in step; packed rows with
    # shared prompts (pairs of samples) and the output head in chunks of 3 tokens (recomputed in backward) under DDP
    return _train_step(
        world,
        model_path,
        range(7) if world.rank == 0 else range(7, 8),
        micro=2,
        pack_sequences=True,
        torch={"logprob_chunk_tokens": 3},
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from yatt.models.tiny import TinyModelConfig, write_tiny_model

    tmp = tmp_path_factory.mktemp("exchange")
    model = write_tiny_model(
        tmp / "m",
        TinyModelConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
        ),
    )
    mp.spawn(_worker, args=(str(tmp), str(model)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)], model


@pytest.mark.parametrize("name,unit,groups", [("groups", 4, (5, 1)), ("samples", 1, (7, 0))])
def test_round_trip_keeps_every_sample_once_and_unchanged(two_ranks, name, unit, groups):
    results, _ = two_ranks
    originals = {tuple(s.origin): vars(s) for r in range(2) for s in make_samples(r, groups[r], unit, long=r == 0)}
    held = [[{**s, "origin": tuple(s["origin"])} for s in results[r][name]["held"]] for r in range(2)]
    seen = [s["origin"] for h in held for s in h]
    assert sorted(seen) == sorted(originals)  # each exactly once
    for h in held:
        for s in h:
            # bit-identical: ints, float64 logprobs, reward, baseline, finish reason, response mask, teacher logprobs
            assert s == originals[s["origin"]]
    assert results[0][name]["after"] < results[0][name]["before"]
    assert all(len(h) > 0 for h in held)  # the empty rank got work
    if unit > 1:  # groups intact: a group's samples are on one rank, consecutive and in order
        for h in held:
            origins = [s["origin"] for s in h]
            for start in range(0, len(origins), unit):
                src, first = origins[start]
                assert first % unit == 0 and origins[start : start + unit] == [(src, first + j) for j in range(unit)]
    for r in range(2):  # restore_order maps values back to each original sample, in the original order
        restored = results[r][name]["restored"]
        assert [(int(a), int(b)) for a, b, _ in restored] == [(r, i) for i in range(groups[r] * unit)]
        assert [x[2] for x in restored] == [originals[(r, i)]["reward"] for i in range(groups[r] * unit)]


def test_uneven_ranks_train_in_lockstep_like_one_process(two_ranks):
    """7 + 1 rows on two ranks (4 vs 1 micro-batches, packed, shared prompts, chunked head) give the step of all
    8 rows on one rank computed the plain way (padded, repeated prompts, full logits)."""
    results, model = two_ranks
    single = _train_step(
        World(0, 1, 0, torch.device("cpu")),
        str(model),
        range(8),
        micro=8,
        pack_sequences=False,
        torch={"logprob_chunk_tokens": 0},
    )
    a, b = results[0]["lockstep"], results[1]["lockstep"]
    assert a["grad_norm"] == pytest.approx(single["grad_norm"], abs=1e-5)
    for name, w in single["weights"].items():
        torch.testing.assert_close(torch.tensor(a["weights"][name]), torch.tensor(b["weights"][name]))
        torch.testing.assert_close(torch.tensor(a["weights"][name]), torch.tensor(w), rtol=1e-3, atol=1e-4)
