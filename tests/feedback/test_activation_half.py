"""``--activation-sparsity`` on a float16 model (a Hugging Face model saved in float16, exported as it is).

The native form's kernel (``ai.layerzero::SparseLinear``) takes float32 activations; a float16 model's groups were
refused by the pass after the calibration had counted them, so such a compile wrote the dense model while its
summary and manifest said "native form, realized 0.30". Now x is cast to float32 for the kernel and its output
back (the weights stay float16, or become q4 with ``--weights int4``), and scale 0 is the dense compile to float16
rounding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from layerzero.runtime import Engine

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")

LAYERS, HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 2, 64, 128, 128, 4, 2
TARGET = 0.3
GROUPS = 4 * LAYERS  # per layer: q/k/v, o, gate/up, down


def _feeds(seq: int, seed: int) -> dict[str, np.ndarray]:
    """A prefill of ``seq`` tokens after 4 cached ones, the cache in float16 (the model's type)."""
    rng = np.random.default_rng(seed)
    past = 4
    feeds = {
        "input_ids": rng.integers(0, VOCAB, (1, seq), dtype=np.int64),
        "attention_mask": np.ones((1, past + seq), np.int64),
        "position_ids": np.arange(past, past + seq, dtype=np.int64)[None],
    }
    for i in range(LAYERS):
        for kind in ("key", "value"):
            shape = (1, KV_HEADS, past, HIDDEN // HEADS)
            feeds[f"past_key_values.{i}.{kind}"] = rng.standard_normal(shape).astype(np.float16)
    return feeds


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory):
    """A float16 tiny Llama's export, its dense compile and its compiles at --activation-sparsity 0.3 (float16
    weights, and --weights int4), with liblayerzero_ort.so built (the native form)."""
    from layerzero.cli import main
    from tests.plugins.native_build import build_ort_test_library

    tmp = tmp_path_factory.mktemp("activation_half")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().to(torch.float16).save_pretrained(tmp / "llama")
    assert main(["export", str(tmp / "llama"), "-o", str(tmp / "m.onnx")]) == 0
    mp = pytest.MonkeyPatch()
    mp.setenv("LAYERZERO_PLUGIN_DIR", str(build_ort_test_library().parent))
    try:
        assert main(["compile", str(tmp / "m.onnx"), "-o", str(tmp / "dense.lz")]) == 0
        sparse = ["compile", str(tmp / "m.onnx"), "--activation-sparsity", str(TARGET), "--max-deviation", "100"]
        assert main([*sparse, "-o", str(tmp / "sparse.lz")]) == 0
        assert main([*sparse, "-o", str(tmp / "sparse-int4.lz"), "--weights", "int4"]) == 0
    finally:
        mp.undo()
    return tmp


def _sparse_linears(bundle: Path) -> list[onnx.NodeProto]:
    model = onnx.load(bundle / "model.onnx", load_external_data=False)
    return [n for n in model.graph.node if n.op_type == "SparseLinear"]


def test_the_export_computes_in_float16(bundles: Path) -> None:
    model = onnx.load(bundles / "m.onnx", load_external_data=False)
    logits = next(o for o in model.graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == TensorProto.FLOAT16


@pytest.mark.parametrize(("bundle", "fmt"), [("sparse.lz", "f"), ("sparse-int4.lz", "q4")])
def test_every_group_becomes_the_native_kernel(bundles: Path, bundle: str, fmt: str) -> None:
    manifest = json.loads((bundles / bundle / "manifest.json").read_text())
    record = manifest["activation_sparsity"]
    assert record["form"] == "native" and record["refused"] == [], record["refused"]
    assert len(record["groups"]) == GROUPS and manifest["verification"]["passed"]
    assert manifest["verification"]["dense_at_scale_0"] is True
    nodes = _sparse_linears(bundles / bundle)
    assert len(nodes) == GROUPS
    assert {a.s.decode() for n in nodes for a in n.attribute if a.name == "weight_format"} == {fmt}
    if fmt == "f":  # the weights keep the model's type: half the bytes of float32
        model = onnx.load(bundles / bundle / "model.onnx", load_external_data=False)
        inits = {t.name: t.data_type for t in model.graph.initializer}
        assert {inits[n.input[1]] for n in nodes} == {TensorProto.FLOAT16}


@pytest.mark.parametrize("bundle", ["sparse.lz", "sparse-int4.lz"])
def test_requests_realize_the_sparsity_and_scale_0_is_the_dense_model(bundles: Path, bundle: str) -> None:
    feeds = _feeds(seq=12, seed=5)
    engine = Engine.load(bundles / bundle)
    result = engine.run(feeds)
    entries = {d["path"]: sum(d["params"]) for d in engine.manifest["dynamic"] if d["kind"] == "activation"}
    realized = sum(entries[p] * s for p, s in result.report.activation_sparsity.items()) / sum(entries.values())
    assert 0.15 < realized < 0.45, result.report.activation_sparsity
    assert result.outputs["logits"].dtype == np.float16
    off = engine.run(feeds, activation_scale=0.0)
    assert all(s == 0 for s in off.report.activation_sparsity.values())
    if bundle == "sparse.lz":  # float16 weights: the dense compile to float16 rounding (the kernel sums in float32)
        dense = Engine.load(bundles / "dense.lz").run(feeds).outputs
        for name, want in dense.items():
            got = off.outputs[name].astype(np.float32)
            scale = float(np.abs(want.astype(np.float32)).max())
            np.testing.assert_allclose(got, want.astype(np.float32), rtol=8 * 2**-10, atol=8 * 2**-10 * scale,
                                       err_msg=name)  # fmt: skip
        assert not np.allclose(result.outputs["logits"], dense["logits"], rtol=1e-2, atol=1e-2)


def _compile_int4(bundles: Path, monkeypatch: pytest.MonkeyPatch, out: str, *extra: str) -> Path:
    from layerzero.cli import main
    from tests.plugins.native_build import build_ort_test_library

    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(build_ort_test_library().parent))
    path = bundles / out
    if not path.exists():
        assert main(["compile", str(bundles / "m.onnx"), "-o", str(path), "--weights", "int4", *extra]) == 0
    return path


def test_native_linear_runs_a_float16_model(bundles: Path, caplog, monkeypatch: pytest.MonkeyPatch) -> None:
    """--linear-kernel native on a float16 model: every MatMulNBits became QLinear, x cast to float32 once per
    projection input (q / k / v and gate / up still merge) and the output back. Before, QLinear refused float16 x
    and every projection stayed ONNX Runtime's MatMulNBits (then with a warning saying so)."""
    import logging

    from layerzero import pipeline

    monkeypatch.setattr(pipeline, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="layerzero.pipeline"):
        native = _compile_int4(bundles, monkeypatch, "int4-native.lz", "--linear-kernel", "native")
    assert not [r.getMessage() for r in caplog.records if "--linear-kernel native" in r.getMessage()]
    model = onnx.load(native / "model.onnx", load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulNBits" not in ops
    qlinear = [n for n in model.graph.node if n.op_type == "QLinear"]
    assert len(qlinear) == 4 * LAYERS + 1  # q/k/v merged, o, gate/up merged, down; the lm_head
    assert sum(len(n.output) for n in qlinear) == 7 * LAYERS + 1
    casts = {n.output[0]: n for n in model.graph.node if n.op_type == "Cast"}
    assert all(n.input[0] in casts for n in qlinear)  # x cast to float32 ...
    readers = {i for n in model.graph.node if n.op_type == "Cast" for i in n.input}
    assert all(o in readers for n in qlinear for o in n.output)  # ... and each output back
    manifest = json.loads((native / "manifest.json").read_text())
    assert manifest["verification"]["passed"]
    # The same quantized weights through ONNX Runtime's float16 MatMulNBits: the same model to the rounding of x
    # (QLinear's int8 x per block, MatMulNBits' own) and of float16.
    ort_form = _compile_int4(bundles, monkeypatch, "int4-ort.lz", "--linear-kernel", "ort")
    feeds = _feeds(seq=6, seed=9)
    got = Engine.load(native).run(feeds).outputs
    want = Engine.load(ort_form).run(feeds).outputs
    assert got["logits"].dtype == np.float16
    for name, w in want.items():
        g, w32 = got[name].astype(np.float32), w.astype(np.float32)
        rel = float(np.linalg.norm(g - w32) / max(np.linalg.norm(w32), 1e-30))
        assert rel < 2e-2, (name, rel)
    assert np.array_equal(got["logits"][0, -1].argmax(), want["logits"][0, -1].argmax())


def test_native_linear_says_what_it_left(bundles: Path, caplog, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized MatMuls QLinear does not run (blocks of 64 here) stay ONNX Runtime's MatMulNBits, with one warning
    naming how many and why (before, the compile was silent)."""
    import logging

    from layerzero import pipeline

    monkeypatch.setattr(pipeline, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="layerzero.pipeline"):
        _compile_int4(bundles, monkeypatch, "int4-b64.lz", "--linear-kernel", "native", "--quant-block", "64")
    said = [r.getMessage() for r in caplog.records if "--linear-kernel native" in r.getMessage()]
    assert len(said) == 1 and "stay ONNX Runtime's MatMulNBits" in said[0] and "block_size=64" in said[0], said
