"""DP rebalancing: move scored rollouts (yatt.data.rollout) between ranks so that every rank trains about the same work.

Protocol (every rank runs the same code):
1. `gather_lengths`: all_gather each rank's per-sample (prompt, response) token counts. Metadata only.
2. `plan_rebalance`: every rank computes the same plan from that metadata. The partitioner is
   deterministic, and its parts are mapped to ranks so that as much work as possible stays in place.
3. `exchange`: only units whose destination differs from their source travel, point to point
   (`World.exchange`: isend/irecv, gloo has no all_to_all), as two flat CPU tensors per (source, destination) pair:
   int64 [origin rank, origin index, finish code, has images, routing width, prompt ids, response ids, response
   mask] per sample and float64 [reward, logprobs] per sample. When any rank holds image prompts a second round follows:
   a float32 buffer of each moved image sample's already-encoded pixel inputs (the trainer's, not the image
   files: a moved sample's images are never read again), sized from the first round's has-images flags and
   the pixel layout the ranks agree on (`_pixel_layout`); text samples of the same step move without pixels.
   Samples with an MoE engine's routing (Rollout.routed_experts, routing replay r3) send it in a round of their
   own: int64 (prompt + response tokens) x routing width each, sized from the first round's widths; a pair of
   ranks between which no such sample moves exchanges nothing in it.
   No pickle; receivers size every buffer from the plan, the flags and the layout.
A rank's rollouts after the exchange are ordered by origin (rank, index), so a GRPO group (a unit of
G consecutive samples) stays consecutive. `restore_order` sends per-sample values back to the rank
and position each sample came from, for anything logged per original sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from yatt.balance.partition import get_partitioner
from yatt.balance.workload import sample_workload
from yatt.data.images import PromptImages
from yatt.data.rollout import Rollout
from yatt.distributed import World

# what Rollout.finish_reason may be (its code travels): an engine's "stop" | "length" (an agent loop's too), or
# "abort"; an engine's "interrupted" never reaches a rollout (yatt.engines.resume finishes those samples)
FINISH_REASONS = ("stop", "length", "abort")


Lengths = list[list[tuple[int, int]]]  # [rank][sample] -> (prompt tokens, response tokens)


@dataclass(frozen=True)
class Plan:
    unit_size: int
    lengths: Lengths
    workloads: list[list[float]]  # [rank][unit]
    dest: list[list[int]]  # [rank][unit] -> destination rank
    moved_pixel_bytes: int = 0  # encoded pixel inputs of the moved image samples, all ranks (0 for text)

    def rank_loads(self, after: bool) -> list[float]:
        loads = [0.0] * len(self.dest)
        for src, units in enumerate(self.workloads):
            for u, w in enumerate(units):
                loads[self.dest[src][u] if after else src] += w
        return loads

    def imbalance(self, after: bool) -> float:
        """Max over mean rank workload (1.0 is perfect balance)."""
        loads = self.rank_loads(after)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def moves(self, src: int, dst: int) -> list[int]:
        """Sample indices of rank `src` that go to rank `dst`, ascending."""
        return [u * self.unit_size + j for u, d in enumerate(self.dest[src]) if d == dst for j in range(self.unit_size)]

    def held_after(self, rank: int) -> list[tuple[int, int]]:
        """Origins (rank, index) of the samples `rank` holds after the exchange, in their new order."""
        return [(src, i) for src in range(len(self.dest)) for i in self.moves(src, rank)]

    @property
    def moved_samples(self) -> int:
        return sum(self.unit_size for src, units in enumerate(self.dest) for d in units if d != src)

    def metrics(self) -> dict[str, float]:
        return {
            "balance/imbalance_before": self.imbalance(after=False),
            "balance/imbalance_after": self.imbalance(after=True),
            "balance/moved_samples": float(self.moved_samples),
            "balance/moved_pixel_bytes": float(self.moved_pixel_bytes),
        }


def plan_rebalance(
    lengths: Lengths,
    unit_size: int,
    attention_coef: float = 0.0,
    partitioner: str = "kk",
    equal_count: bool = False,
    enabled: bool = True,
) -> Plan:
    """A deterministic plan: the same on every rank given the same gathered lengths."""
    for rank, samples in enumerate(lengths):
        if len(samples) % unit_size:
            raise ValueError(f"rank {rank} holds {len(samples)} samples, not a multiple of the unit size {unit_size}")
    workloads = [
        [
            sum(sample_workload(p, r, attention_coef) for p, r in samples[s : s + unit_size])
            for s in range(0, len(samples), unit_size)
        ]
        for samples in lengths
    ]
    identity = Plan(unit_size, lengths, workloads, [[rank] * len(units) for rank, units in enumerate(workloads)])
    k = len(lengths)
    if not enabled or k == 1:
        return identity
    flat = [(rank, u) for rank, units in enumerate(workloads) for u in range(len(units))]
    weights = [workloads[rank][u] for rank, u in flat]
    parts = get_partitioner(partitioner)(weights, k, equal_count=equal_count)
    rank_of_part = _parts_to_ranks(parts, flat, weights, k)
    dest = [[0] * len(units) for units in workloads]
    for p, part in enumerate(parts):
        for i in part:
            rank, u = flat[i]
            dest[rank][u] = rank_of_part[p]
    _cancel_swaps(dest, workloads)
    plan = Plan(unit_size, lengths, workloads, dest)
    # Moving costs a little: keep today's placement unless the partition is strictly better.
    return plan if plan.imbalance(after=True) < identity.imbalance(after=False) - 1e-9 else identity


def _parts_to_ranks(parts: list[list[int]], flat: list[tuple[int, int]], weights: list[float], k: int) -> list[int]:
    """Give each part the rank that already holds most of its work (greedy, ties by part then rank)."""
    overlap = [[0.0] * k for _ in range(k)]
    for p, part in enumerate(parts):
        for i in part:
            overlap[p][flat[i][0]] += weights[i]
    rank_of_part, taken = [-1] * k, set()
    for _, p, r in sorted((-overlap[p][r], p, r) for p in range(k) for r in range(k)):
        if rank_of_part[p] < 0 and r not in taken:
            rank_of_part[p] = r
            taken.add(r)
    return rank_of_part


def _cancel_swaps(dest: list[list[int]], workloads: list[list[float]]) -> None:
    """Keep both units in place when equal workloads would trade places: same loads, fewer moves."""
    for a in range(len(dest)):
        for b in range(a + 1, len(dest)):
            back = {}
            for u, d in enumerate(dest[b]):
                if d == a:
                    back.setdefault(workloads[b][u], []).append(u)
            for u, d in enumerate(dest[a]):
                partners = back.get(workloads[a][u])
                if d == b and partners:
                    dest[a][u], dest[b][partners.pop(0)] = a, b


# ---- over the world's collectives (CPU tensors: metadata, see yatt.distributed) --------------------


def gather_lengths(world: World, samples: Sequence[Rollout]) -> Lengths:
    """Every rank's per-sample (prompt, response) token counts; ranks may hold different counts."""
    local = torch.tensor([[len(s.prompt_ids), len(s.response_ids)] for s in samples], dtype=torch.int64).view(-1, 2)
    return [[tuple(x) for x in g.tolist()] for g in world.all_gather(local)]


