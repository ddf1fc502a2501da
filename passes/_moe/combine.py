"""The combine part: how the experts' outputs are weighted and summed, one variant per block shape.

1. ``batched_mm`` (Hugging Face ``_experts_implementation="batched_mm"``): tokens repeated k times
   (``Expand`` or, TorchScript, ``Tile`` to ``[1, k, 1]``; then ``Reshape [-1, H]`` or ``Flatten``), the top-k
   indices flattened, per-slot expert projections, scaled by the flattened routing weights,
   ``Reshape [-1, k, H]`` (a constant shape, or one built from ``Shape``: its inferred dims) and
   ``ReduceSum`` over the k slots.
2. ``dense``: every expert on every token, combined with a ``[T, E]`` routing matrix by
   ``Einsum("te,eth->th")`` or ``ReduceSum(Unsqueeze(Transpose(R)) * Y, axis 0)``.
3. ``unrolled``: one FFN per expert, each scaled by its column of the routing matrix (``Slice`` or
   ``Gather``) and summed (``Add`` chain or ``Sum``).
4. ``sorted`` (JetMoE, dynamo): the (token, slot) pairs sorted by expert (``TopK(largest=0)`` of the
   flattened indices), each slot's token ``order // k``, its row gathered (``GatherND``), the rows ``Split`` by
   the experts' token counts (``ReduceSum`` of a ``ScatterElements`` one-hot of the indices), one ``Gemm``
   per expert (``experts.sorted_projection``), scaled by the sorted routing weights and added back into the
   tokens' rows with ``ScatterND(reduction="add")``.
5. ``input_scaled`` (Llama 4): every expert on every token repeated ``E`` times, each token's INPUT scaled by
   the router's own matrix (``match_input_scaled``), summed over the experts; top-1 routing only.

``FORMS`` (rules as data) says which shapes a combining node may end: each is tried in order.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array, same_shape
from layerzero.passes._moe.experts import (
    batched_projection,
    expert_ffn,
    linear_projection,
    sorted_projection,
    stack_experts,
    stacked_projection,
)
from layerzero.passes._moe.router import Router, routing_matrix, routing_weights
from layerzero.passes._moe.walk import (
    STD,
    Attempts,
    NoMatch,
    Walk,
    attr_of,
    axes_of,
    commuted,
    const_ints,
    furthest_of,
    need,
    rank_of,
    reshape_dims,
    sorted_axes,
    static_ints,
    zeros_node,
)

__all__ = ["FORMS", "match_batched_mm", "match_dense", "match_input_scaled", "match_sorted", "match_unrolled"]


def _repeated_tokens(w: Walk, value: ir.Value, top_k: int, hidden_size: int) -> ir.Value:
    """``Reshape(Expand(Unsqueeze(x, 1), [1, k, 1]), [-1, H])`` (``repeat_interleave(x, k, dim=0)``) → x."""
    reshape = w.node(value, ("Reshape", "Flatten"), "repeated tokens")
    if reshape.op_type == "Flatten":  # TorchScript: Flatten(axis=2) of [T, k, H]
        need(attr_of(reshape, "axis", 1) in (2, -1), "repeated tokens: Flatten is not of [T, k, H] at axis 2")
    else:
        need(reshape_dims(reshape) == [-1, hidden_size], "repeated tokens: not reshaped to [-1, H]")
    repeated = reshape.inputs[0]
    producer = repeated.producer() if repeated is not None else None
    if top_k > 1 or (producer is not None and producer.op_type in ("Expand", "Tile")):
        # With k = 1 the Expand to [1, 1, 1] is an identity the static passes remove first. Tile by [1, k, 1]
        # (TorchScript) repeats the size-1 axis the same way.
        expand = w.node(repeated, ("Expand", "Tile"), "repeated tokens")
        shape = static_ints(w, expand.inputs[1])
        if shape is None and expand.outputs[0].shape is not None and expand.inputs[0].shape is not None:
            # A shape built at run time (TorchScript): the inferred [T, k, H] of an input [T, 1, H] says the same.
            before, after = list(expand.inputs[0].shape), list(expand.outputs[0].shape)
            if len(before) == len(after) == 3 and before[1] == 1 and before[0] == after[0] and before[2] == after[2]:
                shape = [1, after[1], 1]
        need(
            shape is not None and len(shape) == 3 and shape[1] == top_k and shape[0] == 1 and shape[2] == 1,
            f"repeated tokens: not repeated k={top_k} times ({expand.op_type} to [1, k, 1])",
        )
        repeated = expand.inputs[0]
    unsq = w.node(repeated, "Unsqueeze", "repeated tokens")
    need(sorted_axes(axes_of(unsq), 3) == [1], "repeated tokens: not unsqueezed at axis 1")
    x = unsq.inputs[0]
    need(rank_of(x) == 2, "repeated tokens: the hidden state is not [T, H]")
    return x


def match_batched_mm(w: Walk, end: ir.Node, router: Router) -> dict:
    # ReduceSum(Reshape(Mul(down, Unsqueeze(Reshape(weights, [-1]), 1)), [-1, k, H]), axis=1)
    need(end.op_type == "ReduceSum", "batched_mm: the combination is not a ReduceSum")
    need(sorted_axes(axes_of(end), 3) == [1], "batched_mm: ReduceSum is not over the top-k slots")
    need(attr_of(end, "keepdims", 1) == 0, "batched_mm: ReduceSum keeps the top-k axis")
    reshape = w.node(end.inputs[0], "Reshape", "batched_mm: [T·k, H] → [T, k, H]")
    shape = reshape_dims(reshape)
    need(
        shape is not None and len(shape) == 3 and shape[0] == -1 and shape[1] == router.top_k,
        f"batched_mm: not reshaped to [-1, k={router.top_k}, H]",
    )
    hidden_size = shape[2]
    mul = w.node(reshape.inputs[0], "Mul", "batched_mm: expert output × routing weight")
    attempts, down_value = Attempts(), None
    for other, weight_value in commuted(mul):
        with attempts.trying():
            normalize = w.attempt(lambda v=weight_value: _flat_weights(w, v, router))
            down_value = other
            break
    if down_value is None:
        raise furthest_of(attempts, "batched_mm: no factor is the flattened routing weights", ties="last")
    ffn = expert_ffn(w, down_value, batched_projection(w, router))
    need(
        ffn.w_down.shape[1] == hidden_size,
        f"batched_mm: down weights {list(ffn.w_down.shape)} do not give H={hidden_size}",
    )
    x = _repeated_tokens(w, ffn.x, router.top_k, hidden_size)
    return {"hidden": x, "normalize": normalize, **ffn.fields()}


def _flat_weights(w: Walk, value: ir.Value, router: Router) -> int:
    unsq = w.node(value, "Unsqueeze", "routing weight per slot")
    need(sorted_axes(axes_of(unsq), 2) == [1], "routing weight per slot: not unsqueezed to [T·k, 1]")
    flat = w.node(unsq.inputs[0], "Reshape", "routing weight per slot")
    need(reshape_dims(flat) == [-1], "routing weight per slot: not flattened with Reshape [-1]")
    return routing_weights(w, flat.inputs[0], router)


def match_dense(w: Walk, end: ir.Node, router: Router) -> dict:
    if end.op_type == "Einsum":
        eq = str(attr_of(end, "equation", "")).replace(" ", "")
        lhs, _, out = eq.partition("->")
        terms = lhs.split(",")
        need(len(terms) == 2 and len(out) == 2, f"dense: Einsum {eq!r} is not a [T, E] × [E, T, H] combination")
        r_i = 0 if len(terms[0]) == 2 else 1
        r, y = terms[r_i], terms[1 - r_i]
        need(
            len(r) == 2 and len(y) == 3 and len(set(r + y[2])) == 3 and y == r[1] + r[0] + out[1] and out[0] == r[0],
            f"dense: Einsum {eq!r} is not 'te,eth->th'",
        )
        r_value, y_value = end.inputs[r_i], end.inputs[1 - r_i]
    else:
        need(end.op_type == "ReduceSum", "dense: the combination is not an Einsum or ReduceSum")
        need(sorted_axes(axes_of(end), 3) == [0], "dense: ReduceSum is not over the experts axis")
        need(attr_of(end, "keepdims", 1) == 0, "dense: ReduceSum keeps the experts axis")
        mul = w.node(end.inputs[0], "Mul", "dense: routing × expert outputs")
        r_value = y_value = None
        for a, b in commuted(mul):
            unsq = a.producer()
            if unsq is None or unsq.op_type != "Unsqueeze" or sorted_axes(axes_of(unsq), 3) != [2]:
                continue
            tr = unsq.inputs[0].producer()
            if tr is None or tr.op_type != "Transpose" or list(attr_of(tr, "perm", [1, 0])) != [1, 0]:
                continue
            w.nodes.extend(n for n in (unsq, tr) if n not in w.nodes)
            r_value, y_value = tr.inputs[0], b
            break
        need(r_value is not None, "dense: no factor is the transposed routing matrix [E, T, 1]")
    normalize = routing_matrix(w, r_value, router)
    ffn = expert_ffn(w, y_value, stacked_projection(w))
    need(rank_of(ffn.x) == 2, "dense: the experts' input is not the hidden state [T, H]")
    return {"hidden": ffn.x, "normalize": normalize, **ffn.fields()}


def _column(w: Walk, value: ir.Value) -> tuple[ir.Value, int]:
    """``R[:, e:e+1]`` (Slice) or ``R[:, e][:, None]`` (Gather + Unsqueeze) or ``Gather(R, [e], axis=1)``."""
    node = w.node(value, ("Slice", "Unsqueeze", "Gather"), "routing column")
    if node.op_type == "Slice":
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        steps = const_ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else [1]
        need(axes is not None and sorted_axes(axes, 2) == [1] and steps == [1], "routing column: Slice not on axis 1")
        need(
            starts is not None
            and ends is not None
            and len(starts) == 1
            and ends[0] == starts[0] + 1
            and starts[0] >= 0,
            "routing column: Slice is not one column",
        )
        return node.inputs[0], starts[0]
    if node.op_type == "Unsqueeze":
        need(sorted_axes(axes_of(node), 2) == [1], "routing column: not unsqueezed to [T, 1]")
        gather = w.node(node.inputs[0], "Gather", "routing column")
        index = const_array(gather.inputs[1])
        need(index is not None and index.ndim == 0, "routing column: Gather index is not a scalar constant")
    else:
        gather = node
        index = const_array(gather.inputs[1])
        need(index is not None and index.shape == (1,), "routing column: Gather index is not [e]")
    need(attr_of(gather, "axis", 0) in (1, -1), "routing column: Gather is not on the experts axis")
    e = int(index.reshape(-1)[0])
    need(e >= 0, "routing column: negative expert index")
    return gather.inputs[0], e


def _sum_terms(w: Walk, end: ir.Node) -> list[ir.Value]:
    terms: list[ir.Value] = []

    def visit(value: ir.Value) -> None:
        producer = value.producer()
        if (
            producer is not None
            and producer.op_type in ("Add", "Sum")
            and producer.domain in STD
            and len(value.uses()) == 1
        ):
            w.nodes.append(producer)
            for v in producer.inputs:
                visit(v)
        else:
            terms.append(value)

    w.nodes.append(end)
    for v in end.inputs:
        visit(v)
    return terms


def match_unrolled(w: Walk, end: ir.Node, router: Router) -> dict:
    terms = _sum_terms(w, end)
    need(len(terms) == router.experts, f"unrolled: a sum of {len(terms)} terms for {router.experts} experts")
    per_expert: dict[int, ir.Value] = {}
    matrix = None
    for term in terms:
        mul = w.node(term, "Mul", "unrolled: expert output × routing column")
        found = None
        for y, col in commuted(mul):
            try:
                found = (w.attempt(lambda c=col: _column(w, c)), y)
                break
            except NoMatch:
                continue
        need(found is not None, "unrolled: a term is not an expert output times a routing column")
        (r_value, e), y = found
        need(matrix is None or r_value is matrix, "unrolled: terms read different routing matrices")
        matrix = r_value
        need(e < router.experts and e not in per_expert, f"unrolled: expert column {e} repeated or out of range")
        per_expert[e] = y
    normalize = routing_matrix(w, matrix, router)
    projection = linear_projection(w)
    ffns = []
    for e in range(router.experts):
        ffn = expert_ffn(w, per_expert[e], projection)
        need(not ffns or ffn.x is ffns[0].x, f"unrolled: expert {e} reads another input than expert 0")
        ffns.append(ffn)
    ffn = stack_experts(ffns)
    return {"hidden": ffn.x, "normalize": normalize, **ffn.fields()}


def _through_scalars(w: Walk, value: ir.Value) -> ir.Value:
    """Through the ops that keep a one-element value's element (``Reshape``, ``Squeeze``, ``Unsqueeze``,
    ``Cast`` to an integer, ``Gather`` of index 0)."""
    while True:
        node = value.producer()
        if node is None or node.domain not in STD:
            return value
        if node.op_type == "Gather":
            index = const_array(node.inputs[1])
            if index is None or index.size != 1 or int(index.reshape(-1)[0]) != 0:
                return value
        elif node.op_type == "Cast":
            if attr_of(node, "to") not in (ir.DataType.INT64, ir.DataType.INT32, 6, 7):
                return value
        elif node.op_type not in ("Reshape", "Squeeze", "Unsqueeze"):
            return value
        if node not in w.nodes:
            w.nodes.append(node)
        w.shareable.add(node)
        value = node.inputs[0]


def _expert_counts(w: Walk, sizes: ir.Value, router: Router) -> None:
    """``sizes`` = each expert's number of (token, slot) pairs, in expert order: ``Concat_e(counts[e:e+1])`` (through
    one-element reshapes), ``counts = ReduceSum(Cast(ScatterElements(zeros, indices, ones, axis=1)), axis 0)``."""
    what = "sorted: split sizes"
    concat = w.node(sizes, "Concat", what)
    w.shareable.add(concat)
    need(len(concat.inputs) == router.experts, f"{what}: {len(concat.inputs)} sizes for {router.experts} experts")
    counts = None
    for e, part in enumerate(concat.inputs):
        sl = w.node(_through_scalars(w, part), "Slice", f"{what}: expert {e}'s count")
        w.shareable.add(sl)
        bounds = [const_ints(v) if v is not None else None for v in sl.inputs[1:]]
        starts, ends = bounds[0], bounds[1]
        axes = bounds[2] if len(bounds) > 2 else [0]
        steps = bounds[3] if len(bounds) > 3 and bounds[3] is not None else [1]
        need(
            starts == [e] and ends == [e + 1] and axes in ([0], [-1]) and steps == [1],
            f"{what}: part {e} is not the count of expert {e}",
        )
        need(counts is None or sl.inputs[0] is counts, f"{what}: the sizes read different counts")
        counts = sl.inputs[0]
    total = w.node(counts, "ReduceSum", f"{what}: the counts")
    w.shareable.add(total)
    need(
        sorted_axes(axes_of(total), 2) == [0] and attr_of(total, "keepdims", 1) == 0,
        f"{what}: the counts do not sum the one-hot over the tokens",
    )
    hot = total.inputs[0]
    cast = hot.producer()
    if cast is not None and cast.op_type == "Cast" and cast.domain in STD:  # the one-hot counted as int64
        w.node(hot, "Cast", what)
        w.shareable.add(cast)
        hot = cast.inputs[0]
    scatter = w.node(hot, "ScatterElements", f"{what}: the one-hot of the indices")
    w.shareable.add(scatter)
    need(
        attr_of(scatter, "axis", 0) in (1, -1) and attr_of(scatter, "reduction", "none") == "none",
        f"{what}: ScatterElements is not along the experts axis",
    )
    need(scatter.inputs[1] is router.indices, f"{what}: the one-hot is not of the router's indices")
    zeros_node(w, scatter.inputs[0], f"{what}: the one-hot's zeros")
    ones = scatter.inputs[2].producer()
    if ones is not None and ones.op_type == "ConstantOfShape":
        fill = ones.attributes.get("value")
        one = fill is not None and fill.value.numpy().reshape(-1).tolist() == [1]
        w.nodes.append(ones)
        w.shareable.add(ones)
    else:
        array = const_array(scatter.inputs[2])
        one = array is not None and bool(np.all(array == 1))
    need(one, f"{what}: the one-hot does not scatter ones")


def _length_of(w: Walk, value: ir.Value, of: ir.Value) -> bool:
    """``value`` is ``[len(of)]`` (of a 1-D value): ``Shape(of)`` (start 0), through one-element reshapes."""
    node = _through_scalars(w, value).producer()
    if node is not None and node.op_type == "Gather":
        index = const_array(node.inputs[1])
        if index is None or index.size != 1 or int(index.reshape(-1)[0]) != 0:
            return False
        w.nodes.append(node)
        w.shareable.add(node)
        node = node.inputs[0].producer()
    if node is None or node.op_type != "Shape" or node.inputs[0] is not of or attr_of(node, "start", 0) != 0:
        return False
    w.nodes.append(node)
    w.shareable.add(node)
    return rank_of(of) == 1


def _sort_by_expert(w: Walk, value: ir.Value, router: Router) -> ir.Value:
    """``value`` is the slot order sorted by expert: ``TopK(Reshape(indices, [-1]), len, axis 0, largest=0)``'s
    indices; returns it."""
    sort = w.node(value, "TopK", "sorted: the slots sorted by expert")
    need(value is sort.outputs[1], "sorted: not the sort's order")
    need(
        attr_of(sort, "largest", 1) == 0 and attr_of(sort, "axis", -1) in (0, -1),
        "sorted: the sort is not ascending along the slots",
    )
    flat = w.node(sort.inputs[0], "Reshape", "sorted: the flattened indices")
    need(reshape_dims(flat) == [-1] and flat.inputs[0] is router.indices, "sorted: not the router's indices flattened")
    need(_length_of(w, sort.inputs[1], sort.inputs[0]), "sorted: the sort does not take every slot")
    return value


def _token_of_slot(w: Walk, value: ir.Value, router: Router) -> tuple[ir.Value, ir.Value]:
    """``value = Unsqueeze(order // k, -1)`` (torch's ``div(k, rounding_mode="trunc")``: ``Cast(Sign(d) ·
    Floor(Abs(d)))``, ``d = Cast(order) / k``, or an integer ``Div``) → ``(value, order)``."""
    what = "sorted: each slot's token"
    unsq = w.node(value, "Unsqueeze", what)
    need(sorted_axes(axes_of(unsq), 2) == [1], f"{what}: not unsqueezed to rows [S, 1]")
    w.shareable.add(unsq)
    node = w.node(unsq.inputs[0], ("Cast", "Div"), what)
    w.shareable.add(node)
    if node.op_type == "Cast":
        mul = w.node(node.inputs[0], "Mul", what)
        w.shareable.add(mul)
        found = None
        for floor_v, sign_v in commuted(mul):
            floor, sign = floor_v.producer(), sign_v.producer()
            if floor is None or sign is None or floor.op_type != "Floor" or sign.op_type != "Sign":
                continue
            absolute = floor.inputs[0].producer()
            if absolute is None or absolute.op_type != "Abs" or absolute.inputs[0] is not sign.inputs[0]:
                continue
            found = (floor, sign, absolute)
            break
        need(found is not None, f"{what}: not a truncating division")
        for n in found:
            w.nodes.append(n)
            w.shareable.add(n)
        div = w.node(found[1].inputs[0], "Div", what)
        w.shareable.add(div)
        cast = w.node(div.inputs[0], "Cast", what)
        w.shareable.add(cast)
        order = cast.inputs[0]
    else:
        div, order = node, node.inputs[0]
    k = const_array(div.inputs[1])
    need(k is not None and k.size == 1 and float(k.reshape(-1)[0]) == router.top_k, f"{what}: not divided by k")
    return value, _sort_by_expert(w, order, router)


def match_sorted(w: Walk, end: ir.Node, router: Router) -> dict:
    # ScatterND(zeros [T, H], Unsqueeze(order // k), Expand(experts(GatherND(x, ...)) * weights[order]), add)
    need(end.op_type == "ScatterND", "sorted: the combination is not a ScatterND")
    need(attr_of(end, "reduction", "none") == "add", "sorted: ScatterND does not add")
    rows, order = _token_of_slot(w, end.inputs[1], router)
    zeros_node(w, end.inputs[0], "sorted: the accumulator")
    updates = end.inputs[2]
    producer = updates.producer()
    if producer is not None and producer.op_type == "Expand":
        # Expand(y [S, H], Concat(Shape(order // k), [H])): y already has that shape (S rows, H columns).
        expand = w.node(updates, "Expand", "sorted: the weighted rows")
        shape = w.node(expand.inputs[1], "Concat", "sorted: the weighted rows' shape")
        w.shareable.add(shape)
        parts = shape.inputs
        need(len(parts) == 2, "sorted: the weighted rows are expanded to another shape")
        shape_of = w.node(parts[0], "Shape", "sorted: the weighted rows' shape")
        w.shareable.add(shape_of)
        src = shape_of.inputs[0]
        need(src in (order, rows.producer().inputs[0]), "sorted: the weighted rows are expanded to another shape")
        hidden_dims = const_ints(parts[1])
        need(hidden_dims is not None and len(hidden_dims) == 1, "sorted: the weighted rows' width is not a constant")
        updates = expand.inputs[0]
    else:
        hidden_dims = None
    mul = w.node(updates, "Mul", "sorted: expert output × routing weight")
    attempts, found = Attempts(), None
    for y, weight in commuted(mul):
        with attempts.trying():
            normalize = w.attempt(lambda v=weight: _sorted_weights(w, v, router, order))
            found = (y, normalize)
            break
    if found is None:
        raise furthest_of(attempts, "sorted: no factor is the sorted routing weights", ties="last")
    y, normalize = found
    sizes: list[ir.Value] = []
    ffn = expert_ffn(w, y, sorted_projection(w, router.experts, sizes))
    need(all(s is sizes[0] for s in sizes), "sorted: the projections split the rows at different sizes")
    _expert_counts(w, sizes[0], router)
    gather = w.node(ffn.x, "GatherND", "sorted: the slots' token rows")
    need(attr_of(gather, "batch_dims", 0) == 0, "sorted: GatherND with batch_dims")
    index = gather.inputs[1]
    if index is not rows:
        _token_of_slot(w, index, router)
    x = gather.inputs[0]
    need(rank_of(x) == 2, "sorted: the hidden state is not [T, H]")
    hidden_size = ffn.w_down.shape[1]
    need(hidden_dims in (None, [hidden_size]), f"sorted: the weighted rows are not [S, {hidden_size}]")
    need(same_shape(end.inputs[0], x), "sorted: the accumulator does not have the hidden state's shape")
    return {"hidden": x, "normalize": normalize, **ffn.fields()}


def _sorted_weights(w: Walk, value: ir.Value, router: Router, order: ir.Value) -> int:
    """``Unsqueeze(GatherND(Reshape(weights, [-1]), Unsqueeze(order, -1)), 1)``: each sorted slot's weight."""
    unsq = w.node(value, "Unsqueeze", "sorted: routing weight per row")
    need(sorted_axes(axes_of(unsq), 2) == [1], "sorted: routing weight per row is not unsqueezed to [S, 1]")
    gather = w.node(unsq.inputs[0], ("GatherND", "Gather"), "sorted: the sorted routing weights")
    if gather.op_type == "GatherND":
        pos = w.node(gather.inputs[1], "Unsqueeze", "sorted: the sorted routing weights")
        need(sorted_axes(axes_of(pos), 2) == [1], "sorted: the sorted routing weights' index is not [S, 1]")
        index = pos.inputs[0]
    else:
        need(attr_of(gather, "axis", 0) == 0, "sorted: the routing weights are not gathered along the slots")
        index = gather.inputs[1]
    need(index is order, "sorted: the routing weights are not taken in the experts' order")
    flat = w.node(gather.inputs[0], "Reshape", "sorted: the flattened routing weights")
    need(reshape_dims(flat) == [-1], "sorted: routing weights not flattened with Reshape [-1]")
    return routing_weights(w, flat.inputs[0], router)


