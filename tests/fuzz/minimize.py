"""Delta debugging over nodes: the smallest model that still fails the same way.

A removed node's outputs become graph inputs (typed from shape inference of the failing model), nodes that
no longer reach an output go, and so do unused initializers and inputs. A candidate is kept when
``check_model`` gives the same ``Outcome.signature`` as the original failure. Then outputs are reduced too.
"""

from __future__ import annotations

import onnx
from onnx import helper

from tests.fuzz.harness import Outcome, check_model

__all__ = ["minimize", "to_text"]


def _types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        inferred = model
    g = inferred.graph
    return {v.name: v.type for v in list(g.value_info) + list(g.input) + list(g.output)}


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    reads: set[str] = set()
    for attr in node.attribute:
        for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for n in g.node:
                reads.update(n.input)
                reads |= _subgraph_reads(n)
    return reads


def _build(model: onnx.ModelProto, keep: list[int], outputs: list[int], types: dict) -> onnx.ModelProto | None:
    g = model.graph
    nodes = [g.node[i] for i in sorted(keep)]
    outs = [g.output[i] for i in outputs]
    # Keep only nodes that reach an output.
    needed = {o.name for o in outs}
    live: list[onnx.NodeProto] = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            live.append(node)
            needed.update(i for i in node.input if i)
            needed |= _subgraph_reads(node)
    live.reverse()
    produced = {o for n in live for o in n.output}
    inits = [t for t in g.initializer if t.name in needed]
    init_names = {t.name for t in inits}
    inputs = [i for i in g.input if i.name in needed and i.name not in init_names]
    have = {i.name for i in inputs} | init_names | produced
    for name in sorted(needed - have):
        if not name:
            continue
        t = types.get(name)
        if t is None or not t.HasField("tensor_type"):
            return None
        vi = onnx.ValueInfoProto(name=name)
        vi.type.CopyFrom(t)
        if not vi.type.tensor_type.HasField("shape"):
            return None
        inputs.append(vi)
    graph = helper.make_graph(live, g.name, inputs, outs, inits)
    return helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)


def minimize(model: onnx.ModelProto, failure: Outcome, seed: int = 0, budget: int = 300) -> onnx.ModelProto:
    """The smallest model (nodes, then outputs) whose ``check_model`` signature equals ``failure``'s."""
    types = _types(model)
    calls = 0

    def fails(keep: list[int], outputs: list[int]) -> onnx.ModelProto | None:
        nonlocal calls
        if calls >= budget:
            return None
        calls += 1
        candidate = _build(model, keep, outputs, types)
        if candidate is None:
            return None
        return candidate if check_model(candidate, seed).signature == failure.signature else None

    outputs = list(range(len(model.graph.output)))
    keep = list(range(len(model.graph.node)))
    best = model
    # Outputs first (cheap, and it shrinks the live cone).
    for i in list(outputs):
        trial = [o for o in outputs if o != i]
        if trial and (m := fails(keep, trial)) is not None:
            outputs, best = trial, m
    n = 2
    while len(keep) >= 2:
        chunk = max(1, len(keep) // n)
        reduced = False
        for start in range(0, len(keep), chunk):
            trial = keep[:start] + keep[start + chunk :]
            if trial and (m := fails(trial, outputs)) is not None:
                keep, best, reduced = trial, m, True
                n = max(n - 1, 2)
                break
        if not reduced:
            if chunk == 1:
                break
            n = min(len(keep), n * 2)
    return best


def to_text(model: onnx.ModelProto) -> str:
    """The model in ONNX text (``onnx.parser`` reads it back)."""
    return onnx.printer.to_text(model)
