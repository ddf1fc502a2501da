"""``FuseExpertActivationMask``: a MoE block's activation mask taken into the native kernel (issue 23).

``SparsifyActivations`` writes the reference form for a MoE block's experts (``<scope>.gate_up``: the block's
hidden input thresholded per channel before the ``ai.layerzero::MoE`` node, the router reading it unthresholded).
That is exact on every lowering but reads every expert row. On liblayerzero_ort.so's native kernel the mask can
skip rows instead, once gate and up are stored input-major. This pass, run after the lowering and the weight
quantization (``compiler/pipeline.fuse_expert_masks``: only experts that stayed float), rewrites

    # MoE(Where(Not(LessOrEqual(Abs(x), t * s)), x, 0), logits, w_gate, w_up, w_down, ..., threshold)
    #   -> MoE(x, logits, w_gate^T, w_up^T, w_down, ..., threshold, "", "", "", t, s; gate_up_layout="input_major")

(``passes/_moe_node.py``: w_gate, w_up ``[E, H, F]``, the thresholds at 13-14) with the kernel's third output,
``kept`` (each token's kept channels), in place of the reference form's ``ReduceSum`` count (the group's
``layerzero::mask::`` output reads it). The same semantics: ``|x_i| <= t_i * s`` drops channel i of every expert's
gate and up (NaN kept), ``s`` the run-time ``layerzero::activation_scale``. A lazily read expert stack
(``passes/_moe/lazy.py``) is transposed lazily, one expert at a time. The group's dynamic path records
``form: "native"``.

Left as it is (the reference form runs, exact): a MoE node that is not the native float form (quantized experts,
another lowering), a mask that is not exactly that chain, or one whose thresholded value another node reads too.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from layerzero.contract import ACTIVATION_SCALE_INPUT
from layerzero.passes._builder import Builder
from layerzero.passes._dynamic import MOE_DOMAIN, read_dynamic_paths, record_dynamic_path
from layerzero.passes._graph import NameFactory, const_array
from layerzero.passes._moe.lazy import ExpertTensor, stack_of
from layerzero.passes._moe_node import MoENode, is_moe_node
from layerzero.passes.dead_code import RemoveDeadCode

__all__ = ["FuseExpertActivationMask"]

_WEIGHTS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclasses.dataclass
class _Mask:
    x: ir.Value
    thresholds: np.ndarray
    scale: ir.Value
    count: ir.Value | None  # the reference form's per-row kept count (ReduceSum), when there is one


def _one(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = None if value is None else value.producer()
    return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _mask_of(value: ir.Value) -> _Mask | None:
    """The reference form's chain behind ``value`` (module docstring), None when it is not exactly that."""
    where = _one(value, "Where")
    if where is None or len(where.inputs) != 3:
        return None
    keep, x, zero = where.inputs
    z = const_array(zero) if zero is not None else None
    if z is None or z.size != 1 or float(np.asarray(z, np.float64).reshape(())) != 0.0 or x is None:
        return None
    drop = _one(keep, "Not")
    le = _one(drop.inputs[0] if drop is not None else None, "LessOrEqual")
    if le is None:
        return None
    ab, prod = _one(le.inputs[0], "Abs"), _one(le.inputs[1], "Mul")
    if ab is None or ab.inputs[0] is not x or prod is None:
        return None
    t = const_array(prod.inputs[0])
    scale = prod.inputs[1]
    if t is None or scale is None or scale.name != ACTIVATION_SCALE_INPUT or scale.dtype != ir.DataType.FLOAT:
        return None
    count = None
    for user, _ in keep.uses():  # Cast(keep) -> ReduceSum(.., [-1]): the kept count
        if user.op_type == "Cast":
            for reducer, _ in user.outputs[0].uses():
                if reducer.op_type == "ReduceSum":
                    count = reducer.outputs[0]
    return _Mask(x, np.asarray(t, np.float32), scale, count)


