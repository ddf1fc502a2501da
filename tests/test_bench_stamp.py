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


def test_op_count_reads_the_graph_not_its_weights(tmp_path: Path) -> None:
    # The benches check that a --linear-kernel native compile holds QLinear nodes before they cache it as fresh.
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [w],
    )
    bundle = tmp_path / "b"
    bundle.mkdir()
    onnx.save(helper.make_model(graph), bundle / "model.onnx", save_as_external_data=True, size_threshold=0)
    (bundle / "model.onnx.data").unlink(missing_ok=True)  # weights absent: the graph alone is read
    for data in bundle.glob("*.data"):
        data.unlink()
    assert _stamp.op_count(bundle, "MatMul") == 1 and _stamp.op_count(bundle, "QLinear") == 0
