"""Author declared zero flags: list the scopes a flag can name, add ``<scope>.flag`` entries to a model.

    model = load_model("model.onnx")
    [c.scope for c in flaggable_scopes(model)]             # e.g. model.layers.1, model.layers.1.mlp
    add_flags(model, ["model.layers.1"])                    # a one-element initializer model.layers.1.flag = 0
    add_flags(model, ["model.layers.1"], metadata=True)     # or a metadata entry of that name

A scope can carry a flag when ``FoldZeroFlags`` could bypass it (``passes/_layers.bypassable_layer``: one
value leaves it, counting the unscoped nodes between its own as its own, and one entering value provably has
that value's dtype and shape). A cache-carrying export's decoder layer and its ``self_attn``
also write ``present.N.key/value``, so neither is bypassable there; its ``mlp`` is.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from layerzero.errors import InvalidInputError, LayerZeroError, UnsupportedModelError
from layerzero.passes._layers import bypassable_layer, scope_members
from layerzero.passes._shapes import SymbolicShapes
from layerzero.passes.zero_flags import declared_flags
from layerzero.summary import model_scope, scope_counts

__all__ = ["FLAG_SUFFIX", "FlagCandidate", "add_flags", "flaggable_scopes"]

FLAG_SUFFIX = ".flag"

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FlagCandidate:
    """A scope a declared zero flag can name: its node and parameter counts (``summary.scope_counts``'s, the
    counts `layerzero inspect` shows: parameters read only inside the scope)."""

    scope: str
    nodes: int
    params: int


def _all_scopes(model: ir.Model) -> dict[ir.Node, str]:
    return {node: model_scope(node) for node in model.graph}


def _infer_shapes(model: ir.Model) -> None:
    # A layer is matched by the dtype and shape of the values at its border; TorchScript exports carry
    # almost no intermediate shapes, so infer them first (in place: the written model keeps them, harmless).
    from layerzero.passes.shape_inference import InferShapes

    try:
        InferShapes()(model)
    except Exception as exc:  # inference is a help, never a requirement
        logger.info("shape inference failed, shapes left as they are: %s", exc)


def _prefixes(scope: str) -> list[str]:
    parts = scope.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def flaggable_scopes(model: ir.Model) -> list[FlagCandidate]:
    """Every scope (and enclosing scope) of the main graph that ``FoldZeroFlags`` could bypass, in graph order."""
    _infer_shapes(model)
    scopes = _all_scopes(model)
    counts = scope_counts(model)
    shapes = SymbolicShapes(model.graph)
    seen: dict[str, None] = {}
    for scope in scopes.values():
        for prefix in _prefixes(scope) if scope else ():
            seen.setdefault(prefix)
    found = []
    for scope in seen:
        members = scope_members(model.graph, scope, scopes)
        try:
            bypassable_layer(scope, members, scope, error=UnsupportedModelError, shapes=shapes)
        except LayerZeroError:
            continue
        found.append(FlagCandidate(scope, counts.nodes.get(scope, 0), counts.params.get(scope, 0)))
    return found


def add_flags(model: ir.Model, scopes: list[str], *, value: float = 0.0, metadata: bool = False) -> list[str]:
    """Declare ``<scope>.flag = value`` for each scope (an initializer, or a metadata entry); return the names.

    Raises:
        InvalidInputError: a scope no node has, a flag already declared, or no scopes.
        UnsupportedModelError: a scope that is not a layer FoldZeroFlags can bypass (the reason is the pass's).
    """
    if not scopes:
        raise InvalidInputError("give at least one scope (layerzero flag MODEL --list shows them)")
    _infer_shapes(model)
    node_scopes = _all_scopes(model)
    shapes = SymbolicShapes(model.graph)
    known = {p for s in node_scopes.values() if s for p in _prefixes(s)}
    existing = {f.name for f in declared_flags(model)}
    names = []
    for scope in scopes:
        name = scope + FLAG_SUFFIX
        if scope not in known:
            close = sorted(s for s in known if s.endswith(scope) or scope.endswith(s))[:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise InvalidInputError(f"scope {scope!r}: no node has it{hint}; `layerzero flag MODEL --list` lists them")
        if name in existing or name in model.graph.initializers or name in model.metadata_props:
            raise InvalidInputError(f"flag {name!r} is already declared in the model")
        try:
            bypassable_layer(scope, scope_members(model.graph, scope, node_scopes), f"scope {scope!r}", shapes=shapes)
        except UnsupportedModelError as exc:
            # In a cache-carrying export a decoder layer and its self_attn also write present.N.key/value.
            raise UnsupportedModelError(
                f"{exc}; `layerzero flag MODEL --list` lists the scopes a flag can name"
            ) from None
        if metadata:
            model.metadata_props[name] = f"{value:g}"
        else:
            flag = ir.Value(name=name, const_value=ir.tensor(np.asarray([value], dtype=np.float32), name=name))
            flag.shape = ir.Shape([1])
            flag.dtype = ir.DataType.FLOAT
            model.graph.register_initializer(flag)
        names.append(name)
    return names
