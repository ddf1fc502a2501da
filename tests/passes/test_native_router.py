"""``NativeRouter`` (passes/native_router.py) on the corpus' MoE generate exports (qwen3_moe: softmax, normalized;
mixtral), compiled to the native MoE op: each block's router Gemm, the confidence's Softmax / ReduceMax and the two
Reshapes around the block go into its ``ai.layerzero::MoE`` node; logits, presents, masks and router confidences
equal the unfused bundle's on ONNX Runtime (left-padded prefill and decode) to float32 rounding; a second run
changes nothing; the profiler's force-off variant puts the logits back and still runs; ``compile --weights int4
--linear-kernel native`` writes it and verifies."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from layerzero.cli import main
from layerzero.contract import CACHE_BUFFER_META_KEY, ROUTER_PREFIX
from layerzero.options import CompileOptions
from layerzero.passes._moe_node import MoENode, is_moe_node
from layerzero.passes.force_off import ExposeForceOff
from layerzero.passes.native_router import CONFIDENCE_OUTPUT, NativeRouter
from layerzero.passes.shape_inference import InferShapes
from tests.passes.test_fuse_decoder import LAYERS, _feeds
from tests.passes.test_fuse_decoder import _export as corpus_export
from tests.passes.test_native_attention import _session
from tests.plugins.native_build import build_ort_test_library


@pytest.fixture(scope="module")
def lib() -> Path:
    return build_ort_test_library()


def _native_bundle(family: str, tmp: Path, lib: Path, monkeypatch) -> ir.Model:
    from layerzero.compile import compile_file

    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(lib.parent))
    out = tmp / f"{family}.lz"
    compile_file(corpus_export(family), out, CompileOptions(moe_lowering="native", verify=False))
    return ir.load(out / "model.onnx")


def _fused(base: ir.Model) -> tuple[ir.Model, NativeRouter]:
    model = ir.from_proto(ir.serde.serialize_model(base))
    InferShapes()(model)
    step = NativeRouter()
    step(model)
    return model, step


def _same_outputs(lib: Path, base: ir.Model, other: ir.Model, extra: dict | None = None) -> None:
    s0, s1 = _session(lib, base), _session(lib, other)
    for label, (batch, seq, past) in {"prefill": (2, 6, 0), "decode": (2, 1, 5)}.items():
        feeds = _feeds(base, batch, seq, past, seed=len(label))
        got = dict(zip([o.name for o in s1.get_outputs()], s1.run(None, feeds | (extra or {}))))
        for name, a in zip([o.name for o in s0.get_outputs()], s0.run(None, feeds)):
            b = got[name]
            assert a.shape == b.shape, (label, name)
            if a.dtype == bool:
                assert np.array_equal(a, b), (label, name)
            else:
                scale = max(float(np.abs(a).max()), 1e-30)
                assert float(np.abs(b - a).max()) <= 2e-5 * scale, (label, name, float(np.abs(b - a).max()), scale)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routers_go_into_the_moe_nodes_with_the_same_outputs(lib, family, tmp_path, monkeypatch):
    base = _native_bundle(family, tmp_path, lib, monkeypatch)
    fused, step = _fused(base)
    nodes = [n for n in fused.graph if is_moe_node(n)]
    assert len(step.fused) == len(nodes) == LAYERS
    for node in nodes:
        view = MoENode.of(node)
        assert view.logits is None and view.router_weight is not None
        assert node.outputs[CONFIDENCE_OUTPUT].name == ROUTER_PREFIX + view.path
        assert node.outputs[CONFIDENCE_OUTPUT].is_graph_output()
        assert len(view.hidden.shape) == 3 and len(node.outputs[0].shape) == 3  # the block's own [B, T, H]
    before, after = Counter(n.op_type for n in base.graph), Counter(n.op_type for n in fused.graph)
    for op in ("Gemm", "Softmax", "ReduceMax"):  # the routers' (the attention keeps its own Softmax)
        assert before[op] - after[op] == LAYERS, op
    assert before["Reshape"] - after["Reshape"] >= 2 * LAYERS
    _same_outputs(lib, base, fused)


def test_second_run_changes_nothing(lib, tmp_path, monkeypatch):
    fused, _ = _fused(_native_bundle("qwen3_moe", tmp_path, lib, monkeypatch))
    before = ir.serde.serialize_model(fused).SerializeToString()
    again = NativeRouter()
    assert not again(fused).modified and again.fused == []
    assert ir.serde.serialize_model(fused).SerializeToString() == before


def test_force_off_variant_puts_the_logits_back(lib, tmp_path, monkeypatch):
    """The profiler's variant (``ExposeForceOff``) rewrites router logits: on a fused bundle it gets them back as a
    Gemm in the graph; with nothing forced off it computes what the fused bundle does, and forcing an expert off
    takes it out of every token's mask."""
    base = _native_bundle("qwen3_moe", tmp_path, lib, monkeypatch)
    fused, _ = _fused(base)
    variant = ir.from_proto(ir.serde.serialize_model(fused))
    expose = ExposeForceOff()
    expose(variant)
    assert len(expose.exposed) == LAYERS and not expose.missing
    forces = {v.name: np.zeros(v.shape.numpy(), bool) for v in variant.graph.inputs if "force_off" in (v.name or "")}
    _same_outputs(lib, fused, variant, forces)
    first = sorted(forces)[0]
    forces[first][0] = True
    s = _session(lib, variant)
    out = dict(zip([o.name for o in s.get_outputs()], s.run(None, _feeds(fused, 2, 6, 0, 1) | forces)))
    path = first.split("force_off::", 1)[1]
    assert not out["layerzero::mask::" + path][:, 0].any()


