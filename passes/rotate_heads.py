"""``RotateHeads``: an exact rotation of each attention head's output that puts o_proj's input energy into few
channels, so that activation sparsity drops more of them at less error (issue 23).

For a layer whose attention has an output projection (``o_proj``: MatMul with a constant 2-D float weight ``W_o``
``[h·d, N]``) and a value projection (``v_proj``) whose output is reshaped into heads of dim ``d`` (read off the
graph: ``[..., kv_heads, d]`` after it, through an optional constant bias), with ``h = K_o / d`` query heads:
o_proj's input ``x`` becomes ``x'``, each head's ``d`` channels times an orthogonal ``R_i`` (``Reshape`` to
``[N, h, 1, d]``, ``MatMul`` with ``R`` ``[h, d, d]``, ``Reshape`` back to ``Shape(x)``: ``h·d²`` multiply-adds a
token, ``1 / (N / d)`` of o_proj's own), and ``W_o``'s rows of head ``i`` become ``R_iᵀ W_o[i]``: the same product up to
rounding. The value projection and the KV cache are untouched (folding ``R`` into ``v_proj`` would cost nothing at
run time, but it would rotate ``present.*.value``: a cache fed from outside the model would no longer match).

``head_rotations`` picks ``R_i``: the eigenvectors, largest eigenvalue first, of ``X_iᵀ X_i``, ``X_i`` = head
``i``'s channels of o_proj's input on calibration tokens (PCA of each head's output: most of its energy lands in the
first channels, the rest carry little and are what the thresholds drop). Measured on SmolLM2-135M-Instruct's real
weights (bench/README.md, ``sparsity.py --rotation heads``): at ~40 % realized model-wide sparsity the next-token KL
from the dense model falls by 12 % (0.211 -> 0.186) and top-1 agreement rises ~1 point; the perplexity change moves
within its noise between allocations (+12.8-14.1 % against +13.5 %).

The compile path (``activation_rotation.rotate_heads``) checks the result numerically: every projection input after
the rotation must equal the one before (o_proj's rotated by the same ``R``), else the rotation is undone and
recorded as refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import NameFactory, const_array, layer_of, make_constant, scope_of
from layerzero.passes._match import Refusal

__all__ = ["HeadPair", "RotateHeads", "find_head_pairs", "head_rotations", "read_rotations", "rotated_inputs"]

#: The name of a rotated layer's ``R`` initializer: ``<layer>`` + this.
ROTATION_SUFFIX = ".o_proj.rotation.weight"

_FLOAT = ir.DataType.FLOAT


@dataclasses.dataclass
class HeadPair:
    """One attention's value and output projections and its head layout; ``layer``: the attention's scope
    (``model.layers.3.self_attn``)."""

    layer: str
    v: ir.Node
    o: ir.Node
    kv_heads: int
    heads: int
    head_dim: int


def _weight(node: ir.Node) -> np.ndarray | None:
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    if w is None or w.dtype != _FLOAT or node.inputs[0] is None or node.inputs[0].dtype != _FLOAT:
        return None
    array = const_array(w)
    return array if array is not None and array.ndim == 2 and array.size else None


def _leaf(node: ir.Node) -> str:
    return scope_of(node).rsplit(".", 1)[-1]


def _value_layout(v: ir.Node) -> tuple[ir.Value | None, tuple[int, int]] | str:
    """(bias, (kv_heads, head_dim)) from the Reshape after v's output (through one constant bias Add), or why not."""
    out = v.outputs[0]
    uses = list(out.uses())
    bias = None
    if len(uses) == 1 and uses[0].node.op_type == "Add" and not out.is_graph_output():
        add = uses[0].node
        other = add.inputs[1 - uses[0].idx]
        array = const_array(other)
        if array is None or array.ndim != 1:
            return "the value projection's output is added to something other than a constant bias"
        bias, out = other, add.outputs[0]
        uses = list(out.uses())
    if len(uses) != 1 or uses[0].node.op_type != "Reshape" or out.is_graph_output():
        return "the value projection's output is not reshaped into heads alone"
    reshape = uses[0].node
    shape = reshape.outputs[0].shape
    if shape is not None and len(shape) == 4 and all(isinstance(d, int) for d in shape[2:]):
        return bias, (int(shape[2]), int(shape[3]))
    dim = _last_shape_entry(reshape.inputs[1] if len(reshape.inputs) > 1 else None)
    width = _weight(v).shape[1]  # type: ignore[union-attr]
    if dim is None or dim <= 0 or width % dim:
        return "the value heads' shape is unknown (no [batch, seq, kv_heads, head_dim] after the value projection)"
    return bias, (width // dim, dim)


def _last_shape_entry(shape: ir.Value | None) -> int | None:
    """The last entry of a Reshape's target shape when it is a constant: the whole shape constant, or the last
    input of the Concat that builds it (TorchScript: ``[batch, seq, -1, head_dim]`` from two Unsqueezes and two
    constants)."""
    array = const_array(shape)
    if array is None and shape is not None and shape.producer() is not None and shape.producer().op_type == "Concat":
        array = const_array(shape.producer().inputs[-1])
    if array is None or array.ndim != 1 or not array.size:
        return None
    return int(array[-1])


def find_head_pairs(model: ir.Model) -> tuple[list[HeadPair], list[Refusal]]:
    """The attentions ``RotateHeads`` can rotate (graph order), and those it leaves with the reason."""
    by_layer: dict[str, dict[str, list[ir.Node]]] = {}  # by the attention's scope (the projections' parent)
    for node in model.graph:
        scope = scope_of(node)
        leaf = _leaf(node)
        if layer_of(scope) is not None and leaf in ("v_proj", "o_proj") and _weight(node) is not None:
            by_layer.setdefault(scope.rsplit(".", 1)[0], {}).setdefault(leaf, []).append(node)
    pairs, refused = [], []
    for layer, found in by_layer.items():
        vs, os_ = found.get("v_proj", []), found.get("o_proj", [])
        if len(vs) != 1 or len(os_) != 1:
            refused.append(Refusal(layer, f"{len(vs)} value and {len(os_)} output projections, not one each", "",
                                   "rotation"))  # fmt: skip
            continue
        v, o = vs[0], os_[0]
        layout = _value_layout(v)
        if isinstance(layout, str):
            refused.append(Refusal(layer, layout, f"MatMul {v.name}", "rotation"))
            continue
        bias, (kv_heads, head_dim) = layout  # the bias: only checked to fit
        wv, wo = _weight(v), _weight(o)
        assert wv is not None and wo is not None
        heads = wo.shape[0] // head_dim if head_dim else 0
        if (
            wv.shape[1] != kv_heads * head_dim
            or not heads
            or wo.shape[0] != heads * head_dim
            or heads % kv_heads
            or (bias is not None and const_array(bias).shape != (wv.shape[1],))
        ):
            refused.append(
                Refusal(
                    layer,
                    f"the value ({list(wv.shape)}) and output ({list(wo.shape)}) weights do "
                    f"not fit {kv_heads} KV heads of {head_dim}",
                    f"MatMul {o.name}",
                    "rotation",
                )
            )
            continue
        pairs.append(HeadPair(layer, v, o, kv_heads, heads, head_dim))
    return pairs, refused


def head_rotations(pair: HeadPair, o_input: np.ndarray) -> np.ndarray:
    """``R`` ``[heads, head_dim, head_dim]`` of ``pair`` from o_proj's input samples ``[T, heads * head_dim]``."""
    x = np.asarray(o_input, np.float64).reshape(-1, pair.heads, pair.head_dim)
    cov = np.einsum("thi,thj->hij", x, x)
    return np.ascontiguousarray(np.linalg.eigh(cov)[1][:, :, ::-1])


def rotated_inputs(pair: HeadPair, o_input: np.ndarray, rotations: np.ndarray) -> np.ndarray:
    """What o_proj's input becomes under ``rotations`` (each head's channels times its ``R_i``)."""
    x = np.asarray(o_input, np.float64).reshape(-1, pair.heads, pair.head_dim)
    return np.einsum("thi,hij->thj", x, rotations).reshape(np.shape(o_input)).astype(np.float32)


def _set_weight(graph: ir.Graph, names: NameFactory, node: ir.Node, index: int, array: np.ndarray, hint: str) -> None:
    """A new float32 initializer for ``node``'s input ``index`` (the old one may have other readers; dropped if not)."""
    old = node.inputs[index]
    node.replace_input_with(index, make_constant(graph, names, hint, np.ascontiguousarray(array, np.float32)))
    if old is not None and not old.uses() and old.name in graph.initializers and not old.is_graph_input():
        graph.initializers.pop(old.name)


class RotateHeads(ir.passes.InPlacePass):
    """Rotate the output heads of ``find_head_pairs``' attentions by ``rotations`` (``{layer: R [heads, d, d]}``,
    from ``head_rotations``); ``rotated`` lists the layers done."""

    def __init__(self, rotations: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        self.rotations = dict(rotations)
        self.rotated: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        pairs, _ = find_head_pairs(model)
        graph = model.graph
        names = NameFactory(graph)
        for pair in pairs:
            r = self.rotations.get(pair.layer)
            if r is None:
                continue
            h, d = pair.heads, pair.head_dim
            r = np.asarray(r, np.float64)
            if r.shape != (h, d, d):
                raise ValueError(f"{pair.layer}: rotations of shape {r.shape}, not {(h, d, d)}")
            wo = np.asarray(_weight(pair.o), np.float64).reshape(h, d, -1)
            wo = np.einsum("hji,hjn->hin", r, wo).reshape(h * d, -1)  # R_iᵀ W_o[i]
            _set_weight(graph, names, pair.o, 1, wo, f"{pair.layer}.o_proj.rotated_weight")
            x = pair.o.inputs[0]
            assert x is not None
            prefix = f"{pair.layer}.o_proj.rotation"
            path = "/" + "/".join(pair.layer.split(".")) + "/head_rotation"
            # [..., h·d] -> [N, h, 1, d] (any leading dims), times R [h, d, d], back to x's own shape.
            split = make_constant(graph, names, f"{prefix}.heads_shape", np.array([-1, h, 1, d], np.int64))
            rot = make_constant(graph, names, pair.layer + ROTATION_SUFFIX, r.astype(np.float32))
            nodes = [ir.node("Shape", [x], name=f"{path}/Shape")]
            nodes.append(ir.node("Reshape", [x, split], name=f"{path}/Reshape"))
            nodes.append(ir.node("MatMul", [nodes[1].outputs[0], rot], name=f"{path}/MatMul"))
            nodes.append(ir.node("Reshape", [nodes[2].outputs[0], nodes[0].outputs[0]], name=f"{path}/Reshape_1"))
            for n, suffix in zip(nodes, ("shape", "heads", "rotated_heads", "rotated"), strict=True):
                n.outputs[0].name = f"{prefix}.{suffix}"
            nodes[3].outputs[0].dtype = _FLOAT
            nodes[3].outputs[0].shape = x.shape
            graph.insert_before(pair.o, nodes)
            pair.o.replace_input_with(0, nodes[3].outputs[0])
            self.rotated.append(pair.layer)
        return ir.passes.PassResult(model, modified=bool(self.rotated))


def read_rotations(model: ir.Model) -> dict[str, np.ndarray]:
    """The rotations a model compiled with ``RotateHeads`` holds (``{layer: R}``, from its ``R`` initializers): the
    quantized-dense reference of its verification folds the same ones."""
    out = {}
    for name, value in model.graph.initializers.items():
        if name.endswith(ROTATION_SUFFIX) and value.const_value is not None and value.uses():
            out[name[: -len(ROTATION_SUFFIX)]] = value.const_value.numpy().astype(np.float64)
    return out
