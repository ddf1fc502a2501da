"""FoldConstants: constant chains, static Shape, If on a constant condition (nested, in subgraphs), Where."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.passes import FoldConstants, RemoveDeadCode

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'


def _initializer_names(model: ir.Model) -> set[str]:
    return set(model.graph.initializers)


# ------------------------------------------------------------------------------------------- Case 1


def test_elementwise_chain_of_constants(helpers):
    # before: t = a + b; u = t * b; v = Neg(u); y = x + v     after: y = x + [const]
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 3] x) => (float[N, 3] y) <float[3] a = {1.0, 2.0, 3.0}, float[3] b = {0.5, -1.0, 4.0}> {
            t = Add(a, b)
            u = Mul(t, b)
            v = Neg(u)
            y = Add(x, v)
        }
        """,
        FoldConstants,
        modified=True,
        delta=0,  # the folded nodes are left for DCE
        dce_delta=-3,
    )
    assert check.ops() == {"Add": 1}
    (add,) = check.model.graph
    folded = add.inputs[1].const_value.numpy()
    a, b = np.array([1.0, 2.0, 3.0]), np.array([0.5, -1.0, 4.0])
    np.testing.assert_array_equal(folded, -((a + b) * b))


def test_chain_through_constant_nodes_and_graph_output(helpers):
    # A folded graph output keeps its name: before y = Sqrt(Constant) -> after y = Identity(initializer)
    check = helpers.check_pass(
        HEADER
        + """
        g (float[2] x) => (float[2] y, float[2] z) {
            c = Constant<value = float[2] {4.0, 9.0}>()
            y = Sqrt(c)
            z = Add(x, y)
        }
        """,
        FoldConstants,
        modified=True,
        delta=1,  # Identity that keeps the output name
        dce_delta=-1,  # Constant and Sqrt gone, Identity added
    )
    assert check.ops() == {"Add": 1, "Identity": 1}
    assert [o.name for o in check.model.graph.outputs] == ["y", "z"]


def test_cast_and_integer_ops_keep_dtype(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (int64[3] x) => (int64[3] y) <int64[3] a = {7, -7, 9}, int64[1] b = {2}> {
            q = Div(a, b)
            f = Cast<to = 1>(q)
            back = Cast<to = 7>(f)
            y = Mul(x, back)
        }
        """,
        FoldConstants,
        modified=True,
        delta=0,
        dce_delta=-3,
    )
    (mul,) = check.model.graph
    folded = mul.inputs[1].const_value.numpy()
    assert folded.dtype == np.int64
    np.testing.assert_array_equal(folded, [3, -3, 4])  # ONNX integer Div truncates


def test_where_with_constant_condition_and_branches(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[4] x) => (float[4] y) <bool[4] c = {1, 0, 1, 0}, float[4] a = {1.0, 2.0, 3.0, 4.0}> {
            b = Neg(a)
            w = Where(c, a, b)
            y = Mul(x, w)
        }
        """,
        FoldConstants,
        modified=True,
        delta=0,
        dce_delta=-2,
    )
    (mul,) = check.model.graph
    np.testing.assert_array_equal(mul.inputs[1].const_value.numpy(), [1, -2, 3, -4])


def test_where_with_constant_condition_but_dynamic_branch_is_not_folded(helpers):
    # Not all inputs constant: FoldConstants leaves it (a *uniform* condition is PropagateUniforms' job).
    helpers.check_pass(
        HEADER
        + """
        g (float[4] x) => (float[4] y) <bool[4] c = {1, 0, 1, 0}, float[4] a = {1.0, 2.0, 3.0, 4.0}> {
            y = Where(c, x, a)
        }
        """,
        FoldConstants,
        modified=False,
        delta=0,
    )


# ------------------------------------------------------------------------------------------- Case 2


def test_shape_of_static_input(helpers):
    # before: s = Shape(x); y = Reshape(z, s)     after: y = Reshape(z, [2, 3])
    check = helpers.check_pass(
        HEADER
        + """
        g (float[2, 3] x, float[6] z) => (float[2, 3] y, int64 n) {
            s = Shape(x)
            y = Reshape(z, s)
            n = Size(x)
        }
        """,
        FoldConstants,
        modified=True,
        delta=1,  # Identity for the folded output n
        dce_delta=-1,
    )
    assert check.ops() == {"Reshape": 1, "Identity": 1}
    reshape = next(n for n in check.model.graph if n.op_type == "Reshape")
    np.testing.assert_array_equal(reshape.inputs[1].const_value.numpy(), [2, 3])


