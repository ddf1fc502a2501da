"""The projection part of an expert FFN: which block shape reads the stacked weights (batched ``GatherND`` /
``Gather`` of stacked weights, a ``MatMul`` by stacked ``[E, in, out]``, one expert's ``MatMul`` / ``Gemm``,
JetMoE's rows sorted by expert), each with its optional bias (``passes/_moe/experts.py``'s docstring)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array
from layerzero.passes._moe import lazy
from layerzero.passes._moe.lazy import ExpertStack
from layerzero.passes._moe.router import Router
from layerzero.passes._moe.walk import (
    STD,
    Attempts,
    NoMatch,
    Walk,
    attr_of,
    axes_of,
    commuted,
    const_ints,
    const_weight,
    furthest_of,
    need,
    rank_of,
    reshape_dims,
    sorted_axes,
)

__all__ = [
    "Projection",
    "batched_projection",
    "linear_projection",
    "selected_weight",
    "sorted_projection",
    "stacked_projection",
]

# A projection part: (value, what) -> (weights [E, out, in], bias [E, out] or None, the input it reads). Stacked
# weights of an external-data model are ``ExpertStack``s (read one expert at a time: ``passes/_moe/lazy.py``).
Projection = Callable[[ir.Value, str], tuple[np.ndarray | ExpertStack, np.ndarray | None, ir.Value]]


def stacked_weight(value: ir.Value, rank: int, what: str) -> np.ndarray | ExpertStack:
    """``const_weight`` of stacked experts ``[E, ...]``: an ``ExpertStack`` where the initializer can be read one
    expert at a time (external data, a bfloat16 view of it), else the array."""
    stack = lazy.expert_stack(value)
    if stack is None:
        return const_weight(value, rank, what)
    need(stack.ndim == rank, f"{what}: {value.name} has shape {list(stack.shape)}, expected rank {rank}")
    return stack


def _through_identity(w: Walk, value: ir.Value) -> ir.Value:
    """``Squeeze(Unsqueeze(v, a), a)`` → ``v`` (dynamo leaves such pairs around batched projections)."""
    while True:
        squeeze = value.producer()
        if squeeze is None or squeeze.op_type != "Squeeze" or squeeze.domain not in STD:
            return value
        unsq = squeeze.inputs[0].producer()
        if unsq is None or unsq.op_type != "Unsqueeze" or unsq.domain not in STD or len(squeeze.inputs[0].uses()) != 1:
            return value
        rank = rank_of(squeeze.inputs[0])
        a, b = axes_of(squeeze), axes_of(unsq)
        if rank is None or a is None or b is None or sorted_axes(a, rank) != sorted_axes(b, rank):
            return value
        w.nodes.extend(n for n in (squeeze, unsq) if n not in w.nodes)
        value = unsq.inputs[0]


def _biased(
    w: Walk, value: ir.Value, what: str, bias_part: Callable[[ir.Value], np.ndarray]
) -> tuple[ir.Value, np.ndarray | None]:
    """``Add(p, bias)`` (either order) → ``(p, bias [E, out])`` when ``bias_part`` accepts an operand;
    anything else → ``(value, None)``."""
    add = value.producer()
    if add is None or add.op_type != "Add" or add.domain not in STD:
        return value, None
    attempts = Attempts()
    for p, b in commuted(add):
        with attempts.trying():
            bias = w.attempt(lambda b=b: bias_part(b))
            if add not in w.nodes:
                w.nodes.append(add)
            return p, bias
    best = furthest_of(attempts)
    raise NoMatch(f"{what}: an Add whose operands are no bias: {best.reason}", *best.nodes, progress=best.progress)


def _flat_indices(w: Walk, value: ir.Value, router: Router, rows: bool) -> None:
    """``Reshape(indices, [-1])``, as GatherND rows ``[T·k, 1]`` (``Unsqueeze`` at 1) when ``rows``."""
    if rows:
        unsq = w.node(value, "Unsqueeze", "expert index")
        need(sorted_axes(axes_of(unsq), 2) == [1], "expert index: not unsqueezed to [T·k, 1]")
        value = unsq.inputs[0]
    flat = w.node(value, "Reshape", "expert index")
    need(reshape_dims(flat) == [-1], "expert index: the top-k indices are not flattened with Reshape [-1]")
    need(flat.inputs[0] is router.indices, "expert index: not the router's top-k indices")


def batched_projection(w: Walk, router: Router) -> Projection:
    """Per (token, slot) expert weights, picked by ``GatherND(W, rows)`` (dynamo) or ``Gather(W, flat, axis=0)``
    (TorchScript), times the tokens, squeezed: ``Squeeze(MatMul(W[e] [T·k, out, in], Unsqueeze(x, 2)), 2)``, or
    transposed (``is_transposed`` experts, GPT-OSS) ``Squeeze(MatMul(Unsqueeze(x, 1), W[e] [T·k, in, out]), 1)``;
    plus, optionally, the bias rows picked by the same index."""

    def pick(value: ir.Value, rank: int, what: str) -> np.ndarray:
        """``value`` = the rows of a constant ``[E, ...]`` of the given rank picked by the router's indices."""
        gather = w.node(value, ("GatherND", "Gather"), what)
        if gather.op_type == "GatherND":
            need(attr_of(gather, "batch_dims", 0) == 0, f"{what}: GatherND with batch_dims")
        else:
            need(attr_of(gather, "axis", 0) == 0, f"{what}: Gather of expert weights is not along the experts axis")
        source = gather.inputs[0]
        weight = stacked_weight(source, rank, what) if rank == 3 else const_weight(source, rank, what)
        need(
            weight.shape[0] == router.experts,
            f"{what}: {weight.shape[0]} experts' weights for a router of {router.experts}",
        )
        _flat_indices(w, gather.inputs[1], router, rows=gather.op_type == "GatherND")
        return weight

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, np.ndarray | None, ir.Value]:
        value, bias = _biased(w, _through_identity(w, value), what, lambda b: pick(b, 2, f"{what}: bias"))
        squeeze = w.node(value, "Squeeze", what)
        axes = sorted_axes(axes_of(squeeze), 3)
        need(axes in ([1], [2]), f"{what}: Squeeze is not of axis 1 or 2 of [T·k, out, 1] / [T·k, 1, out]")
        matmul = w.node(squeeze.inputs[0], "MatMul", what)
        transposed = axes == [1]
        tokens, weights = (matmul.inputs[0], matmul.inputs[1]) if transposed else (matmul.inputs[1], matmul.inputs[0])
        weight = pick(weights, 3, f"{what}: per-token expert weights")
        if transposed:
            weight = lazy.transposed(weight)
        unsq = w.node(tokens, "Unsqueeze", f"{what}: tokens as a matrix")
        need(
            sorted_axes(axes_of(unsq), 3) == ([1] if transposed else [2]),
            f"{what}: tokens are not unsqueezed to {'[T·k, 1, in]' if transposed else '[T·k, in, 1]'}",
        )
        need(bias is None or bias.shape[1] == weight.shape[1], f"{what}: bias width differs from the weights'")
        return weight, bias, unsq.inputs[0]

    return projection


