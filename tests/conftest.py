"""Shared pytest set-up: the gloo pool fixture, the ``slow`` marker, hypothesis profiles."""

from __future__ import annotations

import os
from typing import Callable

import pytest
from hypothesis import HealthCheck, settings

from tests.distributed import GlooPool, get_pool

# Timing on shared CPUs is noisy: never fail a property on a deadline. CI runs the same examples
# every time (derandomize) so a red build reproduces; locally hypothesis explores.
settings.register_profile("dev", deadline=None)
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: multi-process or long tests; excluded by scripts/test.sh unless --slow"
    )


@pytest.fixture(scope="session")
def gloo_pool() -> Callable[[int], GlooPool]:
    """Factory ``gloo_pool(world_size) -> GlooPool``; pools live for the whole session."""
    return get_pool
