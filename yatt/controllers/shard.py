"""The controller shard: one per torchrun rank, owning its slice of the data from prompt to loss.

The RL step (`ControllerShard.step`) reads top to bottom like the algorithm:
    produce:  generate -> reward (-> dynamic sampling)                        -> rollouts, generation stats
    consume:  rebalance -> old/ref logprobs (and critic values) -> advantages
              -> update (critic, then policy) -> sync                         -> metrics
Each stage hands the next what it made as return values; the pieces live beside it: rollouts.py (sampling,
ReMax baselines, rebalancing), generation.py (rollout + judges on the placement's devices), policy.py (the
train side), minibatches.py, critic.py, and metrics.py (the metrics, pure functions over named reductions).
Ranks exchange only DDP gradients, small metadata (counts, sums, timings) through `World`, and the
samples that load balancing moves (yatt.balance.exchange).
"""

from __future__ import annotations

from pathlib import Path

from yatt.agents import build_loop
from yatt.agents.base import TokenizerCodec
from yatt.checkpoint.export import PolicyWriter, policy_writer
from yatt.checkpoint.snapshot import Snapshot
from yatt.config import ExperimentConfig
from yatt.controllers.components import Components
from yatt.controllers.dynamic_sampling import DynamicSampler, in_groups, reduce_metrics
from yatt.controllers.evaluation import evaluate_greedy
from yatt.controllers.generation import GenerationStats, GroupShare, assign_rewards, generate_placed, sampling_specs
from yatt.controllers.images import load_batch_images
from yatt.controllers.metrics import STAGES, StageTimer, agent_metrics, agent_sums, step_metrics, step_reductions
from yatt.controllers.minibatches import mini_batches
from yatt.controllers.policy import advantage_input, old_logprobs, policy_update, token_batch
from yatt.controllers.rollouts import encode_prompts, rebalance_groups, sample_seed, set_greedy_baselines
from yatt.controllers.schedule import Batch, rollout_schedule, schedule_metrics
from yatt.controllers.shard_state import ShardState
from yatt.data.prepare import RankData, load_rank_data
from yatt.data.rollout import Rollout
from yatt.data.stream import PromptStream
from yatt.distributed import World, model_parallel_world, own_group
from yatt.genrm.judge import Judge
from yatt.models.vision import ImageInputs, is_vision_model
from yatt.placement.engine_lifecycle import ROLLOUT
from yatt.placement.metrics import engine_busy, maxed, step_placement_metrics, summed
from yatt.placement.ownership import DeviceOwnership, HookRole
from yatt.placement.plan import GenerationSchedule


