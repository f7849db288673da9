"""The `data` section (`DataConfig`) and its data sources (`data.train`, `data.eval`): local files or reasoning-gym
generators, or the tasks of a verifiers environment package.

They live beside the readers they configure (yatt.data.sources opens them) and import nothing but pydantic, so
reading a config never imports torch. Both kinds share `ChatPrompt`: with
`chat: true` a row's question text is given to the policy as a chat (system prompt + user message built from
`instruction`) through the tokenizer's chat template (yatt.data.chat), for instruct models.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from yatt.config_loading import Section


class ChatPrompt(BaseModel):
    """How a question becomes a prompt: raw text, or a chat (the fields every data source shares)."""

    model_config = ConfigDict(extra="forbid")

    chat: bool = Field(False, description="Give each question as a chat (system prompt + user message) through the "
                       "tokenizer's chat template, for instruct models; false: the raw question text.")
    system_prompt: str | None = Field(
        "You are a helpful assistant. Solve the problem and give only the final answer.",
        description="chat: the system message (null: none).")
    instruction: str = Field("{question}", description="chat: the user message; {question} is the question, e.g. "
                             "\"{question}\\nReply with only the answer.\"")

    @field_validator("instruction")
    @classmethod
    def _has_question(cls, value: str) -> str:
        if "{question}" not in value:
            raise ValueError("instruction must contain {question}")
        return value


class FileSource(ChatPrompt):
    """Prompts from local files: yatt's JSONL format, or any JSON/JSONL/Parquet whose columns are mapped.

    A row has a prompt column (text) or a messages column (a chat, always rendered with the chat template). With
    chat: true every row's prompt text is wrapped in the same system prompt and instruction, so a messages row,
    which would escape them, is an error naming the row.
    """

    kind: Literal["jsonl", "json", "parquet"] = Field(
        "jsonl", description="jsonl: one JSON object per line; json: one array of objects; parquet: a table.")
    files: list[Path] = Field(min_length=1, description="The files, read in order (see yatt.data.jsonl/files).")
    prompt_key: str = Field("prompt", description="Column with the prompt text: tokenized as is, or with chat: "
                            "true the question of a chat.")
    messages_key: str | None = Field("messages", description="Column with chat messages [{role, content}] "
                                     "(rendered with the tokenizer's chat template); a row has exactly one of the "
                                     "prompt and messages columns set (with chat: true, the prompt column). null: no "
                                     "chat column.")
    answer_key: str | None = Field("answer", description="Column with the reference answer for the verifier.")
    data_source: str | None = Field(None, description="Verifier for every row (e.g. last_number, "
                                    "reasoning_gym/<dataset>); null: each row's data_source column, else exact_match.")
    extra_columns: Literal["error", "ignore", "metadata"] = Field(
        "error", description="Columns not mapped: error (catches typos), ignore, or metadata (passed to the verifier).")
    images_key: str | None = Field("images", description="Column with the row's images: a list of file paths "
                                   "(relative to the data file) or data URIs; the text marks each with <image> "
                                   "(or they go in front of it). null: no image column.")
    answer_regex: str | None = Field(None, description="Take the reference answer from the answer column with this "
                                     "regex's first group, e.g. '####\\s*(.+)$' for GSM8K; a row it does not "
                                     "match is an error naming the row. null: the whole column.")

    @field_validator("answer_regex")
    @classmethod
    def _one_group(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                groups = re.compile(value).groups
            except re.error as err:
                raise ValueError(f"answer_regex is not a valid regular expression: {err}") from None
            if groups < 1:
                raise ValueError("answer_regex needs a group ( ... ) around the answer")
        return value

    @model_validator(mode="after")
    def _distinct_keys(self) -> "FileSource":
        keys = [k for k in (self.prompt_key, self.messages_key, self.answer_key, self.images_key) if k is not None]
        if len(set(keys)) != len(keys):
            raise ValueError(f"prompt_key, messages_key, answer_key and images_key must name different columns, "
                             f"got {keys}")
        return self


class GymSource(ChatPrompt):
    """Procedurally generated prompts from reasoning-gym (offline, verifiable)."""

    kind: Literal["reasoning_gym"] = Field(description="reasoning_gym: prompts generated by reasoning-gym.")
    dataset: str = Field(description="reasoning-gym dataset name, e.g. basic_arithmetic.")
    size: int = Field(10_000, gt=0, description="Number of procedurally generated prompts.")
    seed: int = Field(0, description="Generator seed; use different seeds for the train and eval splits.")
    options: dict = Field(default_factory=dict, description="Extra keyword arguments of the generator.")
    data_source: str | None = Field(None, description="Verifier instead of the dataset's own reasoning-gym scorer, "
                                    "e.g. last_number for a model that answers in a sentence; null: the scorer.")


class VerifiersSource(BaseModel):
    """Tasks of a `verifiers` environment package's taskset (offline, seeded; docs/environments.md). Each row is
    a task: its chat prompt (the taskset's system prompt and opening message) and, in its metadata, what the
    rollout.agent.kind=verifiers loop needs to play it in-process and read the environment's own reward."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["verifiers"] = Field(description="verifiers: tasks of a verifiers taskset (pip install "
                                       "'yatt[verifiers]').")
    taskset: str = Field(description="The verifiers taskset id: a built-in one (textarena) or an installed "
                         "environment package's (vf-reasoning-gym).")
    options: dict = Field(default_factory=dict, description="The taskset's own config fields, e.g. {game: "
                          "Wordle-v0} for textarena (Wordle-v0, Wordle-v0-long, Hangman-v0, WordLadder-v0, "
                          "WordSearch-v0), {dataset: basic_arithmetic, ...} for vf-reasoning-gym.")
    start: int = Field(0, ge=0, description="Index of the first task in the taskset's stream (textarena: its seed); "
                       "give the train and eval splits disjoint ranges.")
    size: int = Field(1000, gt=0, description="Number of tasks, from start on; each rank keeps its own slice "
                      "(every rank walks the taskset's stream to start + size).")
    nltk_data: Path | None = Field(None, description="An nltk_data folder (python -m yatt.envs.nltk_data --out DIR "
                                   "builds textarena's offline) the run sets as NLTK_DATA; null: the NLTK_DATA "
                                   "the run inherits.")

    @property
    def data_source(self) -> str:
        """The rows' data_source: the reward is the environment's own (yatt.rewards.rules.ENV_PREFIX)."""
        return f"verifiers/{self.taskset}"


