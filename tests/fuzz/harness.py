"""One differential case: compile a model (``verify=False``), run original and compiled with ORT, compare.

Outcomes (``Outcome.kind``):
- ``equal``: every output equal within float rounding on every input-size set, interface identical;
- ``differ``: an output differs, or the interface (input/output names, order, element types) changed;
- ``exception``: ``compile_model`` raised;
- ``cannot_run``: a node of the compiled model reads a value its scope does not define before it (a node before
  the producer of its input, a subgraph reading a value of another branch: not valid ONNX, even where ORT sorts a
  graph itself), or ORT cannot load or run the compiled model;
- ``invalid``: the generated model itself is invalid (checker or ORT refuses it) or computes non-finite values
  (``assume_finite`` folds ``x * 0`` on purpose, so those are not compared).
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from layerzero.compile import compile_model
from layerzero.options import CompileOptions
from layerzero.passes._dynamic import MASK_PREFIX, ROUTER_PREFIX

__all__ = ["KINDS", "Outcome", "check_model", "make_feeds", "run_ort", "scope_problem"]

KINDS = ("equal", "differ", "exception", "cannot_run", "invalid")
ATOL = 1e-4
RTOL = 1e-3
SIZES: tuple[dict[str, int], ...] = ({"N": 1, "S": 3}, {"N": 3, "S": 5})


@dataclasses.dataclass
class Outcome:
    kind: str
    detail: str = ""

    @property
    def signature(self) -> str:
        """What a minimised case must keep reproducing: the kind, and for exceptions the exception type."""
        if self.kind == "exception":
            return f"exception:{self.detail.split(':', 1)[0]}"
        return self.kind


def _session(model: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def run_ort(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    wanted = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in wanted})


def make_feeds(
    model: onnx.ModelProto, sizes: Mapping[str, int], seed: int, override: bool = False
) -> dict[str, np.ndarray]:
    """Seeded inputs: symbolic dims from ``sizes`` (unknown names: 2); with ``override``, initializers that
    are also graph inputs get other values too (they are no constants)."""
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        if inp.name in inits and not override:
            continue
        tt = inp.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else sizes.get(d.dim_param, 2) for d in tt.shape.dim)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        if dtype == np.bool_:
            feeds[inp.name] = np.asarray(rng.random(shape) > 0.5)
        elif np.issubdtype(dtype, np.integer):
            feeds[inp.name] = np.asarray(rng.integers(0, 3, size=shape)).astype(dtype)
        else:
            feeds[inp.name] = np.asarray(rng.standard_normal(shape)).astype(dtype)
    return feeds


def _interface(model: onnx.ModelProto) -> tuple[list, list]:
    inits = {t.name for t in model.graph.initializer}

    def sig(v: onnx.ValueInfoProto) -> tuple[str, int]:
        return v.name, v.type.tensor_type.elem_type

    inputs = [sig(v) for v in model.graph.input if v.name not in inits]
    outputs = [sig(v) for v in model.graph.output if not v.name.startswith((MASK_PREFIX, ROUTER_PREFIX))]
    return inputs, outputs


def _close(a: np.ndarray, b: np.ndarray) -> str | None:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.size == 0:
        return None
    if not np.issubdtype(a.dtype, np.number):
        return None if np.array_equal(a, b) else "values differ"
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if np.allclose(b64, a64, rtol=RTOL, atol=ATOL, equal_nan=True):
        return None
    return f"max abs {float(np.nanmax(np.abs(a64 - b64))):.3g}"


def scope_problem(graph: onnx.GraphProto, outer: frozenset[str] = frozenset()) -> str | None:
    """The first node (or graph output) that reads a name not defined before it in its graph or in the graphs
    enclosing it (a subgraph sees the outer names defined before the node that owns it); None when there is none."""
    defined = set(outer) | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                return f"input {name!r} of {node.op_type} {node.name or node.output[0]!r} in graph {graph.name!r}"
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                problem = scope_problem(sub, frozenset(defined))
                if problem is not None:
                    return problem
        defined.update(o for o in node.output if o)
    for out in graph.output:
        if out.name not in defined:
            return f"output {out.name!r} of graph {graph.name!r}"
    return None


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every value's shape onnx infers, where every dim is a number (graph inputs, value_info, initializers)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes: dict[str, tuple[int, ...]] = {}
    graphs = [inferred.graph]
    while graphs:
        graph = graphs.pop()
        for init in graph.initializer:
            shapes[init.name] = tuple(init.dims)
        for info in [*graph.input, *graph.value_info, *graph.output]:
            t = info.type.tensor_type
            if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
                shapes[info.name] = tuple(d.dim_value for d in t.shape.dim)
        for node in graph.node:
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))
    return shapes


def spec_problem(model: onnx.ModelProto) -> str | None:
    """What makes ``model`` invalid by the operators' own rules although onnx's checker passes it: a PRelu slope
    that is not unidirectionally broadcastable to X (the spec's rule; ONNX Runtime's kernel then broadcasts both
    ways while its constant folding takes onnx's inferred shape, X's: one model, two behaviours)."""
    shapes = _static_shapes(model)
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))
            if node.op_type != "PRelu" or node.domain not in ("", "ai.onnx"):
                continue
            x, slope = (shapes.get(n) for n in node.input[:2])
            if x is None or slope is None:
                continue
            fits = len(slope) <= len(x) and all(s in (1, d) for s, d in zip(reversed(slope), reversed(x)))
            if not fits:
                where = f"PRelu {node.output[0]}: slope {list(slope)}"
                return f"{where} is not unidirectionally broadcastable to X {list(x)}"
    return None


def check_model(
    model: onnx.ModelProto, seed: int = 0, options: CompileOptions | None = None, *, check_spec: bool = True
) -> Outcome:
    """Run one differential case on ``model`` (``check_spec``: a model ``spec_problem`` finds is ``invalid``; the
    regression cases turn it off, they are models ONNX Runtime runs consistently that the compiler must keep)."""
    try:
        onnx.checker.check_model(model, full_check=True)
        problem = spec_problem(model) if check_spec else None
        if problem is not None:
            return Outcome("invalid", problem)
        blob = model.SerializeToString()
        original = _session(blob)
        # The second set also overrides the initializers that are graph inputs.
        feed_sets = [make_feeds(model, s, seed + k, override=k == 1) for k, s in enumerate(SIZES)]
        expected = [run_ort(original, f) for f in feed_sets]
    except Exception as exc:
        return Outcome("invalid", f"{type(exc).__name__}: {str(exc).strip()[:200]}")
    for outs in expected:
        for o in outs:
            o = np.asarray(o)
            if np.issubdtype(o.dtype, np.floating) and not np.all(np.isfinite(o)):
                return Outcome("invalid", "non-finite reference output")
    try:
        result = compile_model(model, options or CompileOptions(verify=False))
        compiled = ir.to_proto(result.model)
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return Outcome("exception", f"{type(exc).__name__}: {str(exc)[:200]} ({tb.filename}:{tb.lineno})")
    if _interface(compiled) != _interface(model):
        return Outcome("differ", f"interface {_interface(model)} -> {_interface(compiled)}")
    problem = scope_problem(compiled.graph)
    if problem is not None:
        return Outcome("cannot_run", f"scope: {problem}")
    try:
        session = _session(compiled.SerializeToString())
    except Exception as exc:
        return Outcome("cannot_run", f"load: {str(exc).strip().splitlines()[0][:200]}")
    names = [o.name for o in model.graph.output]
    user = [i for i, o in enumerate(session.get_outputs()) if not o.name.startswith((MASK_PREFIX, ROUTER_PREFIX))]
    for feeds, outs in zip(feed_sets, expected):
        try:
            got = run_ort(session, feeds)
        except Exception as exc:
            return Outcome("cannot_run", f"run: {str(exc).strip().splitlines()[0][:200]}")
        got = [got[i] for i in user]
        for name, a, b in zip(names, outs, got):
            problem = _close(a, b)
            if problem is not None:
                shape = {k: list(v.shape) for k, v in feeds.items()}
                return Outcome("differ", f"output {name!r} at inputs {shape}: {problem}")
    return Outcome("equal")
