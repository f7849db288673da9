"""Dynamic sampling with a fake generate function: what is dropped, refilled, queued and adapted."""

import json

import pytest

from yatt.config import DynamicSamplingConfig
from yatt.controllers.dynamic_sampling import DynamicSampler, has_signal
from yatt.data.rollout import Rollout
from yatt.data.rows import PromptRow


class FakeGenerate:
    """Groups of 4 whose rewards follow a repeating pattern of 'signal' flags; records each call."""

    def __init__(self, signal_pattern: list[bool]):
        self.pattern, self.calls, self.made = signal_pattern, [], 0

    def __call__(self, prompts: int, round_: int) -> list[list[Rollout]]:
        self.calls.append((prompts, round_))
        groups = []
        for _ in range(prompts):
            signal = self.pattern[self.made % len(self.pattern)]
            row = PromptRow(self.made, "1+1=", None, "2", "exact_match")
            rewards = [1.0, 0.0, 0.0, 1.0] if signal else [0.0] * 4
            groups.append([Rollout(row, [1, 2], [3], [-0.5], "stop", "2", r) for r in rewards])
            self.made += 1
        return groups


def cfg(**kw) -> DynamicSamplingConfig:
    return DynamicSamplingConfig(
        enabled=True,
        **{"max_rounds": 3, "initial_oversample": 1.0, "min_oversample": 1.0, "max_oversample": 4.0, "ema": 1.0, **kw},
    )


def test_drops_all_equal_groups_and_refills():
    gen = FakeGenerate([True, False])  # half the groups carry signal
    sampler = DynamicSampler(cfg())
    kept, m = sampler.collect(4, gen)
    assert len(kept) == 4 and all(has_signal(g) for g in kept)
    assert gen.calls == [(4, 0), (4, 1)]  # round 0 keeps 2, the ratio becomes 2 -> 2 missing x 2
    assert m["dynamic_sampling/dropped_groups"] == 4 and m["dynamic_sampling/rounds"] == 2
    assert m["dynamic_sampling/oversample_ratio"] == 2.0 and m["dynamic_sampling/queue"] == 0


def test_bounded_rounds_give_a_short_step():
    gen = FakeGenerate([False])
    sampler = DynamicSampler(cfg(max_rounds=2))
    kept, m = sampler.collect(3, gen)
    assert kept == [] and len(gen.calls) == 2 and m["dynamic_sampling/short_steps"] == 1
    assert sampler.ratio == 4.0  # nothing kept: the ratio goes to its upper bound


def test_surplus_is_queued_for_the_next_step_and_the_ratio_adapts_down():
    gen = FakeGenerate([True])
    sampler = DynamicSampler(cfg(initial_oversample=2.0, ema=0.5))
    kept, m = sampler.collect(3, gen)  # 6 generated, all kept: 3 trained, 3 queued
    assert len(kept) == 3 and m["dynamic_sampling/queue"] == 3 and sampler.ratio == 1.0
    kept2, m2 = sampler.collect(3, gen)  # served from the queue, nothing generated
    assert [g[0].row.index for g in kept2] == [3, 4, 5] and len(gen.calls) == 1
    assert m2["dynamic_sampling/from_queue"] == 3 and m2["dynamic_sampling/rounds"] == 0


def test_ratio_follows_the_keep_rate_within_bounds():
    sampler = DynamicSampler(cfg(max_oversample=3.0, ema=0.5))
    ratios = []
    for pattern in ([True, False, False, False], [True, False], [True]):
        gen = FakeGenerate(pattern)
        sampler.queue = []
        sampler.collect(8, gen)
        ratios.append(sampler.ratio)
    assert ratios[0] == 3.0 and ratios[0] > ratios[1] > ratios[2] >= 1.0


def test_state_dict_round_trips_through_json():
    gen = FakeGenerate([True])
    sampler = DynamicSampler(cfg(initial_oversample=2.0))
    sampler.collect(2, gen)
    state = json.loads(json.dumps(sampler.state_dict()))
    other = DynamicSampler(cfg())
    other.load_state_dict(state)
    assert other.ratio == sampler.ratio and other.keep_rate == sampler.keep_rate
    assert [[r.to_dict() for r in g] for g in other.queue] == [[r.to_dict() for r in g] for g in sampler.queue]
    assert len(other.queue) == 2 and other.queue[0][0].row.index == 2


def test_config_bounds_are_checked():
    with pytest.raises(ValueError, match="min_oversample <= initial_oversample"):
        DynamicSamplingConfig(initial_oversample=5.0, max_oversample=4.0)
