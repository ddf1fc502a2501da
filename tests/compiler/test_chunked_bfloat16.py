"""Chunked verification of a bfloat16 model gathers the bf16 bits, not the float32 upcast (issue 22, real size).

A ``Gather`` / ``GatherND`` of an upcast bfloat16 weight in external data runs in ``layerzero.chunked`` itself:
only the gathered rows are read from the file and upcast (a batched_mm MoE export's expert table is 1.07 GB a
layer in float32 at OLMoE-1B-7B's shape). The outputs must be the float32 model's bit for bit, ONNX's index
rules kept (negative indices, any axis, GatherND's index depth), an index out of range a one-line error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from layerzero import chunked
from layerzero.chunked import run_in_chunks
from layerzero.errors import InvalidInputError
from layerzero.loader import load_model, upcast_bfloat16
from layerzero.ort_runner import create_session

RNG = np.random.default_rng(0)
TABLE = (RNG.standard_normal((6, 5, 4)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
EMBED = (RNG.standard_normal((10, 4)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
PROJ = RNG.standard_normal((4, 3)).astype(np.float32)


def _upcast(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _graph(bf16: bool) -> onnx.ModelProto:
    def weight(name: str, bits: np.ndarray) -> TensorProto:
        if bf16:
            return helper.make_tensor(name, TensorProto.BFLOAT16, bits.shape, bits.tobytes(), raw=True)
        return helper.make_tensor(name, TensorProto.FLOAT, bits.shape, _upcast(bits).tobytes(), raw=True)

    elem = TensorProto.BFLOAT16 if bf16 else TensorProto.FLOAT
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["e"], axis=0),  # [2, 3, 4]
        helper.make_node("GatherND", ["table", "pick"], ["g"]),  # [3, 4]: (expert, row) pairs
        helper.make_node("Gather", ["table", "cols"], ["c"], axis=-1),  # [6, 5, 2]
        helper.make_node("Cast", ["e"], ["ef"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["g"], ["gf"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["ef", "proj"], ["y"]),
        helper.make_node("MatMul", ["gf", "proj"], ["z"]),
        helper.make_node("Cast", ["c"], ["w"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
         helper.make_tensor_value_info("pick", TensorProto.INT64, [3, 2]),
         helper.make_tensor_value_info("cols", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("y", [2, 3, 3]), ("z", [3, 3]),
                                                                             ("w", [6, 5, 2]))],
        [weight("embed", EMBED), weight("table", TABLE),
         helper.make_tensor("proj", TensorProto.FLOAT, PROJ.shape, PROJ.tobytes(), raw=True)],
        value_info=[helper.make_tensor_value_info(n, elem, s) for n, s in (("e", [2, 3, 4]), ("g", [3, 4]),
                                                                          ("c", [6, 5, 2]))],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FEEDS = {
    "ids": np.array([[0, 9, -1], [3, -10, 4]], dtype=np.int64),
    "pick": np.array([[5, 0], [-6, 4], [2, -1]], dtype=np.int64),
    "cols": np.array([-4, 3], dtype=np.int64),
}


def _bf16_file(tmp_path: Path) -> Path:
    path = tmp_path / "bf16.onnx"
    onnx.save(_graph(True), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="bf16.onnx.data", size_threshold=0)  # fmt: skip
    return path


def test_gathers_of_bfloat16_weights_run_on_the_bits_and_equal_float32(tmp_path, monkeypatch) -> None:
    model = load_model(_bf16_file(tmp_path))
    upcast_bfloat16(model)
    done: list[str] = []
    real = chunked._gather_bfloat16

    def spy(node, source, env):
        real(node, source, env)
        done.append(node.op_type)

    monkeypatch.setattr(chunked, "_gather_bfloat16", spy)
    names, outs = run_in_chunks(model, FEEDS, budget_bytes=1)
    assert sorted(done) == ["Gather", "Gather", "GatherND"]  # all three ran on the bits, none through ORT
    session = create_session(_graph(False).SerializeToString(), libraries=())
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, FEEDS)))
    for name, out in zip(names, outs):
        assert out.dtype == np.float32 and out.shape == want[name].shape
        np.testing.assert_array_equal(out, want[name])  # bit for bit: the upcast commutes with the gather


@pytest.mark.parametrize(
    ("feed", "value"),
    [("ids", [[0, 10, 1], [1, 1, 1]]), ("pick", [[6, 0], [0, 0], [0, 0]]), ("cols", [0, -5])],
)
def test_a_gather_index_out_of_range_is_one_line(tmp_path, feed: str, value: list) -> None:
    model = load_model(_bf16_file(tmp_path))
    upcast_bfloat16(model)
    feeds = dict(FEEDS, **{feed: np.array(value, dtype=np.int64)})
    with pytest.raises(InvalidInputError, match="outside") as err:
        run_in_chunks(model, feeds, budget_bytes=1)
    assert "\n" not in str(err.value)
