"""Structured zeros: the rows, columns and blocks of weights that pruning tools leave zero.

A weight that is zero only in some rows or columns is kept whole by the value lattice (it is no uniform). This pass
slices such weights so the MatMuls shrink, working from the operands: the contraction axis of ``MatMul`` / ``Gemm``,
``Split`` / ``Slice`` of fused weights, and the elementwise ops between them.

Cases:
1. Pruned neurons. ``MatMul(A, W)`` / ``Gemm(A, W, C)`` with a constant weight: entry ``k`` of ``A``'s last axis is
   *dead* when row ``k`` of ``W`` is zero, or when column ``k`` of ``A`` is a known constant ``c_k`` (its producing
   columns are zero, so ``act(b_k) * ...`` is known). The chain that computes ``A`` (linear leaves ``x @ W_p (+ b)``,
   elementwise ops and activations, constants along the last axis, Reshapes that keep the last axis) is sliced
   along that axis to the live entries, and ``sum_k c_k * W[k]`` (a row) goes into the consumer's bias.
   # act(x @ Wg) * (x @ Wu) @ Wd  ->  act(x @ Wg[:, live]) * (x @ Wu[:, live]) @ Wd[live]
2. Zero blocks of fused weights. A leaf of Case 1 may be a piece of a fused projection (Phi-3's ``gate_up_proj``):
   ``Split`` or ``Slice`` (constant or ``Shape``-computed bounds, ``chunk``'s form) of ``x @ W`` along its last axis.
   The fused weight keeps the live columns of each piece, the split sizes / slice bounds follow. When every entry
   is dead (an up or gate half all zero), the consumer's weight becomes one zero row: the lattice folds the MLP.
3. Zero output columns whose consumer cannot be narrowed (a pruned attention head's query rows): ``x @ W (+ b)``
   whose leading and/or trailing columns of ``W`` (and ``b``) are zero becomes ``Pad(x @ W[:, live] (+ b[live]))``
   with zeros: the MatMul shrinks, the value is the same.
   # x @ W + b  ->  Pad(x @ W[:, a:b] + b[a:b], zeros)
   Interior zero columns (head 2 of 4): the narrower MatMul gets one zero column appended and a ``Gather`` puts
   every column back in place.
4. Zero contraction rows whose producer cannot be narrowed (a pruned head's columns of the output projection):
   ``A @ W`` whose leading and/or trailing rows of ``W`` are zero becomes ``Slice(A)[..., a:b] @ W[a:b]``;
   interior ones ``Gather(A, live, axis=-1) @ W[live]``.
Cases 3 and 4 add a node: only for weights of 16 or more on both axes losing at least 1/64 of an axis.

Every rewrite assumes finite activations (``NaN * 0``), like the lattice's ``x * 0``: the pass runs only under
``assume_finite`` and verification guards it. A chain is narrowed only when each value whose width changes is read
by the chain alone (``Shape`` readers only where their size reaches no other node). A weight that is all zero is
left to the lattice; a weight read by several nodes (tied embeddings) is not narrowed (it would be duplicated).
``removed_params`` counts the weight and bias elements removed (model metadata
``layerzero.structured_zeros.params_removed`` accumulates it for the compile summary).
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from layerzero.passes._graph import NameFactory
from layerzero.passes._structured.cases import consumer_of, narrow_chain, pad_output, slice_input
from layerzero.passes._structured.rewrite import Rewriter

__all__ = ["PARAMS_REMOVED_KEY", "RemoveStructuredZeros"]

logger = logging.getLogger(__name__)

PARAMS_REMOVED_KEY = "layerzero.structured_zeros.params_removed"


class RemoveStructuredZeros(ir.passes.InPlacePass):
    """Slice away zero rows / columns / blocks of weights (module docstring: Cases 1-4)."""

    def __init__(self, assume_finite: bool = True) -> None:
        super().__init__()
        self.assume_finite = assume_finite
        self.removed_params = 0
        self.refusals: list[str] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not self.assume_finite:
            return ir.passes.PassResult(model, modified=False)
        names = NameFactory(model.graph)
        rewriter = Rewriter(model.graph, names)
        removed = 0
        for graph in list(model.graphs()):
            for node in list(graph):
                if node.graph is None:
                    continue
                consumer = consumer_of(node)
                if consumer is not None:
                    removed += narrow_chain(consumer, rewriter, self.assume_finite, self.refusals)
            # Cases 3 and 4: what Case 1 could not narrow keeps its width at the boundary.
            for node in list(graph):
                if node.graph is None:
                    continue
                removed += pad_output(node, rewriter)
                consumer = consumer_of(node)
                if consumer is not None:
                    removed += slice_input(consumer, rewriter)
        if removed:
            self.removed_params += removed
            previous = int(model.metadata_props.get(PARAMS_REMOVED_KEY, "0") or 0)
            model.metadata_props[PARAMS_REMOVED_KEY] = str(previous + removed)
            logger.info("structured zeros: %d parameters removed", removed)
        return ir.passes.PassResult(model, modified=removed > 0)

