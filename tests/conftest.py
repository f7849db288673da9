"""Shared pytest setup: marker registration only (keep fixtures in the test modules)."""

from __future__ import annotations


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers", "engine: starts real inference-engine child processes (vLLM); slow, deselect with -m 'not engine'"
    )
