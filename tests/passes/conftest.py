"""Shared helpers of the pass tests: ONNX text in, ORT out, and the ``check`` of one pass (``check_pass``).

Tests reach the helpers through the ``helpers`` fixture (the functions below): ``from conftest import``
breaks as soon as a sibling test folder gets its own ``conftest.py``, since they share one module name.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Callable, Mapping
from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.passes import InferShapes, RemoveDeadCode

__all__ = [
    "PassCheck",
    "apply_pass",
    "assert_same_outputs",
    "check_model",
    "check_pass",
    "count_nodes",
    "infer_shapes",
    "op_counts",
    "parse",
    "random_feeds",
    "run_ort",
    "session",
    "to_proto",
]

# Symbolic dims get these sizes when feeds are generated; any other symbol gets 2.
DEFAULT_DIMS = {"N": 3, "batch": 2, "seq": 5}


def parse(text: str) -> ir.Model:
    """An onnx-ir model from ONNX text (``onnx.parser`` syntax)."""
    return ir.from_onnx_text(textwrap.dedent(text))


def to_proto(model: ir.Model | onnx.ModelProto) -> onnx.ModelProto:
    return model if isinstance(model, onnx.ModelProto) else ir.to_proto(model)


def infer_shapes(model: ir.Model) -> None:
    """The shape inference the pipeline runs before each iteration (the passes read shapes)."""
    InferShapes()(model)


def apply_pass(pass_: ir.passes.PassBase, model: ir.Model, *, infer: bool = True) -> ir.passes.PassResult:
    """Run one pass in place, after shape inference unless ``infer`` is False."""
    if infer:
        infer_shapes(model)
    return pass_(model)


def _graphs(graph: ir.Graph):
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    yield from _graphs(sub)


def op_counts(model: ir.Model | onnx.ModelProto) -> Counter[str]:
    """op_type -> number of nodes, subgraphs included."""
    if isinstance(model, onnx.ModelProto):
        model = ir.from_proto(model)
    return Counter(node.op_type for g in _graphs(model.graph) for node in g)


def count_nodes(model: ir.Model | onnx.ModelProto, op_type: str | None = None) -> int:
    """Number of nodes (of ``op_type``, if given), subgraphs included."""
    counts = op_counts(model)
    return counts[op_type] if op_type is not None else sum(counts.values())


def check_model(model: ir.Model | onnx.ModelProto) -> None:
    onnx.checker.check_model(to_proto(model), full_check=True)


def session(model: ir.Model | onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # declared flags and folded leftovers make ORT warn about unused initializers
    return ort.InferenceSession(to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_ort(model: ir.Model | onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Output name -> array, running ``model`` on the CPU provider."""
    sess = session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, dict(feeds))))


_NP = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.BOOL: np.bool_,
}


def random_feeds(
    model: ir.Model | onnx.ModelProto, seed: int = 0, dims: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input that is not an initializer: floats in [-2, 2), ints in [0, 4)."""
    proto = to_proto(model)
    sizes = {**DEFAULT_DIMS, **(dims or {})}
    initializers = {t.name for t in proto.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else sizes.get(d.dim_param, 2) for d in tensor_type.shape.dim]
        dtype = _NP[tensor_type.elem_type]
        if dtype == np.bool_:
            feeds[value.name] = np.asarray(rng.random(shape) < 0.5)
        elif np.issubdtype(dtype, np.integer):
            feeds[value.name] = rng.integers(0, 4, size=shape).astype(dtype)
        else:
            feeds[value.name] = rng.uniform(-2.0, 2.0, size=shape).astype(dtype)
    return feeds


def assert_same_outputs(
    reference: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray], rtol: float = 1e-6, atol: float = 1e-6
) -> None:
    assert list(actual) == list(reference), "graph outputs changed names or order"
    for name, expected in reference.items():
        got = actual[name]
        assert got.dtype == expected.dtype, f"output {name!r}: dtype {got.dtype} != {expected.dtype}"
        if expected.dtype.kind in "OSU":  # strings
            np.testing.assert_array_equal(got, expected, err_msg=f"output {name!r}")
            continue
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"output {name!r}")


class PassCheck:
    """What :func:`check_pass` saw: the rewritten model and the node counts around the pass."""

    def __init__(self, model: ir.Model, before: int, after: int) -> None:
        self.model = model
        self.before = before
        self.after = after

    def ops(self) -> Counter[str]:
        return op_counts(self.model)


def check_pass(
    model: ir.Model | str,
    make_pass: Callable[[], ir.passes.PassBase],
    *,
    modified: bool,
    delta: int,
    dce_delta: int | None = None,
    infer: bool = True,
    feeds: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    rtol: float = 1e-6,
    atol: float = 1e-6,
    run: bool = True,
    reference: ir.Model | onnx.ModelProto | str | None = None,
) -> PassCheck:
    """The pass tests' shape: apply one pass and check it.

    - ``modified`` is the pass's honest report, and the node count changes by exactly ``delta``;
    - with ``dce_delta``, RemoveDeadCode then runs and the count is ``dce_delta`` off the original
      (the passes leave dead producers to DCE, so this is the delta a user sees);
    - a second run (after fresh shape inference) reports no change and leaves the node count alone;
    - ``onnx.checker.check_model(full_check=True)`` passes;
    - ORT outputs equal the original's on seeded inputs (or ``reference``'s: a declared flag changes
      what the model computes, so its oracle is the model without the layer; skipped with ``run=False``).
    """
    if isinstance(model, str):
        model = parse(model)
    original = ir.to_proto(model)
    before = count_nodes(model)
    result = apply_pass(make_pass(), model, infer=infer)
    after = count_nodes(model)
    assert result.modified is modified, f"modified={result.modified}, expected {modified}"
    assert after - before == delta, f"node delta {after - before}, expected {delta}:\n{ir.to_onnx_text(model)}"
    if dce_delta is not None:
        RemoveDeadCode()(model)
        after = count_nodes(model)
        assert after - before == dce_delta, (
            f"node delta after DCE {after - before}, expected {dce_delta}:\n{ir.to_onnx_text(model)}"
        )
    again = apply_pass(make_pass(), model, infer=infer)
    assert again.modified is False, f"second run modified the model:\n{ir.to_onnx_text(model)}"
    assert count_nodes(model) == after
    check_model(model)
    if run:
        if isinstance(reference, str):
            reference = parse(reference)
        expected_model = original if reference is None else to_proto(reference)
        feeds = feeds if feeds is not None else random_feeds(original, dims=dims)
        assert_same_outputs(run_ort(expected_model, feeds), run_ort(model, feeds), rtol=rtol, atol=atol)
    return PassCheck(model, before, after)


@pytest.fixture
def helpers():
    """The functions of this module: ``helpers.parse``, ``helpers.check_pass``, ``helpers.run_ort``, ..."""
    return SimpleNamespace(**{name: globals()[name] for name in __all__})