def _pack(samples: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor]:
    ints: list[int] = []
    floats: list[float] = []
    for s in samples:
        if len(s.rollout_logprobs) != len(s.response_ids):
            raise ValueError(f"sample {s.origin}: {len(s.rollout_logprobs)} logprobs for {len(s.response_ids)} tokens")
        if s.finish_reason not in FINISH_REASONS:
            raise ValueError(f"sample {s.origin}: finish_reason {s.finish_reason!r} is none of {FINISH_REASONS}")
        width = len(s.routed_experts[0]) if s.routed_experts else 0
        if s.routed_experts and len(s.routed_experts) != len(s.prompt_ids) + len(s.response_ids):
            raise ValueError(f"sample {s.origin}: routing of {len(s.routed_experts)} tokens, it has "
                             f"{len(s.prompt_ids) + len(s.response_ids)}")  # fmt: skip
        if s.teacher_logprobs and len(s.teacher_logprobs) != len(s.response_ids):
            raise ValueError(f"sample {s.origin}: {len(s.teacher_logprobs)} teacher logprobs for "
                             f"{len(s.response_ids)} tokens")  # fmt: skip
        # on-policy distillation: the teacher's log-probs travel too, in a slot every sample has (zeros without a
        # teacher), so the receiver sizes its buffer from the lengths alone
        taught = int(bool(s.teacher_logprobs))
        ints += [s.origin[0], s.origin[1], FINISH_REASONS.index(s.finish_reason), int(s.vision is not None), width]
        ints += [taught, *s.prompt_ids, *s.response_ids]
        ints += s.loss_mask()  # an agent loop's response mask (all 1 for a single-turn sample)
        floats += [s.reward, s.baseline, *s.rollout_logprobs, *(s.teacher_logprobs or [0.0] * len(s.response_ids))]
    return torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float64)


