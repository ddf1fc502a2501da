"""Minimised failures of the differential fuzzer (and issue 14's causes), kept in ONNX text.

Each case must compile (``verify=False``) to a model with the same interface whose ORT outputs equal the
original's on two input-size sets. ``LATTICE_CASES``: issue 14 causes 1, 4 and 5, fixed in passes/_lattice.py.
"""

from __future__ import annotations

import onnx
import pytest

from tests.fuzz.harness import check_model

LATTICE = "lattice: "

CASES: dict[str, str] = {
    # Cause 2: a value listed twice as a graph output keeps its name in both places.
    "duplicate_output_folded": """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[4] x) => (float[1,4] y, float[1,4] y)
           <float[4,4] w = {0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0}, float[4] b = {0,0,0,0}, int64[2] k = {1,-1}>
        {
           m = MatMul (x, w)
           a = Add (m, b)
           y = Reshape (a, k)
        }""",
    "duplicate_output_uniform": """
        <ir_version: 9, opset_import: ["" : 20]>
        g (double[N,3] x) => (float[N,1,3] y, float[N,1,3] y)
           <double c = {0}, int64[1] k = {1}>
        {
           m = Mul (x, c)
           f = Cast <to: int = 1> (m)
           y = Unsqueeze (f, k)
        }""",
    "duplicate_output_shape_fold": """
        <ir_version: 9, opset_import: ["" : 19]>
        g (float[N,2] x) => (float[N,2] y, float[N,2] y, float[N,2] z)
           <int64 c = {1}>
        {
           s = Shape (x)
           k = ConstantOfShape <value: tensor = int64[1] {3}> (s)
           d = Sub (k, c)
           y = Cast <to: int = 1> (d)
           z = Add (y, x)
        }""",
    # Seed 108743: PRelu(x[], slope[1]) is [1] in onnxruntime (onnx infers []); a gated branch trusted [] and its
    # off branch returned the residual's shape.
    "prelu_broadcast_beyond_x_gated_branch": """
        <ir_version: 9, opset_import: ["" : 19]>
        fuzz108743 (float cast60, int64 mul56, float squeeze11) => (float add61)
           <float[1] c42 = {0}>
        {
           prelu43 = PRelu (squeeze11, c42)
           cast57 = Cast <to: int = 1> (mul56)
           mul58 = Mul (cast57, prelu43)
           add61 = Add (mul58, cast60)
        }""",
    # Seed 134274: onnxruntime's removal of a lossless Cast round trip misses the If that reads it ("Missing Input");
    # it did not fire on Cast(Cast(Expand(x, Shape(x)))), and the static passes made that Cast(Cast(x)).
    "round_trip_exposed_to_the_models_own_if": """
        <ir_version: 9, opset_import: ["" : 20]>
        g (float[N,4] x, bool c) => (float[N,4] y) {
           s = Shape (x)
           e = Expand (x, s)
           a = Cast <to: int = 11> (e)
           b = Cast <to: int = 1> (a)
           y = If (c) <else_branch: graph = el () => (float[N,4] eo) { eo = Relu (b) },
                       then_branch: graph = th () => (float[N,4] tho) { tho = Neg (b) }>
        }""",
    # Issue 20: a shape tensor PropagateUniforms built for a row (Case 4, before `z`) was reused for the uniform `u`
    # (Case 1, earlier): its ConstantOfShape, which the If's branches read, came before the shape's Concat.
    "shape_reused_before_its_producer_if_reads_it": """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,4] x, bool c) => (float[N,8] y, float[N,4] z)
           <float zero = {0}, float[4,4] w = {0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0}, float[4] b = {1,2,3,4}>
        {
           u = Mul (x, zero)
           y = If (c) <else_branch: graph = el () => (float[N,8] eo) { eo = Concat <axis: int = 1> (u, x) },
                       then_branch: graph = th () => (float[N,8] tho) { tho = Concat <axis: int = 1> (x, u) }>
           m = MatMul (x, w)
           r = Add (m, b)
           z = Relu (r)
        }""",
    # Issue 20, the same cause inside a branch of an If nothing reads: RemoveDeadCode emptied the branch from its end
    # and met the shape's Concat while the ConstantOfShape before it still read it (a compiler exception).
    "shape_reused_before_its_producer_in_a_dead_branch": """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,4] x, bool c) => (float[N,4] y)
           <float zero = {0}, float[4,4] w = {0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0}, float[4] b = {1,2,3,4}>
        {
           y = Relu (x)
           d1, d2 = If (c) <else_branch: graph = el () => (float[N,8] eo, float[N,4] ez) {
                                u = Mul (x, zero)
                                eo = Concat <axis: int = 1> (u, x)
                                m = MatMul (x, w)
                                r = Add (m, b)
                                ez = Relu (r)
                            },
                            then_branch: graph = th () => (float[N,8] tho, float[N,4] tz) {
                                tho = Concat <axis: int = 1> (x, x)
                                tz = Neg (x)
                            }>
        }""",
    # Cause 3: LpNormalization p=1 folds to what onnxruntime computes (sum |x|), not sum(x).
    "fold_lp_normalization_p1": """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,3] x) => (float[N,3] y)
           <float[1,3] c = {1, -2, 0.5}>
        {
           n = LpNormalization <axis: int = -1, p: int = 1> (c)
           y = Add (x, n)
        }""",
    # Cause 6: the gated-branch rewrite must not make the branches read the result of a lossless Cast round
    # trip (float -> double -> float): onnxruntime removes the round trip and its If then misses the input.
    "gated_branch_cast_round_trip_scalar_gate": """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,4] xi, float[1] gi) => (float[N,4] y) {
           xd = Cast <to: int = 11> (xi)
           x = Cast <to: int = 1> (xd)
           h = Relu (x)
           m = Mul (gi, h)
           y = Add (x, m)
        }""",
    "gated_branch_cast_round_trip_token_gate": """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,S,4] xi) => (float[N,S,4] y) <int64[1] ax = {-1}> {
           xd = Cast <to: int = 11> (xi)
           x = Cast <to: int = 1> (xd)
           h = Relu (x)
           r = ReduceMean <keepdims: int = 1> (x, ax)
           s = Sigmoid (r)
           m = Mul (s, h)
           y = Add (x, m)
        }""",
    "gated_branch_lossy_cast_chain_is_kept": """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,4] xi, float[1] gi) => (float[N,4] y) {
           xh = Cast <to: int = 10> (xi)
           xf = Cast <to: int = 1> (xh)
           xb = Cast <to: int = 10> (xf)
           x = Cast <to: int = 1> (xb)
           h = Tanh (x)
           m = Mul (gi, h)
           y = Add (x, m)
        }""",
    # An overridable initializer (also a graph input) is never folded.
    "overridable_initializer": """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,3] x, float[3] c) => (float[N,3] y)
           <float[3] c = {0, 0, 0}>
        {
           n = Neg (c)
           y = Mul (x, n)
        }""",
}

