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

from dataclasses import replace
from pathlib import Path

from yatt.checkpoint.export import PolicyWriter, policy_writer
from yatt.checkpoint.snapshot import Snapshot
from yatt.config import ExperimentConfig
from yatt.controllers.components import Components
from yatt.controllers.conversations import Agent
from yatt.controllers.dynamic_sampling import DynamicSampler, in_groups, reduce_metrics
from yatt.controllers.evaluation import evaluate_greedy
from yatt.controllers.generation import GenerationStats, GroupShare, assign_rewards, generate_placed, sampling_specs
from yatt.controllers.images import load_batch_images, reload_images
from yatt.controllers.metrics import STAGES, StageTimer, StepResult, loop_metrics, train_metrics
from yatt.controllers.minibatches import mini_batches
from yatt.controllers.policy import advantage_input, old_logprobs, policy_update, token_batch
from yatt.controllers.rollouts import encode_prompts, rebalance_groups, sample_seed, set_greedy_baselines
from yatt.controllers.schedule import build_schedule, schedule_metrics
from yatt.controllers.shard_state import Progress, ShardCheckpoint
from yatt.data.prepare import RankData, load_rank_data
from yatt.data.rollout import Rollout
from yatt.data.stream import PromptStream
from yatt.distributed import World
from yatt.genrm.judge import Judge
from yatt.genrm.teacher import Teacher
from yatt.models.vision import ImageInputs, is_vision_model
from yatt.placement.engine_lifecycle import ROLLOUT
from yatt.placement.ownership import HookRole


