"""Real MoE exports by router variant (issue 8 item 4): tiny Hugging Face configs, both torch.onnx exporters.

Each family is exported with ``_experts_implementation="batched_mm"`` by ``dynamo=True`` and by the
TorchScript exporter (``dynamo=False``, eager attention; transformers' packed-sequence check uses
``aten::diff``, which that exporter lacks: it is patched out, the exported prompt is one unpacked sequence).
The compiled model must have every MoE block in the skipping form (one ``If`` per expert, no stacked expert
weights left) and equal the export at 1 and 16 tokens within 1e-5.

Families and router variants:
- GraniteMoE, GraniteMoeShared: ``TopK`` of the raw logits, then ``Softmax`` of the k values.
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

from layerzero.compile import compile_model  # noqa: E402
from layerzero.options import CompileOptions  # noqa: E402
from layerzero.passes._dynamic import read_dynamic_paths  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 128
EXPERTS = 4
ATOL = 1e-5


def _granite_moe() -> torch.nn.Module:
    config = transformers.GraniteMoeConfig(
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
    return transformers.GraniteMoeForCausalLM(config)


def _granite_moe_shared() -> torch.nn.Module:
    config = transformers.GraniteMoeSharedConfig(
        hidden_size=64,
        intermediate_size=96,
        shared_intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.GraniteMoeSharedForCausalLM(config)


FAMILIES = {
    "granitemoe": (_granite_moe, 2, "model.layers.{}.block_sparse_moe"),
    # The shared MLP next to the routed experts stays as exported.
    "granitemoeshared": (_granite_moe_shared, 1, "model.layers.{}.block_sparse_moe"),
}


def _export(family: str, dynamo: bool, path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    build = FAMILIES[family][0]
    torch.manual_seed(0)
    model = build()
    model.config._experts_implementation = "batched_mm"
    model.config._attn_implementation = "sdpa" if dynamo else "eager"
    model.eval()
    ids = torch.randint(0, VOCAB, (1, 8))
    if dynamo:
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
    import transformers.masking_utils as masking_utils

    # aten::diff has no TorchScript symbolic; the check only matters for packed batches, which this is not.
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    try:
        torch.onnx.export(
            model,
            (ids,),
            str(path),
            dynamo=False,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_axes={"input_ids": {0: "batch", 1: "seq"}},
            opset_version=18,
        )
    except Exception as exc:  # the exporter's own error is the reason
        pytest.skip(f"{family}: the TorchScript exporter fails: {str(exc).splitlines()[0][:200]}")
    return path


@pytest.fixture(
    scope="module",
    params=[(f, d) for f in FAMILIES for d in (True, False)],
    ids=lambda p: f"{p[0]}-{'dynamo' if p[1] else 'torchscript'}",
)
def export(request, tmp_path_factory) -> tuple[str, Path]:
    family, dynamo = request.param
    with pytest.MonkeyPatch.context() as monkeypatch:
        path = _export(family, dynamo, tmp_path_factory.mktemp(family) / "model.onnx", monkeypatch)
    return family, path


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
    _, layers, scope = FAMILIES[family]
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
        ids = rng.integers(0, VOCAB, (1, seq), dtype=np.int64)
        expected = original.run(["logits"], _feeds(original, ids))[0]
        got = compiled.run(["logits"], _feeds(compiled, ids))[0]
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
