"""Per-sample compute-cost model used to balance work across ranks."""


def sample_workload(prompt_tokens: int, response_tokens: int, attention_coef: float = 0.0) -> float:
    """Estimated cost of one sample: ``L + attention_coef * L**2`` with ``L = prompt + response``.

    The linear term models the MLP/projection cost; the quadratic term models
    attention, whose cost grows with the square of the sequence length. The
    coefficient is configurable because the attention share depends on model size.
    """
    if prompt_tokens < 0 or response_tokens < 0:
        raise ValueError(
            f"token counts must be non-negative, got prompt_tokens={prompt_tokens}, response_tokens={response_tokens}"
        )
    if attention_coef < 0:
        raise ValueError(f"attention_coef must be non-negative, got {attention_coef}")
    length = prompt_tokens + response_tokens
    return float(length + attention_coef * length * length)