def _unpack(
    ints: torch.Tensor, floats: torch.Tensor, origins: list[tuple[int, int]], lengths: Lengths
) -> tuple[list[Rollout], list[bool], list[int]]:
    """The received samples, for each whether it has images (its pixels come in the second round), and its
    routing width (0: none; its routing comes in a round of its own)."""
    ints_l, floats_l = ints.tolist(), floats.tolist()
    out, images, widths, a, b = [], [], [], 0, 0
    for rank, index in origins:
        p, r = lengths[rank][index]
        if (ints_l[a], ints_l[a + 1]) != (rank, index):
            raise RuntimeError(f"exchange out of step: expected sample {(rank, index)}, got {tuple(ints_l[a : a + 2])}")
        finish, taught = ints_l[a + 2], ints_l[a + 5]
        prompt, response = ints_l[a + 6 : a + 6 + p], ints_l[a + 6 + p : a + 6 + p + r]
        mask = ints_l[a + 6 + p + r : a + 6 + p + 2 * r]
        images.append(bool(ints_l[a + 3]))
        widths.append(ints_l[a + 4])
        out.append(
            Rollout(
                None,
                prompt,
                response,
                floats_l[b + 2 : b + 2 + r],
                FINISH_REASONS[finish],
                reward=floats_l[b],
                baseline=floats_l[b + 1],
                origin=(rank, index),
                response_mask=mask if 0 in mask else [],
                teacher_logprobs=floats_l[b + 2 + r : b + 2 + 2 * r] if taught else [],
            )
        )
        a, b = a + 6 + p + 2 * r, b + 2 + 2 * r
    return out, images, widths


# the processor outputs a moved image sample may carry, by code (the layout travels as ints)
PIXEL_KEYS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes")
PIXEL_DTYPES = (torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.float16, torch.int32)
_SPEC_WIDTH = 64


@dataclass(frozen=True)
class PixelLayout:
    """What one image sample's pixel inputs look like: (key, dtype, shape with batch dimension 1) each."""

    parts: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]

    @property
    def floats(self) -> int:
        return sum(math.prod(shape) for _, _, shape in self.parts)

    def encode(self) -> list[int]:
        out = [len(self.parts)]
        for key, dtype, shape in self.parts:
            out += [PIXEL_KEYS.index(key), PIXEL_DTYPES.index(dtype), len(shape), *shape]
        if len(out) > _SPEC_WIDTH - 2:
            raise ValueError(f"pixel layout {self.parts} does not fit the {_SPEC_WIDTH}-int spec")
        return out + [0] * (_SPEC_WIDTH - len(out))

    @classmethod
    def decode(cls, spec: list[int]) -> PixelLayout:
        parts, at = [], 1
        for _ in range(spec[0]):
            key, dtype, ndim = PIXEL_KEYS[spec[at]], PIXEL_DTYPES[spec[at + 1]], spec[at + 2]
            parts.append((key, dtype, tuple(spec[at + 3 : at + 3 + ndim])))
            at += 3 + ndim
        return cls(tuple(parts))


def _layout_of(sample: Rollout) -> PixelLayout:
    pixels = sample.vision.pixels
    for key, t in pixels.items():
        if key not in PIXEL_KEYS or t.dtype not in PIXEL_DTYPES or t.shape[0] != 1:
            raise ValueError(f"cannot move pixel input {key!r} ({t.dtype}, {tuple(t.shape)}) between ranks")
    return PixelLayout(tuple((k, pixels[k].dtype, tuple(pixels[k].shape)) for k in sorted(pixels)))


