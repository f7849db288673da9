"""Tests for yatt.balance: workload model and k-way partitioners."""

import itertools
import random

import pytest

from yatt.balance import PARTITIONERS, get_partitioner, greedy_partition, imbalance, karmarkar_karp, sample_workload

BOTH = [karmarkar_karp, greedy_partition]


def _sums(weights, parts):
    return [sum(weights[i] for i in p) for p in parts]


def _max_sum(weights, parts):
    return max(_sums(weights, parts))


def _brute_force_opt(weights, k, equal_count):
    """Optimal max part sum over all k**n assignments (optionally count-constrained)."""
    best = float("inf")
    for assign in itertools.product(range(k), repeat=len(weights)):
        if equal_count:
            counts = [assign.count(p) for p in range(k)]
            if max(counts) - min(counts) > 1:
                continue
        sums = [0] * k
        for i, p in enumerate(assign):
            sums[p] += weights[i]
        best = min(best, max(sums))
    return best


# ---------------------------------------------------------------- workload


def test_sample_workload_hand_values():
    assert sample_workload(3, 7) == 10.0
    assert sample_workload(3, 7, attention_coef=0.5) == 10 + 0.5 * 100
    assert sample_workload(0, 0, attention_coef=2.0) == 0.0
    assert sample_workload(100, 0, attention_coef=1e-3) == pytest.approx(110.0)


@pytest.mark.parametrize("args", [(-1, 0), (0, -1), (1, 1, -0.1)])
def test_sample_workload_rejects_negative(args):
    with pytest.raises(ValueError):
        sample_workload(*args)


# ------------------------------------------------------- partition validity


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("equal_count", [False, True])
def test_every_index_exactly_once(fn, equal_count):
    rng = random.Random(1234)
    for n in [0, 1, 2, 3, 5, 8, 17, 64]:
        for k in range(1, 5):
            weights = [rng.uniform(0, 100) for _ in range(n)]
            parts = fn(weights, k, equal_count=equal_count)
            assert len(parts) == k
            flat = sorted(i for p in parts for i in p)
            assert flat == list(range(n))
            if equal_count:
                sizes = [len(p) for p in parts]
                assert max(sizes) - min(sizes) <= 1, (n, k, sizes)


@pytest.mark.parametrize("fn", BOTH)
def test_equal_count_with_ties_and_zeros(fn):
    weights = [0, 0, 5, 5, 5, 0, 1, 1, 1, 1, 0]
    for k in range(1, 6):
        sizes = [len(p) for p in fn(weights, k, equal_count=True)]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("fn", BOTH)
def test_deterministic(fn):
    rng = random.Random(7)
    weights = [rng.choice([1, 2, 3]) for _ in range(30)]
    assert fn(weights, 4) == fn(list(weights), 4)


# ------------------------------------------------------------------ quality
#
# Observed max-part-sum / optimum over these exact trials (seeded, weights 1..100):
#   k=2 free : KK mean 1.002 (worst 1.02), greedy mean 1.007 (worst 1.05)
#   k=2 equal: KK mean 1.006 (worst 1.06), greedy mean 1.011 (worst 1.08)
#   k=3 free : KK mean 1.003 (worst 1.10), greedy mean 1.006 (worst 1.10)
#   k=3 equal: KK mean 1.004 (worst 1.10), greedy mean 1.004 (worst 1.08)
# LPT is guaranteed <= (4/3 - 1/(3k)) * OPT without the count constraint; KK
# stays well within that too. With equal counts KK is not always better than
# greedy on average (k=3 is a near tie), so the mean comparison is free-only.


@pytest.mark.parametrize("k,n_max", [(2, 9), (3, 8)])
@pytest.mark.parametrize("equal_count", [False, True])
def test_quality_vs_brute_force(k, n_max, equal_count):
    rng = random.Random(100 * k + equal_count)
    bound = 4 / 3 - 1 / (3 * k)
    kk_ratios, gr_ratios = [], []
    for _ in range(50):
        n = rng.randint(k, n_max)
        weights = [rng.randint(1, 100) for _ in range(n)]
        opt = _brute_force_opt(weights, k, equal_count)
        kk = _max_sum(weights, karmarkar_karp(weights, k, equal_count=equal_count))
        gr = _max_sum(weights, greedy_partition(weights, k, equal_count=equal_count))
        assert opt <= kk <= bound * opt
        assert opt <= gr <= bound * opt
        if k == 2 and not equal_count:
            assert kk <= 1.15 * opt
        kk_ratios.append(kk / opt)
        gr_ratios.append(gr / opt)
    kk_mean = sum(kk_ratios) / len(kk_ratios)
    gr_mean = sum(gr_ratios) / len(gr_ratios)
    assert kk_mean < 1.05 and gr_mean < 1.05
    if not equal_count:
        assert kk_mean <= gr_mean


# ------------------------------------------------------------ hand examples


def test_kk_hand_example_classic():
    # Classic LDM example: differencing gives 16/14, although 15/15 exists
    # ({8,7} vs {6,5,4}). KK is a heuristic, not exact.
    weights = [8, 7, 6, 5, 4]
    assert sorted(_sums(weights, karmarkar_karp(weights, 2))) == [14, 16]
    assert _brute_force_opt(weights, 2, False) == 15
    # LPT greedy does worse here: 17/13.
    assert sorted(_sums(weights, greedy_partition(weights, 2))) == [13, 17]


def test_kk_hand_example_perfect():
    weights = [4, 5, 6, 7, 8, 10]
    assert sorted(_sums(weights, karmarkar_karp(weights, 2))) == [20, 20]


@pytest.mark.parametrize("fn", BOTH)
def test_equal_count_hand_example(fn):
    weights = [3, 3, 2, 2, 2]
    parts = fn(weights, 2, equal_count=True)
    assert sorted(len(p) for p in parts) == [2, 3]
    assert sorted(_sums(weights, parts)) == [5, 7]  # {3,2} vs {3,2,2}


@pytest.mark.parametrize("fn", BOTH)
def test_fewer_items_than_parts(fn):
    parts = fn([5, 1], 4)
    assert sorted(len(p) for p in parts) == [0, 0, 1, 1]


def test_imbalance():
    weights = [4, 2, 2, 0]
    assert imbalance(weights, [[0], [1, 2]]) == 1.0
    assert imbalance(weights, [[0, 1], [2, 3]]) == pytest.approx(6 / 4)
    assert imbalance(weights, [[0, 1, 2], [], [3]]) == pytest.approx(8 / (8 / 3))
    assert imbalance([0, 0], [[0], [1]]) == 1.0


# --------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("k", [0, -1, 1.5])
def test_bad_k(fn, k):
    with pytest.raises(ValueError, match="k must be"):
        fn([1, 2, 3], k)


@pytest.mark.parametrize("fn", BOTH)
def test_negative_weight(fn):
    with pytest.raises(ValueError, match="non-negative"):
        fn([1, -2, 3], 2)


def test_imbalance_no_parts():
    with pytest.raises(ValueError):
        imbalance([1], [])


def test_registry():
    assert list(PARTITIONERS) == ["greedy", "kk"] and PARTITIONERS.get("kk") is karmarkar_karp
    assert get_partitioner("kk") is karmarkar_karp
    assert get_partitioner("greedy") is greedy_partition
    with pytest.raises(ValueError, match="greedy.*kk"):
        get_partitioner("nope")
