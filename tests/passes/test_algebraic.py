"""SimplifyConcatSplit: Split(Concat(a, b)) along the same axis into the same pieces is (a, b)."""

from __future__ import annotations

from layerzero.passes import SimplifyConcatSplit

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'


def test_split_of_concat_gives_the_pieces_back(helpers):
    # before: s = Concat(a, b, axis=1); p, q = Split(s, [4, 2]); y = p + 1; z = q * 2
    # after:  y = Sin(x) + 1; z = Cos(x)[:, :2] * 2 (the Split is gone, DCE takes the Concat)
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 4] x) => (float[N, 4] y, float[N, 2] z) <int64[2] sizes = {4, 2}, int64[1] st = {0},
                                                           int64[1] en = {2}, int64[1] ax = {1}> {
            a = Sin(x)
            c = Cos(x)
            b = Slice(c, st, en, ax)
            s = Concat <axis = 1> (a, b)
            p, q = Split <axis = 1> (s, sizes)
            y = Neg(p)
            z = Exp(q)
        }
        """,
        SimplifyConcatSplit,
        modified=True,
        delta=0,
        dce_delta=-2,
    )
    assert "Split" not in check.ops() and "Concat" not in check.ops()


def test_equal_parts_with_num_outputs(helpers):
    check = helpers.check_pass(
        HEADER
        + """
        g (float[N, 3] x) => (float[N, 3] y, float[N, 3] z) {
            a = Sin(x)
            b = Cos(x)
            s = Concat <axis = -1> (a, b)
            p, q = Split <axis = 1, num_outputs = 2> (s)
            y = Neg(p)
            z = Exp(q)
        }
        """,
        SimplifyConcatSplit,
        modified=True,
        delta=0,
        dce_delta=-2,
    )
    assert check.ops() == {"Sin": 1, "Cos": 1, "Neg": 1, "Exp": 1}


def test_different_pieces_or_axis_stay(helpers):
    # Split sizes [3, 3] do not match the concatenated [4, 2]; the other Split is on another axis.
    helpers.check_pass(
        HEADER
        + """
        g (float[2, 4] x, float[2, 2] w) => (float[2, 3] y, float[2, 3] z, float[1, 6] u, float[1, 6] v)
          <int64[2] sizes = {3, 3}> {
            s = Concat <axis = 1> (x, w)
            p, q = Split <axis = 1> (s, sizes)
            y = Neg(p)
            z = Exp(q)
            u, v = Split <axis = 0, num_outputs = 2> (s)
        }
        """,
        SimplifyConcatSplit,
        modified=False,
        delta=0,
    )
