"""FoldZeroFlags: declared flags (initializer, metadata) bypass their scope; errors name the scope.

The end of the file runs the example transformer of ``layerzero.models`` through ``run_static_passes``:
consumed flags fold to the hand-pruned ``omit_*`` oracle, declared flags remove their scopes.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from layerzero.errors import UnsupportedModelError
from layerzero.models import TransformerConfig, build_transformer, example_feeds, reference_forward
from layerzero.options import CompileOptions
from layerzero.passes import FoldZeroFlags
from layerzero.passes._graph import NAME_SCOPES_KEY
from layerzero.pipeline import run_static_passes
from tests.passes.onnx_text import HEADER, WITHOUT_BLOCK, floats

# A residual block in scope `blk`: y = Neg(h + Sin(h @ w)), with h = Relu(x) outside it.
BLOCK = (
    HEADER
    + f"""
    g (float[N, 4] x) => (float[N, 4] y) <float[4, 4] w = {{{floats(16, 0)}}}, float[1] "blk.flag" = {{FLAG}}> {{
        ["/pre/Relu"] h = Relu(x)
        ["/blk/mlp/MatMul"] m = MatMul(h, w)
        ["/blk/mlp/Sin"] s = Sin(m)
        ["/blk/Add"] o = Add(h, s)
        ["/post/Neg"] y = Neg(o)
    }}
    """
)


def test_declared_initializer_flag_bypasses_the_scope(helpers):
    # before: o = h + Sin(h @ w) under /blk/      after: y = Neg(h); the flag initializer is gone
    flags = FoldZeroFlags()
    check = helpers.check_pass(
        BLOCK.replace("FLAG", "0.0"),
        lambda: flags,
        modified=True,
        delta=0,  # the pass only rewires; DCE removes the scope
        dce_delta=-3,
        reference=WITHOUT_BLOCK,
    )
    assert check.ops() == {"Relu": 1, "Neg": 1}
    assert set(check.model.graph.initializers) == set()  # w died with the scope, the flag was removed
    assert [(b.scope, b.flag, b.declared_in, b.nodes) for b in flags.bypassed] == [
        ("blk", "blk.flag", "initializer", 3)
    ]


def test_declared_metadata_flag_bypasses_the_scope(helpers):
    model = helpers.parse(BLOCK.replace(', float[1] "blk.flag" = {FLAG}', ""))
    model.metadata_props["blk.flag"] = "0"
    check = helpers.check_pass(model, FoldZeroFlags, modified=True, delta=0, dce_delta=-3, reference=WITHOUT_BLOCK)
    assert check.ops() == {"Relu": 1, "Neg": 1}
    assert "blk.flag" not in check.model.metadata_props


def test_flag_equal_to_one_is_left_alone(helpers):
    check = helpers.check_pass(BLOCK.replace("FLAG", "1.0"), FoldZeroFlags, modified=False, delta=0)
    assert "blk.flag" in check.model.graph.initializers
    model = helpers.parse(BLOCK.replace(', float[1] "blk.flag" = {FLAG}', ""))
    model.metadata_props["blk.flag"] = "1"
    check = helpers.check_pass(model, FoldZeroFlags, modified=False, delta=0)
    assert check.model.metadata_props["blk.flag"] == "1"


def test_consumed_flag_is_not_a_declared_flag(helpers):
    # A flag the graph computes with is constant propagation's business: FoldZeroFlags ignores it.
    helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float[1] "blk.flag" = {0.0}> {
            ["/blk/Sin"] s = Sin(x)
            ["/blk/Mul"] g = Mul(s, "blk.flag")
            ["/blk/Add"] y = Add(x, g)
        }
        """,
        FoldZeroFlags,
        modified=False,
        delta=0,
    )