def stacked_projection(w: Walk) -> Projection:
    """``MatMul(x, W [E, in, out])`` (+ a stacked bias ``[E, 1, out]``)."""

    def bias_part(value: ir.Value, what: str) -> np.ndarray:
        bias = const_weight(value, 3, f"{what}: bias [E, 1, out]")
        need(bias.shape[1] == 1, f"{what}: bias {list(bias.shape)} is not [E, 1, out]")
        return bias[:, 0, :]

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, np.ndarray | None, ir.Value]:
        value, bias = _biased(w, value, what, lambda b: bias_part(b, what))
        matmul = w.node(value, "MatMul", what)
        weight = stacked_weight(matmul.inputs[1], 3, f"{what}: stacked weights [E, in, out]")
        x = matmul.inputs[0]
        need(rank_of(x) in (2, 3), f"{what}: input {x.name} is not [T, in] or [E, T, in]")
        need(bias is None or bias.shape == (weight.shape[0], weight.shape[2]), f"{what}: bias does not fit weights")
        return lazy.transposed(weight), bias, x

    return projection


def linear_projection(w: Walk) -> Projection:
    """One expert's projection as a stacked weight of one expert ``[1, out, in]``: ``MatMul`` (+ a bias
    ``[out]``) or ``Gemm`` (with or without C)."""

    def bias_part(value: ir.Value, what: str) -> np.ndarray:
        bias = const_weight(value, 1, f"{what}: bias [out]")
        return bias[None]

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, np.ndarray | None, ir.Value]:
        value, bias = _biased(w, value, what, lambda b: bias_part(b, what))
        node = w.node(value, ("MatMul", "Gemm"), what)
        weight = selected_weight(w, node.inputs[1], f"{what}: weight")
        if node.op_type == "Gemm":
            need(
                attr_of(node, "transA", 0) == 0 and attr_of(node, "alpha", 1.0) == 1.0,
                f"{what}: Gemm with transA/alpha",
            )
            if len(node.inputs) > 2 and node.inputs[2] is not None:
                need(bias is None, f"{what}: Gemm with a bias and an Add of another")
                c = const_array(node.inputs[2])
                need(
                    c is not None and c.dtype.kind == "f" and attr_of(node, "beta", 1.0) == 1.0,
                    f"{what}: Gemm's C is not a constant bias (beta 1)",
                )
                need(c.ndim == 1 or (c.ndim == 2 and c.shape[0] == 1), f"{what}: Gemm's C {list(c.shape)} is not [out]")
                bias = c.reshape(1, -1)
            if not attr_of(node, "transB", 0):
                weight = weight.T
        else:
            weight = weight.T
        need(rank_of(node.inputs[0]) == 2, f"{what}: input is not [T, in]")
        need(bias is None or bias.shape[1] == weight.shape[0], f"{what}: bias width differs from the weights'")
        return np.ascontiguousarray(weight)[None], bias, node.inputs[0]

    return projection


