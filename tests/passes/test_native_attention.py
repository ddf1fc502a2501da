"""``NativeAttention`` (passes/native_attention.py) on real exports: a tiny Llama with grouped-query attention (4 query
heads, 2 kv heads: FuseDecoder's repeat_kv form) and with as many kv as query heads, exported by ``layerzero export``
(torch.onnx dynamo) and fused as the compile does (``FuseDecoder`` first). Each layer's attention core and its
cache's two Concats become one ``ai.layerzero::Attention``; the logits and the presents equal the unfused graph's on
ONNX Runtime (prefill, decode with a past, a left-padded batch) to float32 rounding; a second run changes nothing;
the TorchScript export's form is left as it is; ``compile --weights int4 --linear-kernel native`` writes it and
verifies."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.cli import main
from layerzero.options import CompileOptions
from layerzero.passes.native_attention import NativeAttention
from layerzero.passes.shape_inference import InferShapes
from layerzero.pipeline import fuse_decoder
from tests.plugins.native_build import build_ort_test_library

LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 4, 16, 100


def _export(tmp: Path, kv_heads: int, exporter: str, family: str = "llama") -> Path:
    torch = pytest.importorskip("torch", reason="the Llama exports need torch")
    transformers = pytest.importorskip("transformers", reason="the Llama exports need transformers")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    torch.manual_seed(0)
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}  # fmt: skip
    config_class, model_class = classes[family]
    extra = {"sliding_window": 4} if family == "mistral" else {}
    config = config_class(
        **extra,
        hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None, head_dim=HEAD_DIM,
    )  # fmt: skip
    model_class(config).eval().save_pretrained(tmp / "hf")
    out = tmp / "export" / "model.onnx"
    argv = ["export", str(tmp / "hf"), "-o", str(out)] + (["--exporter", "torchscript"] if exporter == "ts" else [])
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def lib() -> Path:
    return build_ort_test_library()


@pytest.fixture(scope="module", params=[("llama", 2), ("llama", 4), ("qwen3", 2)], ids=["gqa", "mha", "qwen3-qk-norm"])
def export(request, tmp_path_factory) -> tuple[Path, int]:
    family, kv_heads = request.param
    path = _export(tmp_path_factory.mktemp(f"attn-{family}{kv_heads}"), kv_heads, "dynamo", family)
    return path, kv_heads


def _fused(path: Path) -> tuple[ir.Model, ir.Model, NativeAttention]:
    model = ir.load(path)
    fuse_decoder(model, CompileOptions())
    base = ir.from_proto(ir.serde.serialize_model(model))
    InferShapes()(model)
    step = NativeAttention()
    step(model)
    return base, model, step


def _session(lib: Path, model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(lib))
    options.log_severity_level = 3
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), options)


def _feeds(sess: ort.InferenceSession, rng, kv_heads: int, batch: int, tokens: int, past: int) -> dict:
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, VOCAB, (batch, tokens)).astype(np.int64)
        elif i.name == "attention_mask":
            mask = np.ones((batch, past + tokens), np.int64)
            mask[0, : min(2, past)] = 0  # row 0 left-padded (the batcher's form)
            feeds[i.name] = mask
        elif i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(past, past + tokens), (batch, 1)).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal((batch, kv_heads, past, HEAD_DIM)).astype(np.float32)
    return feeds


def test_each_layer_becomes_one_node_with_the_same_outputs(lib, export):
    path, kv_heads = export
    base, fused, step = _fused(path)
    ops = Counter(n.op_type for n in fused.graph)
    assert ops["Attention"] == LAYERS and "Softmax" not in ops and "IsNaN" not in ops and not step.refused
    assert len(step.fused) == LAYERS
    nodes = [n for n in fused.graph if n.op_type == "Attention"]
    # The heads' split, RMS norm (Qwen3's q / k norm), transpose and rotary went into the op (input_layout "bsh"),
    # and the caches' Concats (its past form): it reads the projections and writes the presents, the graph outputs.
    assert all(n.domain == "ai.layerzero" and n.attributes["input_layout"].value == "bsh" for n in nodes)
    assert all(len(n.inputs) == 11 and len(n.outputs) == 3 for n in nodes)
    assert not {"RotaryEmbedding", "Transpose"} & set(ops)
    # The rotary tables' nodes went too: the op computes cos / sin of position * inv_freq (rotary_form inv_freq).
    assert all(n.attributes["rotary_form"].value == "inv_freq" and n.inputs[9] is None for n in nodes)
    # And the exporter's mask: the op reads attention_mask itself (mask_form padding_causal, probed equal).
    assert step.mask_folded and all(n.attributes["mask_form"].value == "padding_causal" for n in nodes)
    assert all(n.inputs[3].name == "attention_mask" for n in nodes) and not {"GatherND", "Where"} & set(ops)
    assert not {"Cos", "Sin"} & set(ops)
    assert Counter(n.op_type for n in base.graph)["Concat"] - ops["Concat"] >= 2 * LAYERS  # (+ dead shape Concats)
    presents = {o.name for n in nodes for o in n.outputs[1:]}
    assert presents == {f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")}
    removed = sum(len(g) for g in base.graphs()) - sum(len(g) for g in fused.graphs())
    assert removed >= 18 * LAYERS  # MHA 20 a layer (the core 9, the caches' Concats, the heads' 9 views)
    s0, s1 = _session(lib, base), _session(lib, fused)
    rng = np.random.default_rng(kv_heads)
    for batch, tokens, past in [(1, 1, 7), (2, 3, 5), (1, 6, 0), (2, 1, 40)]:
        feeds = _feeds(s0, rng, kv_heads, batch, tokens, past)
        for name, a, b in zip([o.name for o in s0.get_outputs()], s0.run(None, feeds), s1.run(None, feeds)):
            assert a.shape == b.shape, name
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-5, err_msg=name)


def test_second_run_changes_nothing(export):
    _, fused, _ = _fused(export[0])
    before = ir.serde.serialize_model(fused).SerializeToString()
    again = NativeAttention()
    assert not again(fused).modified and again.fused == [] and again.refused == []
    assert ir.serde.serialize_model(fused).SerializeToString() == before


@pytest.mark.slow
def test_torchscript_form_is_left_as_it_is(tmp_path):
    """The TorchScript exporter scales the scores after the MatMul and casts the probabilities: not this pattern
    (yet); the graph is left unchanged, its Softmax nodes still there."""
    _, fused, step = _fused(_export(tmp_path, 2, "ts"))
    assert step.fused == [] and Counter(n.op_type for n in fused.graph)["Softmax"] == LAYERS


def test_compile_int4_native_writes_and_verifies_it(lib, export, tmp_path, monkeypatch):
    path, _ = export
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(lib.parent))
    out = tmp_path / "int4.lz"
    assert main(["compile", str(path), "-o", str(out), "--weights", "int4", "--linear-kernel", "native"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["passed"]
    ops = Counter(n.op_type for n in ir.load(out / "model.onnx").graph)
    assert ops["Attention"] == LAYERS and ops["QLinear"] >= 1 and "Softmax" not in ops
    # Without the native linear kernel nothing of it: MatMulNBits and ONNX Runtime's own attention nodes.
    plain = tmp_path / "plain.lz"
    assert main(["compile", str(path), "-o", str(plain), "--weights", "int4"]) == 0
    assert "Attention" not in Counter(n.op_type for n in ir.load(plain / "model.onnx").graph)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_corpus_families_fuse_to_one_node_a_layer_with_the_same_outputs(lib, family, tmp_path):
    """The corpus' generate exports of four families (tests/corpus): every layer's attention, its cache Concats and
    its heads' preparation become one bsh node; logits and presents equal the unfused graph's (FuseDecoder's only)
    on a left-padded prefill and decode."""
    from tests.passes.test_fuse_decoder import LAYERS as CORPUS_LAYERS
    from tests.passes.test_fuse_decoder import _export as corpus_export
    from tests.passes.test_fuse_decoder import _feeds as corpus_feeds

    base, fused, step = _fused(corpus_export(family))
    nodes = [n for n in fused.graph if n.op_type == "Attention"]
    assert len(step.fused) == CORPUS_LAYERS and not step.refused
    assert all(n.attributes["input_layout"].value == "bsh" for n in nodes)
    assert all(n.attributes["mask_form"].value == "padding_causal" for n in nodes)
    gone = {"RotaryEmbedding", "Transpose", "Cos", "Sin"}
    assert not gone & {n.op_type for n in fused.graph}  # (a router keeps its Softmax)
    s0, s1 = _session(lib, base), _session(lib, fused)
    for label, (batch, seq, past) in {"prefill": (2, 6, 0), "decode": (2, 1, 5)}.items():
        feeds = corpus_feeds(base, batch, seq, past, seed=len(label))
        for name, a, b in zip([o.name for o in s0.get_outputs()], s0.run(None, feeds), s1.run(None, feeds)):
            scale = max(float(np.abs(a).max()), 1e-30)
            assert float(np.abs(b - a).max()) <= 1e-5 * scale, (label, name)


def test_native_without_the_library_warns_and_keeps_matmulnbits(export, tmp_path, monkeypatch, caplog):
    """``--linear-kernel native`` where liblayerzero_ort.so is not built: a warning saying so (once), and the bundle
    holds ONNX Runtime's own ops (MatMulNBits, its attention nodes), not an op it could not load."""
    import layerzero.pipeline as pipeline

    monkeypatch.setattr("layerzero.plugins.ort_library.find_ort_library", lambda *a, **k: None)
    monkeypatch.setattr(pipeline, "_WARNED", set())
    out = tmp_path / "int4.lz"
    with caplog.at_level("WARNING", logger="layerzero.pipeline"):
        assert main(["compile", str(export[0]), "-o", str(out), "--weights", "int4", "--linear-kernel", "native",
                     "--no-verify"]) == 0  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "liblayerzero_ort.so is not built" in r.getMessage()]
    assert len(warned) == 1 and "stay ONNX Runtime's MatMulNBits" in warned[0]
    ops = Counter(n.op_type for n in ir.load(out / "model.onnx").graph)
    assert ops["MatMulNBits"] > 0 and not {"QLinear", "Attention"} & set(ops)


def test_a_sliding_window_mask_is_not_folded(lib, tmp_path):
    """Mistral with a 4-token window: its mask is not the padding-causal one (the probes longer than the window
    tell), so the op keeps the graph's mask (and no cache buffers); the outputs equal the unfused graph's."""
    base, fused, step = _fused(_export(tmp_path, 2, "dynamo", "mistral"))
    nodes = [n for n in fused.graph if n.op_type == "Attention"]
    assert len(nodes) == LAYERS and not step.mask_folded and not step.cache_buffer
    assert all("mask_form" not in n.attributes and n.inputs[3].name != "attention_mask" for n in nodes)
    s0, s1 = _session(lib, base), _session(lib, fused)
    feeds = _feeds(s0, np.random.default_rng(5), 2, 2, 3, 9)
    for name, a, b in zip([o.name for o in s0.get_outputs()], s0.run(None, feeds), s1.run(None, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-5, err_msg=name)
