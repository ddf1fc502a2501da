"""Do no harm: the static passes keep every ONNX backend node test that ORT passes passing.

For each node test (``onnx/backend/test/data/node/*``: ``model.onnx`` and ``test_data_set_*``): if ORT
(CPU) loads the model and reproduces the expected outputs within the backend runner's tolerances, then
after ``run_static_passes`` the compiled model must still load in ORT and reproduce them. Some onnx wheels
ship without the data folder; the cases are then built in memory by ``onnx.backend.test.case.node`` (the
generator that writes those folders: same models, same data sets).

Exclusions are listed in ``EXCLUDED`` with a one-line reason each.
"""

from __future__ import annotations

import glob
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from layerzero.options import CompileOptions
from layerzero.pipeline import run_static_passes

# Test name -> why it is not checked after compiling (none so far; keep each reason to one line).
EXCLUDED: dict[str, str] = {}

# Known to break, for a reason outside passes/: checked strictly, so a fix shows up as a failure
# asking to empty this list (test name -> one-line reason). Empty since the pipeline merges whole
# inferred types back (sequence/optional values used to come back as tensors).
KNOWN_BROKEN: dict[str, str] = {}

DATA_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "node")


@dataclass
class NodeCase:
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float = 1e-3
    atol: float = 1e-7


def _read_value(path: str, type_proto: onnx.TypeProto) -> Any:
    """A test_data_set_*/{input,output}_*.pb file as numpy (tensor), list (sequence) or None/value (optional)."""
    with open(path, "rb") as f:
        data = f.read()
    kind = type_proto.WhichOneof("value")
    if kind == "sequence_type":
        proto = onnx.SequenceProto()
        proto.ParseFromString(data)
        return numpy_helper.to_list(proto)
    if kind == "optional_type":
        proto = onnx.OptionalProto()
        proto.ParseFromString(data)
        return numpy_helper.to_optional(proto)
    if kind == "map_type":
        proto = onnx.MapProto()
        proto.ParseFromString(data)
        return numpy_helper.to_dict(proto)
    proto = onnx.TensorProto()
    proto.ParseFromString(data)
    return numpy_helper.to_array(proto)


def _cases_from_files() -> Iterator[NodeCase]:
    for model_path in sorted(glob.glob(os.path.join(DATA_DIR, "*", "model.onnx"))):
        case_dir = os.path.dirname(model_path)
        model = onnx.load(model_path)
        data_sets = []
        for set_dir in sorted(glob.glob(os.path.join(case_dir, "test_data_set_*"))):
            inputs = [
                _read_value(os.path.join(set_dir, f"input_{j}.pb"), v.type)
                for j, v in enumerate(model.graph.input)
                if os.path.exists(os.path.join(set_dir, f"input_{j}.pb"))
            ]
            outputs = [
                _read_value(os.path.join(set_dir, f"output_{j}.pb"), v.type) for j, v in enumerate(model.graph.output)
            ]
            data_sets.append((inputs, outputs))
        yield NodeCase(os.path.basename(case_dir), model, data_sets)


def _cases_in_memory() -> Iterator[NodeCase]:
    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = node.collect_testcases()
    for case in sorted(cases, key=lambda c: c.name):
        data_sets = [(list(inputs), list(outputs)) for inputs, outputs in case.data_sets]
        yield NodeCase(case.name, case.model, data_sets, case.rtol, case.atol)


def node_cases() -> tuple[str, list[NodeCase]]:
    """(where the cases came from, the cases)."""
    if glob.glob(os.path.join(DATA_DIR, "*", "model.onnx")):
        return DATA_DIR, list(_cases_from_files())
    return "onnx.backend.test.case.node (in memory)", list(_cases_in_memory())


def _to_feed(value: Any) -> Any:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list):
        return [_to_feed(v) for v in value]
    return value


def _assert_similar(expected: Any, actual: Any, rtol: float, atol: float, where: str) -> None:
    """onnx's ``Runner.assert_similar_outputs``: shapes, dtypes, then allclose (strings exactly)."""
    expected = _to_feed(expected)
    if isinstance(expected, list):
        assert isinstance(actual, list), f"{where}: expected a sequence, got {type(actual).__name__}"
        assert len(actual) == len(expected), f"{where}: sequence length {len(actual)} != {len(expected)}"
        for k, (e, a) in enumerate(zip(expected, actual)):
            _assert_similar(e, a, rtol, atol, f"{where}[{k}]")
        return
    if expected is None:
        assert actual is None, f"{where}: expected an empty optional"
        return
    expected, actual = np.asarray(expected), np.asarray(actual)
    assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
    if expected.dtype == object:
        np.testing.assert_array_equal(actual, expected, err_msg=where)
        return
    assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
    if actual.dtype.name == "bfloat16":
        rtol = max(rtol, 2**-6)
        actual, expected = actual.astype(np.float32), expected.astype(np.float32)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=where)


