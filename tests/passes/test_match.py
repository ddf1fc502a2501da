"""passes/_match.py: one failure type, the furthest attempt wins."""

import onnx_ir as ir
import pytest

from layerzero.passes._match import Attempts, NoMatch, Refusal, furthest, need


def _node(op: str, name: str) -> ir.Node:
    return ir.Node("", op, [], name=name)


def test_need_raises_with_reason_and_nodes():
    a = _node("MatMul", "mm")
    need(True, "never raised", a)
    with pytest.raises(NoMatch) as info:
        need(False, "not a constant weight", a)
    assert info.value.reason == "not a constant weight" and str(info.value) == "not a constant weight"
    assert info.value.nodes == (a,) and info.value.where == "MatMul mm" and info.value.progress == 1


def test_furthest_attempt_wins_and_first_of_equals():
    a, b, c = _node("TopK", "t"), _node("Softmax", "s"), _node("Gather", "g")
    near = NoMatch("no softmax", a)
    far = NoMatch("no gather", a, b, c)
    tie = NoMatch("other", a, b, c)
    assert furthest([near, far, tie]) is far
    assert furthest([]) is None
    assert furthest([NoMatch("x", a, progress=9), far]).reason == "x"


def test_attempts_keeps_failures_and_lets_other_errors_through():
    attempts = Attempts()
    for depth in (1, 3, 2):
        with attempts.trying():
            raise NoMatch(f"depth {depth}", *[_node("Add", str(i)) for i in range(depth)])
    assert attempts.best().reason == "depth 3" and len(attempts.failures) == 3
    with pytest.raises(ValueError), attempts.trying():
        raise ValueError("a bug is not a refusal")


def test_refusal_round_trips_through_json():
    r = Refusal.of("model.layers.0.mlp", NoMatch("k is not constant", _node("TopK", "topk")), kind="moe")
    assert r == Refusal("model.layers.0.mlp", "k is not constant", "TopK topk", "moe")
    assert Refusal.from_json(r.to_json()) == r
    assert Refusal.from_json({"path": "p", "reason": "r"}, kind="gate") == Refusal("p", "r", "", "gate")
