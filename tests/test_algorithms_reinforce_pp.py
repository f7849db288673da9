"""REINFORCE++ (and its group-baseline variant) against hand-computed values; global whitening on 2 ranks."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yatt.algorithms import ADVANTAGES
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.reinforce_pp import (
    REINFORCE_PP,
    REINFORCE_PP_BASELINE,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    global_whiten,
    token_returns,
)
from yatt.distributed import World

T = torch.tensor


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b if torch.is_tensor(b) else T(b, dtype=a.dtype), atol=atol, rtol=0)


def adv(rewards, mask, token_kl=None, group=1, baseline=False, gamma=1.0, world=None, width=4):
    mask = T(mask, dtype=torch.float32).reshape(len(rewards), -1 if rewards else width)
    inp = AdvantageInput(T(rewards), mask, group, world, T(token_kl) if token_kl is not None else None)
    est, cfg = (
        (REINFORCE_PP_BASELINE, ReinforcePPBaselineConfig(gamma=gamma))
        if baseline
        else (REINFORCE_PP, ReinforcePPConfig(gamma=gamma))
    )
    return est.compute(inp, cfg)


def test_kl_shaped_token_returns():
    # outcome 1 on the last token, KL penalties [.1,.2,.3]: gamma 1 -> [1-.6, 1-.5, 1-.3] = [.4,.5,.7]
    kl, mask = T([[0.1, 0.2, 0.3]]), torch.ones(1, 3)
    close(token_returns(T([1.0]), mask, kl, 1.0), [[0.4, 0.5, 0.7]])
    # gamma .5: t2 = -.3+1 = .7; t1 = -.2+.5*.7 = .15; t0 = -.1+.5*.15 = -.025
    close(token_returns(T([1.0]), mask, kl, 0.5), [[-0.025, 0.15, 0.7]])
    # masked positions are skipped: same values on the valid tokens, 0 elsewhere; no KL: the outcome everywhere
    close(
        token_returns(T([1.0]), T([[1.0, 0.0, 1.0, 1.0, 0.0]]), T([[0.1, 9.0, 0.2, 0.3, 9.0]]), 1.0),
        [[0.4, 0.0, 0.5, 0.7, 0.0]],
    )
    close(token_returns(T([2.0, 3.0]), T([[1.0, 1.0], [0.0, 0.0]]), None, 1.0), [[2.0, 2.0], [0.0, 0.0]])


def test_advantages_whiten_the_returns():
    # the input reward is KL-penalised (1 - .6 = .4); the estimator puts the penalty back on the tokens:
    # returns [.4,.5,.7], mean .53333, population var .015556 -> [-1.069045, -.267261, 1.336306]
    close(adv([0.4], [[1, 1, 1]], [[0.1, 0.2, 0.3]]), [[-1.069045, -0.267261, 1.336306]])
    # no KL: returns [[1,1,0],[0,(masked),(masked)]] -> valid 1,1,0: mean 2/3, var 2/9, std .471405
    close(adv([1.0, 0.0], [[1, 1, 0], [1, 0, 0]]), [[0.707107, 0.707107, 0.0], [-1.414214, 0.0, 0.0]])


def test_group_baseline():
    # groups [1,0], [0,0] -> outcomes [.5,-.5,0,0]; mean 0, var .125 -> [1.414214,-1.414214,0,0]
    close(adv([1.0, 0.0, 0.0, 0.0], [[1]] * 4, group=2, baseline=True), [[1.414214], [-1.414214], [0.0], [0.0]])
    # without the baseline: outcomes [1,0,0,0]: mean .25, var .1875 -> [1.732051, -.57735, -.57735, -.57735]
    close(adv([1.0, 0.0, 0.0, 0.0], [[1]] * 4, group=2), [[1.732051], [-0.57735], [-0.57735], [-0.57735]])
    # singleton groups have no baseline signal: all zero; so do zero-variance groups
    close(adv([1.0, 0.0], [[1]] * 2, group=1, baseline=True), [[0.0], [0.0]])
    close(adv([1.0, 1.0, 0.0, 0.0], [[1]] * 4, group=2, baseline=True), [[0.0]] * 4)
    assert ADVANTAGES.get("reinforce_pp_baseline") is REINFORCE_PP_BASELINE and REINFORCE_PP_BASELINE.needs_groups
    assert ADVANTAGES.get("reinforce_pp") is REINFORCE_PP and not REINFORCE_PP.needs_groups


def test_empty_rows_all_masked_and_empty_batch():
    out = adv([1.0, 0.0, 5.0], [[1, 1], [1, 0], [0, 0]])  # an all-masked sequence gets 0 and counts for nothing
    close(out[2], [0.0, 0.0])
    close(out[:2], adv([1.0, 0.0], [[1, 1], [1, 0]]))
    close(adv([2.0, 2.0], [[1, 1], [1, 1]]), [[0.0, 0.0], [0.0, 0.0]])  # zero variance: 0, not NaN
    assert adv([], [], baseline=True, group=2).shape == (0, 4)  # a rank that holds no samples


# ---- 2 ranks: the same advantages as one process holding the whole batch ----------------------------------

REW = [1.0, 0.0, 0.3, 0.8, 0.1, 0.6]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]]
KL = [[0.1 * (i + 1) + 0.01 * j for j in range(4)] for i in range(6)]
SPLITS = {"uneven": (4, 2), "rank1_empty": (6, 0)}  # samples on rank 0 and rank 1


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    world = World(rank, 2, rank, torch.device("cpu"))
    out = {}
    for name, (n0, _) in SPLITS.items():
        rows = slice(0, n0) if rank == 0 else slice(n0, len(REW))
        for baseline in (False, True):
            a = adv(REW[rows], MASK[rows], KL[rows] or None, group=2, baseline=baseline, world=world)
            out[f"{name}/{baseline}"] = a.tolist()
    dist.destroy_process_group()
    Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whiten")
    mp.spawn(_worker, args=(str(tmp),), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("baseline", [False, True])
def test_two_ranks_whiten_over_the_global_batch(two_ranks, split, baseline):
    whole = adv(REW, MASK, KL, group=2, baseline=baseline)
    parts = [T(r[f"{split}/{baseline}"]).reshape(-1, 4) for r in two_ranks]
    close(torch.cat(parts), whole)
    # and not the per-rank whitening, which would differ
    local = torch.cat(
        [
            adv(REW[:4], MASK[:4], KL[:4], group=2, baseline=baseline),
            adv(REW[4:], MASK[4:], KL[4:], group=2, baseline=baseline),
        ]
    )
    assert not torch.allclose(local, whole, atol=1e-3)


def test_global_whiten_without_a_world():
    x, m = T([[1.0, 2.0], [3.0, 9.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    close(global_whiten(x, m, None), [[-1.224745, 0.0], [1.224745, 0.0]])  # 1,2,3: mean 2, var 2/3
