"""The exporters' attention mask folded into ``ai.layerzero::Attention`` (``mask_form="padding_causal"``; run by
``NativeAttention``, passes/native_attention.py).

The dynamo exports build each step's ``[B, 1, T, past + T]`` additive mask from ``attention_mask`` in ~20 small
nodes (aranges, the causal comparison, the padding gather, ``Where(visible, 0, float32 min)``). When every
Attention node reads one such mask, the op can read ``attention_mask`` and build it itself. The mask's subgraph is
not matched node by node (its form changes with transformers' versions): it is accepted when it reads only
``attention_mask`` (values) and ``input_ids`` / the pasts (shapes), holds only small constants (no window length),
and equals the formula exactly on every probe of ``_MASK_PROBES``, run on ONNX Runtime alone. A sliding window, a
position-based mask or anything else differs on a probe (or holds a constant no probe covers) and is left as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.contract import ATTENTION_OP, MOE_DOMAIN
from layerzero.ort_runner import create_session
from layerzero.passes._graph import const_array
from layerzero.passes.dead_code import RemoveDeadCode

__all__ = ["fold_mask"]

_FLOAT = ir.DataType.FLOAT

_HIDDEN_KEY = np.float32(np.finfo(np.float32).min)
# (batch, new tokens, past tokens, the left padding of each row after the first) of the mask probes.
_MASK_PROBES = ((1, 1, 0, 0), (1, 4, 0, 0), (2, 1, 6, 2), (2, 3, 9, 4), (3, 5, 19, 7), (1, 1, 30, 0))


def _mask_subgraph(graph: ir.Graph, mask: ir.Value) -> tuple[list[ir.Node], set[str], dict[str, np.ndarray]] | None:
    """The nodes computing ``mask``, the graph inputs and the constants (by name) they read, when those are only
    ``attention_mask`` (values) and ``input_ids`` / the pasts (their shapes) and every constant is a small one (an
    index, an axis, 0, the float32 minimum: no window length); else None."""
    nodes: list[ir.Node] = []
    inputs: set[str] = set()
    consts: dict[str, np.ndarray] = {}
    seen: set[int] = set()
    stack = [mask]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        array = const_array(value)
        if array is not None:
            small = array.size <= 4 and (array.dtype.kind != "f" or all(v in (0.0, _HIDDEN_KEY) for v in array.flat))
            if not small or (array.dtype.kind in "iu" and np.abs(array).max(initial=0) > 8):
                return None
            consts[value.name or ""] = array
            continue
        node = value.producer()
        if node is None:
            if value.name not in ("attention_mask", "input_ids") and not (value.name or "").startswith(
                "past_key_values."
            ):
                return None
            inputs.add(value.name)
            continue
        if (
            node.graph is not graph
            or node.domain not in ("", "ai.onnx")
            or any(a.type == ir.AttributeType.GRAPH for a in node.attributes.values())
        ):
            return None  # fmt: skip
        for i in node.inputs:
            if i is None:
                continue
            shaped = i.name == "input_ids" or (i.name or "").startswith("past_key_values.")
            if shaped and i.producer() is None and node.op_type != "Shape":
                return None  # a past's or the ids' values read: not a mask of the positions alone
            stack.append(i)
        nodes.append(node)
    return nodes, inputs, consts


def fold_mask(model: ir.Model) -> bool:
    """``mask_form="padding_causal"`` (attention.h): the Attention nodes read ``attention_mask`` itself when the mask
    they share is, on every probe (batch, new and past tokens, left padding, a padded key amid the others), exactly
    the exporters' ``Where(attention_mask[b, l] != 0 and l <= past + t, 0, float32 min)`` ``[B, 1, T, past + T]``;
    its nodes (~20 a step) then go. The probes run that subgraph alone on ONNX Runtime; a window, a position-based
    or otherwise different mask differs on one of them (or has a constant no probe length covers: refused before)."""
    graph = model.graph
    nodes = [n for n in graph if n.op_type == ATTENTION_OP and n.domain == MOE_DOMAIN]
    masks = {id(n.inputs[3]): n.inputs[3] for n in nodes if len(n.inputs) > 3 and n.inputs[3] is not None}
    attention_mask = next((v for v in graph.inputs if v.name == "attention_mask"), None)
    if len(masks) != 1 or len(nodes) != sum(1 for n in nodes if len(n.inputs) > 3 and n.inputs[3] is not None):
        return False
    (mask,) = masks.values()
    if attention_mask is None or attention_mask.dtype != ir.DataType.INT64 or mask.dtype != _FLOAT:
        return False
    if mask.is_graph_output() or any(u.node not in nodes for u in mask.uses()):
        return False
    found = _mask_subgraph(graph, mask)
    if found is None or "attention_mask" not in found[1]:
        return False
    sub_nodes, read, consts = found
    order = {id(n): i for i, n in enumerate(graph)}
    sub_nodes.sort(key=lambda n: order[id(n)])
    specs = {v.name: v for v in graph.inputs if v.name in read}
    import onnx

    # The probe model from the subgraph alone (its nodes, the inputs it reads, its constants as initializers): the
    # whole model is never serialised (a real-size one's weights would be copied for ~20 small nodes).
    sub = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in sub_nodes],
        "mask_probe",
        [ir.serde.serialize_value(v) for v in specs.values()],
        [onnx.helper.make_tensor_value_info(mask.name, onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.asarray(a), name) for name, a in consts.items()],
    )
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items() if d in ("", "ai.onnx")]
    try:
        probe = onnx.helper.make_model(sub, opset_imports=opsets, ir_version=model.ir_version)
        session = create_session(probe.SerializeToString(), libraries=(), log_severity_level=4, label="mask probe")
        rng = np.random.default_rng(0)
        for batch, new, past, pad in _MASK_PROBES:
            total = past + new
            am = np.ones((batch, total), np.int64)
            for b in range(1, batch):
                am[b, :pad] = 0
                if total > pad + 2:
                    am[b, pad + int(rng.integers(0, total - pad - 1))] = 0  # a padded key amid the others
            feeds = {"attention_mask": am}
            for name, v in specs.items():
                if name == "input_ids":
                    feeds[name] = np.zeros((batch, new), np.int64)
                elif name.startswith("past_key_values."):
                    dims = [batch, v.shape[1], past, v.shape[3]]
                    if not all(isinstance(d, int) for d in dims):
                        return False
                    feeds[name] = np.zeros(dims, v.dtype.numpy())
            (got,) = session.run(None, feeds)
            visible = (am[:, None, None, :] != 0) & (np.arange(total)[None, None, None, :]
                                                     <= (past + np.arange(new))[None, None, :, None])  # fmt: skip
            want = np.where(visible, np.float32(0), _HIDDEN_KEY).astype(np.float32)
            if got.shape != want.shape or not np.array_equal(got, want):
                return False
    except Exception:  # the subgraph does not run alone: left as it is
        return False
    for node in nodes:
        node.replace_input_with(3, attention_mask)
        node.attributes["mask_form"] = ir.AttrString("mask_form", "padding_causal")
    RemoveDeadCode()(model)
    return True