def _ones_expand(w: Walk, value: ir.Value) -> ir.Value:
    """Through ``Expand(v, ones)`` of at most ``rank(v)`` ones (an identity: torch's ``repeat`` writes it before
    its ``Tile``): a constant, or ``ConstantOfShape(Shape(s), 1)`` of a static length."""
    node = value.producer()
    if node is None or node.op_type != "Expand" or node.domain not in STD:
        return value
    rank = rank_of(node.inputs[0])
    shape = const_ints(node.inputs[1])
    fill = node.inputs[1].producer()
    nodes = [node]
    if shape is None and fill is not None and fill.op_type == "ConstantOfShape":
        attr = fill.attributes.get("value")
        one = attr is not None and attr.value.numpy().reshape(-1).tolist() == [1]
        length = static_ints(w, fill.inputs[0])
        if one and length is not None and len(length) == 1:
            shape = [1] * length[0]
            nodes.append(fill)
    if rank is None or shape is None or len(shape) > rank or any(d != 1 for d in shape):
        return value
    w.nodes.extend(n for n in nodes if n not in w.nodes)
    w.shareable.update(nodes[1:])
    return node.inputs[0]


def _shape_computation(w: Walk, value: ir.Value, depth: int = 6) -> None:
    """Accept the nodes computing a reshape's target (``Shape`` / ``Gather`` / ``Unsqueeze`` / ``Squeeze`` /
    ``Concat`` / ``Cast``, as TorchScript builds it) into the walk as shareable: one may read a value inside
    the block (``Shape`` of the experts' output) and goes with it."""
    node = value.producer()
    if depth == 0 or node is None or node.domain not in STD:
        return
    if node.op_type not in ("Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast"):
        return
    if node not in w.nodes:
        w.nodes.append(node)
    w.shareable.add(node)
    if node.op_type != "Shape":
        for v in node.inputs:
            if v is not None:
                _shape_computation(w, v, depth - 1)


