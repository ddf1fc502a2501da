"""Declared zero flags: bypass the layer a ``<scope>.flag = 0`` tensor or metadata entry names."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re

import onnx_ir as ir

from layerzero.errors import UnsupportedModelError
from layerzero.passes._graph import NameFactory, const_array, replace_value, scope_of
from layerzero.passes._layers import bypassable_layer, in_scope
from layerzero.passes._shapes import SymbolicShapes

__all__ = ["BypassedLayer", "FoldZeroFlags", "declared_flags", "flag_regex"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BypassedLayer:
    """One declared layer the pass removed: its scope, the flag that named it, where it was declared."""

    scope: str
    flag: str
    declared_in: str  # "initializer" | "metadata"
    nodes: int


@dataclasses.dataclass(frozen=True)
class DeclaredFlag:
    name: str
    scope: str
    value: float
    declared_in: str


def flag_regex(pattern: str) -> re.Pattern[str]:
    """A regex for flag names with a named group ``scope`` standing for the pattern's ``*``."""
    # "*.flag" -> the scope is what the first "*" matched.
    head, star, tail = pattern.partition("*")
    if not star:
        raise UnsupportedModelError(f"flag pattern {pattern!r} needs one '*' standing for the scope")
    return re.compile(
        re.escape(head) + "(?P<scope>.+)" + fnmatch.translate(tail).removeprefix("(?s:").removesuffix(")\\Z") + r"\Z"
    )


def declared_flags(model: ir.Model, pattern: str = "*.flag") -> list[DeclaredFlag]:
    """Flags declared next to a scope: unconsumed one-element initializers and metadata entries."""
    regex = flag_regex(pattern)
    flags: list[DeclaredFlag] = []
    graph = model.graph
    for name, init in graph.initializers.items():
        match = regex.match(name)
        if match is None or init.uses() or init.is_graph_input():
            continue  # a consumed flag is computed with: constant propagation handles it
        array = const_array(init)
        if array is None or array.size != 1:
            raise UnsupportedModelError(
                f"flag initializer {name!r} must hold exactly one number, it has shape {list(init.shape or [])}"
            )
        flags.append(DeclaredFlag(name, match["scope"], float(array.reshape(-1)[0]), "initializer"))
    for name, text in model.metadata_props.items():
        match = regex.match(name)
        if match is None:
            continue
        try:
            value = float(text)
        except ValueError:
            raise UnsupportedModelError(f"metadata flag {name!r} = {text!r} is not a number") from None
        flags.append(DeclaredFlag(name, match["scope"], value, "metadata"))
    return flags


class FoldZeroFlags(ir.passes.InPlacePass):
    """Replace each declared zero-flag layer by its residual input.

    Cases:
    1. A one-element initializer named by ``pattern`` (default ``*.flag``) that no node consumes,
       or a model metadata entry of that name, equal to 0: the scope is the name without the
       suffix (``layers.12.attention.rotary_emb.flag`` → ``layers.12.attention.rotary_emb``).
       The scope's nodes are those whose scope (node-name path or exporter name-scope metadata)
       is the scope or below it. If exactly one value leaves the scope, and exactly one value
       entering it has that value's dtype and shape (the residual stream; side inputs such as
       masks or position tables are allowed), uses of the output are rewired to that input.
       DCE removes the rest. The declaration is removed, so a second run changes nothing.
    2. A flag whose scope lies inside a scope bypassed on this run is dropped with it.
    3. Anything else with a zero flag (no such nodes, several outputs, no or several matching
       inputs) raises UnsupportedModelError naming the scope and why.
    4. Several values leave the scope, but exactly one of them has the dtype and shape of exactly one
       entering value, and no other leaving value depends on that entering value: the others are
       side values that do not read the layer's data (torch.onnx's common-subexpression elimination
       puts the shape vectors, rotary tables and masks every layer shares into the first layer's
       scope). They keep being computed as before; the one output is rewired as in Case 1.
    5. Nodes outside the scope that lie between two of its nodes (computed from one, read by another:
       the unscoped ``Split`` of a fused projection the dynamo exporter's optimizer emits, the bare
       ``Shape`` nodes of a TorchScript export) are part of the layer (``_layers.layer_hull``), so
       they neither count as outputs nor stay behind. The residual input's shape is matched to the
       output's by the operand-based shape rules (``_shapes.SymbolicShapes``), not by dim names,
       which TorchScript exports leave unnamed.
    Flags equal to 1 are left as they are. Only the main graph is searched for scopes.
    """

    def __init__(self, pattern: str = "*.flag") -> None:
        super().__init__()
        self.pattern = pattern
        self.bypassed: list[BypassedLayer] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        zero = [f for f in declared_flags(model, self.pattern) if f.value == 0.0]
        if not zero:
            return ir.passes.PassResult(model, modified=False)
        names = NameFactory(graph)
        scopes = {node: scope_of(node) for node in graph}
        # Shapes proved from operands: a bypass replaces a value by one of provably equal shape, so the
        # proof stays valid for the rest of this run.
        shapes = SymbolicShapes(graph)
        done: list[str] = []
        for flag in sorted(zero, key=lambda f: (f.scope.count("."), f.scope)):
            inside = next((s for s in done if in_scope(s, flag.scope)), None)
            if inside is None:
                members = [n for n, s in scopes.items() if in_scope(flag.scope, s)]
                removed = self._bypass(flag, members, names, shapes)
                self.bypassed.append(BypassedLayer(flag.scope, flag.name, flag.declared_in, removed))
                done.append(flag.scope)
            else:  # Case 2
                logger.info("flag %s lies inside bypassed scope %s", flag.name, inside)
            if flag.declared_in == "initializer":
                graph.initializers.pop(flag.name)
            else:
                del model.metadata_props[flag.name]
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _bypass(flag: DeclaredFlag, members: list[ir.Node], names: NameFactory, shapes: SymbolicShapes) -> int:
        """Rewire the layer's output to its residual input; return how many nodes the layer has."""
        where = f"zero flag {flag.name!r} ({flag.declared_in})"
        if not members:  # Case 3
            raise UnsupportedModelError(
                f"{where}: no node has scope {flag.scope!r}; "
                "check the flag's name against the scopes `layerzero inspect` lists"
            )
        layer = bypassable_layer(flag.scope, members, f"{where}: scope {flag.scope!r}", shapes=shapes)  # Cases 3-5
        replace_value(layer.output, layer.input, names)
        return len(layer.members)