def test_scope_with_side_inputs(helpers):
    # The block also reads a mask [N, N] and a position row [4]: only h matches the output, so h is
    # the residual stream and the side inputs are fine.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <int64[1] axes0 = {0}, float[1] "layers.0.flag" = {0.0}> {
            ["/pre/Relu"] h = Relu(x)
            ["/mask/Transpose"] hT = Transpose<perm = [1, 0]>(h)
            ["/mask/MatMul"] mask = MatMul(h, hT)
            ["/pos/ReduceMean"] pos = ReduceMean<keepdims = 0>(x, axes0)
            ["/layers.0/attn/MatMul"] scores = MatMul(mask, h)
            ["/layers.0/attn/Add"] shifted = Add(scores, pos)
            ["/layers.0/Add"] o = Add(h, shifted)
            ["/post/Neg"] y = Neg(o)
        }
        """,
        FoldZeroFlags,
        modified=True,
        delta=0,
        dce_delta=-6,  # the block's 3 nodes, and the mask and pos that only it read
        reference=WITHOUT_BLOCK,
    )
    assert check.ops() == {"Relu": 1, "Neg": 1}


def test_scope_from_name_scope_metadata(helpers):
    # torch.onnx (dynamo) names nodes like `mul_3` and records the module path in metadata.
    model = helpers.parse(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float[1] "blk.inner.flag" = {0.0}> {
            h = Relu(x)
            s = Sin(h)
            c = Cos(s)
            o = Add(h, c)
            y = Neg(o)
        }
        """
    )
    scopes = {"Relu": "['']", "Sin": "['', 'blk', 'blk.inner']", "Cos": "['', 'blk', 'blk.inner']"}
    scopes |= {"Add": "['', 'blk', 'blk.inner']", "Neg": "['', 'blk']"}
    for node in model.graph:
        node.metadata_props[NAME_SCOPES_KEY] = scopes[node.op_type]
    check = helpers.check_pass(
        model,
        FoldZeroFlags,
        modified=True,
        delta=0,
        dce_delta=-3,
        reference=WITHOUT_BLOCK,
    )
    assert check.ops() == {"Relu": 1, "Neg": 1}


NESTED = (
    HEADER
    + """
    g (float[N, 4] x) => (float[N, 4] y) <float[1] "blk.flag" = {OUTER}, float[1] "blk.inner.flag" = {INNER}> {
        ["/pre/Relu"] h = Relu(x)
        ["/blk/Exp"] e = Exp(h)
        ["/blk/inner/Sin"] s = Sin(e)
        ["/blk/inner/Add"] i = Add(e, s)
        ["/blk/Mul"] o = Mul(i, h)
        ["/post/Neg"] y = Neg(o)
    }
    """
)


def test_nested_flags_outer_and_inner_zero(helpers):
    flags = FoldZeroFlags()
    check = helpers.check_pass(
        NESTED.replace("OUTER", "0.0").replace("INNER", "0.0"),
        lambda: flags,
        modified=True,
        delta=0,
        dce_delta=-4,
        reference=WITHOUT_BLOCK,
    )
    assert [b.scope for b in flags.bypassed] == ["blk"]  # the inner one went with it (Case 2)
    assert set(check.model.graph.initializers) == set()


def test_nested_flags_inner_zero_only(helpers):
    check = helpers.check_pass(
        NESTED.replace("OUTER", "1.0").replace("INNER", "0.0"),
        FoldZeroFlags,
        modified=True,
        delta=0,
        dce_delta=-2,
        reference=HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) {
            h = Relu(x)
            e = Exp(h)
            o = Mul(e, h)
            y = Neg(o)
        }
        """,
        rtol=1e-5,
    )
    # blk.flag (1) was left by FoldZeroFlags; as an initializer nothing reads, DCE then dropped it.
    assert set(check.model.graph.initializers) == set()


def test_custom_flag_pattern(helpers):
    model = helpers.parse(BLOCK.replace('"blk.flag" = {FLAG}', '"skip_blk" = {0.0}'))
    helpers.check_pass(
        model, lambda: FoldZeroFlags("skip_*"), modified=True, delta=0, dce_delta=-3, reference=WITHOUT_BLOCK
    )


# ------------------------------------------------------------------------------------------- Case 3


def _raises(helpers, text: str, *, match: str, metadata: dict[str, str] | None = None) -> str:
    model = helpers.parse(text)
    model.metadata_props.update(metadata or {})
    helpers.infer_shapes(model)
    with pytest.raises(UnsupportedModelError, match=match) as info:
        FoldZeroFlags()(model)
    return str(info.value)


def test_error_no_such_scope(helpers):
    message = _raises(helpers, BLOCK.replace('"blk.flag" = {FLAG}', '"blok.flag" = {0.0}'), match="'blok'")
    assert "no node" in message


def test_error_no_such_scope_from_metadata(helpers):
    model_text = BLOCK.replace(', float[1] "blk.flag" = {FLAG}', "")
    message = _raises(helpers, model_text, match="'nowhere'", metadata={"nowhere.flag": "0"})
    assert "metadata" in message


def test_error_two_outputs(helpers):
    # Both values leave the scope and both are computed from its input: no single layer output.
    message = _raises(
        helpers,
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y, float[N, 4] z) <float[1] "blk.flag" = {0.0}> {
            ["/pre/Relu"] h = Relu(x)
            ["/blk/Sin"] s = Sin(h)
            ["/blk/Cos"] c = Cos(h)
            ["/post/Neg"] y = Neg(s)
            ["/post/Exp"] z = Exp(c)
        }
        """,
        match="'blk'",
    )
    assert "2 outputs" in message and "'s'" in message and "'c'" in message


