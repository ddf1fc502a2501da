"""The group-mask example: a 4-block transformer, a small ONNX router, and the spec that ties them.

The router reads the same ``input_ids`` as the model, pools a tiny token-feature table over the
sequence and scores two groups (``MatMul`` + ``Sigmoid``): ``scores[:, 0]`` ("vision", blocks 1 and 2)
is high for odd token ids, ``scores[:, 1]`` ("audio", block 3) for ids with bit 1 set. A request of
one repeated token ``t`` therefore switches the groups deterministically (``routed_feeds``); a mixed
request lands in between.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from layerzero.models.transformer import IR_VERSION, OPSET, TransformerConfig, build_transformer

__all__ = [
    "ROUTED_CONFIG",
    "ROUTED_GROUPS",
    "build_routed_example",
    "build_router",
    "bypassed_blocks",
    "embed_router",
    "routed_feeds",
]

#: The example model: small, no flags (the groups are the only thing switched off).
ROUTED_CONFIG = TransformerConfig(vocab_size=64, hidden=32, num_layers=4, num_heads=2, ffn=64, flags=False)
#: group name -> (blocks, router index)
ROUTED_GROUPS: dict[str, tuple[tuple[int, ...], int]] = {"vision": ((1, 2), 0), "audio": ((3,), 1)}
_FEATURES = 4
_SHARPNESS = 8.0


def build_router(vocab_size: int = ROUTED_CONFIG.vocab_size) -> onnx.ModelProto:
    """``scores = Sigmoid(ReduceMean(features[input_ids], seq) @ W)``: ``[batch, 2]``, opset 18."""
    ids = np.arange(vocab_size)
    features = np.zeros((vocab_size, _FEATURES), np.float32)
    features[:, 0] = np.where(ids % 2 == 1, 1.0, -1.0)
    features[:, 1] = np.where((ids // 2) % 2 == 1, 1.0, -1.0)
    features[:, 2] = np.where(ids % 3 == 0, 1.0, -1.0)  # features the groups do not use
    features[:, 3] = 1.0
    weight = np.zeros((_FEATURES, 2), np.float32)
    weight[0, 0] = weight[1, 1] = _SHARPNESS
    nodes = [
        helper.make_node("Gather", ["router.features", "input_ids"], ["token_features"], name="/router/Gather", axis=0),
        helper.make_node(
            "ReduceMean", ["token_features", "router.seq_axis"], ["pooled"], name="/router/ReduceMean", keepdims=0
        ),
        helper.make_node("MatMul", ["pooled", "router.weight"], ["logits"], name="/router/MatMul"),
        helper.make_node("Sigmoid", ["logits"], ["scores"], name="/router/Sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "layerzero_router",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 2])],
        initializer=[
            numpy_helper.from_array(features, "router.features"),
            numpy_helper.from_array(np.array([1], np.int64), "router.seq_axis"),
            numpy_helper.from_array(weight, "router.weight"),
        ],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="layerzero.models.routed_groups",
    )


def build_routed_example(router_file: str = "router.onnx") -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """``(model, router_model, spec_dict)``; the spec names the router as ``router_file`` (next to the spec)."""
    spec = {
        "router": {"model": router_file, "output_name": "scores"},
        "threshold": 0.5,
        "groups": [
            {"name": name, "scopes": [f"layers.{i}" for i in blocks], "index": index}
            for name, (blocks, index) in ROUTED_GROUPS.items()
        ],
    }
    return build_transformer(ROUTED_CONFIG), build_router(ROUTED_CONFIG.vocab_size), spec


def embed_router(model: onnx.ModelProto, router: onnx.ModelProto, output: str = "router_scores") -> onnx.ModelProto:
    """``model`` computing ``router`` too (names prefixed ``router.``), its scores the graph output ``output``.

    The form of a model that was exported with its router: the spec then says ``router: {output: ...}``.
    """
    merged = onnx.ModelProto()
    merged.CopyFrom(model)
    inputs = {i.name for i in router.graph.input}
    initializers = {t.name for t in router.graph.initializer}
    scores = router.graph.output[0].name

    def rename(name: str) -> str:
        if name == scores:
            return output
        return name if name in inputs or name in initializers or not name else f"router.{name}"

    for node in router.graph.node:
        copy = merged.graph.node.add()
        copy.CopyFrom(node)
        copy.input[:] = [rename(n) for n in node.input]
        copy.output[:] = [rename(n) for n in node.output]
    merged.graph.initializer.extend(router.graph.initializer)
    out = merged.graph.output.add()
    out.CopyFrom(router.graph.output[0])
    out.name = output
    return merged


def routed_feeds(vision: bool, audio: bool, *, batch: int = 1, seq: int = 6) -> dict[str, np.ndarray]:
    """``input_ids`` of one repeated token that switches "vision" / "audio" on or off."""
    token = int(vision) + 2 * int(audio)
    return {"input_ids": np.full((batch, seq), token, dtype=np.int64)}


def bypassed_blocks(vision: bool, audio: bool) -> tuple[int, ...]:
    """The blocks a request with these groups on does not run (for the hand-pruned oracle)."""
    on = {"vision": vision, "audio": audio}
    return tuple(sorted(i for name, (blocks, _) in ROUTED_GROUPS.items() if not on[name] for i in blocks))
