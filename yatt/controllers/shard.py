"""The controller shard: one per torchrun rank, owning its slice of the data from prompt to loss.

The RL step (`ControllerShard.step`) reads top to bottom like the algorithm:
    generate -> reward -> old/ref logprobs -> advantages -> update -> sync weights
Ranks exchange only DDP gradients and small metadata (counts, sums, timings) through `World`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from transformers import AutoTokenizer

from yatt.algorithms import get_advantage_estimator, kl_estimate, kl_penalized_rewards, masked_sum
from yatt.checkpoint.rng import rng_state, set_rng_state
from yatt.config import ExperimentConfig
from yatt.controllers.objective import policy_objective
from yatt.controllers.rollouts import Rollout, encode_prompts, generate_rollouts, sample_seed, score_rollouts
from yatt.data.sources import load_shard
from yatt.data.stream import PromptStream
from yatt.distributed import World
from yatt.engines.base import SamplingSpec
from yatt.engines.client import spawn_engine
from yatt.placement.ownership import DeviceOwnership, HookRole
from yatt.trainers.batch import TokenBatch
from yatt.trainers.torch_trainer import TorchTrainer


class StageTimer:
    """Seconds per named stage of one step: `with timer("generate"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class ControllerShard:
    # Components whose state is the same on every rank (DDP keeps weights and AdamW state in lockstep):
    # a checkpoint stores them once, from rank 0; every other component is stored per rank.
    REPLICATED = ("trainer",)

    def __init__(self, cfg: ExperimentConfig, world: World, run_dir: Path):
        self.cfg, self.world = cfg, world
        self.tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.path))
        self.prompts_per_rank = cfg.data.prompts_per_step // world.size
        self.train_stream = PromptStream(load_shard(cfg.data.train, world.rank, world.size),
                                         seed=cfg.run.seed * 1009 + world.rank, shuffle=cfg.data.shuffle)
        self.eval_rows = (load_shard(cfg.data.eval, world.rank, world.size, limit=cfg.data.eval_prompts)
                          if cfg.data.eval is not None else [])
        self.eval_prompt_ids = encode_prompts(self.eval_rows, self.tokenizer, cfg.data.max_prompt_tokens)
        torch.manual_seed(cfg.run.seed)
        optimizer_steps = cfg.run.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches
        self.trainer = TorchTrainer(cfg.model.path, cfg.trainer, world, total_steps=optimizer_steps)
        self.ref = TorchTrainer(cfg.model.path, cfg.trainer, world, trainable=False) if cfg.algorithm.kl_coef else None
        self.engine = spawn_engine(str(cfg.model.path), cfg.rollout.engine, seed=cfg.run.seed + world.rank,
                                   log_path=run_dir / "logs" / f"engine-rank{world.rank}.log")
        self.placement = DeviceOwnership({"rollout": HookRole(self.engine.sleep, self.engine.wake),
                                          "train": HookRole(self.trainer.offload, self.trainer.onload)},
                                         initial_owner="rollout")
        eos = self.tokenizer.eos_token_id
        self.sampling = SamplingSpec(n=cfg.rollout.group_size, temperature=cfg.rollout.temperature,
                                     top_p=cfg.rollout.top_p, max_tokens=cfg.rollout.max_new_tokens,
                                     stop_token_ids=[eos], logprobs=True)
        self.greedy = SamplingSpec(n=1, temperature=0.0, max_tokens=cfg.rollout.max_new_tokens,
                                   stop_token_ids=[eos], logprobs=False)
        self.samples_trained = 0
        self.last_step = 0

    # ---- the RL step -------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        cfg, algo, timer = self.cfg, self.cfg.algorithm, StageTimer()
        rows = self.train_stream.next_batch(self.prompts_per_rank)
        with timer("generate"), self.placement.own("rollout"):
            prompt_ids = encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_tokens)
            seeds = [sample_seed(cfg.run.seed, step, row.index) for row in rows]
            rollouts = generate_rollouts(self.engine, rows, prompt_ids, self.sampling, self.tokenizer, seeds)
        with timer("reward"):
            score_rollouts(rollouts)
        with self.placement.own("train"):
            batch = self._token_batch(rollouts)
            with timer("logprobs"):
                old_lp, entropy = self.trainer.logprobs(batch, with_entropy=True)
                ref_lp = self.ref.logprobs(batch)[0] if self.ref else None
            with timer("advantages"):
                rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
                if ref_lp is not None and algo.kl_mode == "reward":
                    kl = kl_estimate(old_lp, ref_lp, algo.kl_estimator)
                    rewards = kl_penalized_rewards(rewards, kl, batch.mask, algo.kl_coef)
                estimator = get_advantage_estimator(algo.advantage)
                advantages = estimator(rewards, cfg.rollout.group_size, normalize_std=algo.normalize_std)
            batch.extras.update(old_logprobs=old_lp, advantages=advantages)
            if ref_lp is not None:
                batch.extras["ref_logprobs"] = ref_lp
            with timer("update"):
                update = self._update(batch, step)
        with timer("sync"), self.placement.own("rollout"):
            self.engine.update_weights(self.trainer.named_weights())
        self.samples_trained += len(rollouts)
        self.last_step = step
        return self._step_metrics(rollouts, batch, entropy, ref_lp, update, timer)

    def _token_batch(self, rollouts: list[Rollout]) -> TokenBatch:
        batch = TokenBatch.from_sequences([r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts],
                                          self.tokenizer.pad_token_id)
        batch.extras["rollout_logprobs"] = batch.per_token([r.rollout_logprobs for r in rollouts])
        return batch

    def _update(self, batch: TokenBatch, step: int) -> dict[str, float]:
        """ppo_epochs passes, each split into mini_batches optimizer steps; groups stay together."""
        algo, group = self.cfg.algorithm, self.cfg.rollout.group_size
        generator = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + step * 31 + self.world.rank)
        num_groups = len(batch) // group
        totals: dict[str, float] = {}
        for _ in range(algo.ppo_epochs):
            order = torch.randperm(num_groups, generator=generator)
            for chunk in order.chunk(algo.mini_batches):
                rows = (chunk[:, None] * group + torch.arange(group)).flatten()
                mini = batch.select(rows)
                tokens, seqs = self.world.sum([float(mini.mask.sum()), float(len(mini))])
                loss_fn = policy_objective(algo, tokens / self.world.size, seqs / self.world.size,
                                           norm_length=self.cfg.rollout.max_new_tokens)
                stats = self.trainer.train_mini_batch(mini, loss_fn)
                stats["optimizer_steps"] = 1.0
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        return totals

    # ---- metrics -----------------------------------------------------------------------------
    def _step_metrics(self, rollouts, batch, entropy, ref_lp, update, timer) -> dict[str, float]:
        mask = batch.mask
        rewards = torch.tensor([r.reward for r in rollouts])
        groups = rewards.view(-1, self.cfg.rollout.group_size)
        lp_diff = (batch.extras["old_logprobs"] - batch.extras["rollout_logprobs"]).abs() * mask
        kl_ref = float(masked_sum(kl_estimate(batch.extras["old_logprobs"], ref_lp, self.cfg.algorithm.kl_estimator),
                                  mask)) if ref_lp is not None else 0.0
        lengths = mask.sum(dim=1)
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
            "tokens": update["tokens"],
            "clip": update["clip_frac_sum"],
            "dual_clip": update["dual_clip_frac_sum"],
            "policy_loss": update["policy_loss_sum"],
            "approx_kl": update["approx_kl_sum"],
        }
        s = dict(zip(local, self.world.sum(list(local.values()))))
        stage_names = sorted(timer.seconds)
        maxes = self.world.max([float(lengths.max()), float(lp_diff.max())] + [timer.seconds[k] for k in stage_names])
        steps = update["optimizer_steps"]
        metrics = {
            "reward/mean": s["reward"] / s["samples"],
            "reward/correct_frac": s["correct"] / s["samples"],
            "reward/zero_variance_group_frac": s["zero_var_groups"] / s["groups"],
            "reward/pass_at_group": s["solved_groups"] / s["groups"],  # groups with >= 1 fully correct sample
            "response/length_mean": s["resp_tokens"] / s["samples"],
            "response/length_max": maxes[0],
            "response/truncated_frac": s["truncated"] / s["samples"],
            "actor/entropy": s["entropy"] / s["resp_tokens"],
            "actor/policy_loss": s["policy_loss"] / s["tokens"],
            "actor/clip_frac": s["clip"] / s["tokens"],
            "actor/dual_clip_frac": s["dual_clip"] / s["tokens"],
            "actor/approx_kl": s["approx_kl"] / s["tokens"],
            "actor/kl_ref": s["kl_ref"] / s["resp_tokens"],
            "actor/grad_norm": update["grad_norm"] / steps,
            "actor/lr": update["lr"] / steps,
            "rollout/trainer_logprob_diff_mean": s["lp_diff"] / s["resp_tokens"],
            "rollout/trainer_logprob_diff_max": maxes[1],
            "rollout/samples": s["samples"],
        }
        metrics.update({f"time/{k}_s": v for k, v in zip(stage_names, maxes[2:])})
        metrics["perf/gen_tokens_per_s"] = s["resp_tokens"] / max(metrics["time/generate_s"], 1e-9)
        metrics.update(self.placement.take_metrics())
        return metrics

    # ---- checkpoint state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict]:
        """Everything resuming needs, as named component states (live references; yatt.checkpoint copies
        them). A new stateful component (e.g. a dynamic-sampling queue) adds one key here and in
        load_state_dict. The reference model is not saved: it is frozen at model.path."""
        return {"trainer": self.trainer.state_dict(), "train_stream": self.train_stream.state_dict(),
                "rng": rng_state(), "progress": {"step": self.last_step, "samples_trained": self.samples_trained}}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        """Restore a checkpoint, then push the restored policy into the engine, which started from model.path."""
        self.trainer.load_state_dict(state["trainer"])
        self.train_stream.load_state_dict(state["train_stream"])
        self.last_step = state["progress"]["step"]
        self.samples_trained = state["progress"]["samples_trained"]
        with self.placement.own("rollout"):
            self.engine.update_weights(self.trainer.named_weights())
        self.placement.take_metrics()  # the load's timing is not the first step's
        set_rng_state(state["rng"])

    # ---- evaluation, export, shutdown ---------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split (mean verifier score over all ranks' eval shards)."""
        if not self.eval_rows:
            return {}
        start = time.perf_counter()
        with self.placement.own("rollout"):
            rollouts = generate_rollouts(self.engine, self.eval_rows, self.eval_prompt_ids, self.greedy,
                                         self.tokenizer, None)
        score_rollouts(rollouts)
        total, count = self.world.sum([sum(r.reward for r in rollouts), float(len(rollouts))])
        return {"eval/accuracy": total / count, "eval/count": count, "time/eval_s": time.perf_counter() - start}

    def export_policy(self, folder: Path) -> None:
        self.trainer.save_hf(folder, self.tokenizer)

    def close(self) -> None:
        self.engine.close()
