"""Engine's feed checks that ONNX Runtime would not make (issue 20), on small hand-built graphs (no torch):

- a named dim (``batch``) is one size across the inputs: ONNX Runtime broadcasts ``[1, n] + [2, n]`` and answers;
- ``input_ids`` outside the embedding's rows: ONNX Runtime's ``Gather`` wraps -1 to the last row and answers;
- a causal LM's first step is filled (``Engine.first_step_feeds``): mask ones, positions, an empty past, and a
  mask that is not past + seq long is named.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper
import onnx.parser
import pytest

from layerzero.errors import InvalidInputError
from layerzero.runtime import Engine

ROWS, HEADS, HEAD_DIM = 10, 2, 4


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_a_named_dim_agrees_across_inputs(tmp_path: Path) -> None:
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[batch, 3] a, float[batch, 3] b) => (float[batch, 3] y) { y = Add(a, b) }
        """
    )
    engine = Engine.load(_save(model, tmp_path / "add.onnx"))
    a, b = np.ones((1, 3), np.float32), np.ones((2, 3), np.float32)
    message = r"input 'b': shape \[2, 3\], expected \[1, 3\] .*batch is 1, as in 'a'"
    with pytest.raises(InvalidInputError, match=message):
        engine.run({"a": a, "b": b})
    assert engine.run({"a": b, "b": b}).outputs["y"].shape == (2, 3)


def _embedding(name: str) -> onnx.ModelProto:
    table = onnx.numpy_helper.from_array(np.arange(ROWS * 2, dtype=np.float32).reshape(ROWS, 2), "table")
    node = oh.make_node("Gather", ["table", name], ["y"], axis=0)
    graph = oh.make_graph(
        [node],
        "g",
        [oh.make_tensor_value_info(name, onnx.TensorProto.INT64, ["batch", "seq"])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", "seq", 2])],
        [table],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8)


def test_token_ids_are_inside_the_embedding(tmp_path: Path) -> None:
    engine = Engine.load(_save(_embedding("input_ids"), tmp_path / "embed.onnx"))
    assert engine.vocab_size == ROWS
    for bad in (-1, ROWS):
        with pytest.raises(InvalidInputError, match=rf"'input_ids': token id {bad} is outside .*\[0, {ROWS}\)"):
            engine.run({"input_ids": np.array([[1, bad]], np.int64)})
    assert engine.run({"input_ids": np.array([[0, ROWS - 1]], np.int64)}).outputs["y"][0, 1].tolist() == [18, 19]
    # Another integer input indexing a table keeps ONNX's own Gather semantics (a negative index counts back).
    other = Engine.load(_save(_embedding("index"), tmp_path / "index.onnx"))
    assert other.vocab_size is None
    assert other.run({"index": np.array([[-1]], np.int64)}).outputs["y"].tolist() == [[[18, 19]]]


def _tiny_lm(path: Path) -> Path:
    """An LM-shaped graph named as ``layerzero export`` names it (batch 1): logits = embedding(ids) + position,
    present = Concat(past, a constant new row), and the mask's sum per row."""
    int64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    consts = [
        onnx.numpy_helper.from_array(np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3), "table"),
        onnx.numpy_helper.from_array(np.ones((1, HEADS, 1, HEAD_DIM), np.float32), "new_kv"),
        onnx.numpy_helper.from_array(np.array([-1], np.int64), "last"),
        onnx.numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    nodes = [
        oh.make_node("Gather", ["table", "input_ids"], ["emb"], axis=0),
        oh.make_node("Cast", ["position_ids"], ["pos"], to=f32),
        oh.make_node("Unsqueeze", ["pos", "last"], ["pos3"]),
        oh.make_node("Add", ["emb", "pos3"], ["logits"]),
        oh.make_node("Concat", ["past_key_values.0.key", "new_kv"], ["present.0.key"], axis=2),
        oh.make_node("ReduceSum", ["attention_mask", "axis1"], ["mask_tokens"], keepdims=0),
    ]
    graph = oh.make_graph(
        nodes,
        "lm",
        [
            oh.make_tensor_value_info("input_ids", int64, ["batch", "seq"]),
            oh.make_tensor_value_info("attention_mask", int64, ["batch", "total"]),
            oh.make_tensor_value_info("position_ids", int64, ["batch", "seq"]),
            oh.make_tensor_value_info("past_key_values.0.key", f32, ["batch", HEADS, "past", HEAD_DIM]),
        ],
        [
            oh.make_tensor_value_info("logits", f32, ["batch", "seq", 3]),
            oh.make_tensor_value_info("present.0.key", f32, [1, HEADS, None, HEAD_DIM]),
            oh.make_tensor_value_info("mask_tokens", int64, ["batch"]),
        ],
        consts,
    )
    return _save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=8), path)


def test_first_step_feeds_fill_what_is_not_given(tmp_path: Path) -> None:
    engine = Engine.load(_tiny_lm(tmp_path / "lm.onnx"))
    feeds = engine.first_step_feeds({"input_ids": [4, 5, 6]})  # 1-D: one sequence
    assert feeds["input_ids"].shape == (1, 3)
    assert feeds["attention_mask"].tolist() == [[1, 1, 1]] and feeds["position_ids"].tolist() == [[0, 1, 2]]
    assert feeds["past_key_values.0.key"].shape == (1, HEADS, 0, HEAD_DIM)
    out = engine.run(feeds).outputs
    table = np.arange(ROWS * 3, dtype=np.float32).reshape(ROWS, 3)
    np.testing.assert_array_equal(out["logits"][0], table[[4, 5, 6]] + np.arange(3, dtype=np.float32)[:, None])
    assert out["present.0.key"].shape == (1, HEADS, 1, HEAD_DIM)

    # Given inputs are used as they are: a left-padded mask gives the positions of the kept tokens.
    padded = engine.first_step_feeds({"input_ids": [[0, 5, 6]], "attention_mask": [[0, 1, 1]]})
    assert padded["attention_mask"] == [[0, 1, 1]] and padded["position_ids"].tolist() == [[0, 0, 1]]
    # A given past continues: the mask covers past + seq, the positions start after the past.
    past = np.zeros((1, HEADS, 2, HEAD_DIM), np.float32)
    step = engine.first_step_feeds({"input_ids": [[7]], "past_key_values.0.key": past})
    assert step["past_key_values.0.key"] is past
    assert step["attention_mask"].tolist() == [[1, 1, 1]] and step["position_ids"].tolist() == [[2]]
    assert engine.run(step).outputs["mask_tokens"].tolist() == [3]

    # A mask not past + seq long is named (ONNX Runtime would run a wrong-length mask without a word here).
    with pytest.raises(InvalidInputError, match=r"'attention_mask': shape \[1, 2\], expected \[1, 3\]"):
        engine.run(engine.first_step_feeds({"input_ids": [[7]], "past_key_values.0.key": past,
                                            "attention_mask": [[1, 1]]}))  # fmt: skip
    with pytest.raises(InvalidInputError, match=r"'input_ids': shape \[1, 0\] has no token"):
        engine.run(engine.first_step_feeds({"input_ids": np.zeros((1, 0), np.int64)}))
    with pytest.raises(InvalidInputError, match=r"input 'input_ids': cannot make an array"):  # ragged rows
        engine.first_step_feeds({"input_ids": [[1, 2], [3]]})


def test_first_step_feeds_leave_other_models_alone(tmp_path: Path) -> None:
    engine = Engine.load(_save(_embedding("input_ids"), tmp_path / "embed.onnx"))
    feeds = {"input_ids": np.array([[1, 2]], np.int64)}
    assert engine.first_step_feeds(feeds) == feeds
