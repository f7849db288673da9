"""The prompt record every data source produces, and how it becomes token ids."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptRow:
    """One prompt. `index` is its position in the whole source, so shards and logs can name it."""

    index: int
    prompt: str | None
    messages: list[dict] | None
    answer: str | None
    data_source: str
    metadata: dict = field(default_factory=dict)

    def question(self) -> str:
        """The user-visible question text (the last user message for chat rows)."""
        if self.prompt is not None:
            return self.prompt
        users = [m["content"] for m in self.messages if m.get("role") == "user"]
        return users[-1] if users else ""

    def prompt_ids(self, tokenizer) -> list[int]:
        """Token ids fed to the policy: chat rows go through the tokenizer's chat template."""
        if self.messages is not None:
            return list(tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True))
        return tokenizer(self.prompt, add_special_tokens=False)["input_ids"]


def shard_indices(count: int, rank: int, world_size: int) -> range:
    """Rows of one rank: a stride over the source, so shards are disjoint, cover it and stay balanced."""
    return range(rank, count, world_size)