def test_shape_with_start_end_of_partly_static_input(helpers):
    # Only the static slice of a [N, 3, 4] shape folds; Shape over the symbolic dim stays.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 3, 4] x) => (int64[2] s, int64[3] full) {
            s = Shape<start = -2>(x)
            full = Shape(x)
        }
        """,
        FoldConstants,
        modified=False,  # the *inferred* shape of x is not fully static: nothing folds
        delta=0,
        dims={"N": 5},
    )
    assert check.ops() == {"Shape": 2}


def test_shape_of_static_intermediate(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[2, 3] x) => (float[3, 2] y) {
            t = Transpose<perm = [1, 0]>(x)
            s = Shape(t)
            y = Reshape(x, s)
        }
        """,
        FoldConstants,
        modified=True,
        delta=0,
        dce_delta=-2,
    )
    assert check.ops() == {"Reshape": 1}


# ------------------------------------------------------------------------------------------- Case 3

IF_MODEL = (
    HEADER
    + """
    g (float[N, 4] x) => (float[N, 4] y) <bool c = {COND}> {
        y = If(c) <then_branch = then_g () => (float[N, 4] t) {
                two = Constant<value = float {2.0}>()
                t = Mul(x, two)
            }, else_branch = else_g () => (float[N, 4] e) {
                e = Neg(x)
            }>
    }
    """
)


def test_if_with_constant_true_inlines_then_branch(helpers):
    check = helpers.check_pass(IF_MODEL.replace("COND", "1"), FoldConstants, modified=True, delta=-2, dce_delta=-2)
    # If + Constant, Mul (then) + Neg (else) -> Constant, Mul (its output renamed to y)
    assert check.ops() == {"Constant": 1, "Mul": 1}
    assert [o.name for o in check.model.graph.outputs] == ["y"]


def test_if_with_constant_false_inlines_else_branch(helpers):
    check = helpers.check_pass(IF_MODEL.replace("COND", "0"), FoldConstants, modified=True, delta=-3, dce_delta=-3)
    assert check.ops() == {"Neg": 1}


def test_if_with_constant_condition_from_a_constant_chain(helpers):
    # The condition is computed (Greater of constants): one run folds it, then the If.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <float flag = {0.0}, float half = {0.5}> {
            keep = Greater(flag, half)
            y = If(keep) <then_branch = then_g () => (float[N, 4] t) {
                    t = Sin(x)
                }, else_branch = else_g () => (float[N, 4] e) {
                    e = Identity(x)
                }>
        }
        """,
        FoldConstants,
        modified=True,
        delta=-2,  # Greater, If, Sin, Identity -> Greater (dead), Identity(x) renamed to y
        dce_delta=-3,
    )
    assert check.ops() == {"Identity": 1}


def test_nested_if_inside_a_taken_branch(helpers):
    # Both conditions constant: one run inlines the outer If and then the inner one it brought along.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <bool c = {1}, bool d = {0}> {
            y = If(c) <then_branch = outer_then () => (float[N, 4] t) {
                    t = If(d) <then_branch = inner_then () => (float[N, 4] it) {
                            it = Cos(x)
                        }, else_branch = inner_else () => (float[N, 4] ie) {
                            ie = Exp(x)
                        }>
                }, else_branch = outer_else () => (float[N, 4] e) {
                    e = Neg(x)
                }>
        }
        """,
        FoldConstants,
        modified=True,
        delta=-4,  # If, If, Cos, Exp, Neg -> Exp
        dce_delta=-4,
    )
    assert check.ops() == {"Exp": 1}


