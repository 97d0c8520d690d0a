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


def shared_data_dir() -> Path:
    """The real CTR samples: ``$EMBSTORE_DATA_DIR``, else ``../shared/data`` next to the repo
    (see its README; they are never copied into the repository)."""
    env = os.environ.get("EMBSTORE_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """``shared_data_dir()``; the test is skipped, saying why, when it is absent."""
    path = shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"real CTR data not found at {path} (set EMBSTORE_DATA_DIR)")
    return path
