"""The policy's side of a step's training, as functions of their inputs: the rollouts as a token batch, the
advantage estimator's input, the old log-probs, and the update (yatt.controllers.critic is the critic's side).

Read in the order the step calls them: token_batch -> old_logprobs -> advantage_input -> policy_update.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt.algorithms import kl_estimate, kl_penalized_rewards
from yatt.algorithms.base import AdvantageInput
from yatt.algorithms.objective import Algorithm
from yatt.controllers.images import stack_pixels
from yatt.controllers.minibatches import global_mini_batches
from yatt.data.rollout import Rollout
from yatt.distributed import World
from yatt.tensors import LossFn, TokenBatch
from yatt.trainers.base import Trainer
from yatt.trainers.moe import keep_routing


def token_batch(rollouts: list[Rollout], pad_id: int, temperature: float, replay: bool = True) -> TokenBatch:
    """What the trainer reads: prompt + response ids, the images' pixels (once per prompt), the engine's
    log-probs, and an MoE engine's routing: at the positions that predict the response tokens, to compare with
    (`batch.engine_routing`), and with `replay` (routing replay r3) every token's, to replay (`batch.routing`).

    The loss mask (`batch.mask`) is the response positions AND each rollout's response mask (agent loops: 0 on
    tool and environment tokens), so those tokens get no policy loss, KL, entropy or IS weight, and their
    log-probs are neither computed by the trainer nor read from the engine's."""
    batch = TokenBatch.from_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts], pad_id)
    batch.pixels, batch.image_index = stack_pixels(rollouts)
    batch.extras["rollout_logprobs"] = batch.per_token([r.rollout_logprobs for r in rollouts])
    if any(r.teacher_logprobs for r in rollouts):  # on-policy distillation (reward.teacher)
        batch.extras["teacher_logprobs"] = batch.per_token([r.teacher_logprobs for r in rollouts])
    if any(r.response_mask for r in rollouts):  # laid out under the response positions, before they change
        batch.mask = batch.mask * batch.per_token([r.loss_mask() for r in rollouts])
        batch.extras["rollout_logprobs"] *= batch.mask
        if "teacher_logprobs" in batch.extras:
            batch.extras["teacher_logprobs"] *= batch.mask
    batch.temperature = temperature
    routing = routing_of(rollouts, batch)
    batch.routing = routing if replay else None
    if routing is not None:  # at the positions that predict the response tokens in the loss: one per token
        predicting = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
        predicting[:, :-1] = batch.mask.bool()
        batch.engine_routing = torch.where(predicting[..., None], routing, -1)
    return batch


