"""``activation_calibration.refine``: sparsity moved between groups at the operating point by the marginal
deviation measured there, the model-wide (parameter-weighted) level held."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from layerzero.activation_calibration import GroupSamples, _transport, greedy, refine, refine_unit, uniform
from layerzero.errors import InvalidInputError


def _groups() -> list[GroupSamples]:
    rng = np.random.default_rng(3)
    out = []
    for i, (k, n) in enumerate([(32, 96), (32, 32), (48, 64), (64, 32), (16, 48)]):
        x = rng.laplace(size=(800, k)) * rng.uniform(0.2, 2.0, size=k)
        out.append(GroupSamples(f"model.layers.{i}.mlp.g", x.astype(np.float32), rng.normal(size=(k, n))))
    return out


def _weighted(groups, levels) -> float:
    return sum(g.params * levels[g.name] for g in groups) / sum(g.params for g in groups)


def _quadratic(groups, weight):
    """A deviation of known shape: sum over groups of weight[g] * (fraction of g's samples dropped)^2."""
    by = {g.name: g for g in groups}
    calls = []

    def evaluate(thresholds) -> float:
        calls.append(1)
        return float(sum(weight[n] * by[n].realized(t) ** 2 for n, t in thresholds.items()))

    return evaluate, calls


def test_refine_moves_sparsity_to_the_cheap_groups_at_a_constant_level() -> None:
    groups = _groups()
    weight = {g.name: float(w) * g.params for g, w in zip(groups, [1.0, 8.0, 2.0, 0.5, 4.0], strict=True)}
    evaluate, calls = _quadratic(groups, weight)
    start = uniform(groups, 0.4, "wina")
    got = refine(groups, start, evaluate, "wina", step=0.05, rounds=3, by="group")
    assert got.method == "uniform+refine" and got.trace[0] == pytest.approx(evaluate(start.thresholds))
    assert all(b < a for a, b in itertools.pairwise(got.trace)) and len(got.trace) >= 2
    assert got.deviation == got.trace[-1] == pytest.approx(evaluate(got.thresholds))
    assert _weighted(groups, got.levels) == pytest.approx(0.4, abs=1e-9)
    assert abs(got.sparsity - 0.4) <= 0.01  # realized on the samples
    # The optimum of sum w_g s_g^2 at a fixed sum p_g s_g has s_g proportional to p_g / w_g: the group with the
    # least weight per parameter (index 3) gains, the dearest (index 1) gives.
    assert got.levels[groups[3].name] > 0.4 + 0.04 and got.levels[groups[1].name] < 0.4 - 0.04
    # Each round: at most 2 runs per group, the base and 3 trials.
    assert len(calls) <= 1 + 1 + 3 * (2 * len(groups) + 3)
    # Closer to the optimum than the start: the deviation the allocation predicts exactly.
    p = np.array([g.params for g in groups], float)
    w = np.array([weight[g.name] for g in groups])
    s_opt = 0.4 * p.sum() * (p / w) / (p * p / w).sum()
    best = float((w * s_opt**2).sum())
    assert best < got.deviation < 0.9 * got.trace[0]


def test_refine_keeps_an_allocation_no_move_improves() -> None:
    groups = _groups()
    evaluate, _ = _quadratic(groups, {g.name: float(g.params) for g in groups})  # the optimum: every group equal
    start = uniform(groups, 0.3, "wina")
    got = refine(groups, start, evaluate, "wina", step=0.05, rounds=2, by="group")
    for g in groups:  # a realized-fraction step costs the same in every group: nothing moves (or barely)
        assert abs(got.levels[g.name] - 0.3) <= 0.05
    assert got.deviation <= evaluate(start.thresholds) + 1e-12
    flat, _ = _quadratic(groups, {g.name: 0.0 for g in groups})  # nothing ever costs: nothing is moved
    same = refine(groups, greedy(groups, 0.3, "wina"), flat, "wina", by="group")
    assert same.levels == greedy(groups, 0.3, "wina").levels and same.trace == [0.0]


def test_transport_moves_budget_only_while_it_gains() -> None:
    up = {"a": (1.0, 10.0), "b": (2.0, 10.0), "c": (5.0, 10.0)}
    down = {"c": (6.0, 4.0), "d": (3.0, 20.0), "a": (0.5, 10.0)}
    moves = _transport(up, down)
    # c gives 4 to a (1 < 6), d gives 6 to a, then 10 to b (2 < 3); c takes nothing (5 > 3), a never gives.
    assert moves == pytest.approx({"a": 10.0, "b": 10.0, "c": -4.0, "d": -16.0})
    assert sum(moves.values()) == pytest.approx(0.0)
    assert _transport({"a": (2.0, 1.0)}, {"b": (1.0, 1.0)}) == {}


def test_units_move_together_and_name_their_layer_or_kind() -> None:
    assert refine_unit("model.layers.12.mlp.down", "layer") == "model.layers.12"
    assert refine_unit("model.layers.12.self_attn.qkv", "kind") == "qkv"
    assert refine_unit("model.layers.12.mlp.down", "group") == "model.layers.12.mlp.down"
    with pytest.raises(InvalidInputError):
        refine_unit("model.layers.0.mlp.down", "block")
    rng = np.random.default_rng(5)
    groups = []
    for layer in range(3):
        for kind, k in (("qkv", 32), ("down", 48)):
            x = (rng.laplace(size=(600, k)) * rng.uniform(0.2, 2.0, size=k)).astype(np.float32)
            groups.append(GroupSamples(f"model.layers.{layer}.mlp.{kind}", x, rng.normal(size=(k, 32))))
    # qkv dear (10 per parameter), down cheap (1): the kinds move, each kind's groups by the same step.
    evaluate, _ = _quadratic(groups, {g.name: (10.0 if g.name.endswith("qkv") else 1.0) * g.params for g in groups})
    start = uniform(groups, 0.4, "wina")
    got = refine(groups, start, evaluate, "wina", step=0.05, rounds=2, by="kind")
    qkv = {round(v, 9) for n, v in got.levels.items() if n.endswith("qkv")}
    down = {round(v, 9) for n, v in got.levels.items() if n.endswith("down")}
    assert len(qkv) == len(down) == 1 and qkv.pop() < 0.4 < down.pop()
    assert _weighted(groups, got.levels) == pytest.approx(0.4, abs=1e-9) and got.deviation < got.trace[0]
