"""A source's rows as chats: `chat: true` (yatt.data.config.ChatPrompt) wraps each row's question text in the
source's system prompt and instruction, one code path for every kind of source.

The row then holds messages instead of text, so `PromptRow.prompt_ids` renders it through the tokenizer's chat
template (with the generation prompt) and yatt.data.prepare checks it like any chat row. Image markers already
placed in the text stay in the user message.
"""

from __future__ import annotations

from dataclasses import replace

from yatt.data.config import ChatPrompt
from yatt.data.errors import DataError
from yatt.data.rows import PromptRow


def chat_messages(question: str, system_prompt: str | None, instruction: str) -> list[dict]:
    """The question as an instruct model expects it: an optional system message, then the user's turn."""
    user = {"role": "user", "content": instruction.replace("{question}", question)}
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [user]


def as_chats(rows: list[PromptRow], chat: ChatPrompt) -> list[PromptRow]:
    """`rows` unchanged unless chat.chat; then each text row as a chat. A row that is a chat already would escape
    the source's system prompt and instruction, so it is refused, naming the row."""
    if not chat.chat:
        return rows
    out = []
    for row in rows:
        if row.messages is not None:
            raise DataError(f"{row.where}: a 'messages' row in a source with chat: true, which builds each chat "
                            "from the prompt text (system_prompt, instruction); give the row's text in the prompt "
                            "column, or set chat: false to use its messages as they are")
        out.append(replace(row, prompt=None, messages=chat_messages(row.prompt, chat.system_prompt, chat.instruction)))
    return out
