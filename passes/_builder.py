"""The dynamic passes' one node builder: nodes recorded on an ``ir.tape.Tape``, named uniquely, in the model's opset.

A :class:`Builder` belongs to one pass run on one model:

- names: every node and value it makes gets a name no graph of the model holds yet (values, initializers, graph
  inputs and outputs, node names, in every subgraph: ``NameFactory``), so a user's model that already uses a name
  LayerZero would pick (``layerzero::mask::<path>``, ``<path>.experts.0.down_proj``, ...) keeps its own and the new
  one gets a suffix;
- scope: node names ``<node_prefix><op_type>``, value names ``<value_prefix><op_type lower>`` (or the node's name
  and ``_output``), optional name-scope metadata, so a new node reads as part of the module it replaces;
- small constants: ``const`` (a ``Constant`` node, not a parameter) and ``initializer`` (a root-graph initializer,
  visible to every subgraph), ``ints``;
- the opset-aware forms: ``Unsqueeze`` / ``Squeeze`` axes (input from opset 13, attribute before), reductions'
  axes (``ReduceSum`` from 13, the others from 18), ``Split`` sizes (input from 13);
- a tape per subgraph body (``body()``), and ``sub(scope)`` for another scope on the same tape.

Where the nodes go is the caller's: ``nodes`` / ``take()`` hand them over in order, ``graph(...)`` makes a body.
Private to ``layerzero.passes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from layerzero.errors import InvalidInputError
from layerzero.passes._graph import NAME_SCOPES_KEY, NameFactory, make_constant

__all__ = ["Builder", "claim_name", "model_opset"]

# Reductions whose axes became an input at opset 18 (ReduceSum's at 13).
_AXES_INPUT_SINCE = 18


def model_opset(model: ir.Model) -> int:
    """The model's default-domain opset (0 when it imports none)."""
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0)))


