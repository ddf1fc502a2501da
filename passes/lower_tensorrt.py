"""Lower the target-independent skipping form of a MoE block to the TensorRT plugin node.

The skipping form (``ai.layerzero::MoE``, written by the dynamic MoE pass) is::

    y, mask = ai.layerzero::MoE(hidden [T, H], router_logits [T, E], w_gate [E, F, H], w_up [E, F, H],
                                w_down [E, H, F]; top_k, normalize, scoring, activation, zeroing_threshold, path)

TensorRT runs it as the plugin ``layerzero::LayerZeroMoE`` version ``1`` (``plugins/src/moe_plugin.cpp``). The
TensorRT ONNX parser imports a node whose op type it does not know through its fallback plugin importer: it
asks the plugin registry for the creator named ``op_type`` with version ``plugin_version`` and namespace
``plugin_namespace`` (node attributes), and hands the node's other attributes to the creator as plugin fields
(INT -> kINT32, FLOAT -> kFLOAT32, STRING -> kCHAR). The node's domain is not part of the lookup; we use
``trt.plugins``, the domain ONNX Runtime's TensorRT execution provider registers TensorRT plugins under, so the
lowered model also passes ``onnx.checker`` and loads in ORT with the TensorRT EP.

The plugin's mask output is int32 (IPluginV3 outputs may not be bool), so a ``Cast(to=BOOL)`` restores the
``[T, E]`` bool mask under its original name: graph outputs (``layerzero::mask::<path>``) keep their names.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import onnx_ir as ir

from layerzero.errors import UnsupportedModelError
from layerzero.passes._builder import Builder, model_opset
from layerzero.passes._dynamic import MOE_DOMAIN, MOE_OP
from layerzero.passes._graph import NameFactory, replace_value
from layerzero.passes._moe_node import MoENode

__all__ = [
    "MOE_DOMAIN",
    "MOE_OP",
    "PLUGIN_DOMAIN",
    "PLUGIN_FIELDS",
    "PLUGIN_NAME",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "LowerMoEToTensorRT",
]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "LayerZeroMoE"
PLUGIN_NAMESPACE = "layerzero"
PLUGIN_VERSION = "1"
PLUGIN_DOMAIN = "trt.plugins"
#: The plugin's fields, in the creator's order (MoEPluginCreator::getFieldNames).
PLUGIN_FIELDS = ("top_k", "normalize", "scoring", "activation", "zeroing_threshold")

_SCORINGS = ("softmax", "sigmoid")
_ACTIVATIONS = ("silu", "gelu", "relu")
_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_MAX_TOP_K = 32  # LZ_MAX_TOP_K of layerzero_kernels.h
# What an attribute the node leaves out means: MoENode's default, as for every other reader of the node (the
# reference, LowerMoE, the ORT custom op). The plugin's own defaults differ (normalize 1): every field is written.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MoENode) if f.name in (*PLUGIN_FIELDS, "routing")}


class LowerMoEToTensorRT(ir.passes.InPlacePass):
    """Replace every ``ai.layerzero::MoE`` node by ``trt.plugins::LayerZeroMoE`` (+ a bool Cast of its mask).

    Cases:
    1. The mask output is used (a graph output or read by a node): plugin node, then ``Cast(mask_i32, to=BOOL)``
       under the mask's name.
    2. The mask output is absent or unused: the plugin node alone (its int32 mask output dangles).
    3. router_logits or a weight has another float type than hidden: ``Cast`` it to hidden's type first (the
       plugin takes a single dtype for all five inputs).
    Nodes in subgraphs are lowered too. The ``path`` attribute is not a plugin field; it moves to the plugin
    node's metadata (``layerzero.path``).
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        build = Builder(model.graph, NameFactory(model.graph), model_opset(model))
        lowered = 0
        for node in list(model.graph.all_nodes()):  # a snapshot: _lower replaces the node
            if node.domain == MOE_DOMAIN and node.op_type == MOE_OP:
                _lower(node, build)
                lowered += 1
        if lowered:
            model.opset_imports[PLUGIN_DOMAIN] = 1
            if not any(n.domain == MOE_DOMAIN for n in model.graph.all_nodes()):
                model.opset_imports.pop(MOE_DOMAIN, None)
            logger.info("lowered %d MoE node(s) to %s::%s", lowered, PLUGIN_DOMAIN, PLUGIN_NAME)
        return ir.passes.PassResult(model, modified=bool(lowered))


