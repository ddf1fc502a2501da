"""``SparsifyActivations``: calibrated activation sparsity of a dense decoder's projections (issue 23).

Cases (a MatMul ``y = x @ W`` is a *projection* when ``W`` is a constant 2-D float weight and the node lies inside
a layer scope, ``model.layers.<i>...``; ``lm_head`` and embeddings are outside every layer, so never):

- **Groups**: the projections that read the same value share one mask (q/k/v read the attention's normed input,
  gate/up the MLP's, o and down their own). A group's name, the key of ``thresholds``, is the module scope above its
  projections plus their leaf names without ``_proj`` (single letters run together): ``model.layers.3.self_attn.qkv``,
  ``model.layers.3.self_attn.o``, ``model.layers.3.mlp.gate_up``, ``model.layers.3.mlp.down`` (``find_groups``).
- **Experts** (issue 23, composes with MoE): a float ``ai.layerzero::MoE`` block inside a layer is one group,
  ``<its scope>.gate_up`` (``model.layers.3.mlp.experts.gate_up``), thresholding its hidden input for every
  expert's gate and up (the router's logits are computed from the unthresholded x: routing unchanged; down reads
  its own h, not thresholded). Its weights are the
  gate and up of its first top_k experts, ``[H, F]`` each: the parameters one token reads through x, so the
  parameter-weighted sparsity counts the routed bytes and the calibration error is those experts' (an estimate of
  the routed ones'). The router's MatMul (``_routers``: what reaches the MoE's router_logits) is never a group.
  The pass writes the reference form for it; the native lowering's ``fuse_moe_activation_mask`` (passes/
  lower_moe_native.py) takes the Where into the kernel (gate / up stored input-major, the thresholds at inputs
  13-14, the kept count as output 2) when the experts stay float.
- **Thresholds**: one per input channel (``[K]``, or a scalar: the uniform case), all >= 0. An entry is kept when
  ``NOT (|x| <= threshold * scale)``, so NaN is kept and propagates, and threshold 0 keeps every nonzero entry (the
  dense result). ``scale`` is the run-time multiplier ``layerzero::activation_scale`` (a graph input, default 1;
  0 = dense): its own input rather than ``layerzero::threshold``, whose compiled default is 0 (exact) and whose
  unit is a router weight (one shared input would either turn MoE skipping on or start the activations dense). The
  guard's back-off (``runtime/guard.py``) divides this scale by its factor at each back-off, as it divides
  ``layerzero::threshold`` (0 below the floor: the dense model). The semantics apply to every token, prefill
  included (as TEAL evaluates).
- **Reference form** (``native=False``, plain ONNX Runtime): ``xm = Where(Not(LessOrEqual(Abs(x), t * scale)), x,
  0)`` once per group, the group's MatMuls then read ``xm``.
- **Native form** (``native=True``): each group becomes one ``ai.layerzero::SparseLinear(x, W, t, scale)``
  (``weight_format "f"``: row i = input channel i) from ``liblayerzero_ort.so``; a float16 / bfloat16 ``x`` is cast
  to float32 for it and its output back (the kernel computes in float32; the weights keep their type). A group of
  several projections (q/k/v, gate/up) is fused (``fuse_projections``): W = their weights side by side
  (``<group>.weight``, ``[K, N_1 + ... + N_p]``), ``path`` = the group's name, ``projections`` = their scopes in
  column order, and a ``Split`` gives each its columns: x is thresholded and quantized once, one parallel section
  runs the group and each kept row is one longer run of codes; bitwise the separate nodes (a column's arithmetic
  does not depend on its neighbours). Not fused (one node per projection, ``path`` its scope): weights of different
  dtypes, or an N off the quantized kernels' block of 32.
- **Mask**: per group, the graph output ``layerzero::mask::<group>`` holds the number of kept channels of each
  token row (``[...]`` int64; nonzero = the group ran for that token); the realized sparsity of a row is
  ``1 - kept / channels`` (``DynamicPath.detail["channels"]``). Each group is recorded as a ``DynamicPath`` of kind
  ``"activation"`` whose one subpath's parameters are the group's weights.
- **No rewrite**: a group that ``thresholds`` does not name, or whose thresholds are all zero (the dense model
  exactly), or that is recorded as sparsified already (a second run); in the native form a group whose input is
  not a float type is refused (``Refusal``, kind ``"activation"``, in ``REFUSED_META_KEY``).

Bad thresholds (a name no group has, a shape other than ``[]`` / ``[K]``, a negative or non-finite value) are an
``InvalidInputError`` naming the group.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from layerzero.contract import (
    ACTIVATION_SCALE_INPUT,
    MASK_PREFIX,
    MOE_DOMAIN,
    REFUSED_META_KEY,
    SPARSE_LINEAR_OP,
    DynamicPath,
)
from layerzero.errors import InvalidInputError
from layerzero.passes._builder import Builder, claim_name
from layerzero.passes._dynamic import read_dynamic_paths, record_dynamic_path
from layerzero.passes._graph import (
    NameFactory,
    const_array,
    drop_if_unused,
    insert_after_producer,
    layer_of,
    replace_value,
    scope_of,
)
from layerzero.passes._match import NoMatch, Refusal, need
from layerzero.passes._moe.lazy import stack_of
from layerzero.passes._moe_node import MoENode, is_moe_node

__all__ = [
    "SPARSE_LINEAR_OP",
    "ActivationGroup",
    "SparsifyActivations",
    "find_groups",
    "fuse_projections",
    "quantized_moe_nodes",
]

KIND = "activation"
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclasses.dataclass
class ActivationGroup:
    """The projections of one layer that read one value ``x``; ``weights[j]`` is ``projections[j]``'s ``[K, N_j]``."""

    name: str
    x: ir.Value
    projections: list[ir.Node]
    weights: list[np.ndarray]

    @property
    def channels(self) -> int:
        return int(self.weights[0].shape[0])

    @property
    def params(self) -> int:
        return int(sum(w.size for w in self.weights))

    @property
    def scopes(self) -> list[str]:
        return [scope_of(n) for n in self.projections]

    @property
    def experts(self) -> bool:
        """A MoE block's experts (the group's one node is its ``ai.layerzero::MoE``)."""
        return len(self.projections) == 1 and is_moe_node(self.projections[0])