def test_if_with_constant_condition_inside_a_subgraph(helpers):
    # The outer If is data-dependent and stays; the inner one, in its then-branch, is inlined there.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x, bool b) => (float[N, 4] y) <bool d = {1}> {
            y = If(b) <then_branch = outer_then () => (float[N, 4] t) {
                    t = If(d) <then_branch = inner_then () => (float[N, 4] it) {
                            it = Cos(x)
                        }, else_branch = inner_else () => (float[N, 4] ie) {
                            ie = Exp(x)
                        }>
                }, else_branch = outer_else () => (float[N, 4] e) {
                    e = Neg(x)
                }>
        }
        """,
        FoldConstants,
        modified=True,
        delta=-2,  # If, If, Cos, Exp, Neg -> If, Cos, Neg
        dce_delta=-2,
    )
    assert check.ops() == {"If": 1, "Cos": 1, "Neg": 1}
    outer = next(iter(check.model.graph))
    then_branch = outer.attributes["then_branch"].value
    assert [n.op_type for n in then_branch] == ["Cos"]
    assert then_branch.outputs[0].producer() is next(iter(then_branch))
    for flag in (True, False):
        feeds = helpers.random_feeds(check.model)
        feeds["b"] = np.array(flag)
        ref = helpers.run_ort(helpers.parse(IF_INSIDE_REF), feeds)
        helpers.assert_same_outputs(ref, helpers.run_ort(check.model, feeds))


IF_INSIDE_REF = (
    HEADER
    + """
    g (float[N, 4] x, bool b) => (float[N, 4] y) {
        y = If(b) <then_branch = then_g () => (float[N, 4] t) {
                t = Cos(x)
            }, else_branch = else_g () => (float[N, 4] e) {
                e = Neg(x)
            }>
    }
    """
)


def test_if_branch_initializers_move_out(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[3] x) => (float[3] y) <bool c = {1}> {
            y = If(c) <then_branch = then_g () => (float[3] t) <float[3] w = {1.0, 2.0, 3.0}> {
                    t = Mul(x, w)
                }, else_branch = else_g () => (float[3] e) {
                    e = Identity(x)
                }>
        }
        """,
        FoldConstants,
        modified=True,
        delta=-2,
        dce_delta=-2,
    )
    assert check.ops() == {"Mul": 1}
    (mul,) = check.model.graph
    assert mul.inputs[1].is_initializer() and mul.inputs[1].graph is check.model.graph


def test_untaken_branch_releases_outer_values(helpers):
    # `s` is read only by the else branch: once the If is inlined on its then branch, DCE removes it.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y) <bool c = {1}> {
            s = Sin(x)
            y = If(c) <then_branch = then_g () => (float[N, 4] t) {
                    t = Cos(x)
                }, else_branch = else_g () => (float[N, 4] e) {
                    e = Neg(s)
                }>
        }
        """,
        FoldConstants,
        modified=True,
        delta=-2,  # Sin, If, Cos, Neg -> Sin (dead), Cos
        dce_delta=-3,
    )
    assert check.ops() == {"Cos": 1}


def test_if_with_a_sequence_output_at_opset_13(helpers):
    # Identity takes no sequence before opset 14: the inlined branch output takes the If's name.
    check = helpers.check_pass(
        """
        <ir_version: 7, opset_import: ["" : 13]>
        g (float[4] x) => (seq(float[4]) res) <bool c = {0}> {
            res = If(c) <then_branch = then_g () => (seq(float[4]) t) {
                    t = SequenceConstruct(x, x)
                }, else_branch = else_g () => (seq(float[4]) e) {
                    n = Neg(x)
                    e = SequenceConstruct(n)
                }>
        }
        """,
        FoldConstants,
        modified=True,
        delta=-2,
        infer=False,  # onnx-ir's ShapeInferencePass turned sequence-typed values into tensors (InferShapes does not)
        run=False,
    )
    assert check.ops() == {"Neg": 1, "SequenceConstruct": 1}
    assert next(iter(check.model.graph.outputs)).producer().op_type == "SequenceConstruct"
    feeds = {"x": np.arange(4, dtype=np.float32)}
    (res,) = helpers.run_ort(check.model, feeds).values()
    np.testing.assert_array_equal(res, [-np.arange(4, dtype=np.float32)])


def test_sequence_results_fold_only_into_tensors(helpers):
    # SplitToSequence of a constant is a sequence: it has no initializer form, it is never replaced; the
    # tensor SequenceAt takes from it is (both run in the same ORT session), and the sequence goes with DCE.
    check = helpers.check_pass(
        HEADER
        + """
        g (float[4] x) => (float[4] y) <float[4] a = {1.0, 2.0, 3.0, 4.0}, int64 one = {1}> {
            seq = SplitToSequence(a)
            e = SequenceAt(seq, one)
            y = Add(x, e)
        }
        """,
        FoldConstants,
        modified=True,
        delta=0,
        dce_delta=-2,
        infer=False,  # see test_if_with_a_sequence_output_at_opset_13
    )
    assert check.ops() == {"Add": 1}


def test_if_with_a_dynamic_condition_is_kept(helpers):
    helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x, bool b) => (float[N, 4] y) {
            y = If(b) <then_branch = then_g () => (float[N, 4] t) {
                    t = Sin(x)
                }, else_branch = else_g () => (float[N, 4] e) {
                    e = Cos(x)
                }>
        }
        """,
        FoldConstants,
        modified=False,
        delta=0,
    )


