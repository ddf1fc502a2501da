"""Building liblayerzero_ort.so for the tests: one place for the plugin tests' fixtures (tests/plugins/conftest.py)
and the pass tests that run the native op (tests/passes/test_moe_*.py). Builds go to build/ort-test (never the
user's ~/.cache); ``LAYERZERO_ORT_TEST_BUILD`` overrides. A missing prerequisite skips, and fails under
``LAYERZERO_REQUIRE_NATIVE=1`` (CI)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from layerzero.plugins import ort_library
from layerzero.plugins.loader import PluginError

ORT_TEST_BUILD = Path(os.environ.get("LAYERZERO_ORT_TEST_BUILD") or Path(__file__).resolve().parents[2] / "build"
                      / "ort-test")  # fmt: skip


def missing(reason: str) -> None:
    """Skip for a missing native prerequisite; fail when ``LAYERZERO_REQUIRE_NATIVE=1`` (CI must have it)."""
    if os.environ.get("LAYERZERO_REQUIRE_NATIVE") == "1":
        pytest.fail(f"LAYERZERO_REQUIRE_NATIVE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def build_ort_test_library(asan: bool = False) -> Path:
    """liblayerzero_ort.so (with AddressSanitizer when ``asan``), built (incrementally) into ``ORT_TEST_BUILD``."""
    require = os.environ.get("LAYERZERO_REQUIRE_NATIVE") == "1"
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        missing("cmake / g++ not found: liblayerzero_ort.so cannot be built")
    if ort_library.find_ort_headers() is None and not require:
        missing("ONNX Runtime headers not found: run scripts/fetch_ort_headers.sh (or LAYERZERO_ORT_INCLUDE)")
    try:
        return ort_library.build_ort_library(ORT_TEST_BUILD, asan=asan, fetch_headers=require)
    except PluginError as e:
        missing(str(e))
        raise
