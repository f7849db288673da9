"""Judge prompts: a template with {question}, {reference}, {response} and, for image prompts, {images} filled in.

{images} is where a vision-language judge sees the prompt's images: one image placeholder per image (the
convention of yatt.data.images; the judge's engine expands them with the judge's own processor). A VL judge
whose template has no {images} gets them in front of the prompt, as a data row without markers does. The texts
never carry images: the question's own markers are removed (only {images} places them), so a text-only judge
reads an image prompt's text alone.
"""

from __future__ import annotations

import string

FIELDS = frozenset({"question", "reference", "response", "images"})


def template_fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def check_template(template: str) -> str:
    """The template may use only the known fields, and must use {response}."""
    used = template_fields(template)
    unknown = used - FIELDS
    if unknown:
        raise ValueError(f"unknown template field(s) {sorted(unknown)}; allowed: {sorted(FIELDS)}")
    if "response" not in used:
        raise ValueError("the judge template must contain {response}")
    return template


def render(template: str, question: str, reference: str | None, response: str, images: str = "") -> str:
    """Fill the template (`images`: the image placeholders, "" for none; in front when the template has no
    {images}). Braces inside the texts are safe: `format` does not re-parse substituted values."""
    text = template.format(question=question, reference=reference or "", response=response, images=images)
    return text if "images" in template_fields(template) else images + text
