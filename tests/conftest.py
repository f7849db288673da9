"""Shared pytest setup: markers and the per-test timeout (keep fixtures in the test modules)."""

from __future__ import annotations

import pytest


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers", "engine: starts real inference-engine child processes (vLLM); slow, deselect with -m 'not engine'"
    )
    config.addinivalue_line(
        "markers",
        "slow: long end-to-end runs (the full quickstart); `make test` deselects them, `make test-all` runs them",
    )


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    # The suite-wide `timeout` (pyproject.toml) turns a hang into a failure; the slow end-to-end runs train
    # for up to an hour and bound their own subprocesses, so they are exempt.
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(0))
