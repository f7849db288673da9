"""Faults that set the pace of the partial-rollout tests: an hf engine that waits before each token it decodes,
and a torch trainer that waits in each update. Plugged in by import path:

    rollout: {engine: {backend: tests.plugins.slow:SlowEngine}}
    trainer: {backend: tests.plugins.slow:SlowTrainer}

With rollout.schedule.in_flight: resume, a weight push interrupts the samples in flight. It finds some part-way
only if the training step outlasts the first tokens of the next batch and ends before the batch does. On CPU
both sides take milliseconds and shift with the machine's load; these waits do not shrink with it. The samples
and updates are the hf engine's and torch trainer's exactly (a wait draws no random numbers).
"""

from __future__ import annotations

import time

from yatt.engines.hf_engine import HFEngine
from yatt.trainers.torch_trainer import TorchTrainer


class SlowEngine(HFEngine):
    DELAY_S = 0.05

    def _run(self, prompts, seeds, sp, pixels=None, preempted=lambda: None):
        def slowly():  # the decode loop asks before each token whether a sample must end
            time.sleep(self.DELAY_S)
            return preempted()

        return super()._run(prompts, seeds, sp, pixels, slowly)


class SlowTrainer(TorchTrainer):
    DELAY_S = 0.1

    def train_mini_batch(self, batch, loss_fn, with_entropy=False):
        time.sleep(self.DELAY_S)
        return super().train_mini_batch(batch, loss_fn, with_entropy)
