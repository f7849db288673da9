"""Balancing image rollouts (2 gloo processes): moved samples carry their encoded pixel inputs, bit for bit, a
group's samples share them again on arrival, and the images themselves are never read again on the receiving
rank. A step that mixes text and image groups balances too: text samples move without pixels."""

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yatt.balance.exchange import rebalance
from yatt.data.images import PromptImages
from yatt.data.rollout import Rollout
from yatt.distributed import World


def image_samples(rank: int, groups: int, unit: int, long: bool, text_groups: tuple[int, ...] = ()) -> list[Rollout]:
    """`groups` groups of `unit` samples of one prompt each, image prompts but those in text_groups."""
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
                    vision=None if g in text_groups else vision,
                )
            )
    return out


# rank 0: six long groups, rank 1: one short one; in the mixed step rank 0's groups 0 and 3 are text (the plan
# moves groups 0, 2 and 4 to rank 1)
SHAPES = {0: dict(groups=6, unit=2, long=True), 1: dict(groups=1, unit=2, long=False)}
MIXED_TEXT = {0: (0, 3), 1: ()}


def samples_of(rank: int, mixed: bool) -> list[Rollout]:
    return image_samples(rank, **SHAPES[rank], text_groups=MIXED_TEXT[rank] if mixed else ())


def _held(held: list[Rollout], plan) -> dict:
    return {
        "moved": plan.moved_samples,
        "moved_bytes": plan.metrics()["balance/moved_pixel_bytes"],
        "held": [
            {
                "origin": list(s.origin),
                "prompt": s.prompt_ids,
                "images": None if s.vision is None else [b.decode() for b in s.vision.images],
                "shared": id(s.vision),
                "pixels": None
                if s.vision is None
                else {k: [list(v.shape), str(v.dtype), v.flatten().tolist()] for k, v in s.vision.pixels.items()},
            }
            for s in held
        ],
    }


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    world = World(rank, 2, rank, torch.device("cpu"))
    out = {mixed: _held(*rebalance(world, samples_of(rank, mixed), unit_size=2)) for mixed in (False, True)}
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump({"images": out[False], "mixed": out[True]}, f)
    dist.destroy_process_group()


def check(results: list[dict], mixed: bool) -> None:
    assert results[0]["moved"] > 0
    originals = {tuple(s.origin): s for r in range(2) for s in samples_of(r, mixed)}
    moved_images = sum(
        1 for r, res in enumerate(results) for s in res["held"] if s["origin"][0] != r and s["pixels"] is not None
    )
    # pixel_values 3x4x4 + mask 4x4 floats per moved image sample, float32; text samples move none
    assert results[0]["moved_bytes"] == moved_images * 4 * (48 + 16)
    seen = []
    for rank, res in enumerate(results):
        for s in res["held"]:
            origin = tuple(s["origin"])
            seen.append(origin)
            ref = originals[origin]
            assert s["prompt"] == ref.prompt_ids
            if ref.vision is None:  # a text sample stays one
                assert s["pixels"] is None
                continue
            for key, (shape, dtype, values) in s["pixels"].items():
                assert shape == list(ref.vision.pixels[key].shape) and dtype == str(ref.vision.pixels[key].dtype)
                assert values == ref.vision.pixels[key].flatten().tolist()  # bit-identical
            # kept samples still hold their image bytes; moved ones only the encoded inputs
            assert s["images"] == (["png-bytes"] if origin[0] == rank else [])
        # a group's samples share one PromptImages after the move too (the trainer's batch holds its pixels once)
        groups = {}
        for s in res["held"]:
            if s["pixels"] is not None:
                groups.setdefault((s["origin"][0], s["origin"][1] // 2), set()).add(s["shared"])
        assert all(len(ids) == 1 for ids in groups.values()) and len(set.union(*groups.values())) == len(groups)
    assert sorted(seen) == sorted(originals)
    arrived = [originals[tuple(s["origin"])] for s in results[1]["held"] if s["origin"][0] == 0]
    assert arrived and (not mixed or {r.vision is None for r in arrived} == {True, False}), "both kinds must move"


def test_moved_image_samples_carry_their_pixels(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    check([r["images"] for r in results], mixed=False)
    check([r["mixed"] for r in results], mixed=True)
