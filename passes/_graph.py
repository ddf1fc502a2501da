"""Graph helpers shared by the passes: traversal, insertion, constants, value replacement, scopes.

Private to ``layerzero.passes``, whose modules import nothing of ours but ``layerzero.passes``,
``layerzero.contract``, ``layerzero.errors`` and ``layerzero.ort_runner`` (``docs/architecture.md``; checked by
``tests/compiler/test_architecture.py``).
"""

from __future__ import annotations

import ast
import itertools
import re

import numpy as np
import onnx_ir as ir

__all__ = [
    "NAME_SCOPES_KEY",
    "NameFactory",
    "common_scope",
    "const_array",
    "insert_after_producer",
    "layer_of",
    "make_constant",
    "node_subgraphs",
    "read_round_trip_sources",
    "release_subgraphs",
    "rename_output",
    "replace_value",
    "round_trip_source",
    "same_dim",
    "same_shape",
    "scope_of",
]

# torch.onnx (dynamo) records each node's module path in this metadata entry.
NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def node_subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs held by ``node``'s attributes (If branches, Loop/Scan bodies), not their own subgraphs."""
    subgraphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            subgraphs.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            subgraphs.extend(attr.value)
    return subgraphs


def release_subgraphs(node: ir.Node) -> None:
    """Empty a dying node's subgraphs so the outer values they read lose those uses."""
    for sub in node_subgraphs(node):
        for inner in sub:
            release_subgraphs(inner)
        sub.outputs.clear()
        for inner in reversed(list(sub)):
            sub.remove(inner, safe=True)


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents (initializer or Constant node), or None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        producer = value.producer()
        if producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx"):
            return None
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is None:
            return None
    if value.is_graph_input():
        # An initializer that is also a graph input can be overridden at run time.
        return None
    try:
        return tensor.numpy()
    except Exception:  # string tensors without numpy form, unsupported dtypes
        return None


class NameFactory:
    """Fresh, model-wide unique value and node names."""

    def __init__(self, graph: ir.Graph) -> None:
        self._taken: set[str] = set()
        for g in (graph, *graph.subgraphs()):
            self._taken.update(v.name for v in g.inputs if v.name)
            self._taken.update(g.initializers)
            for node in g:
                if node.name:
                    self._taken.add(node.name)
                self._taken.update(v.name for v in node.outputs if v.name)
        self._counter = itertools.count()

    def __call__(self, hint: str) -> str:
        hint = hint or "lz"
        name = hint
        while name in self._taken:
            name = f"{hint}__lz{next(self._counter)}"
        self._taken.add(name)
        return name


def make_constant(root: ir.Graph, names: NameFactory, hint: str, array: np.ndarray) -> ir.Value:
    """Register ``array`` as an initializer of the root graph (visible to every subgraph)."""
    name = names(hint)
    value = ir.Value(name=name, const_value=ir.tensor(np.asarray(array), name=name))
    value.shape = ir.Shape(np.asarray(array).shape)
    value.dtype = value.const_value.dtype
    root.register_initializer(value)
    return value


def replace_value(old: ir.Value, new: ir.Value, names: NameFactory) -> None:
    """Make every consumer of ``old`` read ``new``; keep the graph's output interface exactly.

    A graph output keeps its name (users address outputs by name): ``new`` takes the name when a node
    of the same graph produces it and it is no output yet; otherwise the output becomes
    ``Identity(new)`` under the old name. A value listed several times as an output is replaced by the
    same value at every place, so the duplicates keep their (shared) name too.
    """
    if old is new:
        return
    graph = old.graph
    if graph is not None and old.is_graph_output():
        # Graph outputs first: onnx-ir refuses to rewire the uses of a value that is still an output.
        old_name = old.name
        old.name = names(f"{old_name}__replaced")
        producer = new.producer()
        if producer is not None and producer.graph is graph and not new.is_graph_output():
            # NOTE: renaming beats an Identity, which also cannot carry a sequence before opset 14.
            new.name = old_name
            target = new
        else:
            target = ir.tape.Tape().op("Identity", [new], name=names(f"{old_name}__identity"))
            ident = target.producer()
            target.name = old_name
            target.shape = old.shape
            target.type = old.type
            graph.append(ident)
        for i, out in enumerate(list(graph.outputs)):
            if out is old:
                graph.outputs[i] = target
    old.replace_all_uses_with(new, replace_graph_outputs=False)


def rename_output(graph: ir.Graph, old: ir.Value, new: ir.Value, names: NameFactory, tag: str) -> None:
    """``new`` takes the graph output ``old``'s place(s) and name; ``old`` is renamed ``<name>__<tag>``.

    Uses are not touched: the caller rewires the readers it means to.
    """
    name = old.name
    old.name = names(f"{name}__{tag}")
    new.name = name
    for i, out in enumerate(list(graph.outputs)):
        if out is old:
            graph.outputs[i] = new


_D = ir.DataType
# (narrow, wide): Cast narrow -> wide -> narrow gives back every value exactly.
_WIDER: dict[ir.DataType, tuple[ir.DataType, ...]] = {
    _D.FLOAT: (_D.DOUBLE,),
    _D.FLOAT16: (_D.FLOAT, _D.DOUBLE),
    _D.BFLOAT16: (_D.FLOAT, _D.DOUBLE),
    _D.INT8: (_D.INT16, _D.INT32, _D.INT64),
    _D.INT16: (_D.INT32, _D.INT64),
    _D.INT32: (_D.INT64,),
    _D.UINT8: (_D.UINT16, _D.UINT32, _D.UINT64, _D.INT16, _D.INT32, _D.INT64),
    _D.UINT16: (_D.UINT32, _D.UINT64, _D.INT32, _D.INT64),
    _D.UINT32: (_D.UINT64, _D.INT64),
}
_LOSSLESS_WIDENING = frozenset((narrow, wide) for narrow, wides in _WIDER.items() for wide in wides)


