"""Chunked verification of compiled MoE models, every lowering (issue 8 item 5).

A small MoE model saved with external data is compiled with ``chunked_verify_bytes`` far below its weights,
so verification runs the original and the compiled model a few nodes at a time with memory-mapped and
borrowed weights: the per-expert ``If`` subgraphs read root initializers the lowering creates, and
``add_external_initializers`` refuses any array ORT would have to copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import layerzero.chunked as chunked
from layerzero.compile import compile_file
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds
from layerzero.options import CompileOptions
from layerzero.runtime import Engine

CONFIG = MoEConfig(hidden=64, ffn=256, experts=4, top_k=2, layers=2, residual=True)


def _save_external(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save_model(
        model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data",
        size_threshold=0,
    )  # fmt: skip
    return path


@pytest.mark.parametrize("lowering", ["if", "ort-moe"])
@pytest.mark.parametrize("form", ["batched_mm", "dense"])
def test_chunked_verification_of_every_lowering(tmp_path: Path, monkeypatch, lowering: str, form: str) -> None:
    config = MoEConfig(**{**CONFIG.__dict__, "form": form})
    src = _save_external(build_moe(config), tmp_path / "m.onnx")
    chunks: list[int] = []
    real = chunked._run_chunk

    def counting(model, chunk, index, *args, **kwargs):
        chunks.append(index)
        return real(model, chunk, index, *args, **kwargs)

    monkeypatch.setattr(chunked, "_run_chunk", counting)
    # ~1.6 MB of weights (per-expert lowered matrices of 128 KiB, above the embedding limit); chunks of 256 KiB.
    result = compile_file(src, tmp_path / "m.lz", CompileOptions(chunked_verify_bytes=512 << 10, moe_lowering=lowering))
    assert result.verification is not None and result.verification.passed
    assert max(chunks) >= 2, "verification did not run in chunks"
    manifest = Engine.load(tmp_path / "m.lz").manifest
    assert [d["detail"]["lowering"] for d in manifest["dynamic"]] == [lowering] * 2
    feeds = moe_feeds(config, 16, seed=3)
    got = Engine.load(tmp_path / "m.lz").run(feeds).outputs["y"]
    want = Engine.load(src).run(feeds).outputs["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_run_in_chunks_lends_non_contiguous_weights_read_by_subgraphs() -> None:
    # A Fortran-ordered initializer of the root graph read inside an If branch: ORT must not be handed a copy.
    weight = np.asfortranarray(np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32))
    model = onnx.parser.parse_model(
        """<ir_version: 10, opset_import: ["" : 18]>
        g (float[N, 64] x, bool c) => (float[N, 512] y) <float[1] w = {0.0}> {
            y = If(c) <then_branch = t () => (float[N, 512] a) { a = MatMul(x, w) },
                       else_branch = e () => (float[N, 512] b) { b = MatMul(x, w) }>
        }"""
    )
    ir_model = ir.from_proto(model)
    value = ir_model.graph.initializers["w"]
    value.const_value = ir.tensor(weight, name="w")
    value.shape = ir.Shape(weight.shape)
    assert not ir_model.graph.initializers["w"].const_value.numpy().flags["C_CONTIGUOUS"]
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    names, outputs = chunked.run_in_chunks(ir_model, {"x": x, "c": np.array(True)}, budget_bytes=1)
    assert names == ["y"]
    np.testing.assert_allclose(outputs[0], x @ weight, rtol=1e-5, atol=1e-4)
