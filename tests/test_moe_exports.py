"""Real MoE exports by router variant (issue 8 item 4): the export corpus's GraniteMoE families, both exporters.

The exports are the corpus's (``tests/corpus``: family table, exporter, cache): ``batched_mm`` experts,
``dynamo=True`` and the TorchScript exporter (``dynamo=False``, eager attention, opset 17). The compiled model
must have every MoE block in the skipping form (one ``If`` per expert, no stacked expert weights left) and
equal the export at 1 and 16 tokens within 1e-5.

Families and router variants:
- GraniteMoE, GraniteMoeShared: ``TopK`` of the raw logits, then ``Softmax`` of the k values (GraniteMoeShared's
  shared MLP next to the routed experts stays as exported);
- issue 20's shapes: qwen3_moe_dense (every expert on every token, a scatter-built ``[T, E]`` routing matrix,
  ``Einsum``), llama4_nope (``TopK`` of the logits, then ``Sigmoid`` of the k values; the experts read their
  tokens scaled by it), jetmoe_wide (sorted experts selecting ``weight[i]`` of weights too large to fold; the
  TorchScript export does not run at 1 token: skipped with the exporter's error).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from tests import onnx_check

torch = pytest.importorskip("torch", reason="real-export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="real-export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

sys.path.insert(0, str(Path(__file__).resolve().parent / "corpus"))

from corpus_export import get_export  # noqa: E402
from corpus_families import FAMILIES, VOCAB  # noqa: E402

from layerzero.compile import compile_model  # noqa: E402
from layerzero.options import CompileOptions  # noqa: E402
from layerzero.passes._dynamic import read_dynamic_paths  # noqa: E402

pytestmark = pytest.mark.slow

EXPERTS = 4
ATOL = 1e-5
SCOPE = {
    "granitemoe": "model.layers.{}.block_sparse_moe",
    "granitemoeshared": "model.layers.{}.block_sparse_moe",
    "qwen3_moe_dense": "model.layers.{}.mlp",
    "llama4_nope": "model.layers.{}.feed_forward",
    "jetmoe_wide": "model.layers.{}.mlp",
}


@pytest.fixture(
    scope="module",
    params=[(f, e) for f in SCOPE for e in ("dynamo", "torchscript")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def export(request) -> tuple[str, Path]:
    family, exporter = request.param
    assert FAMILIES[family].kwargs["num_local_experts"] == EXPERTS
    cached = get_export(family, exporter)
    if cached.error:  # the exporter's own error is the reason
        pytest.skip(f"{family}: the {exporter} exporter fails: {cached.error}")
    try:  # as the corpus does: an export that does not run at 1 token is the exporter's failure
        session = _session(cached.path)
        session.run(["logits"], _feeds(session, np.array([[3]], np.int64)))
    except Exception as exc:  # e.g. a TorchScript trace that kept the example's expert sizes in a Split
        pytest.skip(f"{family}: the {exporter} export does not run at 1 token: {str(exc).splitlines()[0][:200]}")
    return family, cached.path


def _session(model: ir.Model | Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = str(model) if isinstance(model, Path) else ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession, ids: np.ndarray) -> dict[str, np.ndarray]:
    feeds = {"input_ids": ids}
    for extra in session.get_inputs():
        if extra.name == "logits_to_keep":  # TorchScript keeps the argument as an input: 0 = every position
            feeds[extra.name] = np.array(0, np.int64)
    return feeds


def test_compiled_export_skips_experts_and_equals_the_export(export) -> None:
    family, path = export
    layers, scope = FAMILIES[family].kwargs["num_hidden_layers"], SCOPE[family]
    result = compile_model(path, CompileOptions(moe_lowering="if", atol=ATOL, rtol=1e-5, shapes={"input_ids": (1, 16)}))
    assert result.verification.passed
    model = result.model
    assert [d.path for d in read_dynamic_paths(model)] == [scope.format(i) for i in range(layers)]
    assert [n.op_type for n in model.graph].count("If") == EXPERTS * layers
    stacked = [
        n.name
        for n in model.graph
        if n.op_type in ("GatherND", "Gather", "MatMul")
        and any(v is not None and v.const_value is not None and v.shape.rank() == 3 for v in n.inputs)
    ]
    assert stacked == []
    original, compiled = _session(path), _session(model)
    rng = np.random.default_rng(0)
    for seq in (1, 16):
        ids = rng.integers(3, VOCAB, (1, seq), dtype=np.int64)
        expected = original.run(["logits"], _feeds(original, ids))[0]
        got = compiled.run(["logits"], _feeds(compiled, ids))[0]
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    onnx_check.check_model(ir.to_proto(model))