class ControllerShard(ShardState):
    """Takes its trainer, engines and algorithm from `build_components`; owns the data and the step."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        world: World,
        parts: Components,
        data: RankData | None = None,
        data_world: World | None = None,
        group_world: World | None = None,
    ):
        """`data`: this rank's checked data (yatt.data.prepare, read before the engines start); None reads it.
        `data_world`: the data-parallel view of `world` (yatt.distributed.data_parallel_world) when the
        trainer splits the model over ranks: data, seeds, denominators and metric sums go by data-parallel
        rank, so the ranks of one model-parallel group generate and train on the same samples (same prompts,
        same per-sample seeds; the trainer checks the batches agree). Devices (engines, placement) stay `world`'s.
        `group_world`: those ranks (yatt.distributed.model_parallel_world): they split the generation (GroupShare)."""
        self.devices, self.world = world, data_world or world
        self.group = GroupShare(group_world, self.devices, self.world)
        self.cfg, self.tokenizer, self.trainer, self.ref = cfg, parts.tokenizer, parts.trainer, parts.ref
        self.engines, self.algorithm, self.critic = parts.engines, parts.algorithm, parts.critic
        self.prompts_per_rank = cfg.data.prompts_per_step // self.world.size
        data = data or load_rank_data(cfg, self.world, self.tokenizer)
        seed = cfg.run.seed * 1009 + self.world.rank
        self.train_stream = PromptStream(data.train, seed=seed, shuffle=cfg.data.shuffle)
        self.eval_rows, self.eval_prompt_ids = data.eval, data.eval_prompt_ids
        # a VL policy's processor: a step reads and encodes its image rows when it starts (yatt.controllers.images)
        self.image_inputs = ImageInputs(cfg.model.path) if is_vision_model(cfg.model.path) else None
        # what goes next to exported weights: the tokenizer, or a VL policy's processor (tokenizer + image
        # processor), so the folder loads as the same kind of model
        self.saved_with_weights = self.image_inputs.processor if self.image_inputs is not None else self.tokenizer
        # the latest evaluation's and step's rollouts (samples.jsonl shows some)
        self.last_eval, self.last_rollouts = [], []
        self.judges = {j.name: Judge(j) for j in cfg.reward.judges}
        self.schedule = GenerationSchedule(cfg.placement, self.devices.size)
        # what the `train` role owns: the policy, the reference model, the critic
        trainers = lambda: [t for t in (self.trainer, self.ref, self.critic and self.critic.trainer) if t is not None]
        train = HookRole(lambda: [t.offload() for t in trainers()], lambda: [t.onload() for t in trainers()])
        # ahead of the trainer (rollout.schedule) a producer thread generates on the engines' own devices, with its
        # own process groups so that its collectives never interleave with the trainer's
        roles, self.ahead = self.engines.device_roles(), (ahead := cfg.rollout.schedule.mode != "sync")
        self.placement = DeviceOwnership({"train": train, **({} if ahead else roles)}, "train" if ahead else "rollout")
        self.engine_placement = DeviceOwnership(roles, "rollout") if ahead else self.placement
        if ahead:  # a restarted engine gets the version its batch is generated with
            self.engines.keep_pushed()
        mp = model_parallel_world(world, *cfg.trainer.model_parallel) if ahead and group_world else group_world
        self.producer_group = GroupShare(mp, self.devices, self.world) if ahead else self.group
        # partial: every device serves the others until all controllers' batches are made (a barrier)
        self.producer_devices = own_group(world) if ahead and cfg.placement.mode == "partial" else self.devices
        dynamic = cfg.algorithm.dynamic_sampling
        self.sampler = DynamicSampler(dynamic) if dynamic.enabled else None
        self.sampling, self.greedy = sampling_specs(cfg.rollout, self.tokenizer.eos_token_id)
        # rollout.agent: each sample a conversation of this loop (yatt.controllers.conversations); None: single_turn
        codec = TokenizerCodec(self.tokenizer)
        self.agent = build_loop(cfg.rollout.agent, codec) if cfg.rollout.multi_turn else None
        self.samples_trained = self.last_step = 0
        resume = cfg.rollout.schedule.in_flight == "resume"
        # partial: every rank's producer uses every rank's engines, so a push with requests in flight is made by
        # all ranks at once; a device that judges for the others keeps its rollout engines asleep meanwhile
        self.deferred_push = resume and cfg.placement.mode == "partial"
        barrier = self.world.barrier if self.deferred_push else None
        self.rollouts = rollout_schedule(cfg.rollout.schedule, self._batch, 0, cfg.run.steps, barrier)
        if resume:  # requests in flight at a push resume on the new weights
            self.engines.preemption = self.rollouts

    # ---- the RL step -------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """One RL step; its metrics, reduced over ranks (the same on every rank)."""
        timer = StageTimer(STAGES)
        batch = self.rollouts.take(step, timer)
        sampling_metrics = reduce_metrics(self.world, batch.counts) if batch.counts else {}
        self.last_rollouts = rollouts = batch.rollouts
        metrics, balance_metrics = self.consume(rollouts, step, timer)
        metrics.update(self._placement_metrics(step, batch, timer))
        metrics.update(schedule_metrics(self.world, *self.rollouts.metrics(step, rollouts)))
        if self.agent is not None:  # from the rollouts as generated (balancing moves no agent counts)
            metrics.update(agent_metrics(summed(self.world, agent_sums(rollouts)), "agent"))
        self.last_step = step
        return {**metrics, **sampling_metrics, **balance_metrics}

    def _batch(self, step: int, timer: StageTimer, version: int) -> Batch:
        """What a schedule runs for a step's batch: heal the engines, produce, note the engines' time and the
        weights `version` (ahead of the trainer, on the producer thread: a heal without collectives)."""
        restarted = self.engines.heal_local() if self.ahead else self.engines.heal()
        before = self.engines.busy_seconds()
        rollouts, stats, counts = self.produce(step, timer)
        for r in rollouts:  # groups dynamic sampling kept from an earlier batch keep their own version
            r.version = version if r.version < 0 else r.version
        return Batch(rollouts, stats, counts, engine_busy(before, self.engines.busy_seconds()), restarted)

    def produce(self, step: int, timer: StageTimer) -> tuple[list[Rollout], GenerationStats, dict[str, float]]:
        """generate -> reward (-> dynamic sampling): this step's scored groups, its generation rounds' stats
        merged, and this rank's dynamic sampling counts ({} when off). No collective on the shard's worlds: it
        may run on the producer thread (yatt.controllers.schedule)."""
        rounds: list[GenerationStats] = []
        if self.ahead and self.schedule.split is not None:  # partial: the ranks' engines serve each other, so
            with self.rollouts.released():
                self.producer_devices.barrier()  # every rank has pushed the weights this batch is made with

        def generate(count: int, round_: int) -> list[Rollout]:
            rollouts, stats = self._generate_round(step, count, round_, timer)
            rounds.append(stats)
            return rollouts

        if self.sampler is None:
            rollouts, counts = generate(self.prompts_per_rank, 0), {}
        else:  # rounds until prompts_per_rank groups with reward variance (or max_rounds)
            group = self.cfg.rollout.group_size
            groups, counts = self.sampler.collect(self.prompts_per_rank, lambda n, r: in_groups(generate(n, r), group))
            rollouts = [r for group in groups for r in group]
        if self.schedule.split is not None:  # partial: a device keeps serving others until all controllers are done
            with timer("generate"), self.rollouts.released():
                self.producer_devices.barrier()
        return rollouts, GenerationStats.merged(rounds), counts

    def consume(self, rollouts: list[Rollout], step: int, timer: StageTimer) -> tuple[dict, dict]:
        """rebalance -> logprobs -> advantages -> update -> sync: the step's training metrics, and the
        balance plan's ({} with balancing off)."""
        cfg, algo, world = self.cfg, self.algorithm, self.world
        with timer("balance"):
            trained, plan = rebalance_groups(world, rollouts, cfg.balance, cfg.rollout.group_size)
        with self.placement.own("train"):
            batch = token_batch(trained, self.tokenizer.pad_token_id, cfg.rollout.temperature)
            minis = mini_batches(len(batch), cfg, step, world.rank)
            policy_trains = self.critic is None or not self.critic.warming_up(step)  # critic.warmup_steps
            with timer("logprobs"):
                old_lp, entropy = old_logprobs(self.trainer, algo, batch, minis[0], self.ref is not None, policy_trains)
                ref_lp = self.ref.logprobs(batch)[0] if self.ref else None
                values = self.critic.values(batch) if self.critic else None
            with timer("advantages"):
                inp = advantage_input(trained, batch, old_lp, ref_lp, values, algo, cfg.rollout.group_size, world)
                advantages, returns = algo.advantages(inp)
            batch.extras.update(old_logprobs=old_lp, advantages=advantages)
            if ref_lp is not None:
                batch.extras["ref_logprobs"] = ref_lp
            if self.critic is not None:
                batch.extras.update(values=values, returns=self.critic.targets(inp, returns))
            with timer("update"):
                critic_update = self.critic.update(batch, minis) if self.critic else None
                epochs, norm = (minis if policy_trains else []), cfg.rollout.max_new_tokens
                update = policy_update(self.trainer, algo, world, batch, epochs, entropy, norm)
        if step % cfg.rollout.sync_every == 0:  # sync_every > 1: deliberately stale rollouts
            with timer("sync"):
                self.rollouts.push(step, self._push_policy)
        self.samples_trained += len(trained)
        sums, peaks = step_reductions(cfg, algo.stats, trained, batch, entropy, ref_lp, update, timer.seconds)
        metrics = step_metrics(cfg, algo.stats, world.size, summed(world, sums), maxed(world, peaks), update)
        if self.critic is not None:
            metrics.update(self.critic.metrics(batch, critic_update, warming_up=not policy_trains))
        # after the update: with old_logprobs=reuse its first forwards filled in the on-policy rows' log-probs
        metrics.update(algo.mismatch_metrics(batch, world))
        metrics["actor/kl_coef"] = algo.kl_coef  # the coefficient this step used
        algo.kl_control.update(metrics["actor/kl_ref"], metrics["rollout/samples"])
        return metrics, plan.metrics() if plan else {}

    def _generate_round(self, step: int, count: int, round_: int, timer: StageTimer) -> tuple[list, GenerationStats]:
        """`count` prompts' groups, generated, judged and rewarded, on the devices the placement gives each
        role: one round (dynamic sampling may run several)."""
        share = self.producer_group.share(count)  # this rank's part (all of them without a model-parallel group)
        rows, cfg = self.train_stream.next_batch(count)[share], self.cfg
        with timer("generate"):
            prompt_ids = encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_tokens)
            seeds = [sample_seed(cfg.run.seed, step, row.index, round_) for row in rows]
            images = load_batch_images(rows, self.image_inputs, prompt_ids)  # this rank's rows, this step only
            prompts = dict(rows=rows, prompt_ids=prompt_ids, images=images, tokenizer=self.tokenizer)
            split = self.schedule.split_for(self.rollouts.settled(step))  # the same on every rank
            where = (self.engines, self.engine_placement, split, self.devices.rank, self.judges)
            tags = dict(step=step, round_=round_, run_seed=cfg.run.seed, first_group=share.start)  # judge seeds
            sampling, agent = self.sampling, self.agent
            rollouts, stats = generate_placed(*where, seeds=seeds, sampling=sampling, agent=agent, **tags, **prompts)
            if self.algorithm.estimator.needs_greedy_baseline:  # ReMax
                with self.engine_placement.own("rollout"):
                    pool = self.engines.pool(ROLLOUT, [self.devices.rank])
                    set_greedy_baselines(rollouts, pool, self.greedy, cfg.rollout.group_size, **prompts, agent=agent)
            with self.rollouts.released():  # the model-parallel group's other shares
                rollouts, stats = self.producer_group.gather(rollouts, stats)
        with timer("reward"):
            weights = {j.name: j.weight for j in cfg.reward.judges}
            assign_rewards(rollouts, cfg.reward.kind, weights, cfg.reward.rule_weight)
        return rollouts, stats

    def _placement_metrics(self, step: int, batch: Batch, timer: StageTimer) -> dict:
        """Per-device time per role and idle fraction, judge throughput and queue (step_placement_metrics);
        looks restarted engines up again, and picks the next step's split."""
        busy = {**batch.busy, "train": timer.seconds["logprobs"] + timer.seconds["update"]}
        restarts, owned = self.engines.take_restarts(), self.placement.take_metrics()
        split = self.schedule.split_for(self.rollouts.settled(step))  # the batch's
        parts = (busy, owned, restarts, batch.restarted, batch.stats, split, timer.total, self.judges, batch.rollouts)
        out = step_placement_metrics(self.world, self.devices, *parts)
        if out["placement/engine_restarts"]:
            with self.rollouts.engines:
                self.engines.forget_endpoints()
        # every rank saw the same sums, so all choose the same split for the next step
        self.schedule.observe(out["load/rollout_busy_s"], out["load/genrm_busy_s"], step)
        return out

    def _push_policy(self) -> None:
        if self.deferred_push and self.engine_placement.owner != "rollout":
            # this device judges for the others while their requests may be in flight: its judges stay awake, and
            # its rollout engines load these weights when the device next rolls out (EngineServices.catch_up)
            self.engines.push_policy(load=False)
            return
        with self.engine_placement.own("rollout"):
            self.engines.push_policy()

    # ---- evaluation, export, shutdown ---------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy decoding of the held-out split (yatt.controllers.evaluation); {} without one."""
        if self.cfg.data.eval is None:
            return {}
        share, where = self.group.share(len(self.eval_rows)), (self.group.sums, self.engines, self.engine_placement)
        rows, ids = self.eval_rows[share], self.eval_prompt_ids[share]
        if self.ahead and self.schedule.split is not None:
            # partial: this device's engines serve the other ranks' producers, and evaluating switches it to
            # rollout (on a GPU its judges sleep). Once every producer has made the batches the current weights
            # feed (the ranks' batches end together, at a barrier), none has a request on any engine, and none
            # starts one before the next push.
            self.rollouts.quiesce()
        with self.rollouts.engines:
            metrics, self.last_eval = evaluate_greedy(
                *where, rows, ids, self.image_inputs, self.greedy, self.tokenizer, self.agent
            )
        return metrics

    def export_policy(self, folder: Path) -> None:
        self.trainer.save_hf(folder, self.saved_with_weights)

    def export_checkpoint(self, snap: Snapshot | None) -> PolicyWriter | None:
        """checkpoint.export_hf's hook, on every rank at a save: what rank 0's background writer runs to write
        the policy as a Hugging Face folder (yatt.checkpoint.export.policy_writer: snapshot or gathered)."""
        return policy_writer(self.trainer, snap, "trainer", self.saved_with_weights)

    def close(self) -> None:
        self.rollouts.close()
        self.engines.close()
