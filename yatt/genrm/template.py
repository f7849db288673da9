"""Judge prompts: a template with {question}, {reference} and {response} filled in."""

from __future__ import annotations

import string

FIELDS = frozenset({"question", "reference", "response"})


def check_template(template: str) -> str:
    """The template may use only the three known fields, and must use {response}."""
    used = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    unknown = used - FIELDS
    if unknown:
        raise ValueError(f"unknown template field(s) {sorted(unknown)}; allowed: {sorted(FIELDS)}")
    if "response" not in used:
        raise ValueError("the judge template must contain {response}")
    return template


def render(template: str, question: str, reference: str | None, response: str) -> str:
    """Fill the template. Braces inside the texts are safe: `format` does not re-parse substituted values."""
    return template.format(question=question, reference=reference or "", response=response)
