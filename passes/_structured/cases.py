"""The cases of structured zeros (passes/structured_zeros.py's docstring), one function each.

``narrow_chain``: Cases 1 and 2; ``pad_output``: Case 3; ``slice_input``: Case 4.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import const_array, rename_output
from layerzero.passes._match import NoMatch
from layerzero.passes._quantized import is_matmul_nbits
from layerzero.passes._structured.chain import Chain
from layerzero.passes._structured.leaves import (
    Matrix,
    last_dim,
    linear,
    linear_node,
    node_label,
    quantized_matmul,
    set_last_dim,
    std,
    weight_array,
)
from layerzero.passes._structured.rewrite import Rewriter, opset

logger = logging.getLogger("layerzero.passes.structured_zeros")

MIN_WIDTH = 16  # Cases 3 / 4: narrower axes are not worth a node


@dataclasses.dataclass
class Consumer:
    """``MatMul(A, W)`` / ``Gemm(A, W, C)`` reading ``A`` along the contraction axis."""

    node: ir.Node
    weight: Matrix  # math form [K, N]

    @property
    def input(self) -> ir.Value:
        return self.node.inputs[0]  # type: ignore[return-value]


def consumer_of(node: ir.Node) -> Consumer | None:
    if not node.outputs or (not node.outputs[0].uses() and not node.outputs[0].is_graph_output()):
        return None  # dead: DCE's
    quantized = quantized_matmul(node)
    if quantized is not None:  # MatMulNBits, MatMul(A, DequantizeLinear(...)): passes/_quantized.py
        a = node.inputs[0]
        if a is None or a.shape is None or len(a.shape) < 2 or weight_array(a) is not None:
            return None
        return Consumer(node, Matrix(quantized[0], None, quant=quantized[1]))
    if std(node, "MatMul") and len(node.inputs) == 2 and node.inputs[0] is not None:
        weight = weight_array(node.inputs[1], own=True)
        a = node.inputs[0]
        if weight is None or a.shape is None or len(a.shape) < 2 or weight_array(a) is not None:
            return None
        return Consumer(node, Matrix(node.inputs[1], weight))
    if std(node, "Gemm") and not node.attributes.get_int("transA", 0) and node.inputs[0] is not None:
        raw = weight_array(node.inputs[1], own=True)
        if raw is None or weight_array(node.inputs[0]) is not None:
            return None
        transposed = bool(node.attributes.get_int("transB", 0))
        return Consumer(node, Matrix(node.inputs[1], raw, transposed, node.attributes.get_float("alpha", 1.0)))
    return None



def narrow_chain(consumer: Consumer, rewriter: Rewriter, assume_finite: bool, refusals: list[str]) -> int:
    """Cases 1 and 2: narrow the chain computing the consumer's input to its live entries; parameters removed."""
    weight = consumer.weight
    width = weight.shape[0]
    dead_rows = weight.zero_rows()
    if dead_rows.all():
        return 0  # an all-zero weight: the lattice's
    a = consumer.input
    if last_dim(a) not in (None, width) or width < 2:
        return 0
    chain = Chain(width, assume_finite)
    try:
        known, vals = chain.visit(a)
    except NoMatch as exc:
        if dead_rows.any():  # pruned rows whose producer stays whole: say why (Case 4 may still slice)
            refuse(refusals, consumer, int(dead_rows.sum()), exc)
        else:
            logger.debug("structured zeros at %s: %s", consumer.node.name, exc)
        return 0
    dead = dead_rows | known
    quant = weight.quant
    if quant is not None and dead.any():
        removable = quant.removable_rows(dead)  # a quantized consumer loses whole blocks of K only
        if (dead & ~removable).any():
            kept = int((dead & ~removable).sum())
            reason = f"{kept} of them kept: not whole blocks of {quant.block} of its quantized weight (K)"
            refuse(refusals, consumer, int(dead.sum()), NoMatch(reason, consumer.node))
        dead = removable
    if not dead.any():
        return 0
    try:
        chain.exclusive(consumer.node)
    except NoMatch as exc:
        refuse(refusals, consumer, int(dead.sum()), exc)
        return 0
    constant = known & ~dead_rows & (vals != 0)
    row = (vals[constant] @ weight.rows(np.flatnonzero(constant))) if constant.any() else None
    keep = np.flatnonzero(~dead)
    zero_consumer = keep.size == 0
    if zero_consumer:
        keep = np.array([0])  # one column stays, read by a zero weight row: the lattice folds the MatMul
        if quant is not None and quant.layout == "blocked":
            keep = np.arange(min(quant.block, width))  # one block stays, its scales 0
    removed = chain.narrow(keep, rewriter)
    removed += narrow_consumer(consumer, keep, zero_consumer, row, rewriter)
    logger.debug(
        "structured zeros at %s: %d of %d entries dead, %d parameters removed",
        consumer.node.name,
        int(dead.sum()),
        width,
        removed,
    )
    return removed