# ------------------------------------------------------------------------------------------- negatives


def test_dynamic_input_is_not_folded(helpers):
    helpers.check_pass(
        HEADER
        + """
        g (float[3] x) => (float[3] y) <float[3] a = {1.0, 2.0, 3.0}> {
            t = Add(x, a)
            y = Mul(t, a)
        }
        """,
        FoldConstants,
        modified=False,
        delta=0,
    )


def test_initializer_that_is_also_a_graph_input_is_not_a_constant(helpers):
    # `a` is overridable at run time: folding Neg(a) would bake in its default.
    model = helpers.parse(
        HEADER
        + """
        g (float[3] x, float[3] a) => (float[3] y) <float[3] a = {1.0, 2.0, 3.0}> {
            n = Neg(a)
            y = Add(x, n)
        }
        """
    )
    check = helpers.check_pass(model, FoldConstants, modified=False, delta=0, run=False)
    feeds = {"x": np.ones(3, np.float32), "a": np.array([5, 6, 7], np.float32)}
    np.testing.assert_array_equal(helpers.run_ort(check.model, feeds)["y"], [-4, -5, -6])


def test_random_ops_are_not_folded(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[2, 3] x) => (float[2, 3] y, float[2, 3] z) <float[2, 3] a = {1.0, 2.0, 3.0, 4.0, 5.0, 6.0}> {
            r = RandomUniformLike<seed = 1.0>(a)
            y = Add(x, r)
            n = RandomNormal<shape = [2, 3], seed = 2.0>()
            z = Add(x, n)
        }
        """,
        FoldConstants,
        modified=False,
        delta=0,
        run=False,  # random outputs; ORT runs them in test_random_ops_still_run below
    )
    assert check.ops()["RandomUniformLike"] == 1
    assert check.ops()["RandomNormal"] == 1
    feeds = {"x": np.zeros((2, 3), np.float32)}
    assert helpers.run_ort(check.model, feeds)["y"].shape == (2, 3)


def test_output_over_max_elements_is_not_folded(helpers):
    text = (
        HEADER
        + """
        g (float[64, 64] x) => (float[64, 64] y) <float[1] a = {3.0}, int64[2] shape = {64, 64}> {
            big = Expand(a, shape)
            y = Mul(x, big)
        }
        """
    )
    helpers.check_pass(text, lambda: FoldConstants(max_elements=1000), modified=False, delta=0)
    # The same graph under the default bound folds.
    helpers.check_pass(text, FoldConstants, modified=True, delta=0, dce_delta=-1)


def test_dead_constant_nodes_are_left_to_dce(helpers):
    model = helpers.parse(
        HEADER
        + """
        g (float[3] x) => (float[3] y) <float[3] a = {1.0, 2.0, 3.0}> {
            unused = Neg(a)
            y = Identity(x)
        }
        """
    )
    helpers.check_pass(model, FoldConstants, modified=False, delta=0)
    assert RemoveDeadCode()(model).modified
    assert helpers.count_nodes(model) == 1
    assert _initializer_names(model) == set()


# ------------------------------------------------------------------------------------------- folding = ORT


def test_lp_normalization_folds_to_what_onnxruntime_computes(helpers):
    # issue 14 cause 3: onnx.reference divides by sum(x) for p=1; ORT (the target runtime) by sum(|x|).
    model = helpers.parse(
        HEADER
        + """
        g (float[N, 3] x) => (float[N, 3] y) <float[1, 3] c = {1.0, -2.0, 0.5}> {
            n = LpNormalization <axis = -1, p = 1> (c)
            y = Add(x, n)
        }
        """
    )
    helpers.check_pass(model, FoldConstants, modified=True, delta=0, dce_delta=-1)
    add = next(n for n in model.graph if n.op_type == "Add")
    folded = add.inputs[1].const_value.numpy()
    c = np.array([[1.0, -2.0, 0.5]], np.float32)
    np.testing.assert_allclose(folded, c / np.abs(c).sum(), rtol=1e-6)


def test_one_onnxruntime_session_per_graph_and_run(helpers, monkeypatch):
    # A chain of 30 constant nodes is evaluated in one ORT session, not one per node.
    import onnxruntime as ort  # constant folding imports it lazily, when it first evaluates

    sessions = []
    real = ort.InferenceSession

    def counting(*args, **kwargs):
        sessions.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", counting)
    body = "\n".join(f"            t{i + 1} = Sin(t{i})" for i in range(30))
    model = helpers.parse(
        HEADER
        + f"""
        g (float[N, 3] x) => (float[N, 3] y) <float[3] t0 = {{1.0, 2.0, 3.0}}> {{
{body}
            y = Add(x, t30)
        }}
        """
    )
    assert helpers.apply_pass(FoldConstants(), model).modified
    assert len(sessions) == 1
    sessions.clear()
    RemoveDeadCode()(model)
    assert helpers.count_nodes(model) == 1
    assert not helpers.apply_pass(FoldConstants(), model).modified
    assert sessions == []  # nothing left to fold: no session at all
    expected = np.array([1.0, 2.0, 3.0], np.float32)
    for _ in range(30):
        expected = np.sin(expected)
    add = next(n for n in model.graph if n.op_type == "Add")
    np.testing.assert_allclose(add.inputs[1].const_value.numpy(), expected, rtol=1e-6)


def test_a_node_onnxruntime_cannot_run_stays_and_the_rest_folds(helpers):
    # ORT has no int16 Relu kernel: the batch fails, each node is tried alone; Neg folds, Relu stays.
    model = helpers.parse(
        HEADER
        + """
        g (float[3] x) => (float[3] y, int16[2] z) <float[3] a = {1.0, 2.0, 3.0}, int16[2] b = {-1, 2}> {
            n = Neg(a)
            y = Add(x, n)
            z = Relu(b)
        }
        """
    )
    helpers.check_pass(model, FoldConstants, modified=True, delta=0, dce_delta=-1, run=False)
    assert helpers.op_counts(model) == {"Add": 1, "Relu": 1}


def test_shape_of_an_overridable_initializer_still_folds_but_its_values_do_not(helpers):
    # An initializer that is also a graph input may be fed at run time with other values (not another
    # shape: ORT checks it against the declared input), so Shape folds and Neg does not.
    model = helpers.parse(
        HEADER
        + """
        g (float[N, 3] x, float[3] c) => (float[N, 3] y, int64[1] s) <float[3] c = {0.0, 0.0, 0.0}> {
            n = Neg(c)
            y = Mul(x, n)
            s = Shape(c)
        }
        """
    )
    helpers.check_pass(model, FoldConstants, modified=True, delta=1, dce_delta=0)
    assert "Neg" in helpers.op_counts(model)


def test_a_folded_value_listed_twice_as_an_output_keeps_its_name_at_both_places(helpers):
    # issue 14 cause 2: the interface (names, order, duplicates) is preserved exactly.
    model = helpers.parse(
        HEADER
        + """
        g (float[3] x) => (float[3] y, float[3] z, float[3] y) <float[3] a = {1.0, 2.0, 3.0}> {
            y = Neg(a)
            z = Add(x, y)
        }
        """
    )
    helpers.check_pass(model, FoldConstants, modified=True, delta=1, dce_delta=0)
    assert [o.name for o in model.graph.outputs] == ["y", "z", "y"]
    assert model.graph.outputs[0] is model.graph.outputs[2]


def test_a_constant_too_large_to_fold_is_never_read():
    # A GatherND / Transpose of a MoE's expert stack (GBs in an external-data model): the size comes from the
    # shape, so the data is never loaded (a lazy tensor counts its reads).
    reads = []

    def load() -> ir.Tensor:
        reads.append(1)
        return ir.tensor(np.ones((4, 8), np.float32))

    big = ir.Value(name="big", const_value=ir.LazyTensor(load, ir.DataType.FLOAT, ir.Shape([4, 8])))
    big.type, big.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([4, 8])
    small = ir.Value(name="small", const_value=ir.tensor(np.ones((8,), np.float32)))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4, 8]))
    t = ir.node("Transpose", [big], attributes={"perm": [1, 0]})
    a = ir.node("Add", [small, small])
    y = ir.node("Add", [x, t.outputs[0]])
    graph = ir.Graph(
        [x], [y.outputs[0], a.outputs[0]], nodes=[t, a, y], initializers=[big, small], opset_imports={"": 18}
    )
    model = ir.Model(graph, ir_version=10)
    assert FoldConstants(max_elements=16)(model).modified  # the small Add folds
    assert reads == [] and [n.op_type for n in model.graph if n.op_type == "Transpose"] == ["Transpose"]
    assert FoldConstants(max_elements=64)(model).modified and reads  # within the limit it folds (and reads)
