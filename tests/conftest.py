"""pytest configuration: hypothesis profiles and shared fixtures.

Profiles: ``ci`` (derandomized, no deadline, moderate example counts: the whole suite runs
in a few minutes on 2 cores) is loaded when the ``CI`` environment variable is set;
``dev`` otherwise (random, no deadline, a few more examples). Override with
``--hypothesis-profile=NAME``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=100,
    print_blob=True,
    suppress_health_check=_SUPPRESS,
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=200,
    print_blob=True,
    suppress_health_check=_SUPPRESS,
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A numpy Generator seeded from the test's node id (stable across runs)."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % 2**32
    return np.random.default_rng(seed)