def test_compile_int4_native_writes_and_verifies_it(lib, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(lib.parent))
    out = tmp_path / "int4.lz"
    argv = ["compile", str(corpus_export("qwen3_moe")), "-o", str(out), "--weights", "int4"]
    assert main([*argv, "--linear-kernel", "native"]) == 0
    assert json.loads((out / "manifest.json").read_text())["verification"]["passed"]
    model = ir.load(out / "model.onnx")
    ops = Counter(n.op_type for n in model.graph)
    assert ops["MoE"] == LAYERS and "Gemm" not in ops and "ReduceMax" not in ops
    assert all(MoENode.of(n).router_weight is not None for n in model.graph if is_moe_node(n))
    # The int4 codes in the row kernels' chunked layout, experts and projections alike.
    assert all(MoENode.of(n).code_layout == "chunk16" for n in model.graph if is_moe_node(n))
    assert all(n.attributes["code_layout"].value == "chunk16" for n in model.graph if n.op_type == "QLinear")
    # generate's per-step skipped paths, found after the loop from copies of the masks (the bound outputs are
    # overwritten by the next step), equal those found at once (masks=True) and the copying loop's.
    from layerzero.runtime import Engine

    engine = Engine.load(out)
    assert engine.backend.session.get_modelmeta().custom_metadata_map.get(CACHE_BUFFER_META_KEY) == "1"
    prompt = [5, 9, 2, 14, 3]
    runs = [engine.generate(prompt, max_new_tokens=12, stop_tokens=()),
            engine.generate(prompt, max_new_tokens=12, stop_tokens=(), masks=True)]  # fmt: skip
    monkeypatch.setenv("LAYERZERO_KV_BUFFER", "0")
    runs.append(engine.generate(prompt, max_new_tokens=12, stop_tokens=()))
    steps = [[s.skipped_paths for s in run.report.steps] for run in runs]
    assert steps[0] == steps[1] == steps[2] and len(steps[0]) == 12
    assert len({tuple(s) for s in steps[0][1:]}) > 1  # the steps skipped different experts
    assert runs[0].ids == runs[1].ids == runs[2].ids
    assert runs[0].report.skipped_paths == runs[1].report.skipped_paths
