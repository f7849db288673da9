"""Balancing image rollouts (2 gloo processes): moved samples carry their encoded pixel inputs, bit for bit, a
group's samples share them again on arrival, and the images themselves are never read again on the receiving
rank."""

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yatt.balance.exchange import rebalance
from yatt.data.images import PromptImages
from yatt.data.rollout import Rollout
from yatt.distributed import World


def image_samples(rank: int, groups: int, unit: int, long: bool) -> list[Rollout]:
    gen = torch.Generator().manual_seed(rank * 100 + groups)
    out = []
    for g in range(groups):
        prompt = torch.randint(3, 40, (9,), generator=gen).tolist()
        vision = PromptImages(
            prompt[:3],
            [b"png-bytes"],
            prompt,
            {
                "pixel_values": torch.rand((1, 1, 3, 4, 4), generator=gen),
                "pixel_attention_mask": torch.randint(0, 2, (1, 1, 4, 4), generator=gen),
            },
        )
        for _ in range(unit):
            n = 60 if long else 2
            out.append(
                Rollout(
                    None,
                    prompt,
                    [5] * n,
                    [-0.5] * n,
                    "stop",
                    reward=float(g % 2),
                    origin=(rank, len(out)),
                    vision=vision,
                )
            )
    return out


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    world = World(rank, 2, rank, torch.device("cpu"))
    held, plan = rebalance(world, image_samples(rank, 4 if rank == 0 else 1, 2, long=rank == 0), unit_size=2)
    out = {
        "moved": plan.moved_samples,
        "moved_bytes": plan.metrics()["balance/moved_pixel_bytes"],
        "held": [
            {
                "origin": list(s.origin),
                "prompt": s.prompt_ids,
                "images": s.vision.images,
                "shared": id(s.vision),
                "pixels": {k: [list(v.shape), str(v.dtype), v.flatten().tolist()] for k, v in s.vision.pixels.items()},
            }
            for s in held
        ],
    }
    for s in out["held"]:
        s["images"] = [b.decode() for b in s["images"]]
    text_vs_image = None
    mixed = image_samples(rank, 4 if rank == 0 else 1, 2, long=rank == 0)
    if rank == 1:
        mixed[0].vision = None
    try:
        rebalance(world, mixed, unit_size=2)
    except ValueError as err:
        text_vs_image = str(err)
    out["mixed_error"] = text_vs_image
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_moved_image_samples_carry_their_pixels(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["moved"] > 0
    # pixel_values 3x4x4 + mask 4x4 floats per sample, float32
    assert results[0]["moved_bytes"] == results[0]["moved"] * 4 * (48 + 16)
    originals = {tuple(s.origin): s for r in range(2) for s in image_samples(r, 4 if r == 0 else 1, 2, long=r == 0)}
    seen = []
    for rank, res in enumerate(results):
        for s in res["held"]:
            origin = tuple(s["origin"])
            seen.append(origin)
            ref = originals[origin]
            assert s["prompt"] == ref.prompt_ids
            for key, (shape, dtype, values) in s["pixels"].items():
                assert shape == list(ref.vision.pixels[key].shape) and dtype == str(ref.vision.pixels[key].dtype)
                assert values == ref.vision.pixels[key].flatten().tolist()  # bit-identical
            # kept samples still hold their image bytes; moved ones only the encoded inputs
            assert s["images"] == (["png-bytes"] if origin[0] == rank else [])
        # a group's samples share one PromptImages after the move too (the trainer's batch holds its pixels once)
        groups = {}
        for s in res["held"]:
            groups.setdefault((s["origin"][0], s["origin"][1] // 2), set()).add(s["shared"])
        assert all(len(ids) == 1 for ids in groups.values()) and len(set.union(*groups.values())) == len(groups)
    assert sorted(seen) == sorted(originals) and any(
        o[0] == 0 for o in (tuple(s["origin"]) for s in results[1]["held"])
    )
    # a step that mixes text and image samples is refused on both ranks alike (no rank left waiting)
    assert (
        results[0]["mixed_error"] == results[1]["mixed_error"] and "mixes text and image" in results[0]["mixed_error"]
    )