def _cast(value: ir.Value) -> tuple[ir.Value, ir.DataType] | None:
    """(input, target type) when ``value`` is made by a default-domain Cast."""
    node = value.producer()
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
        return None
    to = node.attributes.get_int("to", None)
    return (node.inputs[0], ir.DataType(to)) if to is not None else None


def round_trip_source(value: ir.Value) -> ir.Value:
    """The value a lossless ``Cast(Cast(v, wide), narrow)`` chain gives back (``value`` itself otherwise)."""
    while True:
        outer = _cast(value)
        inner = _cast(outer[0]) if outer is not None else None
        if outer is None or inner is None:
            return value
        source = inner[0]
        narrow, wide = outer[1], inner[1]
        if source.dtype != narrow or (narrow, wide) not in _LOSSLESS_WIDENING:
            return value
        value = source


def read_round_trip_sources(node: ir.Node) -> bool:
    """Make ``node``'s subgraphs read the source of a lossless Cast round trip, not its result.

    NOTE: onnxruntime (1.32) removes such a round trip (float -> double -> float, int32 -> int64 -> int32,
    float16 -> float -> float16) and rewires the main graph's readers only: a subgraph that reads the result
    then fails at run time with "Missing Input". Reading the source is the same value and sidesteps it.
    Returns whether an input changed.
    """
    inner: set[int] = set()
    subgraphs = [g for sub in node_subgraphs(node) for g in (sub, *sub.subgraphs())]
    for g in subgraphs:
        inner.update(id(v) for v in g.inputs)
        inner.update(id(v) for v in g.initializers.values())
        for n in g:
            inner.update(id(v) for v in n.outputs)
    changed = False
    for g in subgraphs:
        for n in list(g):
            for k, value in enumerate(n.inputs):
                if value is None or id(value) in inner:
                    continue
                source = round_trip_source(value)
                if source is not value:
                    n.replace_input_with(k, source)
                    changed = True
        for k, value in enumerate(list(g.outputs)):
            if id(value) not in inner and (source := round_trip_source(value)) is not value:
                g.outputs[k] = source
                changed = True
    return changed


def insert_after_producer(graph: ir.Graph, value: ir.Value | None, nodes: list[ir.Node]) -> None:
    """Insert ``nodes`` right after ``value``'s producer when ``graph`` holds it, else at the start of ``graph``."""
    producer = value.producer() if value is not None else None
    if producer is not None and producer.graph is graph:
        graph.insert_after(producer, nodes)
    elif len(graph):
        graph.insert_before(next(iter(graph)), nodes)
    else:
        graph.extend(nodes)


def same_dim(a: object, b: object) -> bool:
    """True when two dims are provably equal: equal ints, or symbolic dims of the same name."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    na, nb = getattr(a, "value", None), getattr(b, "value", None)
    return isinstance(na, str) and na == nb


def same_shape(a: ir.Value, b: ir.Value) -> bool:
    """True when both values provably have the same dtype and shape (symbolic dims by name)."""
    if a.dtype is None or a.dtype != b.dtype:
        return False
    sa, sb = a.shape, b.shape
    if sa is None or sb is None or len(sa) != len(sb):
        return False
    return all(same_dim(da, db) for da, db in zip(sa, sb))


_SEP = re.compile(r"[/.]+")


def common_scope(scopes: list[str]) -> str:
    """The longest dotted prefix all ``scopes`` share ("" when one of them is "" or there are none)."""
    split = [s.split(".") for s in scopes if s]
    if not split or len(split) != len(scopes):
        return ""
    common: list[str] = []
    for parts in zip(*split):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return ".".join(common)


def scope_of(node: ir.Node) -> str:
    """The dotted module scope of a node ("" when it has none).

    Read from the exporter's name-scope metadata or from a path-like node name
    (``/model/layers.0/self_attn/MatMul`` → ``model.layers.0.self_attn``). torch.onnx writes the module
    paths followed by the fx node's own name (``['', 'model', 'model.layers.0', 'add_3']`` →
    ``model.layers.0``); a list that ends in a module path (it extends the entry before it,
    ``['', 'model', 'model.layers.0']``) is read to its end.
    """
    raw = node.metadata_props.get(NAME_SCOPES_KEY)
    if raw:
        try:
            scopes = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            scopes = None
        if isinstance(scopes, (list, tuple)) and scopes:
            scopes = [str(s) for s in scopes]
            # fx node names hold no ".", so a node name never extends the module path before it.
            if len(scopes) < 2 or not (scopes[-2] and scopes[-1].startswith(scopes[-2] + ".")):
                scopes = scopes[:-1]
            return ".".join(p for p in _SEP.split(scopes[-1]) if p) if scopes else ""
    name = node.name or ""
    if "/" not in name:
        return ""
    parts = [p for p in name.split("/") if p]
    return ".".join(p for p in _SEP.split(".".join(parts[:-1])) if p)


_LAYER = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")


def layer_of(scope: str) -> str | None:
    """The repeated-block scope a scope belongs to: ``model.layers.3.mlp`` → ``model.layers.3``."""
    m = _LAYER.match(scope)
    return m.group(1) if m else None


def drop_if_unused(value: ir.Value | None) -> None:
    """A weight nothing reads any more leaves its graph's initializers (one a node, a graph output or a graph input
    still reads stays: a tied embedding a Gather reads, say)."""
    if value is None or value.uses() or value.is_graph_output() or value.is_graph_input():
        return
    graph = value.graph
    if graph is not None and value.name in graph.initializers and graph.initializers[value.name] is value:
        graph.initializers.pop(value.name)
