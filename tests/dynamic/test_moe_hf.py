"""Real exports: tiny Hugging Face Mixtral and Qwen2-MoE through torch.onnx, then LayerZero.

Experts exported with ``_experts_implementation="batched_mm"`` (Mixtral, Qwen2-MoE), and with a dense
implementation registered here (every expert on every token, ``scatter`` routing matrix, ``einsum``).
Each compiled model must equal the exported original on a 1-token and a 32-token prompt (atol 1e-5), with
every MoE block rewritten (no GatherND / Einsum of expert weights left) and the Qwen2-MoE shared expert
untouched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch", reason="real-export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="real-export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from layerzero.compile import compile_file, compile_model  # noqa: E402
from layerzero.options import CompileOptions  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 128
EXPERTS = 4
ATOL = 1e-5


def _mixtral() -> torch.nn.Module:
    config = transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe() -> torch.nn.Module:
    config = transformers.Qwen2MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    assert not config.norm_topk_prob  # Qwen2-MoE: top-k probabilities, not renormalised
    return transformers.Qwen2MoeForCausalLM(config)


def _dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert on every token ([E, T, ...]), combined with the [T, E] routing matrix."""
    gate, up = torch.matmul(hidden_states, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.matmul(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))  # [E, T, H]
    routing = torch.zeros(hidden_states.shape[0], self.num_experts, dtype=top_k_weights.dtype)
    return torch.einsum("te,eth->th", routing.scatter(1, top_k_index, top_k_weights), out)


transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS.register("layerzero_dense", _dense_experts_forward)

EXPORTS = {
    "mixtral": ("batched_mm", lambda: _mixtral()),
    "qwen2_moe": ("batched_mm", lambda: _qwen2_moe()),
    "mixtral_dense": ("layerzero_dense", lambda: _mixtral()),
}


def _export(name: str, path: Path) -> Path:
    implementation, build = EXPORTS[name]
    torch.manual_seed(0)
    model = build()
    model.config._experts_implementation = implementation
    model.config._attn_implementation = "sdpa"
    model.eval()
    ids = torch.randint(0, VOCAB, (1, 8))
    program = torch.onnx.export(
        model,
        (ids,),
        dynamo=True,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}},
    )
    program.save(str(path))
    return path


@pytest.fixture(scope="module", params=list(EXPORTS))
def export(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _export(request.param, tmp_path_factory.mktemp(request.param) / "model.onnx")


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
    layers = 1 if name == "qwen2_moe" else 2
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
        ids = rng.integers(0, VOCAB, (1, seq), dtype=np.int64)
        expected = original.run(["logits"], {"input_ids": ids})[0]
        got = compiled.run(["logits"], {"input_ids": ids})[0]
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


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
