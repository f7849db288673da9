"""A rollout engine from outside yatt, plugged in by import path (tests/test_plugins.py):

    rollout: {engine: {backend: tests.plugins.counting_engine:CountingEngine}}

It is the hf engine, counting what it serves: `health()` names it and reports the requests it took and the
tokens it sampled, and its last line in the engine's log says them. yatt starts it in an engine process, which
imports this module by its path there too.
"""

from __future__ import annotations

import logging

from yatt.engines.hf_engine import HFEngine

log = logging.getLogger(__name__)


class CountingEngine(HFEngine):
    def __init__(self, model_path, cfg, seed):
        super().__init__(model_path, cfg, seed)
        self.requests = self.tokens = 0

    def add_requests(self, request_ids, prompts, sampling, seeds, images=None):
        super().add_requests(request_ids, prompts, sampling, seeds, images)
        self.requests += len(request_ids)

    def step(self):
        done = super().step()
        self.tokens += sum(len(c.token_ids) for _, completions in done for c in completions)
        return done

    def health(self):
        return {**super().health(), "backend": "counting", "requests": self.requests, "tokens": self.tokens}

    def shutdown(self):
        log.info("counting engine served %d requests, %d tokens", self.requests, self.tokens)
        super().shutdown()
