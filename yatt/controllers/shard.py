"""The controller shard: one per torchrun rank, owning its slice of the data from prompt to loss.

The RL step (`ControllerShard.step`) reads top to bottom like the algorithm:
    generate -> reward (-> dynamic sampling) -> rebalance -> old/ref logprobs (and critic values) -> advantages
    -> update (critic, then policy) -> sync
Ranks exchange only DDP gradients, small metadata (counts, sums, timings) through `World`, and the
samples that load balancing moves (yatt.balance.exchange).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from yatt.algorithms import kl_estimate, kl_penalized_rewards, masked_sum
from yatt.algorithms.base import AdvantageInput
from yatt.balance.exchange import rebalance
from yatt.balance.workload import sample_workload
from yatt.checkpoint.rng import rng_state, set_rng_state
from yatt.checkpoint.export import export_snapshot
from yatt.checkpoint.snapshot import Snapshot
from yatt.config import ExperimentConfig
from yatt.controllers.components import Components
from yatt.controllers.dynamic_sampling import DynamicSampler, reduce_metrics
from yatt.controllers.generation import GenerationStats, JudgeLane, assign_rewards, generate_and_judge
from yatt.controllers.minibatches import global_mini_batches
from yatt.controllers.images import load_batch_images, stack_pixels
from yatt.controllers.rollouts import encode_prompts, generate_rollouts, sample_seed, score_rollouts
from yatt.data.rollout import Rollout
from yatt.data.prepare import RankData, load_rank_data
from yatt.data.stream import PromptStream
from yatt.distributed import World
from yatt.engines.base import SamplingSpec
from yatt.genrm.judge import Judge
from yatt.models.vision import ImageInputs, is_vision_model
from yatt.placement.metrics import device_metrics, judge_metrics, maxed, pool_metrics, summed
from yatt.placement.ownership import DeviceOwnership, HookRole
from yatt.placement.plan import GenerationSchedule
from yatt.placement.engine_lifecycle import ROLLOUT, genrm_role
from yatt.tensors import LossFn
from yatt.tensors import TokenBatch


def _recording(loss_fn: LossFn, old_logprobs: Tensor, entropy: Tensor) -> LossFn:
    """loss_fn, also writing the on_policy rows' log-probs and every row's entropy into the step's tensors."""

    def fn(logp: Tensor, ent: Tensor | None, mb: TokenBatch) -> tuple[Tensor, dict[str, float]]:
        rows, width = mb.extras["row"], logp.shape[1]
        fresh = mb.extras["on_policy"].bool()
        old_logprobs[rows[fresh], :width] = logp.detach()[fresh].cpu()
        entropy[rows, :width] = ent.detach().cpu()
        return loss_fn(logp, ent, mb)

    return fn


STAGES = ("generate", "reward", "balance", "logprobs", "advantages", "update", "sync")


