"""``--activation-rotation heads`` (issue 23): fold ``RotateHeads``' exact rotations into the model before the
activation calibration, chosen on the calibration activations, and check them numerically.

``rotate_heads(model, groups, activations, collect)``: ``R`` per query head from o_proj's input samples
(``head_rotations``), folded (``RotateHeads``), then the calibration activations collected again on the rotated
model (``collect``). The rotation is exact, so every group's input must come back as it was, o_proj's rotated by
the same ``R`` (relative L2 within ``TOLERANCE``): a graph whose head layout is not the one the pass reads off
(another GQA order, a head reshape it misreads) fails that check and the model gets its own weights back, the
refusal recorded. Returns the groups (found again: their weights changed), the new activations and the manifest's
record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from layerzero.passes.rotate_heads import RotateHeads, find_head_pairs, head_rotations, rotated_inputs
from layerzero.passes.sparsify_activations import ActivationGroup, find_groups

__all__ = ["TOLERANCE", "rotate_heads"]

#: The largest relative L2 difference between a group's input after the rotation and what it must be.
TOLERANCE = 1e-4

Collect = Callable[[Sequence[ActivationGroup]], dict[str, np.ndarray]]


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rotate_heads(
    model: ir.Model, groups: Sequence[ActivationGroup], activations: Mapping[str, np.ndarray], collect: Collect
) -> tuple[list[ActivationGroup], dict[str, np.ndarray], dict]:
    """The module docstring's rotation; ``collect(groups)`` runs the calibration requests on ``model``."""
    pairs, refused = find_head_pairs(model)
    by_o = {g.projections[0]: g for g in groups if len(g.projections) == 1}
    rotations, expected = {}, {}
    for pair in pairs:
        group = by_o.get(pair.o)
        if group is None or group.name not in activations:
            continue
        rs = head_rotations(pair, activations[group.name])
        rotations[pair.layer] = rs
        expected[group.name] = rotated_inputs(pair, activations[group.name], rs)
    record = {"kind": "heads", "layers": 0, "refused": [r.to_json() for r in refused]}
    if not rotations:
        return list(groups), dict(activations), record
    weights = {pair.o: pair.o.inputs[1] for pair in pairs if pair.layer in rotations}
    step = RotateHeads(rotations)
    step(model)
    names = {g.name for g in groups}
    new_groups = [g for g in find_groups(model) if g.name in names]

    def undo(path: str, reason: str) -> tuple[list[ActivationGroup], dict[str, np.ndarray], dict]:
        """The model's own weights back, the refusal recorded, the activations as collected before."""
        _restore(model, weights)
        record["refused"].append({"path": path, "reason": reason, "kind": "rotation"})
        return [g for g in find_groups(model) if g.name in names], dict(activations), record

    try:
        got = collect(new_groups)
    except Exception as exc:  # the rotated model does not run (a layout the pass misread)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return undo("", f"the rotated model does not run ({first}): not rotated")
    worst, where = 0.0, ""
    for name, before in activations.items():
        if name not in got:
            continue
        d = _relative(got[name][: len(before)], expected.get(name, before)[: len(got[name])])
        if d > worst:
            worst, where = d, name
    if worst > TOLERANCE:  # not the layout read off the graph
        return undo(where, f"the rotated model's input of {where} is {worst:.2g} (relative L2) from the rotation's, "
                    f"above {TOLERANCE:g}: not rotated")  # fmt: skip
    record["layers"] = len(step.rotated)
    record["check"] = worst
    return new_groups, got, record


def _restore(model: ir.Model, weights: Mapping[ir.Node, ir.Value]) -> None:
    """Undo ``RotateHeads`` on each o_proj of ``weights`` (its weight before): the rotation nodes out, the weight
    back."""
    graph = model.graph
    for o, weight in weights.items():
        join = o.inputs[0].producer()
        if join is None or not join.name.endswith("/head_rotation/Reshape_1"):
            continue
        rotate = join.inputs[0].producer()
        split = rotate.inputs[0].producer()
        shape = join.inputs[1].producer()
        constants = [v for node in (split, rotate) for v in node.inputs[1:] if v is not None]
        o.replace_input_with(0, split.inputs[0])
        graph.remove([join, rotate, split, shape], safe=True)
        for value in constants:
            if not value.uses():
                graph.initializers.pop(value.name, None)
        if weight.name not in graph.initializers:
            graph.register_initializer(weight)
        rotated = o.inputs[1]
        o.replace_input_with(1, weight)
        if rotated is not weight and not rotated.uses():
            graph.initializers.pop(rotated.name, None)
