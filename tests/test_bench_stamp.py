"""bench/_stamp.py: a cached bench bundle is fresh only when the code installed now compiled it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _stamp


def test_a_bundle_is_fresh_only_under_the_stamp_of_the_current_code(tmp_path: Path) -> None:
    bundle = tmp_path / "lz-native"
    assert not _stamp.fresh(bundle)  # nothing there
    bundle.mkdir()
    assert not _stamp.fresh(bundle)  # compiled before stamps existed: compile again
    _stamp.stamp(bundle)
    assert _stamp.fresh(bundle)
    (tmp_path / "lz-native.code-stamp").write_text("0123456789abcdef\n")  # another version of the code
    assert not _stamp.fresh(bundle)
    stamp = _stamp.code_stamp()
    assert len(stamp) == 16 and int(stamp, 16) >= 0