def _projection_weight(node: ir.Node) -> np.ndarray | None:
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    if w is None or w.dtype not in _FLOATS:
        return None
    array = const_array(w)
    # An empty weight (a module of size 0: DeepSeek-V3 with n_shared_experts=0) has no row to skip.
    return array if array is not None and array.ndim == 2 and array.size else None


def _leaf(scope: str) -> str:
    leaf = scope.rsplit(".", 1)[-1]
    return leaf[: -len("_proj")] if leaf.endswith("_proj") and len(leaf) > len("_proj") else leaf


def _group_name(scopes: list[str]) -> str:
    parents = {s.rsplit(".", 1)[0] if "." in s else s for s in scopes}
    parent = parents.pop() if len(parents) == 1 else layer_of(scopes[0]) or scopes[0]
    leaves = list(dict.fromkeys(_leaf(s) for s in scopes))
    joined = "".join(leaves) if all(len(v) == 1 for v in leaves) else "_".join(leaves)
    return f"{parent}.{joined}"


#: Ops between a router's MatMul and the MoE's router_logits input that ``_routers`` looks through.
_ROUTER_PATH = {"Reshape", "Cast", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Add"}


def _is_ort_moe(node: ir.Node) -> bool:
    """ONNX Runtime's ``com.microsoft::MoE`` / ``QMoE`` (a block the skipping rewrite left: its router_probs is
    input 1 as the skipping form's router_logits)."""
    return node.domain == "com.microsoft" and node.op_type in ("MoE", "QMoE")


def quantized_moe_nodes(model: ir.Model) -> list[ir.Node]:
    """The MoE blocks of ``model``'s layers whose experts are quantized (an ``ai.layerzero::MoE`` with quantized
    experts, a ``QMoE`` left as it is): no projection group, since the sparse kernels' input-major layout is float
    (the compile's refusal names them when they are all a model has)."""
    return [
        n
        for n in model.graph
        if layer_of(scope_of(n) or n.name or "") is not None
        and ((is_moe_node(n) and MoENode.of(n).quantized) or (_is_ort_moe(n) and n.op_type == "QMoE"))
    ]


def _routers(model: ir.Model) -> set[ir.Node]:
    """The MatMuls whose product reaches a MoE node's router_logits (``ai.layerzero::MoE``, or ONNX Runtime's MoE /
    QMoE router_probs, through reshapes, casts and a bias add): the routers, never a projection group (their input
    thresholded would change the routing)."""
    out: set[ir.Node] = set()
    for node in model.graph:
        if not (is_moe_node(node) or _is_ort_moe(node)) or len(node.inputs) < 2:
            continue
        value, hops = node.inputs[1], 0
        while value is not None and value.producer() is not None and hops < 8:
            producer = value.producer()
            if producer.op_type in ("MatMul", "Gemm"):
                out.add(producer)
                break
            if producer.op_type not in _ROUTER_PATH:
                break
            value, hops = producer.inputs[0], hops + 1
    return out


def _expert_group_weights(node: ir.Node) -> list[np.ndarray] | None:
    """A float ``ai.layerzero::MoE``'s experts as a group's weights: the gate and up matrices of its first top_k
    experts, each ``[H, F]`` (row i = input channel i), so the group's parameters are the expert weights one token
    reads through x (the routed experts' gate and up) and its calibration error theirs; None when the node has no
    constant float experts in its graph form (quantized, or weights fed at run time)."""
    view = MoENode.of(node)
    if view.quantized or node.attributes.get("gate_up_layout") is not None:
        return None
    arrays = []
    for value in (view.w_gate, view.w_up):
        if value is None or value.dtype not in _FLOATS or value.const_value is None or value.is_graph_input():
            return None
        if len(value.const_value.shape) != 3:
            return None
        arrays.append(value)
    k = max(1, min(view.top_k, int(arrays[0].const_value.shape[0])))
    out = []
    for value in arrays:
        stack = stack_of(value)
        for e in range(k):
            w = stack.expert(e) if stack is not None else value.const_value.numpy()[e]
            out.append(np.asarray(w, np.float32).T)
    return out


def find_groups(model: ir.Model) -> list[ActivationGroup]:
    """The projection groups of ``model``'s main graph, in graph order (names as the module docstring says)."""
    by_x: dict[ir.Value, list[tuple[ir.Node, np.ndarray]]] = {}
    routers = _routers(model)
    experts: list[ActivationGroup] = []
    for node in model.graph:
        if is_moe_node(node) and layer_of(scope_of(node)) is not None:
            weights = _expert_group_weights(node)
            x = node.inputs[0]
            if weights is not None and x is not None and x.dtype in _FLOATS:
                scope = scope_of(node) or node.name or "moe"
                experts.append(ActivationGroup(f"{scope}.gate_up", x, [node], weights))
            continue
        if node in routers:
            continue
        weight = _projection_weight(node)
        x = node.inputs[0] if weight is not None else None
        if x is None or x.dtype not in _FLOATS or layer_of(scope_of(node)) is None:
            continue
        if x.shape is not None and len(x.shape) and isinstance(x.shape[-1], int) and x.shape[-1] != weight.shape[0]:
            continue
        by_x.setdefault(x, []).append((node, weight))
    groups: list[ActivationGroup] = []
    taken: set[str] = set()
    for x, members in by_x.items():
        name = _group_name([scope_of(n) for n, _ in members])
        base, i = name, 1
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        taken.add(name)
        groups.append(ActivationGroup(name, x, [n for n, _ in members], [w for _, w in members]))
    for g in experts:  # after the projections: a name taken by a projection group gets a suffix
        base, i = g.name, 1
        while g.name in taken:
            i += 1
            g.name = f"{base}_{i}"
        taken.add(g.name)
        groups.append(g)
    order = {node: i for i, node in enumerate(model.graph)}
    return sorted(groups, key=lambda g: order.get(g.projections[0], 0))


def _checked(name: str, value: object, channels: int) -> np.ndarray:
    t = np.asarray(value, dtype=np.float32)
    if t.shape not in ((), (channels,)):
        raise InvalidInputError(
            f"activation thresholds of {name!r}: shape {list(t.shape)}, expected [] or [{channels}] (one per input "
            "channel)"
        )
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise InvalidInputError(f"activation thresholds of {name!r}: every value must be finite and >= 0")
    return np.broadcast_to(t, (channels,)).astype(np.float32)


def activation_scale_input(model: ir.Model) -> ir.Value:
    """``layerzero::activation_scale``: a float32 scalar graph input initialised to 1, shared by every group."""
    graph = model.graph
    for value in graph.inputs:
        if value.name == ACTIVATION_SCALE_INPUT:
            return value
    claim_name(graph, ACTIVATION_SCALE_INPUT)
    value = ir.Value(
        name=ACTIVATION_SCALE_INPUT,
        type=ir.TensorType(ir.DataType.FLOAT),
        shape=ir.Shape([]),
        const_value=ir.tensor(np.array(1.0, np.float32), name=ACTIVATION_SCALE_INPUT),
    )
    graph.inputs.append(value)
    graph.register_initializer(value)
    return value


def group_refusal(group: ActivationGroup, native: bool) -> Refusal | None:
    """Why the pass leaves ``group`` as it is (its input's rank unknown; in the native form, an input not float32),
    or None. The compile's calibration leaves such a group out (``compiler/pipeline.py``), as the pass does."""
    try:
        need(group.x.shape is not None and len(group.x.shape) >= 1, "its input's rank is unknown", *group.projections)
        if native and not group.experts:
            need(group.x.dtype in _FLOATS, "SparseLinear takes a float input", *group.projections)
    except NoMatch as failure:
        return Refusal.of(group.name, failure, KIND)
    return None


def record_refusals(model: ir.Model, refused: list[Refusal]) -> None:
    """Add ``refused`` to the model's ``REFUSED_META_KEY`` record (what the report lists as not rewritten)."""
    if refused:
        old = json.loads(model.metadata_props.get(REFUSED_META_KEY) or "[]")
        model.metadata_props[REFUSED_META_KEY] = json.dumps(old + [r.to_json() for r in refused])


class SparsifyActivations(ir.passes.InPlacePass):
    """Threshold each projection group's input per channel (module docstring); ``native``: the SparseLinear form."""

    def __init__(self, thresholds: Mapping[str, np.ndarray], native: bool) -> None:
        super().__init__()
        self.thresholds = dict(thresholds)
        self.native = bool(native)
        self.refused: list[Refusal] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.refused = []
        groups = {g.name: g for g in find_groups(model)}
        unknown = sorted(set(self.thresholds) - set(groups))
        if unknown:
            known = ", ".join(list(groups)[:4]) + (", ..." if len(groups) > 4 else "")
            raise InvalidInputError(
                f"activation thresholds name {unknown[0]!r}, which is no projection group of the model "
                f"({len(groups)} groups: {known or 'none'})"
            )
        checked = {n: _checked(n, t, groups[n].channels) for n, t in self.thresholds.items()}
        done = {p.path for p in read_dynamic_paths(model) if p.kind == KIND}  # a second run changes nothing
        todo = [(groups[n], t) for n, t in checked.items() if np.any(t > 0) and n not in done]
        if not todo:
            return ir.passes.PassResult(model, modified=False)
        names = NameFactory(model.graph)
        scale: ir.Value | None = None
        modified = False
        for group, t in todo:
            # The group's x as its first projection reads it now: an earlier group's native rewrite replaces the
            # value its projection produced (x here when a projection feeds the next layer's directly).
            group.x = group.projections[0].inputs[0]
            refusal = group_refusal(group, self.native)
            if refusal is not None:
                self.refused.append(refusal)
                continue
            if scale is None:
                scale = activation_scale_input(model)
            kept = self._rewrite(model, names, group, t, scale)
            mask = ir.tape.Tape().op("Identity", [kept], name=names(f"/{group.name}/mask"))
            ident = mask.producer()
            mask.name = names(MASK_PREFIX + group.name)
            mask.dtype, mask.shape = ir.DataType.INT64, ir.Shape(list(group.x.shape)[:-1])
            kept.dtype, kept.shape = mask.dtype, mask.shape
            model.graph.insert_after(kept.producer(), [ident])
            model.graph.outputs.append(mask)
            record_dynamic_path(
                model,
                DynamicPath(
                    path=group.name,
                    kind=KIND,
                    subpaths=(group.name,),
                    params=(group.params,),
                    mask_output=mask.name,
                    detail={
                        "channels": group.channels,
                        "projections": group.scopes,
                        "form": "native" if self.native and not group.experts else "reference",
                        "x_dtype": str(np.dtype(group.x.dtype.numpy())),
                        "scale_input": ACTIVATION_SCALE_INPUT,
                    },
                ),
            )
            modified = True
        record_refusals(model, self.refused)
        return ir.passes.PassResult(model, modified=modified)

    def _rewrite(
        self, model: ir.Model, names: NameFactory, group: ActivationGroup, t: np.ndarray, scale: ir.Value
    ) -> ir.Value:
        """Rewrite one group; returns its per-row kept-channel count."""
        b = Builder.for_model(model, names, scope=group.name, scope_metadata=True)
        x = group.x
        dtype = x.dtype.numpy()
        native = self.native and not group.experts  # experts: the reference form (their lowering fuses it)
        thresholds = b.weight("activation_thresholds", t.astype(np.float32 if native else dtype))
        if native:
            return self._native(model, b, group, thresholds, scale)
        s = scale if x.dtype == ir.DataType.FLOAT else b.op1("Cast", [scale], to=x.dtype)
        drop = b.op1("LessOrEqual", [b.op1("Abs", [x]), b.op1("Mul", [thresholds, s])])
        keep = b.op1("Not", [drop])
        xm = b.op1("Where", [keep, x, b.const("zero", np.zeros((), dtype))])
        kept = b.reduce("ReduceSum", b.op1("Cast", [keep], to=ir.DataType.INT64), [-1], keepdims=0)
        insert_after_producer(model.graph, x, b.take())
        for node in group.projections:
            node.replace_input_with(0, xm)
        return kept

    def _native(
        self, model: ir.Model, b: Builder, group: ActivationGroup, thresholds: ir.Value, scale: ir.Value
    ) -> ir.Value:
        model.opset_imports.setdefault(MOE_DOMAIN, 1)
        inputs = [group.x, thresholds, scale]
        if _fusable(group):
            return fuse_projections(model, b, group.projections, group.weights, inputs, group.name)
        kept: ir.Value | None = None
        for node in group.projections:
            count = fuse_projections(model, b, [node], [], inputs, scope_of(node) or node.name or group.name)
            kept = count if kept is None else kept
        assert kept is not None
        return kept


def fuse_projections(
    model: ir.Model,
    b: Builder,
    nodes: list[ir.Node],
    weights: list[np.ndarray],
    inputs: list[ir.Value | None],
    path: str,
) -> ir.Value:
    """``nodes`` (MatMuls reading one x, ``weights[j]`` = node j's ``[K, N_j]``) as one ``SparseLinear(x, [W_1 ...
    W_p], *inputs[1:])`` (``inputs[0]`` = x; weight_format f, ``path``, ``projections`` their scopes) and a Split
    into their outputs; returns its kept count. One node: SparseLinear on its own weight (``weights`` unread), no
    ``projections``, no Split. x is thresholded and (q8 / q4) quantized once, one parallel section
    runs them all and each kept row is one longer run (q/k/v of a Llama-1B shape: 1.5 KB of q4 codes instead of
    1 KB + 2 x 256 B). A column's arithmetic does not depend on the columns beside it (plugins/ort/src/
    sparse_linear.h), so each output is bitwise the separate node's. The compile's form (``SparsifyActivations``)
    and the quantized-dense reference's (``as_dense_sparse_linear``, thresholds 0) are both made here."""
    x = inputs[0]
    # The kernel takes float32 x and writes float32 y: a float16 / bfloat16 model's x is cast in and y back out (the
    # weights keep their type: the kernel reads float16 / bfloat16 rows as they are).
    wide = x is not None and x.dtype not in (None, ir.DataType.FLOAT)
    xin = b.op1("Cast", [x], to=ir.DataType.FLOAT) if wide else x
    if wide:
        xin.dtype, xin.shape = ir.DataType.FLOAT, x.shape

    def narrow(y: ir.Value, like: ir.Value) -> ir.Value:
        y.dtype = ir.DataType.FLOAT
        if not wide:
            return y
        out = b.op1("Cast", [y], to=like.dtype)
        out.dtype, out.shape = like.dtype, y.shape
        return out

    if len(nodes) == 1:
        (node,) = nodes
        attrs = {"weight_format": "f", "block_size": 32, "path": path}
        op = b.node(SPARSE_LINEAR_OP, [xin, node.inputs[1], *inputs[1:]], attrs, domain=MOE_DOMAIN, outputs=2)
        y, kept = op.outputs
        y.shape = node.outputs[0].shape
        y = narrow(y, node.outputs[0])
        kept.dtype = ir.DataType.INT64
        model.graph.insert_before(node, b.take())
        replace_value(node.outputs[0], y, b.names)
        model.graph.remove(node, safe=True)
        return kept
    widths = [int(w.shape[1]) for w in weights]
    w = b.initializer(f"{path}.weight", np.concatenate([np.asarray(a) for a in weights], axis=1))
    w.dtype = nodes[0].inputs[1].dtype
    attrs = {
        "weight_format": "f",
        "block_size": 32,
        "path": path,
        "projections": ir.AttrStrings("projections", [scope_of(n) or n.name or path for n in nodes]),
    }
    op = b.node(SPARSE_LINEAR_OP, [xin, w, *inputs[1:]], attrs, domain=MOE_DOMAIN, outputs=2)
    y, kept = op.outputs
    if x is not None and x.shape is not None:
        y.shape = ir.Shape([*list(x.shape)[:-1], sum(widths)])
    y = narrow(y, nodes[0].outputs[0])
    kept.dtype = ir.DataType.INT64
    parts = b.split(y, widths, axis=-1)
    for node, part in zip(nodes, parts):
        part.dtype, part.shape = node.outputs[0].dtype, node.outputs[0].shape
    model.graph.insert_before(nodes[0], b.take())
    olds = [node.inputs[1] for node in nodes]
    for node, part in zip(nodes, parts):
        replace_value(node.outputs[0], part, b.names)
        model.graph.remove(node, safe=True)
    for old in olds:
        drop_if_unused(old)
    return kept


def _fusable(group: ActivationGroup) -> bool:
    """Whether the native form runs ``group``'s projections as one SparseLinear (``fuse_projections``): more than one,
    their weights of one dtype and each N a multiple of the quantized kernels' block (32), so that ``--weights``
    quantizes the fused weight exactly where it would quantize each alone (a projection left float would not be)."""
    if group.experts or len(group.projections) < 2:
        return False
    dtypes = {node.inputs[1].dtype for node in group.projections}
    return len(dtypes) == 1 and all(w.shape[1] % 32 == 0 for w in group.weights)
