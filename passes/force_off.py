"""The force-off variant of a compiled model: every dynamic path can be switched off from outside.

The profiler (``layerzero profile``) measures a path's impact by running this variant, built in memory from
the bundle's model, with the path forced off and comparing with the same request run normally. The
compiled model itself is untouched: a deployed bundle carries no force-off inputs.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from layerzero.contract import BLOCK_PREFIX, FORCE_OFF_PREFIX, DynamicPath
from layerzero.passes._builder import Builder, claim_name
from layerzero.passes._dynamic import read_dynamic_paths
from layerzero.passes._dynamic_paths import block_output, graph_output, moe_logits
from layerzero.passes._graph import NameFactory, insert_after_producer, rename_output

__all__ = ["BLOCK_PREFIX", "FORCE_OFF_PREFIX", "ExposeForceOff"]

logger = logging.getLogger(__name__)


class ExposeForceOff(ir.passes.InPlacePass):
    """Add a force-off input and a block output for each dynamic path recorded in the model.

    For each ``DynamicPath`` (``layerzero.dynamic`` metadata):

    - input ``layerzero::force_off::<path>``: bool, shape ``[len(subpaths)]``, or ``[]`` when the path has one
      subpath (the mask layout of ``_dynamic.py``); True switches that subpath off for every token. The
      input has no default: the variant is always fed all of them.
    - output ``layerzero::block::<path>``: the value the path writes (``_paths.block_output``).

    Cases:
    1. MoE: the router logits the routing reads become ``Where(force, -inf, logits)``: a forced-off expert is
       never among a token's top-k, the others are ranked as before (softmax scoring: over the remaining
       experts; with ``normalize`` the top-k weights are renormalised as always). This is what solidifying the
       expert does (``solidify_paths.DropExperts``), so the measured impact is the impact of removing it.
       Skipping form, ``if`` and ``ort-moe`` lowerings.
    2. Gate / group: every reader of the mask (the ``If`` conditions, the mask output) reads
       ``And(mask, Not(force))``: the branch takes its else path (the residual; the bypassed layers).
    3. Activation-sparsity groups (kind ``"activation"``) are not forced off: their mask is a kept-channel count,
       and their impact is the compile's measured deviation; listed in ``self.missing``.
    A path whose anchors are not found keeps running; it is listed in ``self.missing`` with the reason,
    and gets neither input nor output.
    """

    def __init__(self) -> None:
        super().__init__()
        self.exposed: list[str] = []
        self.missing: dict[str, str] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameFactory(graph)
        self.exposed, self.missing = [], {}
        existing = {v.name for v in graph.inputs}
        for entry in read_dynamic_paths(model):
            force_name = FORCE_OFF_PREFIX + entry.path
            if force_name in existing:
                continue
            problem = self._expose(graph, names, entry, force_name)
            if problem is None:
                self.exposed.append(entry.path)
            else:
                self.missing[entry.path] = problem
                logger.info("path %s cannot be forced off: %s", entry.path, problem)
        graph.sort()
        return ir.passes.PassResult(model, modified=bool(self.exposed))

    def _expose(self, graph: ir.Graph, names: NameFactory, entry: DynamicPath, force_name: str) -> str | None:
        shape = [len(entry.subpaths)] if len(entry.subpaths) > 1 else []
        if entry.kind == "activation":  # its mask counts kept channels (no switch): its impact is the compile's
            return "an activation-sparsity group (its deviation is measured at compile time), not a path to force off"
        if entry.kind == "moe":
            logits = moe_logits(graph, entry)
            if logits is None:
                return "its router logits are not found (unknown MoE lowering)"
            block = block_output(graph, entry, logits)
            force = _force_input(graph, names, force_name, shape)
            _force_logits(graph, names, logits, force, entry)  # Case 1
        else:
            mask = graph_output(graph, entry.mask_output)
            if mask is None:
                return f"mask output {entry.mask_output!r} is not an output of the model"
            block = block_output(graph, entry)
            force = _force_input(graph, names, force_name, shape)
            _force_mask(graph, names, mask, force, entry)  # Case 2
        if block is None:
            logger.info("path %s: no block output found; its impact is measured on the model output only", entry.path)
            return None
        out = _builder(graph, names, entry).node("Identity", [block], name=f"/{entry.path}/LzBlockIdentity")
        block_output_value = out.outputs[0]
        block_output_value.name = claim_name(graph, BLOCK_PREFIX + entry.path, names)
        block_output_value.type, block_output_value.shape = block.type, block.shape
        graph.append(out)
        graph.outputs.append(block_output_value)
        return None


def _builder(graph: ir.Graph, names: NameFactory, entry: DynamicPath) -> Builder:
    return Builder(graph, names, 0, node_prefix=f"/{entry.path}/Lz", value_prefix=f"{entry.path}.")


def _force_input(graph: ir.Graph, names: NameFactory, name: str, shape: list[int]) -> ir.Value:
    value = ir.Value(name=claim_name(graph, name, names), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape(shape))
    graph.inputs.append(value)
    return value


def _rewire(old: ir.Value, new: ir.Value, keep: ir.Node) -> None:
    """Every node but ``keep`` reads ``new`` instead of ``old`` (graph outputs are left alone)."""
    for user, index in list(old.uses()):
        if user is not keep:
            user.replace_input_with(index, new)


def _force_logits(graph: ir.Graph, names: NameFactory, logits: ir.Value, force: ir.Value, entry: DynamicPath) -> None:
    # logits -> routing   ->   Where(force, -inf, logits) -> routing
    dtype = logits.dtype.numpy() if logits.dtype is not None else np.float32
    build = _builder(graph, names, entry)
    minus_inf = build.initializer(f"{entry.path}.force_off.minus_inf", np.array(-np.inf, dtype))
    node = build.node("Where", [force, minus_inf, logits], name=f"/{entry.path}/LzForceOffWhere")
    forced = build.name(node.outputs[0], f"{entry.path}.forced_logits")
    forced.type, forced.shape = logits.type, logits.shape
    _rewire(logits, forced, node)
    insert_after_producer(graph, logits, [node])


def _force_mask(graph: ir.Graph, names: NameFactory, mask: ir.Value, force: ir.Value, entry: DynamicPath) -> None:
    # mask -> If conditions, mask output   ->   And(mask, Not(force)) -> If conditions, mask output
    build = _builder(graph, names, entry)
    off = build.node("Not", [force], name=f"/{entry.path}/LzForceOffNot")
    build.name(off.outputs[0], f"{entry.path}.not_forced")
    both = build.node("And", [mask, off.outputs[0]], name=f"/{entry.path}/LzForceOffAnd")
    forced = both.outputs[0]
    forced.type, forced.shape = mask.type, mask.shape
    _rewire(mask, forced, both)
    # The mask output reports the forced decision, under its own name.
    rename_output(graph, mask, forced, names, "unforced")
    insert_after_producer(graph, mask, [off, both])