def routing_of(rollouts: list[Rollout], batch: TokenBatch) -> Tensor | None:
    """The experts the engine routed each prompt and response token to (routing replay r3), [B, L, layers x k],
    -1 where it recorded none (the last response token, never fed back); None when no rollout carries any."""
    routed = [r.routed_experts for r in rollouts]
    width = next((len(tokens[0]) for tokens in routed if tokens), 0)
    if not width:
        return None
    out = torch.full((*batch.input_ids.shape, width), -1, dtype=torch.long)
    for i, tokens in enumerate(routed):
        if tokens:
            out[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return out


def old_logprobs(
    trainer: Trainer,
    algorithm: Algorithm,
    batch: TokenBatch,
    first_epoch: list[Tensor],
    has_ref: bool,
    policy_trains: bool = True,
) -> tuple[Tensor, Tensor]:
    """The old policy's log-probs and entropies before the update (algorithm.old_logprobs).

    reuse: the first mini-batch's rows are flagged on_policy and skipped here; the update's first
    forward fills their log-probs and entropies in (a KL reward needs them before, and a step without a
    policy update has no such forward, so those recompute). rollout: the engine's log-probs; entropies
    come from the first epoch's forwards (none without a policy update: 0).
    """
    cfg = algorithm.cfg
    mode = cfg.old_logprobs
    if mode == "reuse" and (not policy_trains or (has_ref and cfg.kl_mode == "reward" and cfg.kl_coef > 0)):
        mode = "recompute"
    # r2 replays this pass's routing in the update: reuse's on-policy rows would have none in a second epoch
    # (their first forward is exactly on-policy, so one epoch needs none)
    if mode == "reuse" and cfg.routing_replay == "r2" and cfg.ppo_epochs > 1:
        mode = "recompute"
    on_policy = torch.zeros(len(batch))
    batch.extras["on_policy"] = on_policy
    if mode == "rollout":
        return batch.extras["rollout_logprobs"].clone(), torch.zeros_like(batch.mask)
    if mode == "reuse":
        on_policy[first_epoch[0]] = 1.0
    rest = (on_policy == 0).nonzero().flatten()
    old_lp, entropy = torch.zeros_like(batch.mask), torch.zeros_like(batch.mask)
    # a sharded trainer's forward is a collective (FSDP2's gathers, megatron's micro-batch count over data-parallel
    # ranks): a rank whose rows are all on-policy still takes part, with none, or the others wait forever
    if len(rest) or not trainer.replicated:
        sub = batch.select(rest)  # with the engine's routing of its rows: this pass counts the routing mismatch
        r2 = cfg.routing_replay == "r2"  # the update replays the experts of this pass
        lp, ent = trainer.logprobs(sub, with_entropy=True, **({"record_routing": True} if r2 else {}))
        old_lp[rest, : lp.shape[1]], entropy[rest, : lp.shape[1]] = lp, ent
        if r2 and sub.routing is not None:
            keep_routing(batch, rest, sub.routing)
    return old_lp, entropy


def advantage_input(
    rollouts: list[Rollout],
    batch: TokenBatch,
    old_lp: Tensor,
    ref_lp: Tensor | None,
    values: Tensor | None,
    algorithm: Algorithm,
    group_size: int,
    world: World,
) -> AdvantageInput:
    """The estimator's input: the rewards (less the KL penalty with kl_mode=reward, which also hands the
    estimator the per-token KL), the ReMax baselines, the critic's values, and for on-policy distillation the
    teacher's log-probs with the student's: the engine's of the tokens it sampled (yatt.algorithms.distill)."""
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
    token_kl = None
    if ref_lp is not None and algorithm.cfg.kl_mode == "reward":
        kl = kl_estimate(old_lp, ref_lp, algorithm.cfg.kl_estimator)
        rewards = kl_penalized_rewards(rewards, kl, batch.mask, algorithm.kl_coef)
        token_kl = algorithm.kl_coef * kl * batch.mask
    baselines = torch.tensor([r.baseline for r in rollouts], dtype=torch.float32)
    teacher = batch.extras.get("teacher_logprobs")
    student = batch.extras["rollout_logprobs"] if teacher is not None else None
    return AdvantageInput(rewards, batch.mask, group_size, world, token_kl, baselines, values, teacher, student)


def _recording(loss_fn: LossFn, old_logprobs: Tensor, entropy: Tensor) -> LossFn:
    """loss_fn, also writing the on_policy rows' log-probs and every row's entropy into the step's tensors."""

    def fn(logp: Tensor, ent: Tensor | None, mb: TokenBatch) -> tuple[Tensor, dict[str, float]]:
        rows, width = mb.extras["row"], logp.shape[1]
        fresh = mb.extras["on_policy"].bool()
        old_logprobs[rows[fresh], :width] = logp.detach()[fresh].cpu()
        entropy[rows, :width] = ent.detach().cpu()
        return loss_fn(logp, ent, mb)

    return fn


def policy_update(
    trainer: Trainer,
    algorithm: Algorithm,
    world: World,
    batch: TokenBatch,
    epochs: list[list[Tensor]],
    entropy: Tensor,
    norm_length: int,
) -> dict[str, float]:
    """ppo_epochs passes, each split into mini_batches optimizer steps; groups stay together. Returns sums of
    the loss stats over the steps (and tokens, grad_norm, lr, skipped, optimizer_steps).

    The first epoch's forwards also record what the log-prob pass skipped (on_policy rows: their
    log-probs into old_logprobs, their entropies into `entropy`), for the metrics. With the engine's routing
    (algorithm.routing_replay r3 or routing_mismatch) the totals also hold the trainer's routing-mismatch counts of
    the step (Trainer.routing_counts): the log-prob pass counted its rows, the update's first forwards count
    the rows no pass did before it (on_policy; with old_logprobs=rollout the first mini-batch's)."""
    batch.extras["row"] = torch.arange(len(batch))
    # the same keys on every rank, even one that holds no samples
    totals = dict.fromkeys(("tokens", *algorithm.stats, "grad_norm", "lr", "skipped", "optimizer_steps"), 0.0)
    for i, (epoch, mini, tokens, seqs) in enumerate(global_mini_batches(world, batch, epochs)):
        first_forward = mini.extras["on_policy"].bool()
        if i == 0 and algorithm.cfg.old_logprobs == "rollout":
            first_forward[:] = True
        only_rows(mini, first_forward if epoch == 0 else None)
        loss_fn = algorithm.objective(tokens, seqs, norm_length=norm_length)
        # entropies for the metrics where no pass computed them
        record = epoch == 0 and (algorithm.cfg.old_logprobs == "rollout" or bool(mini.extras["on_policy"].any()))
        if record:
            loss_fn = _recording(loss_fn, batch.extras["old_logprobs"], entropy)
        stats = trainer.train_mini_batch(mini, loss_fn, with_entropy=record or algorithm.needs_entropy)
        stats["optimizer_steps"] = 1.0
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v
    if algorithm.cfg.engine_routing:
        totals.update(trainer.routing_counts())
    return totals


def only_rows(mini: TokenBatch, rows: Tensor | None) -> None:
    """mini.engine_routing on `rows` ([B] bool) only, the samples whose routing mismatch this forward counts (None:
    none of them)."""
    if mini.engine_routing is not None:
        keep = rows is not None and bool(rows.any())
        mini.engine_routing = torch.where(rows[:, None, None], mini.engine_routing, -1) if keep else None
