"""pytest configuration of bench/: a stand-in ``benchmark`` fixture without pytest-benchmark.

With pytest-benchmark installed (the ``test`` and ``bench`` extras) this file does nothing.
Without it, each benchmark body still runs once, as under ``--benchmark-disable``, so the
smoke test needs only pytest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

try:
    import pytest_benchmark  # noqa: F401
except ImportError:
    HAVE_PYTEST_BENCHMARK = False
else:
    HAVE_PYTEST_BENCHMARK = True

if not HAVE_PYTEST_BENCHMARK:

    class _RunOnce:
        """The part of pytest-benchmark's fixture the benchmarks use; runs the target once."""

        def __init__(self) -> None:
            self.extra_info: dict[str, Any] = {}

        def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        def pedantic(
            self,
            fn: Callable[..., Any],
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
            setup: Callable[[], Any] | None = None,
            **_: Any,
        ) -> Any:
            if setup is not None:
                args, kwargs = setup()
            return fn(*args, **(kwargs or {}))

    @pytest.fixture
    def benchmark() -> _RunOnce:
        """Runs the benchmarked callable once (pytest-benchmark is not installed)."""
        return _RunOnce()

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line("markers", "benchmark(group): pytest-benchmark grouping")
