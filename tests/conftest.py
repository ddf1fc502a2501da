"""Suite-wide settings: the activation probe cache (compiler/activation_runs.py ``ProbeCache``) in a folder of this
test session, so that no test reads deviations a previous run left in ~/.cache (every run measures them afresh)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_probe_cache(tmp_path_factory: pytest.TempPathFactory):
    if "LAYERZERO_PROBE_CACHE" in os.environ:  # the caller chose one (or 0: none)
        yield
        return
    os.environ["LAYERZERO_PROBE_CACHE"] = str(tmp_path_factory.mktemp("probe-cache"))
    try:
        yield
    finally:
        os.environ.pop("LAYERZERO_PROBE_CACHE", None)