class ControllerShard:
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
        """`data`: this rank's checked data (yatt.data.prepare); None reads it. `data_world`: the data-parallel
        view of `world` when the trainer splits the model over ranks (data, seeds and metric sums go by it, so a
        model-parallel group trains on the same samples; devices stay `world`'s). `group_world`: the ranks of
        that group (yatt.distributed.model_parallel_world), which split the generation (GroupShare)."""
        self.devices, self.world = world, data_world or world
        self.group = GroupShare(group_world, self.devices, self.world)
        self.cfg, self.tokenizer, self.trainer, self.ref = cfg, parts.tokenizer, parts.trainer, parts.ref
        self.engines, self.algorithm, self.critic = parts.engines, parts.algorithm, parts.critic
        self.prompts_per_rank = cfg.data.prompts_per_step // self.world.size
        data = data or load_rank_data(cfg.data, self.world, self.tokenizer, cfg.reward.verifiers)
        self.train_stream = PromptStream(data.train, cfg.run.seed * 1009, cfg.data.shuffle, self.world.rank,
                                         self.world.size, cfg.data.shards)  # fmt: skip
        self.eval_rows, self.eval_prompt_ids = data.eval, data.eval_prompt_ids
        # a VL policy's processor: a step reads and encodes its image rows when it starts (yatt.controllers.images)
        self.image_inputs = ImageInputs(cfg.model.path) if is_vision_model(cfg.model.path) else None
        # what goes next to exported weights: the tokenizer, or a VL policy's processor (tokenizer + image
        # processor), so the folder loads as the same kind of model
        self.saved_with_weights = self.image_inputs.processor if self.image_inputs is not None else self.tokenizer
        self.judges = {j.name: Judge(j) for j in cfg.reward.judges}
        self.teacher = Teacher(cfg.reward.teacher) if cfg.reward.teacher else None  # on-policy distillation
        # what the `train` role owns: the policy, the reference model, the critic
        trainers = lambda: [t for t in (self.trainer, self.ref, self.critic and self.critic.trainer) if t is not None]
        train = HookRole(lambda: [t.offload() for t in trainers()], lambda: [t.onload() for t in trainers()])
        dynamic, algo = cfg.algorithm.dynamic_sampling, cfg.algorithm
        self.sampler = DynamicSampler(dynamic) if dynamic.enabled else None
        # r3 or routing_mismatch: the engines return the experts of every token (replayed, or measured against)
        self.sampling, self.greedy = sampling_specs(cfg.rollout, self.tokenizer.eos_token_id, algo.engine_routing)
        # rollout.agent: single_turn's one call per sample, or a conversation (yatt.controllers.conversations)
        self.agent = Agent.build(cfg.rollout.agent, self.tokenizer)
        self.progress = Progress()
        # rollout.schedule: when batches are made (here, or a producer thread ahead), where (yatt.controllers.schedule)
        self.rollouts = build_schedule(cfg, self.produce, self.engines, train, world, self.world, group_world)
        self.placement, self.engine_placement = self.rollouts.where.placement, self.rollouts.where.engine_placement
        # what a checkpoint holds: the parts with their own state, by checkpoint key (yatt.controllers.shard_state)
        stateful = {"trainer": self.trainer, "train_stream": self.train_stream, "kl_control": self.algorithm.kl_control,
                    "sampler": self.sampler, "critic": self.critic}  # fmt: skip
        models = {"trainer": self.trainer, "critic": self.critic and self.critic.trainer}
        encode = lambda rows: encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_tokens)  # noqa: E731
        images = self.image_inputs and (lambda rollouts: reload_images(rollouts, self.image_inputs, encode))
        self.checkpoint = ShardCheckpoint(self.world, self.progress, self.rollouts, stateful, models, images,
                                          cfg.trainer.backend)  # fmt: skip

    # ---- the RL step -------------------------------------------------------------------------
    def step(self, step: int) -> StepResult:
        """One RL step: its metrics (reduced over ranks), this rank's rollouts, the samples trained so far."""
        timer = StageTimer(STAGES)
        batch = self.rollouts.take(step, timer)
        sampling_metrics = reduce_metrics(self.world, batch.counts) if batch.counts else {}
        metrics, balance_metrics = self.consume(batch.rollouts, step, timer)
        metrics.update(self.rollouts.placement_metrics(self.world, step, batch, timer, self.judges, bool(self.teacher)))
        metrics.update(schedule_metrics(self.world, *self.rollouts.metrics(step, batch.rollouts)))
        if self.agent.multi_turn:  # from the rollouts as generated (balancing moves no agent counts)
            metrics.update(loop_metrics(self.world, batch.rollouts))
        self.progress.step, progress = step, self.progress
        return StepResult({**metrics, **sampling_metrics, **balance_metrics}, batch.rollouts, progress.samples_trained)

    def produce(self, step: int, timer: StageTimer) -> tuple[list[Rollout], GenerationStats, dict[str, float]]:
        """generate -> reward (-> dynamic sampling): this step's scored groups, its generation rounds' stats
        merged, and this rank's dynamic sampling counts ({} when off). No collective on the shard's worlds: it
        may run on the producer thread (yatt.controllers.schedule)."""
        rounds: list[GenerationStats] = []
        self.rollouts.batch_started()

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
        self.rollouts.batch_made(timer)
        return rollouts, GenerationStats.merged(rounds), counts

    def consume(self, rollouts: list[Rollout], step: int, timer: StageTimer) -> tuple[dict, dict]:
        """rebalance -> logprobs -> advantages -> update -> sync: the step's training metrics, and the
        balance plan's ({} with balancing off)."""
        cfg, algo, world = self.cfg, self.algorithm, self.world
        with timer("balance"):
            trained, plan = rebalance_groups(world, rollouts, cfg.balance, cfg.rollout.group_size)
        with self.placement.own("train"):
            replay = cfg.algorithm.routing_replay == "r3"
            batch = token_batch(trained, self.tokenizer.pad_token_id, cfg.rollout.temperature, replay)
            minis = mini_batches(len(batch), cfg, step, world.rank)
            policy_trains = self.critic is None or not self.critic.warming_up(step)  # critic.warmup_steps
            with timer("logprobs"):
                old_lp, entropy = old_logprobs(self.trainer, algo, batch, minis[0], self.ref is not None, policy_trains)
                ref_lp = self.ref.logprobs(replace(batch, engine_routing=None))[0] if self.ref else None  # no mismatch
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
                self.rollouts.push_weights(step)
        self.progress.samples_trained += len(trained)
        metrics = train_metrics(cfg, algo, world, trained, batch, entropy, ref_lp, update, timer.seconds)
        if self.critic is not None:
            metrics.update(self.critic.metrics(batch, critic_update, warming_up=not policy_trains))
        algo.kl_control.update(metrics["actor/kl_ref"], metrics["rollout/samples"])
        return metrics, plan.metrics() if plan else {}

    def _generate_round(self, step: int, count: int, round_: int, timer: StageTimer) -> tuple[list, GenerationStats]:
        """`count` prompts' groups, generated, judged and rewarded, on the devices the placement gives each
        role: one round (dynamic sampling may run several)."""
        share = self.rollouts.where.group.share(count)  # this rank's part (all of them without a model-parallel group)
        rows, cfg = self.train_stream.next_batch(count)[share], self.cfg
        with timer("generate"):
            prompt_ids = encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_tokens)
            seeds = [sample_seed(cfg.run.seed, step, row.index, round_) for row in rows]
            images = load_batch_images(rows, self.image_inputs, prompt_ids)  # this rank's rows, this step only
            prompts = dict(rows=rows, prompt_ids=prompt_ids, images=images, tokenizer=self.tokenizer)
            split = self.rollouts.split(step)
            where = (self.engines, self.engine_placement, split, self.devices.rank, self.judges, self.teacher)
            tags = dict(step=step, round_=round_, run_seed=cfg.run.seed, first_group=share.start)  # judge seeds
            sampling, agent = self.sampling, self.agent
            rollouts, stats = generate_placed(*where, seeds=seeds, sampling=sampling, agent=agent, **tags, **prompts)
            if self.algorithm.estimator.needs_greedy_baseline:  # ReMax
                with self.engine_placement.own("rollout"):
                    pool = self.engines.pool(ROLLOUT, [self.devices.rank])
                    set_greedy_baselines(rollouts, pool, self.greedy, cfg.rollout.group_size, **prompts, agent=agent)
            with self.rollouts.released():  # the model-parallel group's other shares
                rollouts, stats = self.rollouts.where.group.gather(rollouts, stats)
        with timer("reward"):
            weights = {j.name: j.weight for j in cfg.reward.judges}
            assign_rewards(rollouts, cfg.reward.kind, weights, cfg.reward.rule_weight)
        return rollouts, stats

    # ---- evaluation, export, shutdown ---------------------------------------------------------
    def evaluate(self) -> tuple[dict[str, float], list[Rollout]]:
        """Greedy decoding of the held-out split (yatt.controllers.evaluation): its metrics (the same on every
        rank) and this rank's scored rollouts; nothing without one."""
        if self.cfg.data.eval is None:
            return {}, []
        share, where = self.group.share(len(self.eval_rows)), (self.group.sums, self.engines, self.engine_placement)
        rows, ids = self.eval_rows[share], self.eval_prompt_ids[share]
        self.rollouts.before_evaluation()
        with self.rollouts.engines:
            return evaluate_greedy(*where, rows, ids, self.image_inputs, self.greedy, self.tokenizer, self.agent)

    def export_policy(self, folder: Path) -> None:
        self.trainer.save_hf(folder, self.saved_with_weights)

    def export_checkpoint(self, snap: Snapshot | None, folder: Path | None) -> PolicyWriter | None:
        """checkpoint.export_hf's hook, on every rank at a save: what rank 0's background writer runs to write
        the policy as a Hugging Face folder (yatt.checkpoint.export.policy_writer: snapshot or gathered)."""
        return policy_writer(self.trainer, snap, folder, "trainer", self.saved_with_weights)

    def close(self) -> None:
        self.rollouts.close()
        self.engines.close()