def _check_with_ort(model: onnx.ModelProto, case: NodeCase) -> None:
    """Raise unless ORT loads ``model`` and reproduces every data set of ``case``."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    input_names = [i.name for i in sess.get_inputs()]
    output_names = [o.name for o in sess.get_outputs()]
    for k, (inputs, expected) in enumerate(case.data_sets):
        feeds = {name: _to_feed(value) for name, value in zip(input_names, inputs)}
        actual = sess.run(output_names, feeds)
        assert len(actual) == len(expected), f"{len(actual)} outputs, expected {len(expected)}"
        for name, e, a in zip(output_names, expected, actual):
            _assert_similar(e, a, case.rtol, case.atol, f"data set {k}, output {name!r}")


def _with_constant_inputs(case: NodeCase) -> NodeCase | None:
    """``case`` with the inputs of its first data set baked in as initializers (None if not all tensors).

    Every node then has constant inputs, so FoldConstants evaluates it ahead of time: this checks folding
    (the reference evaluator, dtypes, output names) op by op against the expected outputs.
    """
    inputs, outputs = case.data_sets[0]
    graph_inputs = list(case.model.graph.input)
    if len(inputs) != len(graph_inputs):
        return None
    initializers = []
    for value_info, value in zip(graph_inputs, inputs):
        if value_info.type.WhichOneof("value") != "tensor_type":
            return None
        value = _to_feed(value)
        if not isinstance(value, np.ndarray):
            return None
        try:
            initializers.append(numpy_helper.from_array(value, value_info.name))
        except Exception:
            return None  # dtypes numpy_helper cannot write
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    del model.graph.input[:]
    model.graph.initializer.extend(initializers)
    return NodeCase(case.name + "[constant inputs]", model, [([], outputs)], case.rtol, case.atol)


def _compile(model: onnx.ModelProto) -> onnx.ModelProto:
    ir_model = ir.from_proto(model)
    run_static_passes(ir_model, CompileOptions())
    return ir.to_proto(ir_model)


def _compiled_case_failure(case: NodeCase) -> tuple[str | None, bool]:
    """(why the compiled model fails ``case``, or None; whether the passes changed the model)."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # the reference evaluator folds NaN/Inf test data
            ir_model = ir.from_proto(case.model)
            result = run_static_passes(ir_model, CompileOptions())
            compiled = ir.to_proto(ir_model)
    except Exception as exc:
        return f"compile raised {type(exc).__name__}: {exc}", True
    changed = any(result.modified_by.values())
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            _check_with_ort(compiled, case)
    except Exception as exc:
        message = " ".join(str(exc).strip().splitlines()[:6])[:400]
        return f"{type(exc).__name__}: {message}", changed
    return None, changed


@pytest.mark.slow
def test_static_passes_keep_backend_node_tests_passing(capsys: pytest.CaptureFixture[str]) -> None:
    source, cases = node_cases()
    assert cases, f"no ONNX backend node tests found ({source})"
    start = time.perf_counter()
    variants: list[NodeCase] = []
    for case in cases:
        variants.append(case)
        constant = _with_constant_inputs(case)
        if constant is not None:
            variants.append(constant)
    ort_passing = still_passing = changed = 0
    failures: list[str] = []
    known: list[str] = []
    fixed: list[str] = []
    for case in variants:
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                _check_with_ort(case.model, case)
        except Exception:
            continue  # ORT itself cannot run it: nothing for the passes to keep
        ort_passing += 1
        if case.name in EXCLUDED:
            continue
        failure, case_changed = _compiled_case_failure(case)
        changed += case_changed
        if failure is None:
            still_passing += 1
            if case.name in KNOWN_BROKEN:
                fixed.append(case.name)
        elif case.name in KNOWN_BROKEN:
            known.append(case.name)
        else:
            failures.append(f"{case.name}: {failure}")
    models = len(cases)
    summary = (
        f"ONNX backend node tests from {source}: {models} models + {len(variants) - models} with constant "
        f"inputs; {ort_passing} pass in ORT before; {still_passing} still pass after run_static_passes "
        f"({changed} of them changed by the passes); {len(EXCLUDED)} excluded, {len(known)} known broken, "
        f"{len(failures)} newly broken ({time.perf_counter() - start:.0f} s)"
    )
    with capsys.disabled():
        print("\n" + summary)
    assert not failures, summary + "\n" + "\n".join(failures)
    assert not fixed, f"these now pass, remove them from KNOWN_BROKEN: {fixed}"
