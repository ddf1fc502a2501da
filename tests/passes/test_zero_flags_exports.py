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

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'


def _floats(n: int, seed: int) -> str:
    values = np.random.default_rng(seed).uniform(-1.0, 1.0, size=n)
    return ", ".join(f"{v:.4f}" for v in values)


# A gated MLP block in scope `blk` with a fused gate_up projection whose Split has no scope (as the dynamo
# exporter's optimizer writes it): o = h + gate * up, with [gate, up] = Split(h @ w).
FUSED = (
    HEADER
    + f"""
    g (float[N, 4] x) => (float[N, 4] y{{EXTRA_OUT}})
      <float[4, 8] w = {{{_floats(32, 0)}}}, float[1] "blk.flag" = {{0.0}}> {{
        ["/pre/Relu"] h = Relu(x)
        ["/blk/gate_up/MatMul"] gu = MatMul(h, w)
        ["node_Split_7"] gate, up = Split <axis = -1, num_outputs = 2> (gu)
        ["/blk/Mul"] m = Mul(gate, up)
        ["/blk/Add"] o = Add(h, m)
        ["/post/Neg"] y = Neg(o){{EXTRA_NODE}}
    }}
    """
)
WITHOUT_BLOCK = (
    HEADER
    + """
    g (float[N, 4] x) => (float[N, 4] y) {
        h = Relu(x)
        y = Neg(h)
    }
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
        g (float[N, 4] x) => (float[N, 4] y) <float[4, 4] w = {{{_floats(16, 1)}}}, float[1] "blk.flag" = {{0.0}}> {{
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
    g (float[N, 4] x) => (float[N, 4] y) <float[4, 4] w = {{{_floats(16, 2)}}}, float[1] "blk.flag" = {{0.0}}> {{
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


# ------------------------------------------------------------------------------------------------ exports

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
# (family, exporter): each one refused before FoldZeroFlags Case 5 (docs/coverage.md "Refusals").
EXPORTS = [
    ("gpt2", "dynamo"),
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