def _input_major(model: ir.Model, names: NameFactory, value: ir.Value) -> ir.Value:
    """An initializer holding ``value``'s experts transposed (``[E, F, H]`` -> ``[E, H, F]``), lazily for a stack."""
    name = names(f"{value.name}.input_major")
    stack = stack_of(value)
    if stack is not None:
        tensor: ir.TensorProtocol = ExpertTensor(stack.transposed(), name=name)
    else:
        array = np.asarray(value.const_value.numpy())
        tensor = ir.tensor(np.ascontiguousarray(array.transpose(0, 2, 1)), name=name)
    new = ir.Value(name=name, type=ir.TensorType(value.dtype), shape=ir.Shape(list(tensor.shape)), const_value=tensor)
    model.graph.register_initializer(new)
    return new


class FuseExpertActivationMask(ir.passes.InPlacePass):
    """The reference-form mask of a native float MoE block into its kernel (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused = []
        names = NameFactory(model.graph)
        for node in list(model.graph):
            if is_moe_node(node):
                self._fuse(model, names, node)
        if not self.fused:
            return ir.passes.PassResult(model, modified=False)
        RemoveDeadCode()(model)
        fused = set(self.fused)
        for path in read_dynamic_paths(model):
            if path.kind == "activation" and path.mask_output in fused:
                record_dynamic_path(model, dataclasses.replace(path, detail={**path.detail, "form": "native"}))
        return ir.passes.PassResult(model, modified=True)

    def _fuse(self, model: ir.Model, names: NameFactory, node: ir.Node) -> None:
        view = MoENode.of(node)
        if view.quantized or view.gate_up_layout != "output_major" or view.threshold is None:
            return  # not the native float form
        hidden = view.hidden
        mask = _mask_of(hidden)
        if mask is None or mask.x.dtype != ir.DataType.FLOAT or len(hidden.uses()) != 1:
            return
        channels = mask.x.shape[-1] if mask.x.shape is not None and len(mask.x.shape) else None
        gate, up = view.w_gate, view.w_up
        if any(v.const_value is None or v.dtype not in _WEIGHTS or v.is_graph_input() for v in (gate, up)):
            return
        H = int(gate.const_value.shape[2])
        if channels != H or mask.thresholds.size not in (1, H):
            return
        t = np.broadcast_to(mask.thresholds.reshape(-1), (H,)).astype(np.float32)
        t_value = ir.Value(name=names(f"{view.path or node.name}.x_thresholds"), const_value=ir.tensor(t),
                           type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([H]))  # fmt: skip
        model.graph.register_initializer(t_value)
        view.hidden = mask.x
        view.w_gate, view.w_up = _input_major(model, names, gate), _input_major(model, names, up)
        view.x_thresholds, view.activation_scale = t_value, mask.scale
        view.gate_up_layout = "input_major"
        b = Builder.for_model(model, names)
        fused = b.node(node.op_type, view.inputs, {a.name: a for a in view.attributes()}, domain=MOE_DOMAIN,
                       outputs=3)  # fmt: skip
        fused.name = node.name  # (the old node goes: its name, scope and metadata pass to the fused one)
        fused.metadata_props.update(node.metadata_props)
        model.graph.insert_before(node, b.take())
        for old, new in zip(node.outputs, fused.outputs, strict=False):
            name = old.name
            new.dtype, new.shape, new.type = old.dtype, old.shape, old.type
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            old.name = None
            new.name = name
        kept = fused.outputs[2]
        kept.dtype = ir.DataType.INT64
        kept.shape = ir.Shape(list(mask.x.shape)[:-1]) if mask.x.shape is not None else None
        kept.name = names(f"{view.path or node.name}/kept")
        if mask.count is not None:
            for user, _ in list(mask.count.uses()):
                if user.op_type == "Identity" and user.outputs[0] in model.graph.outputs:
                    self.fused.append(user.outputs[0].name)
            mask.count.replace_all_uses_with(kept)
        model.graph.remove(node, safe=True)
