"""The fuzzer's modules import as ``tests.fuzz.*``: the repository root goes on ``sys.path`` (importlib mode)."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
