"""The train prompts as endless, reshuffled streams, with cursors that survive a change of the number of ranks.

The rows are cut into `shards` streams by index (row i is in stream i % shards), each reshuffled every epoch
from its own seed and with its own cursor. Rank r of W draws from streams r, r + W, ... in turn, so a rank's
streams hold exactly the rows it loaded (index % W == r; `shards` is a multiple of W). `shards` defaults to the
number of ranks, one stream a rank. The streams' cursors together are the run's global position: a checkpoint
saves all of them, and a resume with another number of ranks that divides `shards` (2 -> 1, or back to 2)
hands each stream to its new owner, so no prompt is skipped or drawn twice.
"""

from __future__ import annotations

import random

from yatt.data.rows import PromptRow


class _Stream:
    """One stream: its rows in a new order each epoch, and how far into the epoch it is."""

    def __init__(self, rows: list[PromptRow], seed: int, shuffle: bool):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self) -> PromptRow:
        if self.cursor == len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._epoch_order()
        self.cursor += 1
        return self.rows[self._order[self.cursor - 1]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order()


class PromptStream:
    """Rank `rank` of `world`'s draws. `rows`: the rows it loaded (index % world == rank); `seed`: stream k's seed
    is seed + k; `shards`: the number of streams (0: one a rank)."""

    def __init__(
        self, rows: list[PromptRow], seed: int, shuffle: bool = True, rank: int = 0, world: int = 1, shards: int = 0
    ):
        if not rows:
            raise ValueError("this rank's data shard is empty: the data set has fewer rows than ranks")
        self.rows, self.seed, self.shuffle, self.rank, self.world = rows, seed, shuffle, rank, world
        self._cut(shards or world)

    def _cut(self, shards: int) -> None:
        if shards % self.world:
            raise ValueError(
                f"the train data is cut into {shards} streams (data.shards), which {self.world} ranks cannot share "
                f"out: use a number of ranks that divides {shards}"
            )
        self.shards, self.turn = shards, 0
        self.streams = {}
        for k in range(self.rank, shards, self.world):
            rows = [row for row in self.rows if row.index % shards == k]
            if not rows:
                raise ValueError(f"train data stream {k} of {shards} is empty: the data set has fewer rows than that")
            self.streams[k] = _Stream(rows, self.seed + k, self.shuffle)

    def next_batch(self, count: int) -> list[PromptRow]:
        """`count` prompts, drawn from this rank's streams in turn."""
        own = list(self.streams.values())
        batch = [own[(self.turn + i) % len(own)].next() for i in range(count)]
        self.turn = (self.turn + count) % len(own)
        return batch

    def state_dict(self) -> dict:
        """This rank's streams' cursors (`merged` joins every rank's into the run's position)."""
        return {"shards": self.shards, "streams": {str(k): s.state_dict() for k, s in self.streams.items()},
                "turns": [self.turn]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Take back this rank's streams from every rank's `merged` cursors, at any number of ranks that divides the
        streams; a checkpoint from before streams held one rank's {epoch, cursor}."""
        if "streams" not in state:
            state = {"shards": self.world, "streams": {str(self.rank): state}, "turns": [0] * self.world}
        if state["shards"] != self.shards:
            self._cut(state["shards"])
        for k, stream in self.streams.items():
            stream.load_state_dict(state["streams"][str(k)])
        same_ranks = len(state["turns"]) == self.world  # else the turns restart: only the order within a step changes
        self.turn = state["turns"][self.rank] if same_ranks else 0


def merged(states: list[dict]) -> dict:
    """Every rank's `PromptStream.state_dict()`, by rank, as one: the run's position in its train data."""
    return {
        "shards": states[0]["shards"],
        "streams": {k: v for state in states for k, v in state["streams"].items()},
        "turns": [state["turns"][0] for state in states],
    }