def selected_weight(w: Walk, value: ir.Value, what: str) -> np.ndarray:
    """One expert's 2-D weight: a constant, or ``weight[e]`` of a stacked constant left unfolded (torch's
    ``select``, JetMoE's ``self.weight[i]``): ``Gather(W, e, axis 0)`` with a scalar ``e``, ``Squeeze(Gather(W,
    [e]) | Slice(W, [e], [e + 1]), 0)``, each also under ``Transpose(perm [1, 0])``. The selecting nodes join
    the block (they go with it)."""
    if const_array(value) is not None:
        return const_weight(value, 2, what)
    nodes: list[ir.Node] = []
    transposed = False
    node = value.producer()
    if node is not None and node.op_type == "Transpose" and node.domain in STD:
        perm = attr_of(node, "perm")
        need(perm is not None and list(perm) == [1, 0], f"{what}: {value.name} is Transpose with perm {perm}")
        nodes.append(node)
        transposed, value = True, node.inputs[0]
        node = value.producer()
    squeeze = None
    if node is not None and node.op_type == "Squeeze" and node.domain in STD:
        need(axes_of(node) == [0], f"{what}: {value.name} is a Squeeze of other axes than 0")
        squeeze = node
        nodes.append(node)
        node = node.inputs[0].producer()
    need(
        node is not None and node.op_type in ("Gather", "Slice") and node.domain in STD,
        f"{what}: {value.name} is not a constant weight",
    )
    stacked = const_weight(node.inputs[0], 3, f"{what}: the stacked weights of {value.name}")
    experts = stacked.shape[0]
    if node.op_type == "Gather":
        index = const_array(node.inputs[1])
        need(attr_of(node, "axis", 0) == 0, f"{what}: Gather {node.name} is not along the experts axis")
        need(
            index is not None and index.size == 1 and index.ndim == (0 if squeeze is None else 1),
            f"{what}: Gather {node.name} does not select one expert by a constant index",
        )
        e = int(index.reshape(-1)[0])
    else:
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else [0]
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        need(
            squeeze is not None and starts is not None and ends is not None and len(starts) == 1
            and axes in ([0], [-3]) and steps == [1],
            f"{what}: Slice {node.name} does not select one expert of the stacked weights",
        )  # fmt: skip
        e = starts[0] + experts if starts[0] < 0 else starts[0]
        need(ends[0] == e + 1, f"{what}: Slice {node.name} selects experts {starts[0]}..{ends[0]}, not one")
    need(-experts <= e < experts, f"{what}: expert {e} of {experts} stacked weights")
    nodes.append(node)
    w.nodes.extend(n for n in nodes if n not in w.nodes)
    weight = stacked[e]
    return weight.T if transposed else weight


def sorted_projection(w: Walk, experts: int, sizes: list[ir.Value]) -> Projection:
    """Rows sorted by expert (JetMoE's ``ParallelExperts``): ``Concat_e(Gemm(Split(x, sizes, axis 0)[e], W_e))``,
    one linear projection per expert reading its part. Every ``Split`` of the block must cut at the same
    ``sizes`` (appended here; the combine part checks they are the experts' token counts)."""
    linear = linear_projection(w)

    def projection(value: ir.Value, what: str) -> tuple[np.ndarray, np.ndarray | None, ir.Value]:
        concat = w.node(value, "Concat", f"{what}: the experts' rows")
        need(
            rank_of(value) == 2 and sorted_axes([int(attr_of(concat, "axis", 0))], 2) == [0],
            f"{what}: Concat is not along the rows",
        )
        need(len(concat.inputs) == experts, f"{what}: {len(concat.inputs)} parts for {experts} experts")
        weights, biases, split = [], [], None
        for e, part in enumerate(concat.inputs):
            weight, bias, x_e = linear(part, f"{what} of expert {e}")
            node = x_e.producer()
            need(
                node is not None and node.op_type == "Split" and node.domain in STD and len(node.outputs) == experts,
                f"{what} of expert {e}: does not read a Split of the rows into {experts} parts",
            )
            need(split is None or node is split, f"{what}: the experts read different Splits")
            need(node.outputs[e] is x_e, f"{what}: expert {e} reads part {list(node.outputs).index(x_e)}")
            split = node
            weights.append(weight)
            biases.append(bias)
        need(
            sorted_axes([int(attr_of(split, "axis", 0))], 2) == [0] and len(split.inputs) > 1,
            f"{what}: Split is not of the rows by sizes",
        )
        if split not in w.nodes:
            w.nodes.append(split)
        sizes.append(split.inputs[1])
        need(len({wt.shape for wt in weights}) == 1, f"{what}: the experts' weights differ in shape")
        bias = None
        if any(b is not None for b in biases):
            width = weights[0].shape[1]
            bias = np.concatenate([np.zeros((1, width), weights[0].dtype) if b is None else b for b in biases])
        return np.concatenate(weights), bias, split.inputs[0]

    return projection