def test_error_no_input_matches_the_output(helpers):
    message = _raises(
        helpers,
        HEADER
        + f"""
        g (float[N, 4] x) => (float[N, 3] y) <float[4, 3] w = {{{floats(12, 1)}}}, float[1] "proj.flag" = {{0.0}}> {{
            ["/pre/Relu"] h = Relu(x)
            ["/proj/MatMul"] m = MatMul(h, w)
            ["/post/Neg"] y = Neg(m)
        }}
        """,
        match="'proj'",
    )
    assert "float[N,3]" in message and "0 of its inputs" in message


def test_error_two_inputs_match_the_output(helpers):
    message = _raises(
        helpers,
        HEADER
        + """
        g (float[N, 4] x, float[N, 4] z) => (float[N, 4] y) <float[1] "blk.flag" = {0.0}> {
            ["/blk/Mul"] m = Mul(x, z)
            ["/post/Neg"] y = Neg(m)
        }
        """,
        match="'blk'",
    )
    assert "2 of its inputs" in message


def test_error_flag_with_several_elements(helpers):
    _raises(
        helpers, BLOCK.replace('float[1] "blk.flag" = {FLAG}', 'float[2] "blk.flag" = {0.0, 0.0}'), match="blk.flag"
    )


def test_error_metadata_flag_not_a_number(helpers):
    _raises(
        helpers, BLOCK.replace(', float[1] "blk.flag" = {FLAG}', ""), match="blk.flag", metadata={"blk.flag": "off"}
    )


# ------------------------------------------------------------------------------------------- the transformer

COMPILE_DELTA_PER_ROTARY = 0  # SimplifyConcatSplit folds the Concat(q, k) + Split a bypassed rotary leaves


@functools.cache
def _compiled(config: TransformerConfig) -> tuple[onnx.ModelProto, dict[str, int]]:
    model = ir.from_proto(build_transformer(config))
    result = run_static_passes(model, CompileOptions())
    assert result.converged, result
    return ir.to_proto(model), result.modified_by


def _logits(helpers, model: onnx.ModelProto, config: TransformerConfig) -> np.ndarray:
    return helpers.run_ort(model, example_feeds(config, batch=2, seq=7))["logits"]


CONSUMED_CASES = {
    "block": ({"zero_blocks": (1,)}, {"omit_blocks": (1,)}, 0),
    "rotary": ({"zero_rotary": (2,)}, {"omit_rotary": (2,)}, 1),
    "norm": ({"zero_norms": (3,)}, {"omit_norms": (3,)}, 0),
    "all": (
        {"zero_blocks": (1,), "zero_rotary": (2,), "zero_norms": (3,)},
        {"omit_blocks": (1,), "omit_rotary": (2,), "omit_norms": (3,)},
        1,
    ),
    "two-blocks": ({"zero_blocks": (0, 3)}, {"omit_blocks": (0, 3)}, 0),
}


