"""The data-parallel view of a world whose model is split TP x PP (yatt.distributed.data_parallel_world):
its rank and size are the data-parallel ones (megatron-core's rank order: TP adjacent, then DP, then PP),
and every World op runs among the ranks that share this rank's model-parallel coordinates."""

from __future__ import annotations

import torch
from megatron_ranks import data_world_body, run_ranks

from yatt.distributed import World, data_parallel_world


def test_no_split_is_the_world_itself():
    world = World(0, 1, 0, torch.device("cpu"))
    assert data_parallel_world(world, 1, 1) is world


def test_tp2_on_4_ranks_gives_2_data_parallel_ranks(tmp_path):
    results = run_ranks(4, data_world_body, tmp_path, 2, 1)
    # TP pairs (0, 1) and (2, 3) are data-parallel ranks 0 and 1; each DP group is one TP coordinate
    assert [(r["rank"], r["size"], r["members"]) for r in results] == [
        (0, 2, (0, 2)),
        (0, 2, (1, 3)),
        (1, 2, (0, 2)),
        (1, 2, (1, 3)),
    ]
    for _g, r in enumerate(results):
        partner = r["members"][1 - r["rank"]]
        assert r["sum"] == [3.0, 2.0]  # data-parallel ranks 0 and 1 counted once each
        assert r["max"] == [float(max(r["members"]))]
        assert r["gathered"] == [[[float(r["members"][0])] * 2], [[float(r["members"][1])] * 2] * 2]
        assert r["broadcast"] == ("from", r["members"][0])
        assert r["exchanged"] == [float(partner)] * 3


def test_tp2_pp2_on_4_ranks_is_one_data_parallel_rank(tmp_path):
    results = run_ranks(4, data_world_body, tmp_path, 2, 2)
    for world_rank, r in enumerate(results):
        assert (r["rank"], r["size"], r["members"]) == (0, 1, (world_rank,))
        assert r["sum"] == [1.0, 1.0] and r["broadcast"] == ("from", world_rank)