class StageTimer:
    """Seconds per named stage of one step: `with timer("generate"): ...`."""

    def __init__(self, stages: tuple[str, ...] = ()):
        self.seconds: dict[str, float] = dict.fromkeys(stages, 0.0)  # same keys on every rank, even if unused

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class ControllerShard:
    """Takes its trainer, engines and algorithm from `build_components`; owns the data and the step."""

    def __init__(self, cfg: ExperimentConfig, world: World, parts: Components, data: RankData | None = None,
                 data_world: World | None = None):
        """`data`: this rank's checked data (yatt.data.prepare, read before the engines start); None reads it.
        `data_world`: the data-parallel view of `world` (yatt.distributed.data_parallel_world) when the
        trainer splits the model over ranks: data, seeds, denominators and metric sums go by data-parallel
        rank, so the ranks of one model-parallel group generate and train on the same samples (same prompts,
        same per-sample seeds; the trainer checks the batches agree). Devices (engines, placement) stay `world`'s."""
        self.devices = world
        world = data_world or world
        self.cfg, self.world = cfg, world
        self.tokenizer, self.trainer, self.ref = parts.tokenizer, parts.trainer, parts.ref
        self.engines, self.algorithm, self.critic = parts.engines, parts.algorithm, parts.critic
        self.prompts_per_rank = cfg.data.prompts_per_step // world.size
        data = data or load_rank_data(cfg, world, self.tokenizer)
        self.train_stream = PromptStream(data.train, seed=cfg.run.seed * 1009 + world.rank, shuffle=cfg.data.shuffle)
        self.eval_rows, self.eval_prompt_ids = data.eval, data.eval_prompt_ids
        # a VL policy's processor: a step reads and encodes its image rows when it starts (yatt.controllers.images)
        self.image_inputs = ImageInputs(cfg.model.path) if is_vision_model(cfg.model.path) else None
        self.last_eval: list[Rollout] = []  # the latest evaluation's and step's rollouts (for samples.jsonl)
        self.last_rollouts: list[Rollout] = []
        bucket_bytes = cfg.rollout.engine.weight_bucket_mb << 20
        self.policy_weights = lambda: self.trainer.engine_weights(bucket_bytes)
        self.engines.policy_weights = self.policy_weights
        self.judges = {j.name: Judge(j) for j in cfg.reward.judges}
        self.schedule = GenerationSchedule(cfg.placement, self.devices.size)
        self.placement = DeviceOwnership({
            # an engine killed between stages is restarted by these, not fatal (services._each)
            "rollout": HookRole(lambda: self.engines.sleep(ROLLOUT), lambda: self.engines.wake(ROLLOUT)),
            "genrm": HookRole(lambda: self.engines.sleep("genrm"), lambda: self.engines.wake("genrm")),
            "train": HookRole(lambda: [t.offload() for t in self._trainers()],
                              lambda: [t.onload() for t in self._trainers()]),
        }, initial_owner="rollout")
        self.sampler = DynamicSampler(cfg.algorithm.dynamic_sampling) if cfg.algorithm.dynamic_sampling.enabled else None
        eos = self.tokenizer.eos_token_id
        self.sampling = SamplingSpec(n=cfg.rollout.group_size, temperature=cfg.rollout.temperature,
                                     top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_new_tokens,
                                     stop_token_ids=[eos], logprobs=True)
        self.greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=cfg.rollout.max_new_tokens,
                                   stop_token_ids=[eos], logprobs=False)
        self.samples_trained = 0
        self.last_step = 0

    def _trainers(self):
        """What the `train` role owns: the policy, the reference model, the critic."""
        return [self.trainer] + ([self.ref] if self.ref else []) + ([self.critic.trainer] if self.critic else [])

    # ---- the RL step -------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        cfg, algo, timer = self.cfg, self.cfg.algorithm, StageTimer(STAGES)
        restarted = self.engines.heal()
        busy_before = self.engines.busy_seconds()
        self._rounds: list[GenerationStats] = []
        rollouts, sampling_metrics = self._generate_and_reward(step, timer)
        self.last_rollouts = rollouts  # this rank's scored rollouts (samples.jsonl shows some)
        if self.schedule.split is not None:  # partial: a device keeps serving others until all controllers are done
            with timer("generate"):
                self.devices.barrier()
        with timer("balance"):
            trained, plan = self._rebalance(rollouts)  # what this rank trains: its own and moved rollouts
        with self.placement.own("train"):
            batch = self._token_batch(trained)
            minis = self._mini_batches(len(batch), step)
            policy_trains = self.critic is None or not self.critic.warming_up(step)  # critic.warmup_steps
            with timer("logprobs"):
                old_lp, entropy = self._old_logprobs(batch, minis[0], policy_trains)
                ref_lp = self.ref.logprobs(batch)[0] if self.ref else None
                values = self.critic.values(batch) if self.critic else None
            with timer("advantages"):
                rewards = torch.tensor([r.reward for r in trained], dtype=torch.float32)
                token_kl = None
                if ref_lp is not None and algo.kl_mode == "reward":
                    kl = kl_estimate(old_lp, ref_lp, algo.kl_estimator)
                    rewards = kl_penalized_rewards(rewards, kl, batch.mask, self.algorithm.kl_coef)
                    token_kl = self.algorithm.kl_coef * kl * batch.mask
                baselines = torch.tensor([r.baseline for r in trained], dtype=torch.float32)
                inp = AdvantageInput(rewards, batch.mask, cfg.rollout.group_size, self.world, token_kl, baselines,
                                     values)
                advantages, returns = self.algorithm.advantages(inp)
            batch.extras.update(old_logprobs=old_lp, advantages=advantages)
            if ref_lp is not None:
                batch.extras["ref_logprobs"] = ref_lp
            if self.critic is not None:
                batch.extras.update(values=values, returns=self.critic.targets(inp, returns))
            with timer("update"):
                critic_update = self.critic.update(batch, minis) if self.critic else None
                update = self._update(batch, minis if policy_trains else [], entropy)
        if step % cfg.rollout.sync_every == 0:  # sync_every > 1: deliberately stale rollouts
            with timer("sync"), self.placement.own("rollout"):
                self.engines.push_weights(self.policy_weights())
        self.samples_trained += len(trained)
        metrics = self._step_metrics(trained, batch, entropy, ref_lp, update, timer)
        if self.critic is not None:
            metrics.update(self.critic.metrics(batch, critic_update, warming_up=not policy_trains))
        # after the update: with old_logprobs=reuse its first forwards filled in the on-policy rows' log-probs
        metrics.update(self.algorithm.mismatch_metrics(batch, self.world))
        metrics["actor/kl_coef"] = self.algorithm.kl_coef  # the coefficient this step used
        self.algorithm.kl_control.update(metrics["actor/kl_ref"], metrics["rollout/samples"])
        metrics.update(self._placement_metrics(rollouts, GenerationStats.merged(self._rounds), timer, busy_before,
                                               restarted))
        self.last_step = step
        return {**metrics, **sampling_metrics, **(plan.metrics() if plan else {})}

    def _generate(self, step: int, rows, round_: int) -> tuple[list[Rollout], GenerationStats]:
        """Rollouts with rule and judge scores, on the devices the placement gives each role."""
        cfg = self.cfg
        prompt_ids = encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_tokens)
        seeds = [sample_seed(cfg.run.seed, step, row.index, round_) for row in rows]
        images = load_batch_images(rows, self.image_inputs, prompt_ids)  # this rank's rows, this step only
        common = dict(step=step, round_=round_, run_seed=cfg.run.seed, images=images)
        if cfg.placement.mode == "full":  # this device: rollout, then GenRM
            rank = [self.devices.rank]
            lanes = {name: JudgeLane(j, self.engines.pool(genrm_role(name), rank)) for name, j in self.judges.items()}
            with self.placement.own("rollout"):
                return generate_and_judge(rows, prompt_ids, seeds, self.sampling, self.tokenizer,
                                          self.engines.pool(ROLLOUT, rank), lanes, stream=False,
                                          before_judging=lambda: self.placement.acquire("genrm"), **common)
        split = self.schedule.split
        lanes = {name: JudgeLane(j, self.engines.pool(genrm_role(name), split.genrm))
                 for name, j in self.judges.items()}
        with self.placement.own(split.role_of(self.devices.rank)):
            return generate_and_judge(rows, prompt_ids, seeds, self.sampling, self.tokenizer,
                                      self.engines.pool(ROLLOUT, split.rollout), lanes, stream=True, **common)

    def _generate_and_reward(self, step: int, timer: StageTimer) -> tuple[list[Rollout], dict[str, float]]:
        """This step's scored groups: one round of prompts_per_rank, or dynamic sampling's kept groups."""
        if self.sampler is None:
            return self._rollouts(step, self.prompts_per_rank, 0, timer), {}
        group = self.cfg.rollout.group_size

        def generate(count: int, round_: int) -> list[list[Rollout]]:
            rollouts = self._rollouts(step, count, round_, timer)
            return [rollouts[i : i + group] for i in range(0, len(rollouts), group)]

        groups, metrics = self.sampler.collect(self.prompts_per_rank, generate)
        return [r for g in groups for r in g], reduce_metrics(self.world, metrics)

    def _rollouts(self, step: int, count: int, round_: int, timer: StageTimer) -> list[Rollout]:
        """`count` prompts' groups, generated, judged and rewarded; one round of dynamic sampling."""
        rows = self.train_stream.next_batch(count)
        with timer("generate"):
            rollouts, stats = self._generate(step, rows, round_)
            self._rounds.append(stats)
            if self.algorithm.estimator.needs_greedy_baseline:
                self._greedy_baselines(rows, rollouts)
        with timer("reward"):
            assign_rewards(rollouts, self.cfg.reward.kind, {j.name: j.weight for j in self.cfg.reward.judges},
                           self.cfg.reward.rule_weight)
        return rollouts

    def _greedy_baselines(self, rows, rollouts: list[Rollout]) -> None:
        """ReMax: one greedy response per prompt, generated right after its group and scored by the rule
        verifier (the config allows ReMax with reward.kind=rule only); its reward is each sample's baseline."""
        prompt_ids = encode_prompts(rows, self.tokenizer, self.cfg.data.max_prompt_tokens)
        images = [rollouts[i * self.cfg.rollout.group_size].vision for i in range(len(rows))]  # the groups' images
        with self.placement.own("rollout"):
            greedy = generate_rollouts(self.engines.pool(ROLLOUT, [self.world.rank]), rows, prompt_ids,
                                       self.greedy, self.tokenizer, None, images)
        score_rollouts(greedy)
        group = self.cfg.rollout.group_size
        for i, g in enumerate(greedy):
            for r in rollouts[i * group : (i + 1) * group]:
                r.baseline = g.reward

    def _rebalance(self, rollouts: list[Rollout]):
        """Move whole groups between ranks so each trains about the same work (yatt.balance). Off: no
        exchange and no plan (the step's metric reductions report the imbalance)."""
        bal = self.cfg.balance
        if not bal.enabled:
            return rollouts, None
        for i, r in enumerate(rollouts):
            r.origin = (self.world.rank, i)
        unit = self.cfg.rollout.group_size if bal.keep_groups is not False else 1
        return rebalance(self.world, rollouts, unit, bal.attention_coef, bal.partitioner, bal.equal_count,
                         enabled=bal.enabled)

    def _token_batch(self, rollouts: list[Rollout]) -> TokenBatch:
        batch = TokenBatch.from_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                                          self.tokenizer.pad_token_id)
        batch.pixels = stack_pixels(rollouts)
        batch.extras["rollout_logprobs"] = batch.per_token([r.rollout_logprobs for r in rollouts])
        batch.temperature = self.cfg.rollout.temperature
        return batch

    def _mini_batches(self, count: int, step: int) -> list[list[Tensor]]:
        """Rows of each optimizer step, per epoch: ppo_epochs x mini_batches chunks of whole groups, in a
        seeded order; exactly mini_batches chunks (some maybe empty) on every rank, as ranks hold
        different group counts."""
        group = self.cfg.rollout.group_size
        generator = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + step * 31 + self.world.rank)
        epochs = []
        for _ in range(self.cfg.algorithm.ppo_epochs):
            order = torch.randperm(count // group, generator=generator)
            epochs.append([(chunk[:, None] * group + torch.arange(group)).flatten()
                           for chunk in torch.tensor_split(order, self.cfg.algorithm.mini_batches)])
        return epochs

    def _old_logprobs(self, batch: TokenBatch, first_epoch: list[Tensor], policy_trains: bool = True
                      ) -> tuple[Tensor, Tensor]:
        """The old policy's log-probs and entropies before the update (algorithm.old_logprobs).

        reuse: the first mini-batch's rows are flagged on_policy and skipped here; the update's first
        forward fills their log-probs and entropies in (a KL reward needs them before, and a step without a
        policy update has no such forward, so those recompute). rollout: the engine's log-probs; entropies
        come from the first epoch's forwards (none without a policy update: 0).
        """
        mode, algo = self.cfg.algorithm.old_logprobs, self.cfg.algorithm
        if mode == "reuse" and (not policy_trains or (self.ref is not None and algo.kl_mode == "reward"
                                                     and algo.kl_coef > 0)):
            mode = "recompute"
        on_policy = torch.zeros(len(batch))
        batch.extras["on_policy"] = on_policy
        if mode == "rollout":
            return batch.extras["rollout_logprobs"].clone(), torch.zeros_like(batch.mask)
        if mode == "reuse":
            on_policy[first_epoch[0]] = 1.0
        rest = (on_policy == 0).nonzero().flatten()
        old_lp, entropy = torch.zeros_like(batch.mask), torch.zeros_like(batch.mask)
        if len(rest):
            lp, ent = self.trainer.logprobs(batch.select(rest), with_entropy=True)
            old_lp[rest, : lp.shape[1]], entropy[rest, : lp.shape[1]] = lp, ent
        return old_lp, entropy

    def _update(self, batch: TokenBatch, epochs: list[list[Tensor]], entropy: Tensor) -> dict[str, float]:
        """ppo_epochs passes, each split into mini_batches optimizer steps; groups stay together.

        The first epoch's forwards also record what the log-prob pass skipped (on_policy rows: their
        log-probs into old_logprobs, their entropies into `entropy`), for the metrics."""
        batch.extras["row"] = torch.arange(len(batch))
        # the same keys on every rank, even one that holds no samples
        totals = dict.fromkeys(("tokens", *self.algorithm.stats, "grad_norm", "lr", "skipped", "optimizer_steps"), 0.0)
        for epoch, mini, tokens, seqs in global_mini_batches(self.world, batch, epochs):
            loss_fn = self.algorithm.objective(tokens, seqs, norm_length=self.cfg.rollout.max_new_tokens)
            # entropies for the metrics where no pass computed them
            record = epoch == 0 and (self.cfg.algorithm.old_logprobs == "rollout"
                                     or bool(mini.extras["on_policy"].any()))
            if record:
                loss_fn = _recording(loss_fn, batch.extras["old_logprobs"], entropy)
            stats = self.trainer.train_mini_batch(mini, loss_fn, with_entropy=record or self.algorithm.needs_entropy)
            stats["optimizer_steps"] = 1.0
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
        return totals

    # ---- metrics -----------------------------------------------------------------------------
    def _step_metrics(self, rollouts, batch, entropy, ref_lp, update, timer) -> dict[str, float]:
        """`rollouts`: what this rank trained (after dynamic sampling and rebalancing)."""
        mask = batch.mask
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        groups = rewards.view(-1, self.cfg.rollout.group_size)
        lp_diff = (batch.extras["old_logprobs"] - batch.extras["rollout_logprobs"]).abs() * mask
        kl_ref = float(masked_sum(kl_estimate(batch.extras["old_logprobs"], ref_lp, self.cfg.algorithm.kl_estimator),
                                  mask)) if ref_lp is not None else 0.0
        lengths = mask.sum(dim=1)
        bal = self.cfg.balance
        workload = sum(sample_workload(len(r.prompt_ids), len(r.response_ids), bal.attention_coef) for r in rollouts)
        local = {  # sums over this rank's samples; summed again over ranks below
            "reward": float(rewards.sum()),
            "correct": float((rewards >= 1.0).sum()),
            "samples": float(len(rollouts)),
            "resp_tokens": float(lengths.sum()),
            "truncated": float(sum(r.finish_reason == "length" for r in rollouts)),
            "entropy": float(masked_sum(entropy, mask)),
            "lp_diff": float(lp_diff.sum()),
            "kl_ref": kl_ref,
            "zero_var_groups": float((groups.std(dim=1) == 0).sum()),
            "solved_groups": float((groups.max(dim=1).values >= 1.0).sum()),
            "groups": float(groups.shape[0]),
            "workload": workload,
            "tokens": update["tokens"],
            **{f"actor/{name}": update[name] for name in self.algorithm.stats},  # sums over trained tokens
        }
        s = dict(zip(local, self.world.sum(list(local.values()))))
        stage_names = sorted(timer.seconds)
        top = [float(t.max()) if t.numel() else 0.0 for t in (lengths, lp_diff)]  # a rank may hold no samples
        maxes = self.world.max(top + [workload] + [timer.seconds[k] for k in stage_names])
        steps = max(update["optimizer_steps"], 1.0)
        den = {k: max(s[k], 1.0) for k in ("tokens", "samples", "resp_tokens", "groups")}  # 0 when nothing was kept
        metrics = {
            "reward/mean": s["reward"] / den["samples"],
            "reward/correct_frac": s["correct"] / den["samples"],
            "reward/zero_variance_group_frac": s["zero_var_groups"] / den["groups"],
            "reward/pass_at_group": s["solved_groups"] / den["groups"],  # groups with >= 1 fully correct sample
            "response/length_mean": s["resp_tokens"] / den["samples"],
            "response/length_max": maxes[0],
            "response/truncated_frac": s["truncated"] / den["samples"],
            **{f"actor/{name}": s[f"actor/{name}"] / den["tokens"] for name in self.algorithm.stats},
            "actor/entropy": s["entropy"] / den["resp_tokens"],
            "actor/kl_ref": s["kl_ref"] / den["resp_tokens"],
            "actor/grad_norm": update["grad_norm"] / steps,
            "actor/lr": update["lr"] / steps,
            "actor/skipped_steps": update["skipped"],
            "rollout/trainer_logprob_diff_mean": s["lp_diff"] / den["resp_tokens"],
            "rollout/trainer_logprob_diff_max": maxes[1],
            "rollout/samples": s["samples"],
        }
        metrics.update({f"time/{k}_s": v for k, v in zip(stage_names, maxes[3:])})
        if not bal.enabled:  # what a plan would report: max over mean rank workload, nothing moved
            imbalance = maxes[2] * self.world.size / s["workload"] if s["workload"] > 0 else 1.0
            metrics.update({"balance/imbalance_before": imbalance, "balance/imbalance_after": imbalance,
                            "balance/moved_samples": 0.0, "balance/moved_pixel_bytes": 0.0})
        metrics["perf/gen_tokens_per_s"] = s["resp_tokens"] / max(metrics["time/generate_s"], 1e-9)
        if self.sampler is not None:
            metrics["dynamic_sampling/trained_zero_var_groups"] = s["zero_var_groups"]
        return metrics

    def _placement_metrics(self, rollouts: list[Rollout], gen: GenerationStats, timer: StageTimer,
                           busy_before: dict[str, float], restarted: int) -> dict[str, float]:
        """Per-device time per role and idle fraction, judge throughput and queue; picks the next split."""
        busy = {role: max(0.0, s - busy_before.get(role, 0.0)) for role, s in self.engines.busy_seconds().items()}
        rollout_busy = busy.pop(ROLLOUT, 0.0)
        judge_busy = sum(busy.values())
        train_busy = timer.seconds["logprobs"] + timer.seconds["update"]
        owned = self.placement.take_metrics()
        load = summed(self.world, {"load/rollout_busy_s": rollout_busy, "load/genrm_busy_s": judge_busy,
                                   "restarts": float(self.engines.take_restarts())})  # during this step
        restarted += int(load.pop("restarts"))
        if restarted:
            self.engines.forget_endpoints()
        split = self.schedule.split
        out = {**load, **maxed(self.world, {"placement/switch_s": owned["placement/switch_s"],
                                            "placement/offload_freed_bytes": owned["placement/offload_freed_bytes"],
                                            "time/rollout_phase_s": gen.rollout_s, "time/judge_tail_s": gen.judge_tail_s}),
               "placement/switches": owned["placement/switches"], "placement/engine_restarts": float(restarted),
               "placement/rollout_devices": float(len(split.rollout) if split else self.devices.size),
               "placement/genrm_devices": float(len(split.genrm) if split else self.devices.size)}
        out.update(device_metrics(self.world, owned, rollout_busy + judge_busy + train_busy, sum(timer.seconds.values())))
        if self.judges:
            out.update(judge_metrics(self.world, self.judges, rollouts, gen.judged, gen.unparseable,
                                     judge_busy, gen.max_judge_queue))
        out.update(pool_metrics(self.world, gen.pools, list(self.judges)))
        # every rank saw the same sums, so all choose the same split for the next step
        self.schedule.observe(load["load/rollout_busy_s"], load["load/genrm_busy_s"])
        return out

    # ---- checkpoint state ------------------------------------------------------------------------
    @property
    def replicated(self) -> tuple[str, ...]:
        """Parts of state_dict() that are the same on every rank: a checkpoint stores them once, from rank 0
        (a trainer whose ranks hold shards of the model saves its own part on every rank instead)."""
        parts = {"trainer": self.trainer, **({"critic": self.critic.trainer} if self.critic else {})}
        return tuple(name for name, part in parts.items() if part.replicated)

    def state_dict(self) -> dict[str, dict]:
        """Everything resuming needs, as named component states (live references; yatt.checkpoint copies
        them). A new stateful component adds one key here and in
        load_state_dict. The reference model is not saved: it is frozen at model.path."""
        return {"trainer": self.trainer.state_dict(), "train_stream": self.train_stream.state_dict(),
                "rng": rng_state(), "progress": {"step": self.last_step, "samples_trained": self.samples_trained},
                "kl_control": self.algorithm.kl_control.state_dict(),
                **({"sampler": self.sampler.state_dict()} if self.sampler else {}),
                **({"critic": self.critic.state_dict()} if self.critic else {})}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Restore a checkpoint, then push the restored policy into the engine, which started from model.path."""
        self.trainer.load_state_dict(state["trainer"])
        self.train_stream.load_state_dict(state["train_stream"])
        self.last_step = state["progress"]["step"]
        self.samples_trained = state["progress"]["samples_trained"]
        self.algorithm.kl_control.load_state_dict(state["kl_control"])
        if self.sampler:
            self.sampler.load_state_dict(state["sampler"])
        if self.critic:
            self.critic.load_state_dict(state["critic"])
        with self.placement.own("rollout"):
            self.engines.push_weights(self.policy_weights())
        self.placement.take_metrics()  # the load's timing is not the first step's
        set_rng_state(state["rng"])

    # ---- evaluation, export, shutdown ---------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy decoding of the held-out split: eval/accuracy is the fraction of prompts with a full score
        (verifier score >= 1), eval/score the mean verifier score (partial credit counts), over all ranks."""
        if self.cfg.data.eval is None:
            return {}
        start = time.perf_counter()
        rollouts = []
        if self.eval_rows:  # a rank may hold no held-out rows; it still joins the sums
            images = load_batch_images(self.eval_rows, self.image_inputs, self.eval_prompt_ids)  # read for this eval
            with self.placement.own("rollout"):
                rollouts = generate_rollouts(self.engines.pool(ROLLOUT, [self.world.rank]), self.eval_rows,
                                             self.eval_prompt_ids, self.greedy, self.tokenizer, None, images)
            score_rollouts(rollouts)
        self.last_eval = rollouts
        full, total, count = self.world.sum([float(sum(r.reward >= 1.0 for r in rollouts)),
                                             sum(r.reward for r in rollouts), float(len(rollouts))])
        return {"eval/accuracy": full / count, "eval/score": total / count, "eval/count": count,
                "time/eval_s": time.perf_counter() - start}

    @property
    def _saved_with_weights(self):
        """What goes next to exported weights: the tokenizer, or a VL policy's processor (tokenizer + image
        processor), so the folder loads as the same kind of model."""
        return self.image_inputs.processor if self.image_inputs is not None else self.tokenizer

    def export_policy(self, folder: Path) -> None:
        self.trainer.save_hf(folder, self._saved_with_weights)

    def export_checkpoint(self, folder: Path, snap: Snapshot) -> None:
        """The policy as a Hugging Face folder, from a checkpoint's host copy of the replicated state
        (checkpoint.export_hf; runs in the background writer)."""
        export_snapshot(folder, snap, "trainer", self.trainer.hf_weights, self.trainer.hf_config,
                        self._saved_with_weights)

    def close(self) -> None:
        self.engines.close()
