"""Memory at real size (issue 22), at small size: a bfloat16 OLMoE export is written to external data tensor by
tensor (never serialised whole in memory), compiles ``--weights int4`` as float32 computed lazily (ORT's CPU kernels
take no bf16 MatMul), and the compile's peak RSS grows far less with the layer count than the float32 weights do.

The models are OLMoE-shaped (transformers' OlmoeConfig), tiny, random and seeded, saved in bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

import onnx  # noqa: E402

from layerzero import hf_export  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")


def _olmoe(folder: Path, layers: int = 2, hidden: int = 64, experts: int = 4, vocab: int = 128) -> Path:
    torch.manual_seed(0)
    config = transformers.OlmoeConfig(
        hidden_size=hidden, intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, num_experts=experts, num_experts_per_tok=2, vocab_size=vocab,
        max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.2, eos_token_id=None,
        bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(folder))
    return folder


def test_export_writes_external_data_directly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above EXTERNAL_DATA_BYTES the exporter writes ``<out>.data`` itself; the weights are never serialised inline
    and moved afterwards (``_set_metadata``'s onnx.save with save_as_external_data: 6.5x the model at peak)."""
    hf = _olmoe(tmp_path / "hf")
    monkeypatch.setattr(hf_export, "EXTERNAL_DATA_BYTES", 4096)
    saves: list[dict] = []
    real_save = onnx.save

    def spy(*args, **kwargs):
        saves.append(kwargs)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(onnx, "save", spy)
    out = tmp_path / "model.onnx"
    hf_export.export_hf(hf, out)
    assert out.with_name("model.onnx.data").stat().st_size > 4096
    assert hf_export._external_locations(out) == {"model.onnx.data"}
    assert saves and not any(s.get("save_as_external_data") for s in saves), saves
    proto = onnx.load(str(out), load_external_data=False)
    kinds = {t.data_type for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert onnx.TensorProto.BFLOAT16 in kinds  # the exporter kept the checkpoint's bf16


def test_bfloat16_export_compiles_int4_verified_and_generates(tmp_path: Path) -> None:
    """A bf16 export compiles (ORT's CPU kernels take no bf16 MatMul, nor could verification draw bf16 inputs:
    ``cannot generate values of type bfloat16`` before): float32 computed, verified against the upcast original,
    int4 weights; the bundle's inputs and outputs are float32 and it generates."""
    from layerzero.compile import compile_file
    from layerzero.options import CompileOptions
    from layerzero.runtime import Engine

    hf = _olmoe(tmp_path / "hf")
    out = tmp_path / "model.onnx"
    hf_export.export_hf(hf, out)
    result = compile_file(out, tmp_path / "model.lz", CompileOptions(weights="int4"))
    assert result.verification is not None and result.verification.passed
    assert result.quantization["quantized"]["moe"] + result.quantization["quantized"]["matmul"] > 0
    compiled = onnx.load(str(tmp_path / "model.lz" / "model.onnx"), load_external_data=False)
    types = {v.type.tensor_type.elem_type for v in (*compiled.graph.input, *compiled.graph.output)}
    assert onnx.TensorProto.BFLOAT16 not in types
    ids = Engine.load(tmp_path / "model.lz").generate([5, 17, 3], max_new_tokens=4).ids
    assert len(ids) == 4