def refuse(refusals: list[str], consumer: Consumer, dead: int, exc: NoMatch) -> None:
    line = f"{node_label(consumer.node)}: {dead} dead entries of its input, the chain computing it not narrowed: {exc}"
    refusals.append(line)
    logger.info("structured zeros at %s", line)

def narrow_consumer(
    consumer: Consumer, keep: np.ndarray, zero: bool, row: np.ndarray | None, rewriter: Rewriter
) -> int:
    node = consumer.node
    quant = consumer.weight.quant
    if quant is not None:
        removed = quant.take_rows(keep, rewriter.constant)
        if zero:
            quant.zeroed(rewriter.constant)
    else:
        raw = const_array(node.inputs[1])
        assert raw is not None
        transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
        new = np.take(raw, keep, axis=1 if transposed else 0)
        if zero:
            new = np.zeros_like(new)
        removed = raw.size - new.size
        node.replace_input_with(1, rewriter.constant(node.inputs[1].name or "lz_weight", new))
    if row is None:
        return removed
    out = node.outputs[0]
    dtype = out.dtype.numpy() if out.dtype is not None else np.float32
    if node.op_type == "Gemm":
        beta = node.attributes.get_float("beta", 1.0)
        has_c = len(node.inputs) > 2 and node.inputs[2] is not None
        c = const_array(node.inputs[2]) if has_c else None
        if beta != 0 and (not has_c or (c is not None and c.size in (1, row.size))):
            base = np.zeros(row.size) if c is None else np.broadcast_to(c.reshape(-1), row.shape)
            merged = (base + row / beta).astype(dtype)
            if has_c:
                node.replace_input_with(2, rewriter.constant(node.inputs[2].name or "lz_bias", merged))
            else:
                node.resize_inputs(3)
                node.replace_input_with(2, rewriter.constant(f"{node.name}_bias", merged))
            return removed
    # before: y = MatMul(A, W)   after: y = Add(MatMul(A', W'), row)
    add = rewriter.node(
        "Add",
        [out, rewriter.constant(f"{node.name}_row", row.astype(dtype))],
        name=f"{node.name}_lz_row",
        output=f"{out.name}_lz_row",
    )
    new_out = add.outputs[0]
    new_out.shape, new_out.type = out.shape, out.type
    rewriter.scopes.insert_after(node, add)
    for user, index in list(out.uses()):
        if user is not add:
            user.replace_input_with(index, new_out)
    if out.is_graph_output():
        rename_output(node.graph, out, new_out, rewriter.names, "lz_before_row")
    return removed

def pad_output(node: ir.Node, rewriter: Rewriter) -> int:
    """Case 3: zero output columns of ``x @ W (+ b)`` come back as a Pad (or Gather) of a narrower MatMul."""
    if not (std(node, "MatMul", "Gemm") or is_matmul_nbits(node)) or not node.outputs or not node.outputs[0].uses():
        return 0
    out = node.outputs[0]
    leaf = None
    uses = out.uses()
    if len(uses) == 1 and std(uses[0][0], "Add") and not out.is_graph_output():
        leaf = linear(uses[0][0].outputs[0])  # x @ W + b, the bias Add included
    if leaf is None:
        leaf = linear_node(out)
    if leaf is None or weight_array(node.inputs[0]) is not None:
        return 0
    if not leaf.out.uses() or leaf.out.is_graph_output():
        return 0
    zero = leaf.zero_columns() & (leaf.column_values() == 0)
    lead, trail = run_lengths(zero)
    width = leaf.width
    if not worth_a_node(leaf.weight.shape, width, int(zero.sum())):
        return 0  # nothing worth a Pad, or an all-zero weight (the lattice's)
    rank = len(leaf.out.shape) if leaf.out.shape is not None else None
    if rank is None or rank < 1:
        return 0
    target = leaf.out
    original_shape, original_type = target.shape, target.type
    live = np.flatnonzero(~zero)
    ends_only = lead + trail == int(zero.sum())
    removed = rewriter.narrow_linear(leaf, live)
    if ends_only:
        # before: y = x @ W + b     after: y = Pad(x @ W[:, lead:-trail] + b[lead:-trail], zeros)
        pad = zero_pad(node, target, rank, lead, trail, rewriter)
        nodes, new = [pad], pad.outputs[0]
    else:
        # Interior zero columns (head 2 of 4): one zero column appended, then each column gathered from its
        # live position or from that zero.
        # before: y = x @ W     after: y = Gather(Pad(x @ W[:, live], 1 zero column), index, axis=-1)
        pad = zero_pad(node, target, rank, 0, 1, rewriter)
        index = np.full(width, len(live), np.int64)
        index[live] = np.arange(len(live))
        gather = rewriter.node(
            "Gather",
            [pad.outputs[0], rewriter.constant(f"{node.name}_columns", index)],
            {"axis": rank - 1},
            name=f"{node.name}_lz_gather",
            output=f"{target.name}_lz_padded",
        )
        nodes, new = [pad, gather], gather.outputs[0]
    if ends_only:
        rewriter.build.name(new, f"{target.name}_lz_padded")
    new.shape, new.type = original_shape, original_type
    producer = target.producer()
    assert producer is not None and producer.graph is not None
    rewriter.scopes.insert_after(producer, nodes)
    for user, index in list(target.uses()):
        if user is not pad:
            user.replace_input_with(index, new)
    logger.debug(
        "structured zeros at %s: %d zero output columns restored after a narrower MatMul, %d parameters removed",
        node_label(node),
        int(zero.sum()),
        removed,
    )
    return removed

