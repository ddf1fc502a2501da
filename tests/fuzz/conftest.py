"""The fuzzer's modules import as ``tests.fuzz.*``: the repository root goes on ``sys.path`` (importlib mode).
``library``: liblayerzero_ort.so for the fuzzers' CI runs, built once a module, the logs quiet meanwhile."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="module")
def library() -> Iterator[str]:
    from tests.fuzz.projections import quiet
    from tests.plugins.native_build import build_ort_test_library

    with quiet():  # the levels come back after the module: later tests read the logs (caplog)
        yield str(build_ort_test_library())
