"""The MoE rewrite of an external-data model reads its experts one at a time (issue 22: a 7B-class MoE compiles in
int4 size + 2 GB): ``SkipExperts`` leaves the node's stacked weights as ``ExpertTensor``\\ s over the file
(``passes/_moe/lazy.py``), never float copies of every layer's experts, and ``QuantizeWeights`` quantizes them expert
by expert into codes equal to the whole stack's. Memory is what Python's allocator traces (numpy reports its arrays
to ``tracemalloc``): before, the rewrite alone allocated every layer's transposed / split float experts."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from layerzero.loader import _upcast_tensor, load_model
from layerzero.models.moe import MoEConfig, build_moe
from layerzero.passes._moe.lazy import ExpertTensor, expert_stack, stack_of
from layerzero.passes._moe_node import MoENode, is_moe_node
from layerzero.passes.moe import SkipExperts
from layerzero.passes.quantize_weights import QuantizeWeights
from layerzero.passes.shape_inference import InferShapes

LAYERS, HIDDEN, FFN, EXPERTS = 3, 256, 256, 8


def _model(tmp_path: Path, form: str) -> tuple[onnx.ModelProto, Path]:
    config = MoEConfig(form=form, layers=LAYERS, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, residual=True,
                       fused_gate_up=form != "batched_mm")  # fmt: skip
    proto = build_moe(config)
    path = tmp_path / "moe.onnx"
    saved = onnx.ModelProto()
    saved.CopyFrom(proto)  # onnx.save_model makes the proto's tensors external in place
    onnx.save_model(saved, str(path), save_as_external_data=True, location="moe.onnx.data", size_threshold=1024)
    return proto, path


def _rewritten(model: ir.Model) -> list[MoENode]:
    InferShapes()(model)
    assert SkipExperts()(model).modified
    return [MoENode.of(n) for n in model.graph if is_moe_node(n)]


def _expert_bytes(model: ir.Model) -> int:
    """The float bytes of the model's stacked (rank-3) weights: what the rewrite used to copy."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if len(v.shape or ()) == 3)


@pytest.mark.parametrize("form", ["batched_mm", "dense"])
def test_rewrite_of_external_data_reads_experts_lazily_and_quantizes_the_same_codes(tmp_path: Path, form: str) -> None:
    proto, path = _model(tmp_path, form)
    model = load_model(path)
    floats = _expert_bytes(model)
    assert floats >= LAYERS * 3 * EXPERTS * HIDDEN * FFN * 4
    tracemalloc.start()
    try:
        nodes = _rewritten(model)
        _, rewrite_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        assert len(nodes) == LAYERS
        for view in nodes:
            for value in (view.w_gate, view.w_up, view.w_down):
                assert isinstance(value.const_value, ExpertTensor), value.name
        step = QuantizeWeights(4)
        step(model)
        _, quant_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert step.quantized["moe"], step.kept
    # The rewrite holds no stacked weight (before: every layer's, transposed and split); the quantization one expert's
    # floats (and its working arrays) at a time, plus the codes it writes (1/8 of the floats in int4, scales 1/16).
    assert rewrite_peak < floats / (3 * LAYERS), (rewrite_peak, floats)
    assert quant_peak < floats / 3, (quant_peak, floats)

    eager = ir.from_proto(proto)  # the same model in memory: the rewrite reads it whole, as before
    eager_nodes = _rewritten(eager)
    assert all(stack_of(v.w_gate) is None for v in eager_nodes)
    QuantizeWeights(4)(eager)
    got = [MoENode.of(n) for n in model.graph if is_moe_node(n)]
    want = [MoENode.of(n) for n in eager.graph if is_moe_node(n)]
    for a, b in zip(got, want, strict=True):
        assert a.weight_format == b.weight_format == "q4"
        for slot in ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"):
            np.testing.assert_array_equal(getattr(a, slot).const_value.numpy(), getattr(b, slot).const_value.numpy())


def test_a_second_load_of_the_file_shares_the_expert_codes(tmp_path: Path) -> None:
    """The verification's quantized-dense reference loads the source again: its experts' codes are the compiled
    model's arrays (read-only), not a second copy of the int4 bytes; another bit width gets its own."""
    _, path = _model(tmp_path, "batched_mm")
    models = [load_model(path) for _ in range(3)]
    for model, bits in zip(models, (4, 4, 8)):
        _rewritten(model)
        QuantizeWeights(bits)(model)
    first, second, other = ([MoENode.of(n) for n in m.graph if is_moe_node(n)] for m in models)
    for a, b, c in zip(first, second, other, strict=True):
        for slot in ("w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"):
            mine, theirs = getattr(a, slot).const_value.numpy(), getattr(b, slot).const_value.numpy()
            assert mine is theirs and not mine.flags.writeable, slot
            assert getattr(c, slot).const_value.numpy() is not mine


def test_a_bfloat16_external_stack_is_read_one_expert_at_a_time(tmp_path: Path) -> None:
    """The loader's bfloat16 views (float32 computed from bf16 external data) name their source, so one expert is
    read from the file alone, equal to that expert of the whole upcast tensor."""
    rng = np.random.default_rng(0)
    floats = rng.normal(0, 1, (5, 6, 32)).astype(np.float32)
    bits = (floats.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bfloat16
    data = tmp_path / "w.data"
    data.write_bytes(b"\0" * 64 + bits.tobytes())
    source = ir.ExternalTensor(data.name, 64, bits.nbytes, ir.DataType.BFLOAT16, shape=ir.Shape(bits.shape),
                               name="w", base_dir=str(tmp_path))  # fmt: skip
    value = ir.Value(name="w", const_value=_upcast_tensor(source, "w"), shape=ir.Shape(bits.shape))
    stack = expert_stack(value)
    assert stack is not None and stack.shape == (5, 6, 32) and stack.dtype == np.float32
    whole = value.const_value.numpy()
    for e in range(5):
        np.testing.assert_array_equal(stack.expert(e), whole[e])
    np.testing.assert_array_equal(np.asarray(stack.transposed()), whole.transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(stack.rows(np.arange(1, 6, 2))), whole[:, 1::2])


def test_the_native_lowering_reads_no_expert(tmp_path: Path) -> None:
    """``LowerMoE`` keeps the node for liblayerzero_ort.so without reading its experts (before: ``MoESpec.of`` read
    every block's stack whole, 1.6 GB a block at OLMoE-1B-7B's shape); the ``if`` lowering lays them out, so reads."""
    from layerzero.passes.lower_moe import LowerMoE

    for lowering, reads in (("native", False), ("if", True)):
        _, path = _model(tmp_path, "batched_mm")
        model = load_model(path)
        _rewritten(model)
        floats = _expert_bytes(model)
        tracemalloc.start()
        try:
            step = LowerMoE(lowering, native_present=True)
            step(model)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert [k for _, k in step.lowered] == [lowering] * LAYERS
        if reads:
            assert peak > floats / (3 * LAYERS), (lowering, peak, floats)  # at least one block's gate read
        else:
            assert peak < floats / (3 * LAYERS * 8), (lowering, peak, floats)