def zero_pad(node: ir.Node, target: ir.Value, rank: int, lead: int, trail: int, rewriter: Rewriter) -> ir.Node:
    """``Pad(target)`` with zeros: ``lead`` / ``trail`` columns before / after its last axis."""
    pads = [0] * (rank - 1) + [lead] + [0] * (rank - 1) + [trail]
    name, output = f"{node.name}_lz_pad", f"{target.name}_lz_pad"
    if opset(rewriter.root, node) >= 11:
        pads_value = rewriter.constant(f"{node.name}_pads", np.array(pads, np.int64))
        pad = rewriter.node("Pad", [target, pads_value], name=name, output=output)
    else:
        pad = rewriter.node("Pad", [target], {"pads": pads}, name=name, output=output)
    pad.outputs[0].dtype = target.dtype
    return pad

def slice_input(consumer: Consumer, rewriter: Rewriter) -> int:
    """Case 4: zero contraction rows of ``A @ W``: the consumer reads a Slice (or Gather) of ``A``."""
    weight = consumer.weight
    width = weight.shape[0]
    zero = weight.zero_rows()
    if weight.quant is not None:
        zero = weight.quant.removable_rows(zero)  # whole blocks of a quantized weight only
    lead, trail = run_lengths(zero)
    if not worth_a_node(weight.shape, width, int(zero.sum())):
        return 0
    node = consumer.node
    a = consumer.input
    rank = len(a.shape) if a.shape is not None else None
    if rank is None or rank < 1 or last_dim(a) not in (None, width):
        return 0
    live = np.flatnonzero(~zero)
    live_name = f"{node.name}_lz_live"
    if lead + trail != int(zero.sum()):
        # Interior zero rows: before: y = A @ W     after: y = Gather(A, live, axis=-1) @ W[live]
        index = rewriter.constant(f"{node.name}_live", live.astype(np.int64))
        cut = rewriter.node("Gather", [a, index], {"axis": rank - 1}, name=live_name, output=f"{a.name}_lz_live")
        return read_live(consumer, cut, live, rewriter)
    # before: y = A @ W     after: y = Slice(A, lead:K-trail, last axis) @ W[lead:K-trail]
    bounds = [
        rewriter.constant(f"{node.name}_starts", np.array([lead], np.int64)),
        rewriter.constant(f"{node.name}_ends", np.array([width - trail], np.int64)),
        rewriter.constant(f"{node.name}_axes", np.array([rank - 1], np.int64)),
    ]
    if opset(rewriter.root, node) >= 10:
        cut = rewriter.node("Slice", [a, *bounds], name=live_name, output=f"{a.name}_lz_live")
    else:
        cut = rewriter.node(
            "Slice",
            [a],
            {"starts": [lead], "ends": [width - trail], "axes": [rank - 1]},
            name=live_name,
            output=f"{a.name}_lz_live",
        )
    return read_live(consumer, cut, live, rewriter)

def read_live(consumer: Consumer, cut: ir.Node, live: np.ndarray, rewriter: Rewriter) -> int:
    """The consumer reads ``cut``'s output (the live entries of its input) with the live rows of its weight."""
    node, a = consumer.node, consumer.input
    sliced = cut.outputs[0]
    sliced.dtype = a.dtype
    if a.shape is not None:
        sliced.shape = a.shape
        set_last_dim(sliced, len(live))
    rewriter.scopes.insert_before(node, cut)
    node.replace_input_with(0, sliced)
    if consumer.weight.quant is not None:
        return consumer.weight.quant.take_rows(live, rewriter.constant)
    raw = const_array(node.inputs[1])
    assert raw is not None
    transposed = node.op_type == "Gemm" and node.attributes.get_int("transB", 0)
    new = np.take(raw, live, axis=1 if transposed else 0)
    node.replace_input_with(1, rewriter.constant(node.inputs[1].name or "lz_weight", new))
    logger.debug("structured zeros at %s: its input read at %d live entries", node_label(node), len(live))
    return raw.size - new.size



def worth_a_node(shape: tuple[int, int], width: int, dead: int) -> bool:
    """Cases 3 / 4 add a Pad or Slice: only for a weight with both axes real (a router's few logits are left
    alone: solidify drops its rows) losing at least 1/64 of ``width``, and never all of it (an all-zero weight is
    the lattice's)."""
    return min(shape) >= MIN_WIDTH and max(1, width // 64) <= dead < width


def run_lengths(zero: np.ndarray) -> tuple[int, int]:
    """Lengths of the leading and trailing runs of True."""
    if zero.all():
        return len(zero), 0
    lead = int(np.argmin(zero))
    trail = int(np.argmin(zero[::-1]))
    return lead, trail