def _pixel_layout(world: World, samples: Sequence[Rollout], plan: Plan) -> tuple[PixelLayout | None, int]:
    """The one pixel layout of every rank's image samples (None: no rank has any), and how many image samples
    the plan moves in all. Every rank reaches the same verdict from the gathered specs, so a refusal (several
    layouts) is raised on all ranks alike instead of leaving the others waiting in the exchange."""
    mine = {_layout_of(s) for s in samples if s.vision is not None}
    spec = next(iter(mine)).encode() if len(mine) == 1 else [0] * _SPEC_WIDTH
    spec[-2] = int(len(mine) > 1)  # this rank holds several layouts
    leaving = [i for peer in range(world.size) if peer != world.rank for i in plan.moves(world.rank, peer)]
    spec[-1] = sum(samples[i].vision is not None for i in leaving)  # this rank's image samples that move
    gathered = [g[0].tolist() for g in world.all_gather(torch.tensor(spec, dtype=torch.int64)[None])]
    layouts = {tuple(g[:-2]) for g in gathered if g[0] > 0}
    if any(g[-2] for g in gathered) or len(layouts) > 1:
        raise ValueError("image samples of different pixel layouts cannot be balanced yet")
    return (PixelLayout.decode(list(layouts.pop())) if layouts else None), sum(g[-1] for g in gathered)


def _pack_pixels(samples: list[Rollout], layout: PixelLayout) -> torch.Tensor:
    parts = [s.vision.pixels[key].reshape(-1).to(torch.float32) for s in samples for key, _, _ in layout.parts]
    return torch.cat(parts) if parts else torch.zeros(0)


def _unpack_pixels(flat: torch.Tensor, samples: list[Rollout], layout: PixelLayout) -> None:
    """Each received sample's pixel inputs. Consecutive samples of one prompt (a group: same prompt, same
    pixels) share one PromptImages again, as they did on the rank that sent them, so the trainer's batch holds
    the prompt's pixels once (yatt.controllers.images.stack_pixels); each is its own copy, not a view that would
    keep the whole receive buffer alive."""
    at, previous = 0, None
    for s in samples:
        part = flat[at : at + layout.floats]
        at += layout.floats
        if previous is not None and previous[0].prompt_ids == s.prompt_ids and torch.equal(previous[1], part):
            s.vision = previous[0].vision
            continue
        pixels, offset = {}, 0
        for key, dtype, shape in layout.parts:
            n = math.prod(shape)
            pixels[key] = part[offset : offset + n].reshape(shape).to(dtype, copy=True)
            offset += n
        # the images themselves stay with the rank that read them; training needs only the encoded inputs
        s.vision = PromptImages([], [], list(s.prompt_ids), pixels)
        previous = (s, part)


def _message_sizes(lengths: Lengths, origins: list[tuple[int, int]]) -> tuple[int, int]:
    pairs = [lengths[rank][i] for rank, i in origins]
    return sum(6 + p + 2 * r for p, r in pairs), sum(2 + 2 * r for _, r in pairs)


def exchange(world: World, samples: list[Rollout], plan: Plan, layout: PixelLayout | None = None) -> list[Rollout]:
    """This rank's samples after the plan: kept ones plus received ones, ordered by origin. With a pixel
    `layout` (image prompts on some rank, the same layout on every rank) each moved image sample carries its
    encoded pixel inputs, in a second round."""
    rank, sends, recvs, inbox = world.rank, {}, {}, []
    keep = set(plan.moves(rank, rank))
    for peer in range(world.size):
        if peer == rank:
            continue
        outgoing = plan.moves(rank, peer)
        if outgoing:
            sends[peer] = _pack([samples[i] for i in outgoing])
        origins = [(peer, i) for i in plan.moves(peer, rank)]
        if origins:
            n_int, n_float = _message_sizes(plan.lengths, origins)
            recvs[peer] = (torch.empty(n_int, dtype=torch.int64), torch.empty(n_float, dtype=torch.float64))
            inbox.append((peer, origins))
    world.exchange(sends, recvs)
    held = [s for i, s in enumerate(samples) if i in keep]
    arrived = {peer: _unpack(*recvs[peer], origins, plan.lengths) for peer, origins in inbox}
    if layout is not None:
        _exchange_pixels(world, samples, plan, layout, arrived)
    _exchange_routing(world, samples, plan, arrived)
    held += [s for received, _, _ in arrived.values() for s in received]
    return sorted(held, key=lambda s: s.origin)


