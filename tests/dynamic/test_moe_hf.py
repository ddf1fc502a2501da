"""Real exports: tiny Hugging Face Mixtral and Qwen2-MoE through torch.onnx, then LayerZero.

The exports are the export corpus's (``tests/corpus``: its family table, exporter and cache), with the
experts exported by transformers' ``batched_mm`` implementation (Mixtral, Qwen2-MoE), and Mixtral with the
corpus's dense implementation (every expert on every token, ``scatter`` routing matrix, ``einsum``).
Each compiled model must equal the exported original on a 1-token and a 32-token prompt (atol 1e-5), with
every MoE block rewritten (no GatherND / Einsum of expert weights left) and the Qwen2-MoE shared expert
untouched.
"""

from __future__ import annotations

import dataclasses
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))

from corpus_export import DENSE_EXPERTS, get_export  # noqa: E402
from corpus_families import FAMILIES, VOCAB  # noqa: E402

from layerzero.compile import compile_file, compile_model  # noqa: E402
from layerzero.options import CompileOptions  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402

pytestmark = pytest.mark.slow

EXPERTS = 4
LAYERS = 2
ATOL = 1e-5

EXPORTS = {
    "mixtral": FAMILIES["mixtral"],
    "qwen2_moe": FAMILIES["qwen2_moe"],
    "mixtral_dense": dataclasses.replace(FAMILIES["mixtral"], name="mixtral_dense", experts=DENSE_EXPERTS),
}


@pytest.fixture(scope="module", params=list(EXPORTS))
def export(request) -> tuple[str, Path]:
    family = EXPORTS[request.param]
    assert family.kwargs["num_local_experts"] == EXPERTS and family.kwargs["num_hidden_layers"] == LAYERS
    if request.param == "qwen2_moe":
        assert not transformers.Qwen2MoeConfig(**family.kwargs).norm_topk_prob  # top-k probabilities as they are
    cached = get_export(request.param, "dynamo", family=family)
    if cached.error:
        pytest.fail(f"the corpus export of {request.param} failed: {cached.error}")
    return request.param, cached.path


def _session(model: ir.Model | Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = str(model) if isinstance(model, Path) else ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _expert_compute(model: ir.Model) -> list[str]:
    """GatherND / MatMul nodes reading a 3-D constant (stacked expert weights), and Einsums."""
    out = []
    for node in model.graph:
        stacked = [v for v in node.inputs if v is not None and v.const_value is not None and v.shape.rank() == 3]
        if (node.op_type in ("GatherND", "MatMul") and stacked) or node.op_type == "Einsum":
            out.append(node.name)
    return out


@pytest.mark.parametrize("lowering", ["if", "ort-moe"])
def test_compiled_equals_export(export, lowering: str) -> None:
    name, path = export
    layers = LAYERS
    assert len(_expert_compute(ir.load(path))) == (3 if name == "mixtral_dense" else 2) * layers
    options = CompileOptions(moe_lowering=lowering, atol=ATOL, rtol=1e-5, shapes={"input_ids": (1, 32)})
    result = compile_model(path, options)
    assert result.verification.passed
    model = result.model
    assert _expert_compute(model) == []
    ops = [n.op_type for n in model.graph]
    if lowering == "if":
        assert ops.count("If") == EXPERTS * layers
    else:
        assert [n.op_type for n in model.graph if n.domain == "com.microsoft"] == ["MoE"] * layers
    paths = [f"model.layers.{i}.mlp" for i in range(layers)]
    assert [d["path"] for d in result.manifest(None, None)["dynamic"]] == paths
    if name == "qwen2_moe":
        # The shared expert and its sigmoid gate stay as exported.
        scopes = {n.metadata_props.get("pkg.torch.onnx.name_scopes", "") for n in model.graph}
        assert any("mlp.shared_expert_gate" in s for s in scopes)
        assert any("mlp.shared_expert.down_proj" in s for s in scopes)
    original, compiled = _session(path), _session(model)
    rng = np.random.default_rng(0)
    for seq in (1, 32):
        ids = rng.integers(3, VOCAB, (1, seq), dtype=np.int64)
        expected = original.run(["logits"], {"input_ids": ids})[0]
        got = compiled.run(["logits"], {"input_ids": ids})[0]
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    onnx_check.check_model(ir.to_proto(model))


def test_engine_report_on_export(export, tmp_path: Path) -> None:
    _, path = export
    bundle = tmp_path / "model.lz"
    compile_file(path, bundle, CompileOptions(shapes={"input_ids": (1, 16)}))
    engine = Engine.load(bundle)
    assert engine.output_names == ["logits"]
    ids = np.arange(5, dtype=np.int64)[None]
    result = engine.run({"input_ids": ids}, masks=True)
    report = result.report
    assert set(report.masks) == {d["path"] for d in engine.manifest["dynamic"]}
    expected_skips = []
    for entry in engine.manifest["dynamic"]:
        mask = report.masks[entry["path"]]
        assert mask.shape == (5, EXPERTS) and (mask.sum(axis=1) == 2).all()
        expected_skips += [entry["subpaths"][e] for e in range(EXPERTS) if not mask[:, e].any()]
    assert report.skipped_paths == expected_skips
    assert 1 / EXPERTS < report.routing_confidence <= 1.0
