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


@pytest.fixture
def unit_merge_bytes(tmp_path):
    """Every baseline implementation's merges at 1 HBM byte per element (the hand-computed
    KERNEL_TOY tests): flat baseline prices read their implementation's bytes from
    ``sim/config.merge_bytes`` (not the hardware), so the toy sets them through ``--config``."""
    from megatron_hsap.sim import config

    impls = "\n".join(f"  {name}: {{fwd: 1.0, bwd: 1.0}}" for name in config.constants.MERGE_BYTES)
    (tmp_path / "unit_merges.yaml").write_text("merge_bytes:\n" + impls + "\n")
    config.load_overrides(tmp_path / "unit_merges.yaml")
    yield
    config.reset_overrides()