DataSource = Annotated[Union[FileSource, GymSource, VerifiersSource], Field(discriminator="kind")]


class DataConfig(Section):
    train: DataSource
    eval: DataSource | None = Field(None, description="Held-out prompts for greedy accuracy.")
    prompts_per_step: int = Field(32, gt=0, description="Prompts per RL step over all ranks.")
    eval_prompts: int = Field(500, gt=0, description="Held-out prompts evaluated (over all ranks).")
    max_prompt_tokens: int = Field(256, gt=0, description="Longer prompts are an error, not truncated.")
    shuffle: bool = Field(True, description="Reshuffle each stream of train prompts every epoch.")
    shards: int = Field(
        0,
        ge=0,
        description="The train prompts are drawn from this many streams (row i in stream i % shards), shared out "
        "over the ranks; a checkpoint resumes on any number of ranks that divides it. 0: the number of ranks "
        "(resume 2 -> 1 -> 2 works; set e.g. 4 to start on 1 rank and resume on 2 or 4). A resumed run keeps its "
        "checkpoint's streams.",
    )
    check_images: bool = Field(
        True,
        description="Before any engine starts, read and decode each image of this "
        "rank's rows once (then drop it), so a missing or corrupt image stops the run naming "
        "the file and row; false: found when the step that uses it reads it.",
    )
