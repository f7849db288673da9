"""GAE advantages (kind gae) and the critic's targets against hand-computed values; edge cases; the same
advantages on 2 ranks as in one process."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yatt.algorithms import ADVANTAGES
from yatt.algorithms.advantages import outcome_token_rewards
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.gae import GAE, GAEConfig, critic_targets, gae_estimate, token_rewards
from yatt.algorithms.objective import Algorithm
from yatt.config import AlgorithmConfig
from yatt.distributed import World

T = torch.tensor


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b if torch.is_tensor(b) else T(b, dtype=a.dtype), atol=atol, rtol=0)


def inp(rewards, mask, values, token_kl=None, world=None, width=3):
    mask = T(mask, dtype=torch.float32).reshape(len(rewards), -1 if rewards else width)
    return AdvantageInput(
        T(rewards),
        mask,
        1,
        world,
        T(token_kl) if token_kl is not None else None,
        values=T(values, dtype=torch.float32).reshape(mask.shape),
    )


def gae(*args, gamma=1.0, lam=1.0, whiten=False, **kw):
    return gae_estimate(inp(*args, **kw), GAEConfig(gamma=gamma, lam=lam, whiten=whiten))


def test_registered_as_an_estimator_that_reads_values():
    assert ADVANTAGES.get("gae") is GAE and GAE.needs_values and not GAE.needs_groups
    algo = Algorithm(AlgorithmConfig(advantage={"kind": "gae", "whiten": False}))
    adv, ret = algo.advantages(inp([1.0], [[1, 1, 1]], [[0.5, 0.6, 0.8]]))
    close(adv, [[0.5, 0.4, 0.2]])
    close(ret, [[1.0, 1.0, 1.0]])
    # an estimator without values gives no targets
    assert Algorithm(AlgorithmConfig()).advantages(AdvantageInput(T([1.0, 0.0]), torch.ones(2, 1), 2))[1] is None


def test_outcome_on_the_last_token_minus_the_kl_per_token():
    close(
        outcome_token_rewards(T([1.0, 2.0]), T([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]), None),
        [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]],
    )
    # kl_mode=reward: inp.rewards = outcome - sum(kl) = 1 - .6; token_rewards spreads the KL out again
    close(token_rewards(inp([0.4], [[1, 1, 1]], [[0, 0, 0]], [[0.1, 0.2, 0.3]])), [[-0.1, -0.2, 0.7]])


def test_gae_lam_one_is_the_return_minus_the_value():
    # rewards [0,0,1], V [.5,.6,.8]: deltas [.1,.2,.2] -> A = [.5,.4,.2]; returns A+V = [1,1,1]
    adv, ret = gae([1.0], [[1, 1, 1]], [[0.5, 0.6, 0.8]])
    close(adv, [[0.5, 0.4, 0.2]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_lambda_half():
    # deltas [.1, .2, .2]; A2 = .2, A1 = .2 + .5*.2 = .3, A0 = .1 + .5*.3 = .25; returns [.75, .9, 1.0]
    adv, ret = gae([1.0], [[1, 1, 1]], [[0.5, 0.6, 0.8]], lam=0.5)
    close(adv, [[0.25, 0.3, 0.2]])
    close(ret, [[0.75, 0.9, 1.0]])


def test_gae_with_the_kl_penalty_per_token():
    # token rewards [-.1,-.2,.7], V [.5,.6,.8]: deltas [-.1+.6-.5, -.2+.8-.6, .7-.8] = [0, 0, -.1]
    # A = [-.1, -.1, -.1]; returns = [.4, .5, .7], the KL-shaped returns of REINFORCE++
    adv, ret = gae([0.4], [[1, 1, 1]], [[0.5, 0.6, 0.8]], [[0.1, 0.2, 0.3]])
    close(adv, [[-0.1, -0.1, -0.1]])
    close(ret, [[0.4, 0.5, 0.7]])


def test_edge_cases_empty_rows_all_masked_and_length_one():
    adv, ret = gae([], [], [], width=3)  # a rank that holds no samples
    assert adv.shape == ret.shape == (0, 3)
    # row 0 all masked (garbage values there), row 1 a one-token response: A = 1 - .3, target 1
    adv, ret = gae([5.0, 1.0], [[0, 0, 0], [1, 0, 0]], [[9.0, 9.0, 9.0], [0.3, 7.0, 7.0]], gamma=0.5, lam=0.5)
    close(adv, [[0.0, 0.0, 0.0], [0.7, 0.0, 0.0]])
    close(ret, [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # whitening over the valid tokens only; an all-masked batch stays 0, not NaN
    close(gae([1.0], [[0, 0, 0]], [[1.0, 2.0, 3.0]], whiten=True)[0], [[0.0, 0.0, 0.0]])


def test_whitened_over_valid_tokens_targets_not():
    # A = [[.5, .4, .2], [-.3, pad, pad]]: mean .2, population var (.09+.04+0+.25)/4 = .095
    adv, ret = gae([1.0, 0.0], [[1, 1, 1], [1, 0, 0]], [[0.5, 0.6, 0.8], [0.3, 0.0, 0.0]], whiten=True)
    s = (0.095 + 1e-8) ** 0.5
    close(adv, [[0.3 / s, 0.2 / s, 0.0], [-0.5 / s, 0.0, 0.0]])
    close(ret, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def test_gae_without_values_is_an_error():
    with pytest.raises(ValueError, match="needs the critic's values"):
        gae_estimate(AdvantageInput(T([1.0]), torch.ones(1, 2), 1), GAEConfig())


def test_critic_targets_of_an_estimator_without_any_are_the_undiscounted_returns():
    close(
        critic_targets(
            inp([0.4, 1.0], [[1, 1, 1], [1, 1, 0]], [[9.0] * 3, [9.0] * 3], [[0.1, 0.2, 0.3], [0.0, 0.0, 0.0]])
        ),
        [[0.4, 0.5, 0.7], [1.0, 1.0, 0.0]],
    )


# ---- 2 ranks: the same whitened advantages as one process holding the whole batch ------------------------

REW = [1.0, 0.0, 0.3, 0.8, 0.1]
MASK = [[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1]]
VAL = [[0.1 * i + 0.05 * j for j in range(3)] for i in range(5)]
N0 = 3  # samples on rank 0


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    rows = slice(0, N0) if rank == 0 else slice(N0, len(REW))
    out = gae(REW[rows], MASK[rows], VAL[rows], lam=0.9, whiten=True, world=World(rank, 2, rank, torch.device("cpu")))
    dist.destroy_process_group()
    Path(f"{tmp}/rank{rank}.json").write_text(json.dumps([t.tolist() for t in out]))


def test_two_ranks_give_the_single_process_advantages(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    want_adv, want_ret = gae(REW, MASK, VAL, lam=0.9, whiten=True)
    close(T(ranks[0][0] + ranks[1][0]), want_adv)
    close(T(ranks[0][1] + ranks[1][1]), want_ret)
