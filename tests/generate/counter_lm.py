"""A hand-made cache-carrying "counter" LM in the layout ``layerzero export`` writes (``input_ids``,
``attention_mask``, ``position_ids`` and one layer's KV cache in; ``logits`` and the presents out): the logits of
token i put all weight (10) on i + 1 (mod V), so what it generates is known exactly; the presents append one row
per token to the past. Used by tests/generate/test_generate_server.py and test_threads.py."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def counter_lm(vocab: int, *, check_mask: bool = False) -> onnx.ModelProto:
    """``check_mask``: the attention mask must cover past + new tokens, as the export's attention does (a wrong
    past length is then a shape error: a negative dim in a ConstantOfShape)."""
    table = np.zeros((vocab, vocab), dtype=np.float32)
    table[np.arange(vocab), (np.arange(vocab) + 1) % vocab] = 10.0
    kv = np.arange(vocab * 2, dtype=np.float32).reshape(vocab, 2)
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(kv, "kv"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
    ]
    if check_mask:
        nodes = [
            helper.make_node("Gather", ["table", "input_ids"], ["raw"]),
            helper.make_node("Shape", ["past_key_values.0.key"], ["past_shape"], start=2, end=3),
            helper.make_node("Shape", ["input_ids"], ["seq_shape"], start=1, end=2),
            helper.make_node("Add", ["past_shape", "seq_shape"], ["total"]),
            helper.make_node("Shape", ["attention_mask"], ["mask_shape"], start=1, end=2),
            helper.make_node("Sub", ["mask_shape", "total"], ["zero"]),  # 0 when the mask is right
            helper.make_node("Concat", ["zero", "one"], ["zshape"], axis=0),
            helper.make_node("ConstantOfShape", ["zshape"], ["check"]),  # a negative dim fails here
            helper.make_node("ReduceSum", ["check"], ["checksum"], keepdims=0),
            helper.make_node("Add", ["raw", "checksum"], ["logits"]),
        ]
        inits.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "one"))
    else:
        nodes = [helper.make_node("Gather", ["table", "input_ids"], ["logits"])]
    nodes += [
        helper.make_node("Gather", ["kv", "input_ids"], ["new_kv"]),
        helper.make_node("Unsqueeze", ["new_kv", "axis1"], ["new_kv4"]),
        helper.make_node("Concat", ["past_key_values.0.key", "new_kv4"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "new_kv4"], ["present.0.value"], axis=2),
    ]
    kv_in, kv_out = ["batch", 1, "past", 2], ["batch", 1, "all", 2]
    graph = helper.make_graph(
        nodes,
        "counter",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, kv_in),
            helper.make_tensor_value_info("past_key_values.0.value", TensorProto.FLOAT, kv_in),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]),
            helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, kv_out),
            helper.make_tensor_value_info("present.0.value", TensorProto.FLOAT, kv_out),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    return model