def match_input_scaled(w: Walk, end: ir.Node, router: Router) -> dict:
    """Llama 4: ``ReduceSum(Reshape(experts(Reshape(Tile(x, [E, 1]) * Reshape(Transpose(M), [-1, 1]), [E, T, H])),
    [E, T, H]), axis 0)``: every expert on every token, each token's input scaled by its column of the router's
    matrix ``M`` (``Router.matrix``: the sigmoid of the chosen logit, 0 elsewhere; an expert without biases maps
    0 to 0). With top-1 routing that is the one chosen expert on ``x · sigmoid(top logit)`` (``input_scale``)."""
    what = "input_scaled"
    need(router.matrix is not None, f"{what}: the router builds no routing matrix of its own (Llama 4's)")
    need(end.op_type == "ReduceSum", f"{what}: the combination is not a ReduceSum")
    need(sorted_axes(axes_of(end), 3) == [0], f"{what}: ReduceSum is not over the experts axis")
    need(attr_of(end, "keepdims", 1) == 0, f"{what}: ReduceSum keeps the experts axis")
    value, outer = end.inputs[0], None
    for _ in range(2):  # [E, T, H] → [E·T, H] → [E, T, H] (TorchScript), or [E, T, H] → [E, T, H] (dynamo)
        producer = value.producer()
        if producer is None or producer.op_type != "Reshape":
            break
        reshape = w.node(value, "Reshape", f"{what}: the experts' outputs")
        outer = outer or reshape_dims(reshape)
        _shape_computation(w, reshape.inputs[1])
        value = reshape.inputs[0]
    ffn = expert_ffn(w, value, stacked_projection(w))
    experts, hidden_size = ffn.w_gate.shape[0], ffn.w_down.shape[1]
    need(experts == router.experts, f"{what}: {experts} experts' weights for {router.experts} router experts")
    need(rank_of(value) == 3, f"{what}: the experts' outputs are not [E, T, H]")
    need(
        outer is None or (len(outer) == 3 and outer[0] == experts and outer[2] == hidden_size),
        f"{what}: the experts' outputs are not summed as [E, T, H]",
    )
    need(ffn.b_gate is None and ffn.b_up is None and ffn.b_down is None, f"{what}: experts with biases see 0 ≠ 0")
    split = w.node(ffn.x, "Reshape", f"{what}: the experts' inputs")
    dims = reshape_dims(split)
    need(
        dims is not None and len(dims) == 3 and dims[0] == experts and dims[2] == hidden_size,
        f"{what}: the experts' inputs are not reshaped to [E, T, H]",
    )
    mul = w.node(split.inputs[0], "Mul", f"{what}: the tokens × their routing weights")
    found = None
    for rep_value, col_value in commuted(mul):
        col = col_value.producer()
        if col is None or col.op_type != "Reshape" or col.domain not in STD:
            continue
        col_dims = reshape_dims(col)
        tr = col.inputs[0].producer()
        if col_dims is None or len(col_dims) != 2 or col_dims[1] != 1 or tr is None or tr.op_type != "Transpose":
            continue
        if list(attr_of(tr, "perm", [1, 0])) != [1, 0] or tr.inputs[0] is not router.matrix:
            continue
        tile = rep_value.producer()
        if tile is None or tile.op_type != "Tile" or tile.domain not in STD:
            continue
        found = (col, tr, tile)
        break
    need(found is not None, f"{what}: the experts' inputs are not the tokens repeated E times × the routing matrix")
    col, tr, tile = found
    w.nodes.extend(n for n in found if n not in w.nodes)
    repeats = static_ints(w, tile.inputs[1])
    need(repeats == [experts, 1], f"{what}: the tokens are not repeated {experts} times (Tile by {repeats})")
    x = _ones_expand(w, tile.inputs[0])
    need(rank_of(x) == 2, f"{what}: the hidden state is not [T, H]")
    need(router.top_k == 1, f"{what}: top-{router.top_k} routing scales each expert's input by its own weight")
    return {"hidden": x, "normalize": 1, "input_scale": True, **ffn.fields()}


# The op that ends a block -> the block shapes it may end, tried in order.
FORMS: dict[str, tuple[tuple[str, Callable[[Walk, ir.Node, Router], dict]], ...]] = {
    "Einsum": (("dense", match_dense),),
    "ReduceSum": (("batched_mm", match_batched_mm), ("dense", match_dense), ("input_scaled", match_input_scaled)),
    "Add": (("unrolled", match_unrolled),),
    "Sum": (("unrolled", match_unrolled),),
    "ScatterND": (("sorted", match_sorted),),
}