def _exchange_routing(
    world: World, samples: list[Rollout], plan: Plan, arrived: dict[int, tuple[list[Rollout], list[bool], list[int]]]
) -> None:
    """The moved samples' MoE routing (point to point, only between ranks that move some), into the samples the
    first round delivered."""
    sends, recvs = {}, {}
    for peer in (p for p in range(world.size) if p != world.rank):
        moved = [samples[i] for i in plan.moves(world.rank, peer) if samples[i].routed_experts]
        if moved:
            flat = [v for s in moved for token in s.routed_experts for v in token]
            sends[peer] = [torch.tensor(flat, dtype=torch.int64)]
    for peer, (received, _, widths) in arrived.items():
        size = sum((len(s.prompt_ids) + len(s.response_ids)) * w for s, w in zip(received, widths))
        if size:
            recvs[peer] = [torch.empty(size, dtype=torch.int64)]
    if not sends and not recvs:
        return
    world.exchange(sends, recvs)
    for peer, (received, _, widths) in arrived.items():
        if peer not in recvs:
            continue
        flat, at = recvs[peer][0].view(-1), 0
        for s, w in zip(received, widths):
            n = (len(s.prompt_ids) + len(s.response_ids)) * w
            if w:
                s.routed_experts = flat[at : at + n].view(-1, w).tolist()
            at += n


def _exchange_pixels(
    world: World,
    samples: list[Rollout],
    plan: Plan,
    layout: PixelLayout,
    arrived: dict[int, tuple[list[Rollout], list[bool], list[int]]],
) -> None:
    """The second round: each moved image sample's pixel inputs, to the samples the first round delivered."""
    sends, recvs = {}, {}
    for peer in (p for p in range(world.size) if p != world.rank):
        moved = [samples[i] for i in plan.moves(world.rank, peer) if samples[i].vision is not None]
        if moved:
            sends[peer] = [_pack_pixels(moved, layout)]
    for peer, (_, images, _) in arrived.items():
        if any(images):
            recvs[peer] = [torch.empty(sum(images) * layout.floats)]
    world.exchange(sends, recvs)
    for peer, (received, images, _) in arrived.items():
        if any(images):
            _unpack_pixels(recvs[peer][0], [s for s, has in zip(received, images) if has], layout)


def restore_order(world: World, plan: Plan, values: torch.Tensor) -> torch.Tensor:
    """The inverse of `exchange` for per-sample values: rows [held samples, ...] -> rows [original samples, ...].

    `values` is indexed like this rank's samples after `exchange`; the result like its samples before.
    """
    rank, held = world.rank, plan.held_after(world.rank)
    if values.shape[0] != len(held):
        raise ValueError(f"{values.shape[0]} rows of values for {len(held)} held samples")
    values = values.detach().to("cpu", torch.float64)  # per-sample metadata: host memory, gloo
    out = torch.zeros((len(plan.lengths[rank]), *values.shape[1:]), dtype=torch.float64)
    sends, recvs, inbox = {}, {}, []
    for peer in range(world.size):
        rows = [j for j, (src, _) in enumerate(held) if src == peer]
        if peer == rank:
            out[[held[j][1] for j in rows]] = values[rows]
            continue
        if rows:
            sends[peer] = [values[rows].contiguous()]
        back = plan.moves(rank, peer)
        if back:
            buffer = torch.empty((len(back), *values.shape[1:]), dtype=torch.float64)
            recvs[peer] = [buffer]
            inbox.append((back, buffer))
    world.exchange(sends, recvs)
    for back, buffer in inbox:
        out[back] = buffer
    return out


def rebalance(
    world: World,
    samples: list[Rollout],
    unit_size: int,
    attention_coef: float = 0.0,
    partitioner: str = "kk",
    equal_count: bool = False,
    enabled: bool = True,
) -> tuple[list[Rollout], Plan]:
    """Gather lengths, plan, exchange: the one call the controller shard makes."""
    plan = plan_rebalance(gather_lengths(world, samples), unit_size, attention_coef, partitioner, equal_count, enabled)
    if plan.moved_samples == 0:
        return exchange(world, samples, plan), plan
    layout, moved_images = _pixel_layout(world, samples, plan)
    if layout is not None:
        plan = replace(plan, moved_pixel_bytes=4 * layout.floats * moved_images)  # they travel as float32
    return exchange(world, samples, plan, layout), plan