LATTICE_CASES: dict[str, tuple[str, str]] = {
    # Cause 1: Pow of an int64 uniform by a negative integer exponent.
    "pow_int_uniform_negative_exponent": (
        "cause 1: numpy power of integers by a negative exponent",
        """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,4] x) => (float[N,4] y)
           <int64 e = {-1}>
        {
           s = Shape (x)
           k = ConstantOfShape <value: tensor = int64[1] {2}> (s)
           p = Pow (k, e)
           f = Cast <to: int = 1> (p)
           y = Add (f, x)
        }""",
    ),
    # Cause 4: MatMulInteger with an all-zero B and an a_zero_point (no b_zero_point): the result is 0.
    "matmul_integer_zero_weight_a_zero_point": (
        "cause 4: MatMulInteger reads a_zero_point as a bias",
        """
        <ir_version: 9, opset_import: ["" : 20]>
        g (float[N,8] x) => (float[N,3] y)
           <uint8[8,3] w = {0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0}, uint8 azp = {2},
            float lo = {0}, float hi = {5}>
        {
           r = Round (x)
           c = Clip (r, lo, hi)
           a = Cast <to: int = 2> (c)
           m = MatMulInteger (a, w, azp)
           y = Cast <to: int = 1> (m)
        }""",
    ),
    # Cause 5: Pad of a uniform with a run-time constant_value.
    "pad_uniform_runtime_constant_value": (
        "cause 5: Pad's run-time constant_value read as 0",
        """
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[N,4] x) => (float[N,6] y)
           <int64[4] pads = {0, 1, 0, 1}>
        {
           z = Shape (x)
           u = ConstantOfShape <value: tensor = float[1] {0}> (z)
           r = ReduceMax <keepdims: int = 0> (x)
           y = Pad (u, pads, r)
        }""",
    ),
}


# Cases whose failure needs the fuzzer's own feeds (the seed the inputs were drawn with), e.g. an int input of 0.
SEEDS = {"prelu_broadcast_beyond_x_gated_branch": 108743}


def _check(text: str, seed: int = 0) -> None:
    model = onnx.parser.parse_model(text)
    outcome = check_model(model, seed=seed, check_spec=False)
    assert outcome.kind == "equal", f"{outcome.kind}: {outcome.detail}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_regression(name: str) -> None:
    _check(CASES[name], SEEDS.get(name, 0))


@pytest.mark.parametrize(
    "name",
    [
        name for name in sorted(LATTICE_CASES)
    ],
)
def test_lattice_regression(name: str) -> None:
    _check(LATTICE_CASES[name][1])


def test_seed_534278_prelu_whose_slope_broadcasts_x_is_an_invalid_model() -> None:
    # PRelu(x[], slope[1]): the spec wants the slope unidirectionally broadcastable to X. ONNX Runtime's kernel
    # broadcasts both ways ([1]) while its constant folding of Shape(prelu) takes onnx's inferred [] : the original
    # model itself answers [] where its own kernel computes [1], so no compile can match it. Such a model is
    # counted invalid, not a difference.
    from tests.fuzz.generator import generate
    from tests.fuzz.harness import check_model, spec_problem

    outcome = check_model(generate(534278), 534278)
    assert outcome.kind == "invalid" and "not unidirectionally broadcastable" in outcome.detail
    assert spec_problem(generate(534277)) is None  # a neighbouring seed's valid PRelus pass