def _describe(node: ir.Node) -> str:
    return f"MoE node {node.name or '(unnamed)'!r}"


def _plugin_fields(node: ir.Node) -> dict[str, int | float | str]:
    """The node's attributes as plugin field values, validated; raises UnsupportedModelError naming the node."""

    def get(name: str, default: object = None) -> object:
        attr = node.attributes.get(name)
        return _DEFAULTS.get(name, default) if attr is None else attr.value

    # v2 routing (moe_op_v2) is not in the plugin (plugins/src/moe_plugin.cpp routes top-k of the scores).
    if len(node.inputs) > 8 and node.inputs[8] is not None:
        raise UnsupportedModelError(f"{_describe(node)}: score_bias is not implemented by the TensorRT plugin")
    for name, default in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0), ("routing", "topk")):
        if get(name, default) != default:
            raise UnsupportedModelError(
                f"{_describe(node)}: {name} = {get(name, default)!r} is not implemented by the TensorRT plugin"
            )
    top_k = get("top_k")
    if not isinstance(top_k, int) or not 1 <= top_k <= _MAX_TOP_K:
        raise UnsupportedModelError(
            f"{_describe(node)}: top_k must be an int in [1, {_MAX_TOP_K}] for the TensorRT plugin, got {top_k!r}"
        )
    normalize = get("normalize")
    if normalize not in (0, 1):
        raise UnsupportedModelError(f"{_describe(node)}: normalize must be 0 or 1, got {normalize!r}")
    scoring = str(get("scoring")).lower()
    if scoring not in _SCORINGS:
        raise UnsupportedModelError(f"{_describe(node)}: scoring {scoring!r} is not one of {', '.join(_SCORINGS)}")
    activation = str(get("activation")).lower()
    if activation not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"{_describe(node)}: activation {activation!r} is not one of {', '.join(_ACTIVATIONS)}"
        )
    threshold = float(get("zeroing_threshold"))  # type: ignore[arg-type]
    if not math.isfinite(threshold) or threshold < 0:
        raise UnsupportedModelError(f"{_describe(node)}: zeroing_threshold must be finite and >= 0, got {threshold}")
    experts = _dim(node.inputs[2], 0) if len(node.inputs) > 2 else None  # w_gate [E, F, H]
    if experts is None and len(node.inputs) > 1:
        experts = _dim(node.inputs[1], 1)  # router_logits [T, E]
    if experts is not None and top_k > experts:
        raise UnsupportedModelError(f"{_describe(node)}: top_k = {top_k} exceeds the number of experts E = {experts}")
    return {
        "top_k": top_k,
        "normalize": int(normalize),
        "scoring": scoring,
        "activation": activation,
        "zeroing_threshold": threshold,
    }


def _dim(value: ir.Value | None, axis: int) -> int | None:
    if value is None or value.shape is None or len(value.shape) <= axis:
        return None
    d = value.shape[axis]
    return d if isinstance(d, int) else None


def _mask_shape(node: ir.Node) -> ir.Shape | None:
    hidden, logits = node.inputs[0].shape, node.inputs[1].shape
    if hidden is None or logits is None or len(hidden) != 2 or len(logits) != 2:
        return None
    return ir.Shape([hidden[0], logits[1]])


def _attributes(fields: dict[str, int | float | str]) -> list[ir.Attr]:
    attrs = [ir.AttrString("plugin_namespace", PLUGIN_NAMESPACE), ir.AttrString("plugin_version", PLUGIN_VERSION)]
    for name in PLUGIN_FIELDS:
        value = fields[name]
        if isinstance(value, str):
            attrs.append(ir.AttrString(name, value))
        elif isinstance(value, float):
            attrs.append(ir.AttrFloat32(name, value))
        else:
            attrs.append(ir.AttrInt64(name, value))
    return attrs


