"""FoldZeroFlags on real exports: a declared flag on the last decoder layer of every exporter's graph shape.

Unit graphs (ONNX text) pin the two rules the exports need (FoldZeroFlags Case 5):
- nodes with no scope that lie between two of a layer's nodes are the layer's (the dynamo exporter's
  unscoped ``Split`` of a fused projection made every last layer of GPT-2, GPT-NeoX, Phi-3 and the MoE
  families seem to have two outputs);
- the residual input's shape is matched to the output's by operand-based shape rules, not by the dim names
  shape inference gave (TorchScript exports name almost no intermediate dim).

Export tests (slow; the export corpus's cached exports, ``tests/corpus``) check the meaning, independently
of the pass: the bypassed export equals transformers' model run with that layer replaced by the identity
(a forward hook returns the layer's input), on seeded prompts, and the un-bypassed export does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from layerzero.errors import UnsupportedModelError
from layerzero.passes import FoldZeroFlags, InferShapes, RemoveDeadCode
from layerzero.passes._graph import same_shape
from tests.passes.onnx_text import HEADER, WITHOUT_BLOCK, floats

# A gated MLP block in scope `blk` with a fused gate_up projection whose Split has no scope (as the dynamo
# exporter's optimizer writes it): o = h + gate * up, with [gate, up] = Split(h @ w).
FUSED = (
    HEADER
    + f"""
    g (float[N, 4] x) => (float[N, 4] y{{EXTRA_OUT}})
      <float[4, 8] w = {{{floats(32, 0)}}}, float[1] "blk.flag" = {{0.0}}> {{
        ["/pre/Relu"] h = Relu(x)
        ["/blk/gate_up/MatMul"] gu = MatMul(h, w)
        ["node_Split_7"] gate, up = Split <axis = -1, num_outputs = 2> (gu)
        ["/blk/Mul"] m = Mul(gate, up)
        ["/blk/Add"] o = Add(h, m)
        ["/post/Neg"] y = Neg(o){{EXTRA_NODE}}
    }}
    """
)


def _fused(extra_out: str = "", extra_node: str = "") -> str:
    return FUSED.replace("{EXTRA_OUT}", extra_out).replace("{EXTRA_NODE}", extra_node)


def test_unscoped_node_inside_the_layer_is_bypassed_with_it(helpers):
    # before: Relu, MatMul, Split (no scope), Mul, Add, Neg      after DCE: Relu, Neg
    flags = FoldZeroFlags()
    check = helpers.check_pass(_fused(), lambda: flags, modified=True, delta=0, dce_delta=-4, reference=WITHOUT_BLOCK)
    assert check.ops() == {"Relu": 1, "Neg": 1}
    assert [(b.scope, b.nodes) for b in flags.bypassed] == [("blk", 4)]  # the Split counts as the layer's


def test_unscoped_node_inside_the_layer_read_outside_is_refused(helpers):
    # The Split's gate half is also a graph output: it depends on the residual, so the layer has two outputs.
    model = helpers.parse(_fused(", float[N, 4] z", '\n        ["/post/Exp"] z = Exp(gate)'))
    helpers.infer_shapes(model)
    with pytest.raises(UnsupportedModelError, match=r"scope 'blk' has 2 outputs \('gate', 'o'\)"):
        FoldZeroFlags()(model)


def test_unscoped_node_outside_the_layer_stays(helpers):
    # A node without scope that reads the layer's output but feeds no layer node is not the layer's.
    text = (
        HEADER
        + f"""
        g (float[N, 4] x) => (float[N, 4] y) <float[4, 4] w = {{{floats(16, 1)}}}, float[1] "blk.flag" = {{0.0}}> {{
            ["/pre/Relu"] h = Relu(x)
            ["/blk/MatMul"] m = MatMul(h, w)
            ["/blk/Add"] o = Add(h, m)
            ["node_Sin_3"] y = Sin(o)
        }}
        """
    )
    reference = HEADER + "\ng (float[N, 4] x) => (float[N, 4] y) {\n h = Relu(x)\n y = Sin(h)\n}\n"
    check = helpers.check_pass(text, FoldZeroFlags, modified=True, delta=0, dce_delta=-2, reference=reference)
    assert check.ops() == {"Relu": 1, "Sin": 1}


# The layer's output and its residual input carry different dim names, as in a TorchScript export after
# shape inference (``unk__N``); the layer's Reshape to ``Shape(h)`` proves them equal from the operands.
UNNAMED = (
    HEADER
    + f"""
    g (float[N, 4] x) => (float[N, 4] y) <float[4, 4] w = {{{floats(16, 2)}}}, float[1] "blk.flag" = {{0.0}}> {{
        ["/pre/Relu"] h = Relu(x)
        ["/blk/Shape"] s = Shape(h)
        ["/blk/MatMul"] m = MatMul(h, w)
        ["/blk/Flatten"] f = Flatten <axis = 0> (m)
        ["/blk/Reshape"] r = Reshape(f, s)
        ["/blk/Add"] o = Add(h, r)
        ["/post/Neg"] y = Neg(o)
    }}
    """
)


def _unnamed(helpers) -> ir.Model:
    model = helpers.parse(UNNAMED)
    values = {v.name: v for n in model.graph for v in n.outputs}
    values["h"].shape = ir.Shape(["unk__1", 4])
    values["o"].shape = ir.Shape(["unk__2", 4])
    for name in ("h", "o"):
        values[name].dtype = ir.DataType.FLOAT
    assert not same_shape(values["h"], values["o"])  # by names, the residual does not match the output
    return model


def test_residual_matched_by_operand_shapes_not_names(helpers):
    flags = FoldZeroFlags()
    helpers.check_pass(
        _unnamed(helpers), lambda: flags, modified=True, delta=0, dce_delta=-5, infer=False, reference=WITHOUT_BLOCK
    )
    assert [b.scope for b in flags.bypassed] == ["blk"]


def test_unprovable_shape_is_still_refused(helpers):
    # o = h + Sin(z) with z: float[M, 4]: broadcasting N against M proves nothing about o's first dim (nor
    # does the graph output, declared float[K, 4]).
    text = (
        HEADER
        + """
        g (float[N, 4] x, float[M, 4] z) => (float[K, 4] y) <float[1] "blk.flag" = {0.0}> {
            ["/pre/Relu"] h = Relu(x)
            ["/blk/Sin"] s = Sin(z)
            ["/blk/Add"] o = Add(h, s)
            ["/post/Neg"] y = Neg(o)
        }
        """
    )
    model = helpers.parse(text)
    values = {v.name: v for n in model.graph for v in n.outputs}
    values["h"].shape, values["o"].shape = ir.Shape(["unk__1", 4]), ir.Shape(["unk__2", 4])
    values["h"].dtype = values["o"].dtype = ir.DataType.FLOAT
    with pytest.raises(UnsupportedModelError, match="0 of its inputs"):
        FoldZeroFlags()(model)


# GPT-2's attention as the TorchScript exporter writes it: heads split by a Reshape to [b, s, -1, 16] and merged
# by one to [b, s, -1] whose b and s are read back from the attention's output; the scores get the causal mask
# that ``expand(b, -1, s, s)`` made, its shape computed through ConstantOfShape / Mul / Equal / Where. Only the
# element count of the Reshapes and the contents of that shape vector prove the layer's output has its input's
# shape (``_shapes.reshape_wildcard``, ``vector_elementwise``, ``vector_where``).
HEADS = (
    HEADER
    + f"""
    g (float[N, T, 64] x) => (float[N, T, 64] y) <float[64, 64] w = {{{floats(64 * 64, 3)}}},
                                                  float[1] "blk.flag" = {{0.0}}> {{
        ["/pre/Relu"] h = Relu(x)
        ["/pre/Shape"] sh = Shape(h)
        ["/pre/C0"] i0 = Constant<value = int64 {{0}}>()
        ["/pre/C1"] i1 = Constant<value = int64 {{1}}>()
        ["/pre/Gather"] b = Gather(sh, i0)
        ["/pre/Gather_1"] s = Gather(sh, i1)
        ["/pre/C2"] u0 = Constant<value = int64[1] {{0}}>()
        ["/pre/Unsqueeze"] bb = Unsqueeze(b, u0)
        ["/pre/Unsqueeze_1"] ss = Unsqueeze(s, u0)
        ["/pre/C3"] keep = Constant<value = int64[1] {{-1}}>()
        ["/pre/Concat"] wanted = Concat<axis = 0>(bb, keep, ss, ss)
        ["/pre/Shape_1"] n = Shape(wanted)
        ["/pre/ConstantOfShape"] ones = ConstantOfShape<value = int64[1] {{1}}>(n)
        ["/pre/C4"] neg = Constant<value = int64 {{-1}}>()
        ["/pre/Mul"] minus = Mul(ones, neg)
        ["/pre/Equal"] is_keep = Equal(wanted, minus)
        ["/pre/Where"] target = Where(is_keep, ones, wanted)
        ["/pre/Range"] r = Range(i0, s, i1)
        ["/pre/C5"] u3 = Constant<value = int64[3] {{0, 1, 3}}>()
        ["/pre/Unsqueeze_2"] col = Unsqueeze(r, u3)
        ["/pre/C6"] u2 = Constant<value = int64[3] {{0, 1, 2}}>()
        ["/pre/Unsqueeze_3"] row = Unsqueeze(r, u2)
        ["/pre/LessOrEqual"] causal = LessOrEqual(row, col)
        ["/pre/Expand"] wide = Expand(causal, target)
        ["/pre/C7"] zero = Constant<value = float {{0.0}}>()
        ["/pre/C8"] low = Constant<value = float {{-1000.0}}>()
        ["/pre/Where_1"] mask = Where(wide, zero, low)
        ["/blk/C0"] split = Constant<value = int64[2] {{-1, 16}}>()
        ["/blk/Concat"] split_shape = Concat<axis = 0>(bb, ss, split)
        ["/blk/MatMul"] q = MatMul(h, w)
        ["/blk/Reshape"] qh = Reshape(q, split_shape)
        ["/blk/Transpose"] qt = Transpose<perm = [0, 2, 1, 3]>(qh)
        ["/blk/Transpose_1"] kt = Transpose<perm = [0, 2, 3, 1]>(qh)
        ["/blk/MatMul_1"] scores = MatMul(qt, kt)
        ["/blk/Add"] masked = Add(scores, mask)
        ["/blk/Softmax"] p = Softmax<axis = -1>(masked)
        ["/blk/MatMul_2"] ctx = MatMul(p, qt)
        ["/blk/Transpose_2"] back = Transpose<perm = [0, 2, 1, 3]>(ctx)
        ["/blk/Shape"] shb = Shape(back)
        ["/blk/Gather"] b2 = Gather(shb, i0)
        ["/blk/Gather_1"] s2 = Gather(shb, i1)
        ["/blk/Unsqueeze"] bb2 = Unsqueeze(b2, u0)
        ["/blk/Unsqueeze_1"] ss2 = Unsqueeze(s2, u0)
        ["/blk/Concat_1"] merge_shape = Concat<axis = 0>(bb2, ss2, keep)
        ["/blk/Reshape_1"] merged = Reshape(back, merge_shape)
        ["/blk/Add_1"] o = Add(h, merged)
        ["/post/Neg"] y = Neg(o)
    }}
    """
)


def test_residual_matched_through_split_and_merged_heads(helpers):
    model = helpers.parse(HEADS)
    helpers.infer_shapes(model)
    values = {v.name: v for n in model.graph for v in n.outputs}
    fresh = iter(range(1000))
    for value in values.values():  # as inference leaves a TorchScript export: no size of a layer's tensor known
        if value.dtype in (ir.DataType.FLOAT, ir.DataType.BOOL) and value.shape is not None:
            value.shape = ir.Shape([f"ts__{next(fresh)}" for _ in value.shape])
    assert not same_shape(values["h"], values["o"])
    flags = FoldZeroFlags()
    reference = HEADER + "\ng (float[N, T, 64] x) => (float[N, T, 64] y) {\n h = Relu(x)\n y = Neg(h)\n}\n"
    # 47 nodes: Relu and Neg stay
    check = helpers.check_pass(
        model, lambda: flags, modified=True, delta=0, dce_delta=-45, infer=False, reference=reference
    )
    assert check.ops() == {"Relu": 1, "Neg": 1}
    assert [b.scope for b in flags.bypassed] == ["blk"]


# ------------------------------------------------------------------------------------------------ exports

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
# (family, exporter): each one refused before FoldZeroFlags Case 5 or the _shapes rules (docs/coverage.md "Refusals").
EXPORTS = [
    ("gpt2", "dynamo"),
    ("gpt2", "torchscript"),  # split / merged heads through Reshape(-1): _shapes.reshape_wildcard
    ("gpt_neox", "dynamo"),
    ("phi3", "torchscript"),
    ("mixtral", "dynamo"),
    ("jetmoe", "dynamo"),
    ("deepseek_v3", "torchscript"),
]


def _corpus():
    pytest.importorskip("torch", reason="the export corpus needs torch (pip install -e '.[export]')")
    pytest.importorskip("transformers", reason="the export corpus needs transformers")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    if str(CORPUS) not in sys.path:
        sys.path.insert(0, str(CORPUS))
    import corpus_cases
    import corpus_export

    return corpus_cases, corpus_export


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(("family", "exporter"), EXPORTS, ids=["/".join(e) for e in EXPORTS])
def test_flag_on_last_layer_equals_transformers_without_it(helpers, family: str, exporter: str) -> None:
    from onnx import numpy_helper

    cases, exports = _corpus()
    fam = exports.FAMILIES[family]
    export = exports.get_export(family, exporter)
    if export.error:
        pytest.skip(f"{exporter} cannot export {family}: {export.error}")
    proto = export.load()
    scope = cases._layer_scopes(ir.from_proto(proto))[-1]
    proto.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), f"{scope}.flag"))
    model = ir.from_proto(proto)
    InferShapes()(model)
    flags = FoldZeroFlags()
    assert flags(model).modified
    assert [b.scope for b in flags.bypassed] == [scope]
    RemoveDeadCode()(model)
    assert not any(scope + ".flag" == name for name in model.graph.initializers)
    helpers.check_model(model)

    without = exports.torch_without_layer(fam, exporter, scope)
    bypassed, original = cases._session(ir.to_proto(model)), cases._session(export.load())
    name = exports.output_name(fam)
    for seed, shape in enumerate(cases.MOE_SHAPES if fam.moe else cases.DENSE_SHAPES):
        feeds = cases._feeds(fam, bypassed, shape, seed)
        got, expected = bypassed.run([name], feeds)[0], without(feeds["input_ids"])
        if got.ndim == expected.ndim - 1:  # TorchScript kept logits_to_keep as an input: fed 0, position 0
            expected = expected[:, 0]
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4, err_msg=f"{family}/{exporter} {shape}")
        # The layer does something: the export that still runs it is not the reference.
        unchanged = original.run([name], feeds)[0]
        assert np.max(np.abs(unchanged - expected)) > 1e-3
