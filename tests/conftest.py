"""Shared pytest setup: marker registration only (keep fixtures in the test modules)."""

from __future__ import annotations


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers", "engine: starts real inference-engine child processes (vLLM); slow, deselect with -m 'not engine'"
    )
    config.addinivalue_line(
        "markers",
        "slow: long end-to-end runs (the full quickstart); `make test` deselects them, `make test-all` runs them",
    )
