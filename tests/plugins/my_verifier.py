"""A plug-in rule verifier, as a user writes one outside yatt: one file, registered from the config under a
data_source name, `reward.verifiers: {even_digit: tests.plugins.my_verifier:even_digit}`. Rows whose data_source
is even_digit are scored by it."""

from __future__ import annotations

from yatt.data.rows import PromptRow


def even_digit(response: str, row: PromptRow) -> float:
    """1 for an even digit (whatever the question), 0 otherwise."""
    return float(response.strip() in {"0", "2", "4", "6", "8"})