@pytest.mark.parametrize("form", ["consumed", "declared-initializer", "declared-metadata"])
@pytest.mark.parametrize("case", list(CONSUMED_CASES))
def test_transformer_flags_compile_to_the_oracle(helpers, case, form):
    zero, omit, rotaries = CONSUMED_CASES[case]
    flag_form = "consumed" if form == "consumed" else "declared"
    declared_in = "metadata" if form == "declared-metadata" else "initializer"
    config = TransformerConfig(flag_form=flag_form, declared_in=declared_in, **zero)
    oracle = TransformerConfig(flags=False, **omit)  # no flags at all: what a hand-pruned model is
    compiled, modified_by = _compiled(config)
    helpers.check_model(compiled)
    np.testing.assert_allclose(
        _logits(helpers, compiled, config), _logits(helpers, build_transformer(oracle), config), rtol=1e-5, atol=1e-5
    )
    # Numerically it is also the numpy reference of the oracle.
    np.testing.assert_allclose(
        _logits(helpers, compiled, config),
        reference_forward(oracle, example_feeds(config, batch=2, seq=7)["input_ids"]),
        rtol=1e-4,
        atol=1e-4,
    )
    oracle_nodes = len(build_transformer(oracle).graph.node)
    assert len(compiled.graph.node) == oracle_nodes + COMPILE_DELTA_PER_ROTARY * rotaries
    if flag_form == "declared":
        assert modified_by["FoldZeroFlags"] == 1
        # The removed scopes left no node behind.
        names = [n.name for n in compiled.graph.node]
        for i in zero.get("zero_blocks", ()):
            assert not [n for n in names if n.startswith(f"/layers.{i}/")]
        for i in zero.get("zero_rotary", ()):
            assert not [n for n in names if n.startswith(f"/layers.{i}/attention/rotary_emb/")]
        for i in zero.get("zero_norms", ()):
            assert not [n for n in names if n.startswith(f"/layers.{i}/input_layernorm/")]
        metadata = {p.key: p.value for p in compiled.metadata_props}
        assert all(value == "1" for key, value in metadata.items() if key.endswith(".flag"))


def test_transformer_flags_equal_to_one_change_nothing_numerically(helpers):
    config = TransformerConfig(flag_form="consumed")
    compiled, _ = _compiled(config)
    np.testing.assert_allclose(
        _logits(helpers, compiled, config),
        _logits(helpers, build_transformer(TransformerConfig(flags=False)), config),
        rtol=1e-5,
        atol=1e-5,
    )
    # The flag gates (Greater, Where, Mul by 1) are gone: the graph is the flag-free one.
    assert len(compiled.graph.node) == len(build_transformer(TransformerConfig(flags=False)).graph.node)


def test_transformer_without_inv_freq_has_no_rotary_math(helpers):
    config = TransformerConfig(disable_rotary_inv_freq=True)
    compiled, modified_by = _compiled(config)
    ops = helpers.op_counts(compiled)
    assert ops["Cos"] == ops["Sin"] == ops["Neg"] == 0
    assert modified_by["PropagateUniforms"] >= 1
    oracle = TransformerConfig(omit_rotary=tuple(range(config.num_layers)))
    np.testing.assert_allclose(
        _logits(helpers, compiled, config), _logits(helpers, build_transformer(oracle), config), rtol=1e-5, atol=1e-5
    )
    assert len(compiled.graph.node) == len(build_transformer(oracle).graph.node) + COMPILE_DELTA_PER_ROTARY * 4


def test_transformer_zero_weight_block_is_removed(helpers):
    # No flag: o_proj and down_proj are all-zero, so the block adds x @ 0 twice and is an identity.
    config = TransformerConfig(flags=False, zero_weight_blocks=(2,))
    compiled, _ = _compiled(config)
    names = [n.name for n in compiled.graph.node]
    assert not [n for n in names if n.startswith("/layers.2/")]
    np.testing.assert_allclose(
        _logits(helpers, compiled, config),
        _logits(helpers, build_transformer(TransformerConfig(flags=False, omit_blocks=(2,))), config),
        rtol=1e-5,
        atol=1e-5,
    )


def test_transformer_compile_is_idempotent():
    config = TransformerConfig(flag_form="consumed", zero_blocks=(1,), zero_rotary=(2,))
    compiled, _ = _compiled(config)
    again = ir.from_proto(compiled)
    result = run_static_passes(again, CompileOptions())
    assert result.iterations == 1 and not any(result.modified_by.values())
