"""The prompt record every data source produces, and how it becomes token ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from yatt.data.tokens import chat_ids, text_ids


@dataclass
class PromptRow:
    """One prompt. `index` is its position in the whole source, so shards and logs can name it."""

    index: int
    prompt: str | None
    messages: list[dict] | None
    answer: str | None
    data_source: str
    metadata: dict = field(default_factory=dict)
    origin: str = ""  # where it came from, for errors: "file:line", "file row N", "reasoning_gym/<dataset> #i"
    images: list[str] = field(default_factory=list)  # refs (paths, data URIs): yatt.data.images reads them lazily

    @property
    def where(self) -> str:
        return self.origin or f"prompt #{self.index} ({self.data_source})"

    def question(self) -> str:
        """The user-visible question text (the last user message for chat rows)."""
        if self.prompt is not None:
            return self.prompt
        users = [m["content"] for m in self.messages if m.get("role") == "user"]
        return users[-1] if users else ""

    def prompt_ids(self, tokenizer) -> list[int]:
        """Token ids fed to the policy, a flat list of ints: chat rows go through the tokenizer's chat template
        (with the generation prompt), text rows are tokenized as they are. Raises DataError naming the row."""
        if self.messages is not None:
            return chat_ids(tokenizer, self.messages, self.where)
        return text_ids(tokenizer, self.prompt, self.where)


def shard_indices(count: int, rank: int, world_size: int) -> range:
    """Rows of one rank: a stride over the source, so shards are disjoint, cover it and stay balanced."""
    return range(rank, count, world_size)
