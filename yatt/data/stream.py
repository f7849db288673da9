"""A rank's endless, reshuffled stream over its shard, with a cursor that can be saved and restored."""

from __future__ import annotations

import random

from yatt.data.rows import PromptRow


class PromptStream:
    def __init__(self, rows: list[PromptRow], seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("this rank's data shard is empty: the data set has fewer rows than ranks")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, count: int) -> list[PromptRow]:
        batch = []
        while len(batch) < count:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order()
            batch.append(self.rows[self._order[self.cursor]])
            self.cursor += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order()