def _lower(node: ir.Node, build: Builder) -> None:
    graph = node.graph
    names = build.names
    _plugin_fields(node)  # the attributes' refusals (v2 routing included) say more than the input count
    if len(node.inputs) != 5 or any(v is None for v in node.inputs):
        raise UnsupportedModelError(
            f"{_describe(node)}: expects 5 inputs (hidden, router_logits, w_gate, w_up, w_down), got {len(node.inputs)}"
        )
    if not 1 <= len(node.outputs) <= 2:
        raise UnsupportedModelError(f"{_describe(node)}: expects outputs (y, mask), got {len(node.outputs)}")
    fields = _plugin_fields(node)
    hidden = node.inputs[0]
    dtype = hidden.dtype
    if dtype is not None and dtype not in _FLOAT_TYPES:
        raise UnsupportedModelError(
            f"{_describe(node)}: hidden is {dtype.name}; the TensorRT plugin takes float32, float16 or bfloat16"
        )
    before: list[ir.Node] = []
    inputs = [hidden]
    for value in node.inputs[1:]:
        if dtype is not None and value.dtype is not None and value.dtype != dtype:
            # Case 3: one dtype for all plugin inputs.
            cast = build.node("Cast", [value], {"to": dtype.value}, name=f"{value.name}__to_{dtype.name}")
            build.name(cast.outputs[0], f"{value.name}__{dtype.name.lower()}")
            cast.outputs[0].dtype = dtype
            cast.outputs[0].shape = value.shape
            before.append(cast)
            value = cast.outputs[0]
        inputs.append(value)

    path = node.attributes.get("path")
    plugin = build.node(
        PLUGIN_NAME,
        inputs,
        {a.name: a for a in _attributes(fields)},
        domain=PLUGIN_DOMAIN,
        outputs=2,
        name=f"{node.name or PLUGIN_NAME}__plugin",
    )
    if path is not None:
        plugin.metadata_props["layerzero.path"] = str(path.value)
    y_old = node.outputs[0]
    y_new, mask_i32 = plugin.outputs
    # y is [T, H] of hidden's dtype, the mask [T, E]: known even where shape inference skipped the custom op.
    if (y_old.dtype or dtype) is not None:
        y_new.dtype = y_old.dtype or dtype
    y_new.shape = y_old.shape or hidden.shape
    mask_old = node.outputs[1] if len(node.outputs) == 2 else None
    mask_shape = mask_old.shape if mask_old is not None and mask_old.shape is not None else _mask_shape(node)
    mask_i32.name = names(f"{mask_old.name if mask_old is not None else y_old.name}__int32")
    mask_i32.dtype, mask_i32.shape = ir.DataType.INT32, mask_shape
    new_nodes = [*before, plugin]

    mask_used = mask_old is not None and (mask_old.uses() or mask_old.is_graph_output())
    if mask_used:
        # Case 1: restore the bool mask (IPluginV3 outputs cannot be kBOOL).
        cast = build.node("Cast", [mask_i32], {"to": ir.DataType.BOOL.value}, name=f"{plugin.name}__mask")
        cast.outputs[0].dtype, cast.outputs[0].shape = ir.DataType.BOOL, mask_shape
        new_nodes.append(cast)
    graph.insert_before(node, new_nodes)
    _replace_keeping_name(y_old, y_new, names)
    if mask_used:
        _replace_keeping_name(mask_old, new_nodes[-1].outputs[0], names)
    graph.remove(node, safe=True)
    if node.name:
        plugin.name = node.name  # the block keeps its node name (scope) in the lowered graph


def _replace_keeping_name(old: ir.Value, new: ir.Value, names: NameFactory) -> None:
    """Rewire ``old``'s uses to ``new``; ``new`` takes ``old``'s name (replace_value does for graph outputs)."""
    name = old.name
    is_output = old.is_graph_output()
    replace_value(old, new, names)
    if not is_output and name:
        old.name = names(f"{name}__lowered")
        new.name = name