class Builder:
    """Nodes on a tape, with model-wide unique names, in one scope, for one opset.

    ``root`` is the model's main graph (initializers go there); ``names`` the pass's ``NameFactory`` (shared by
    every builder of the run, so no two new names collide either). Node names: ``node_prefix + op_type`` (default
    ``"/<scope>/"``); value names: ``value_prefix + op_type.lower()`` (``_<i>`` for output i > 0) when given, else the
    node's name + ``"_output"``. ``scope_metadata``: each node records ``[scope, op_type.lower()]`` as its name
    scopes; ``metadata``: these metadata entries instead (e.g. copied from the node being replaced).
    """

    def __init__(
        self,
        root: ir.Graph,
        names: NameFactory,
        opset: int,
        *,
        scope: str = "",
        node_prefix: str | None = None,
        value_prefix: str | None = None,
        scope_metadata: bool = False,
        metadata: Mapping[str, str] | None = None,
        dtype: np.dtype | None = None,
        tape: ir.tape.Tape | None = None,
    ) -> None:
        self.root = root
        self.names = names
        self.opset = int(opset)
        self.scope = scope
        self.node_prefix = f"/{scope}/" if node_prefix is None else node_prefix
        self.value_prefix = value_prefix
        self.scope_metadata = scope_metadata
        self.metadata = dict(metadata) if metadata is not None else None
        self.dtype = np.dtype(dtype) if dtype is not None else np.dtype(np.float32)  # of the tensors computed
        self.tape = ir.tape.Tape() if tape is None else tape
        self._taken = 0

    @classmethod
    def for_model(cls, model: ir.Model, names: NameFactory | None = None, **kwargs: object) -> Builder:
        """A builder on ``model``'s main graph and opset (a fresh ``NameFactory`` unless given)."""
        names = NameFactory(model.graph) if names is None else names
        return cls(model.graph, names, model_opset(model), **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------- tapes

    def _like(self, tape: ir.tape.Tape | None, **changes: object) -> Builder:
        kwargs: dict[str, object] = {
            "scope": self.scope,
            "node_prefix": self.node_prefix,
            "value_prefix": self.value_prefix,
            "scope_metadata": self.scope_metadata,
            "metadata": self.metadata,
            "dtype": self.dtype,
        }
        kwargs.update(changes)
        return Builder(self.root, self.names, self.opset, tape=tape, **kwargs)  # type: ignore[arg-type]

    def sub(self, scope: str, *, body: bool = False) -> Builder:
        """A builder in ``scope`` (node prefix ``/<scope>/``, value prefix ``<scope>.``): on this builder's tape, or
        on a tape of its own for a subgraph's ``body``."""
        return self._like(None if body else self.tape, scope=scope, node_prefix=f"/{scope}/", value_prefix=f"{scope}.")

    def body(self) -> Builder:
        """The same naming on a tape of its own: the nodes of a subgraph's body."""
        return self._like(None)

    @property
    def nodes(self) -> list[ir.Node]:
        """Every node recorded on this builder's tape, in order."""
        return list(self.tape.nodes)

    def take(self) -> list[ir.Node]:
        """The nodes recorded since the last ``take`` (to place them a batch at a time)."""
        nodes = list(self.tape.nodes)[self._taken :]
        self._taken += len(nodes)
        return nodes

    def graph(self, outputs: Sequence[ir.Value], hint: str, inputs: Sequence[ir.Value] = ()) -> ir.Graph:
        """A subgraph of this builder's nodes (all of its tape) with a unique name."""
        return ir.Graph(list(inputs), list(outputs), nodes=self.nodes, name=self.names(hint))

    # ------------------------------------------------------------------------------------------- nodes

    def node(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: Mapping[str, object] | None = None,
        *,
        domain: str = "",
        outputs: int = 1,
        name: str | None = None,
    ) -> ir.Node:
        """One node; attributes as ``ir.tape.Tape`` takes them (bools become ints, integer sequences int lists)."""
        attrs: dict[str, object] = {}
        for key, value in (attributes or {}).items():
            if isinstance(value, (ir.Attr, str, float, ir.Graph, ir.Tensor)) or value is None:
                attrs[key] = value
            elif isinstance(value, (bool, int, np.integer)):
                attrs[key] = int(value)
            elif isinstance(value, np.floating):
                attrs[key] = float(value)
            else:  # a sequence of integers (axes, perm, ...), possibly numpy scalars; typed even when empty
                attrs[key] = ir.AttrInt64s(key, [int(v) for v in value])  # type: ignore[union-attr]
        node_name = self.names(name if name is not None else f"{self.node_prefix}{op_type}")
        if self.metadata is not None:
            metadata: dict[str, str] | None = dict(self.metadata)
        elif self.scope_metadata:
            metadata = {NAME_SCOPES_KEY: repr([self.scope, op_type.lower()])}
        else:
            metadata = None
        outs = self.tape.op_multi_out(
            op_type,
            list(inputs),
            {k: v for k, v in attrs.items() if v is not None},
            num_outputs=outputs,
            domain=domain,
            name=node_name,
            metadata_props=metadata,
        )
        for i, out in enumerate(outs):
            suffix = f"_{i}" if i else ""
            if self.value_prefix is not None:
                out.name = self.names(f"{self.value_prefix}{op_type.lower()}{suffix}")
            else:
                out.name = self.names(f"{node_name}_output{suffix}")
        producer = outs[0].producer()
        assert producer is not None
        return producer

    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        domain: str = "",
        outputs: int = 1,
        **attrs: object,
    ) -> ir.Value | list[ir.Value]:
        """One node's output (a list of ``outputs`` when more than one)."""
        node = self.node(op_type, inputs, attrs, domain=domain, outputs=outputs)
        return node.outputs[0] if outputs == 1 else list(node.outputs)

    def op1(self, op_type: str, inputs: Sequence[ir.Value | None], **attrs: object) -> ir.Value:
        """One node's single output (typed for the checker)."""
        return self.node(op_type, inputs, attrs).outputs[0]

    def name(self, value: ir.Value, hint: str) -> ir.Value:
        """Give ``value`` a unique name after ``hint``; returns it."""
        value.name = self.names(hint)
        return value

    # ------------------------------------------------------------------------------------- constants

    def const(self, hint: str, array: object) -> ir.Value:
        """A small constant (axes, indices, scalars) as a ``Constant`` node: not a parameter of the model."""
        array = np.asarray(array)
        value = self.op1("Constant", [], value=ir.tensor(array))
        value.name = self.names(f"{self.value_prefix or self.node_prefix}{hint}")
        value.dtype = ir.DataType.from_numpy(array.dtype)
        value.shape = ir.Shape(array.shape)
        return value

    def ints(self, *values: int) -> ir.Value:
        """A 1-D int64 ``Constant``."""
        return self.const("const", np.array(values, dtype=np.int64))

    def initializer(self, hint: str, array: object) -> ir.Value:
        """An initializer of the root graph (visible to every subgraph), named after ``hint``."""
        return make_constant(self.root, self.names, hint, np.asarray(array))

    def weight(self, hint: str, array: np.ndarray) -> ir.Value:
        """A weight of this scope: the root initializer ``<scope>.<hint>``."""
        return self.initializer(f"{self.scope}.{hint}" if self.scope else hint, array)

    # ------------------------------------------------------------------------------- opset-aware forms

    def unsqueeze(self, x: ir.Value, axes: Sequence[int]) -> ir.Value:
        """``Unsqueeze(x, axes)``: axes an input from opset 13, an attribute before."""
        if self.opset >= 13:
            return self.op1("Unsqueeze", [x, self.ints(*axes)])
        return self.op1("Unsqueeze", [x], axes=list(axes))

    def squeeze(self, x: ir.Value, axes: Sequence[int]) -> ir.Value:
        """``Squeeze(x, axes)``: axes an input from opset 13, an attribute before."""
        if self.opset >= 13:
            return self.op1("Squeeze", [x, self.ints(*axes)])
        return self.op1("Squeeze", [x], axes=list(axes))

    def reduce(self, op_type: str, x: ir.Value, axes: Sequence[int], keepdims: int) -> ir.Value:
        """A reduction over ``axes``: an input for ``ReduceSum`` from opset 13 and the others from 18."""
        if (op_type == "ReduceSum" and self.opset >= 13) or self.opset >= _AXES_INPUT_SINCE:
            return self.op1(op_type, [x, self.ints(*axes)], keepdims=keepdims)
        return self.op1(op_type, [x], axes=list(axes), keepdims=keepdims)

    def split(self, x: ir.Value, sizes: Sequence[int], axis: int) -> list[ir.Value]:
        """``Split(x, sizes)`` along ``axis``: sizes an input from opset 13, the ``split`` attribute before."""
        if self.opset >= 13:
            outs = self.op("Split", [x, self.ints(*sizes)], outputs=len(sizes), axis=axis)
        else:
            outs = self.op("Split", [x], outputs=len(sizes), axis=axis, split=list(sizes))
        return outs if isinstance(outs, list) else [outs]


def claim_name(graph: ir.Graph, name: str, names: NameFactory | None = None) -> str:
    """Make ``name`` free for a value LayerZero adds under exactly that name (a contract name: the run-time
    threshold, a force-off input, a block output): a value of the model already called so (inside the model:
    a node's output or an initializer, in any graph) is renamed, which changes nothing the user addresses.

    A graph input or output of the main graph that holds the name is the user's interface: ``InvalidInputError``
    (the loader refuses reserved names first; this is the pass's own guard).
    """
    fresh = names if names is not None else NameFactory(graph)
    for value in graph.inputs:
        if value.name == name and not value.is_initializer():
            raise InvalidInputError(f"the model's input {name!r} uses a name LayerZero reserves; rename it")
    for value in graph.outputs:
        if value.name == name:
            raise InvalidInputError(f"the model's output {name!r} uses a name LayerZero reserves; rename it")
    for g in (graph, *graph.subgraphs()):
        holders = [v for v in (*g.inputs, *g.initializers.values()) if v.name == name]
        holders += [v for node in g for v in node.outputs if v.name == name]
        for value in holders:
            value.name = fresh(f"{name}__model")
    return name
