"""``QuantizeWeights``: weight-only int4 / int8 quantization of the constant weights ONNX Runtime and
liblayerzero_ort.so run quantized (``layerzero compile --weights int4|int8``).

It runs after the zeroing passes and the target's lowering (``compiler/pipeline.py`` ``quantize_weights``), so what
was removed is never quantized. Cases, in every graph of the model (subgraph bodies too: the ``if`` MoE lowering's
per-expert MatMuls are ordinary MatMuls here):

1. ``MatMul(A, B)`` with ``B`` a constant 2-D float initializer ``[K, N]`` (float32 / float16 / bfloat16, A of the
   same dtype and rank >= 2), ``K`` a multiple of the block → ``com.microsoft.MatMulNBits(A, B_q, scales[, zero
   points])`` with attributes ``K``, ``N``, ``bits``, ``block_size``, ``accuracy_level``.
2. ``Gemm(A, B[, C])`` with ``transA = 0``, ``alpha = 1``, ``B`` constant (``transB`` either way), ``C`` absent or a
   constant ``[N]`` with ``beta = 1`` → ``MatMulNBits`` with ``C`` as its bias (input 5).
3. ``ai.layerzero::MoE`` (the native skipping form, kept for liblayerzero_ort.so) with float constant experts →
   ``weight_format`` ``"q4"`` (int4, ``code_layout`` ``"chunk16"``: ``native_expert_codes``) / ``"q8"`` (int8),
   ``block_size`` 32: codes at inputs 2-4, float16 scales at 10-12 (``passes/_moe_node.py``). The kernel reads
   symmetric blocks of 32 only: another ``block`` or
   ``symmetric=False`` with a native block is refused (``InvalidInputError`` naming the option), never
   quantized in another format than the verification's quantized-dense reference (which quantizes the original's
   expert MatMuls with the options given); so is an MoE block whose hidden or expert size the block does not divide
   (its experts are quantized whole or not at all; cases 3 and 4).
4. ``com.microsoft.MoE`` (the ``ort-moe`` lowering) → ``com.microsoft.QMoE`` (``passes/lower_qmoe.py``).
5. ``ai.layerzero::SparseLinear`` (``SparsifyActivations``' native form, issue 23) with ``weight_format`` ``"f"`` and a
   constant float weight ``W [K, N]`` → ``"q4"`` (int4: ``[K, N/2]`` uint8 nibbles) / ``"q8"`` (int8: ``[K, N]`` int8)
   with float16 ``w_scales [K/32, N]`` at input 5 (``""`` for an absent scale / bias at 3 / 4): symmetric blocks of 32
   along K (the reduction axis, as MatMulNBits), one input channel per stored row of an 8192-column tile
   (``plugins/quant.py`` ``quantize_k_blocks``, the kernel's one format; ``sparse_linear_codes``). As for case 3,
   another ``block`` or ``symmetric=False`` is refused (``InvalidInputError`` naming the option); ``K`` or ``N`` not a
   multiple of 32 keeps ``"f"`` (a ``Refusal`` in ``kept``). The kernel quantizes x to int8 (MatMulNBits' accuracy_level
   4 does too, with other rounding): the verification's quantized-dense reference holds the same projections as
   SparseLinear nodes at thresholds 0 (the dense product of the same codes and int8 x), quantized by this case
   (``compiler/compile.py`` ``quantized_dense_reference``, ``as_dense_sparse_linear``).

What stays float, and why: routers (a MatMul / Gemm whose output reaches a ``TopK``, the MoE node's logits or
``com.microsoft`` MoE's router probabilities through reshapes, casts, a bias, softmax / sigmoid: ``is_router``; a
routing decision flips on a small change and the weight is tiny; llama.cpp keeps it float too); ``Gather`` embedding
tables (a lookup reads one row: nothing to gain); a weight a ``Gather`` also reads (a tied ``lm_head``): the MatMul
gets its quantized copy, the ``Gather`` keeps the float table; a ``B`` that is a graph input (a feed may override
it) or computed; ``K`` not a multiple of the block; ``Conv``, biases, norms, anything but the weights above; an
already quantized graph (MatMulNBits, QMoE, a ``weight_format`` q4/q8 MoE or SparseLinear) is left as it is, so a
second run changes nothing.

The block format (``quantize_matrix``; the one for every case above, so the MatMuls of the ``if`` lowering, the
native experts, QMoE and the verification's quantized-dense reference hold the same codes for the same weight):
blocks of ``block`` consecutive elements along the reduction axis K of each output column n;

- symmetric (default): ``d = max|w| / qmax`` (qmax 7 for int4, 127 for int8) rounded to float16 (the native
  experts' scale type; exact in a float32 scale), codes ``round(w / d)`` (half to even) in ``-qmax..qmax``, stored
  offset by ``2^(bits-1)`` (ONNX Runtime's default zero point: no zero-point input). This is
  ``plugins/quant.py``'s ``quantize_blocks`` (the native op's format; a test checks the codes are equal).
  NOTE: ONNX Runtime's own quantizer (``matmul_nbits_quantizer``, symmetric) writes ``d = w_max / -2^(bits-1)``
  (the signed extreme, 16 levels, negative scales) instead: the layout is the same (a test dequantizes its codes
  with ``dequantize_matrix``), the codes differ;
- asymmetric (``symmetric=False``): ONNX Runtime's formula (MLAS blockwise quantization): ``lo = min(w, 0)``,
  ``hi = max(w, 0)``, ``d = (hi - lo) / (2^bits - 1)``, ``zp = round(-lo / d)``, codes ``round(w / d) + zp``
  clipped to ``0..2^bits-1`` (a test checks the codes equal ``matmul_nbits_quantizer``'s); float32 / the A dtype
  scales, zero points packed like the codes (QMoE takes them too; the native experts do not: case 3);
- int4: two codes a byte, element ``2j`` of a block in the low nibble of byte ``j``; ``B_q [N, K / block,
  block * bits / 8]`` uint8, ``scales [N * K / block]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from layerzero.contract import MOE_DOMAIN, SPARSE_LINEAR_CODE_LAYOUT, SPARSE_LINEAR_OP
from layerzero.errors import InvalidInputError
from layerzero.passes import lower_qmoe
from layerzero.passes._builder import Builder
from layerzero.passes._graph import NameFactory, const_array, drop_if_unused, replace_value, scope_of
from layerzero.passes._match import NoMatch, Refusal, need
from layerzero.passes._moe.lazy import stack_of
from layerzero.passes._moe_node import MoENode, is_moe_node
from layerzero.passes._quant_codes import (
    EXPERT_BLOCK,
    check_format,
    dequantize_matrix,
    native_expert_codes,
    pack_codes,
    quantize_matrix,
    quantize_rows,
    sparse_linear_codes,
)

__all__ = [
    "ACCURACY_LEVELS",
    "EXPERT_BLOCK",
    "QuantizeWeights",
    "as_dense_sparse_linear",
    "check_expert_block",
    "dequantize_matrix",
    "is_router",
    "native_expert_codes",
    "pack_codes",
    "quantize_matrix",
    "quantize_rows",
    "sparse_linear_codes",
    "sparse_linear_formats",
]

MS_DOMAIN = "com.microsoft"
#: MatMulNBits' accuracy_level: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations.
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def unreadable_format(block: int, symmetric: bool, kernel: str, otherwise: str) -> InvalidInputError | None:
    """The one-line refusal of a quantization format ``kernel`` (liblayerzero_ort.so's native MoE or SparseLinear
    kernel, named with what it would run) cannot read: it reads symmetric blocks of ``EXPERT_BLOCK`` along K only.
    None where ``block`` / ``symmetric`` are that format; ``otherwise`` names the other way out."""
    if block == EXPERT_BLOCK and symmetric:
        return None
    what = f"blocks of {block}" if block != EXPERT_BLOCK else "zero points (--quant-asymmetric)"
    return InvalidInputError(
        f"option quant_block / quant_symmetric: {kernel} reads symmetric blocks of {EXPERT_BLOCK} along K only, not "
        f"{what}; use --quant-block {EXPERT_BLOCK} without --quant-asymmetric, or {otherwise}"
    )


class QuantizeWeights(ir.passes.InPlacePass):
    """The module docstring's cases. ``bits`` 4 or 8; ``block`` (MatMulNBits' block_size: a power of two >= 16);
    ``symmetric`` (False: with zero points); ``accuracy_level`` (MatMulNBits' 0-4, also QMoE's).

    After a run: ``quantized`` (node names rewritten, by case: "matmul", "gemm", "moe", "qmoe", "sparse_linear"),
    ``kept`` (``Refusal`` records of the MatMul / Gemm / MoE / SparseLinear nodes with a constant weight left float,
    with why; a MatMul of two activations is no candidate and is not listed)."""

    def __init__(self, bits: int, block: int = 32, symmetric: bool = True, accuracy_level: int = 4) -> None:
        super().__init__()
        check_format(bits, block)
        if accuracy_level not in ACCURACY_LEVELS:
            raise InvalidInputError(f"weight quantization accuracy_level={accuracy_level}: expected 0-4")
        self.bits, self.block, self.symmetric, self.accuracy_level = bits, block, symmetric, accuracy_level
        self.quantized: dict[str, list[str]] = {}
        self.kept: list[Refusal] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.quantized = {"matmul": [], "gemm": [], "moe": [], "qmoe": [], "sparse_linear": []}
        self.kept = []
        names = NameFactory(model.graph)
        builder = Builder.for_model(model, names)
        modified = False
        for graph in list(model.graphs()):
            for node in list(graph):
                kind = _case(node)
                if kind is None:
                    continue
                if kind in ("matmul", "gemm") and (len(node.inputs) < 2 or _constant_weight(node.inputs[1]) is None):
                    continue  # two activations (attention's MatMuls): no weight, nothing to keep or refuse
                try:
                    if kind == "matmul":
                        self._matmul(builder, graph, node)
                    elif kind == "gemm":
                        self._gemm(builder, graph, node)
                    elif kind == "moe":
                        self._moe(builder, node)
                    elif kind == "sparse_linear":
                        self._sparse_linear(builder, node)
                    else:
                        lower_qmoe.quantize_ort_moe(
                            builder, graph, node, self.bits, self.block, self.symmetric, self.accuracy_level
                        )
                        model.opset_imports.setdefault(MS_DOMAIN, 1)
                except NoMatch as failure:
                    self.kept.append(Refusal.of(node.name or "", failure, kind))
                    continue
                self.quantized[kind].append(node.name or "")
                modified = True
        if self.quantized["matmul"] or self.quantized["gemm"]:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        return ir.passes.PassResult(model, modified=modified)

    # ---------------------------------------------------------------------------------- MatMul / Gemm

    def _weight(self, node: ir.Node, a: ir.Value | None, b: ir.Value | None, trans: bool) -> np.ndarray:
        """The constant weight as ``[K, N]`` (NoMatch when it is not one this pass quantizes)."""
        need(a is not None and b is not None, "an input is missing", node)
        found = _constant_weight(b)
        need(found is not None, f"weight {b.name} is not a constant (or a feed may override it)", node)
        array, source = found
        need(source.const_value is not None, f"weight {b.name} is a Constant node, not an initializer", node)
        need(array.ndim == 2, f"weight {b.name} has rank {array.ndim}, not 2", node)
        dtype = source.const_value.dtype
        need(dtype in _FLOATS, f"weight {b.name} is {dtype}, not a float type", node)
        need(a.dtype == dtype, f"activation {a.name} is {a.dtype}, the weight {dtype}", node)
        need(a.shape is not None and len(a.shape) >= 2, f"activation {a.name} has no known rank >= 2", node)
        w = array.T if trans else array
        need(w.shape[0] % self.block == 0, f"K={w.shape[0]} is not a multiple of the block {self.block}", node)
        return np.asarray(w, np.float32)

    def _nbits(
        self, builder: Builder, graph: ir.Graph, node: ir.Node, a: ir.Value, b: ir.Value, w: np.ndarray,
        bias: ir.Value | None,
    ) -> None:  # fmt: skip
        k, n = w.shape
        packed, scales, zero_points = quantize_matrix(w, self.bits, self.block, self.symmetric)
        dtype = a.dtype.numpy()
        hint = b.name or "weight"
        # The node's own name scope (metadata) and name: the quantized MatMul still reads as part of its module.
        prefix = f"{node.name or hint}_"
        sub = Builder(builder.root, builder.names, builder.opset, node_prefix=prefix, metadata=node.metadata_props)
        inputs: list[ir.Value | None] = [
            a,
            builder.initializer(f"{hint}_Q{self.bits}", packed),
            builder.initializer(f"{hint}_scales", scales.astype(dtype)),
            None if zero_points is None else builder.initializer(f"{hint}_zp", zero_points),
        ]
        if bias is not None:
            inputs += [None, bias]
        while inputs[-1] is None:
            inputs.pop()
        out = sub.op(
            "MatMulNBits",
            inputs,
            domain=MS_DOMAIN,
            K=k,
            N=n,
            bits=self.bits,
            block_size=self.block,
            accuracy_level=self.accuracy_level,
        )
        old = node.outputs[0]
        out.dtype, out.shape = old.dtype, old.shape
        graph.insert_before(node, sub.take())
        replace_value(old, out, builder.names)
        graph.remove(node, safe=True)
        transpose = b.producer()
        if transpose is not None and not b.uses() and not b.is_graph_output():
            source = transpose.inputs[0]
            transpose.graph.remove(transpose, safe=True)
            drop_if_unused(source)
        drop_if_unused(b)

    def _matmul(self, builder: Builder, graph: ir.Graph, node: ir.Node) -> None:
        need(not is_router(node), "a router (its output chooses experts): kept float", node)
        a, b = node.inputs[0], node.inputs[1]
        w = self._weight(node, a, b, trans=False)
        self._nbits(builder, graph, node, a, b, w, None)

    def _gemm(self, builder: Builder, graph: ir.Graph, node: ir.Node) -> None:
        def attr(name: str, default: float) -> float:
            value = node.attributes.get(name)
            return default if value is None else value.value

        need(not is_router(node), "a router (its output chooses experts): kept float", node)
        need(attr("transA", 0) == 0, "Gemm with transA = 1", node)
        need(attr("alpha", 1.0) == 1.0, "Gemm with alpha != 1", node)
        a, b = node.inputs[0], node.inputs[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        w = self._weight(node, a, b, trans=bool(attr("transB", 0)))
        if c is not None:
            need(attr("beta", 1.0) == 1.0, "Gemm with a bias and beta != 1", node)
            bias = const_array(c)
            need(bias is not None and bias.shape == (w.shape[1],), f"bias {c.name} is not a constant [N]", node)
            need(c.dtype == a.dtype, f"bias {c.name} is {c.dtype}, not {a.dtype}", node)
        self._nbits(builder, graph, node, a, b, w, c)

    # -------------------------------------------------------------------------------------- native MoE

    def _moe(self, builder: Builder, node: ir.Node) -> None:
        view = MoENode.of(node)
        need(view.weight_format == "f", f"experts already {view.weight_format}", node)
        # Refused, not approximated: the quantized-dense reference quantizes these experts' MatMuls with the
        # options given, so experts in another format would not be the model verification compares against.
        refusal = unreadable_format(self.block, self.symmetric, f"the native MoE kernel (liblayerzero_ort.so, block "
                                    f"{view.path or node.name})", "--moe-lowering if / ort-moe")  # fmt: skip
        if refusal is not None:
            raise refusal
        arrays = []
        for value in (view.w_gate, view.w_up, view.w_down):
            # Experts read one at a time where the rewrite left them lazy (passes/_moe/lazy.py): never held whole.
            array = stack_of(value)
            if array is None:
                array = const_array(value)
            need(array is not None and value.const_value is not None, f"expert weight {value.name} is not a constant",
                 node)  # fmt: skip
            need(value.const_value.dtype in _FLOATS, f"expert weight {value.name} is not a float type", node)
            need(array.ndim == 3, f"expert weight {value.name} is not [E, out, in]", node)
            check_expert_block(view.path or node.name, value.name, array.shape[-1], EXPERT_BLOCK)
            arrays.append(array)
        stored = [native_expert_codes(w, self.bits) for w in arrays]
        fmt = f"q{self.bits}"
        base = view.path or node.name or "moe"
        olds = (view.w_gate, view.w_up, view.w_down)
        for slot, (codes, scales) in zip(("gate", "up", "down"), stored):
            setattr(view, f"w_{slot}", builder.initializer(f"{base}.experts.{slot}_{fmt}", codes))
            setattr(view, f"s_{slot}", builder.initializer(f"{base}.experts.{slot}_scales", scales))
        view.weight_format = fmt
        view.code_layout = "chunk16" if self.bits == 4 else "rows"  # native_expert_codes' q4 layout
        view.write_inputs(node)
        for name, value in view.format_attributes().items():
            node.attributes[name] = value
        for old in olds:
            drop_if_unused(old)

    # ------------------------------------------------------------------------------------ SparseLinear

    def _sparse_linear(self, builder: Builder, node: ir.Node) -> None:
        attr = node.attributes.get("weight_format")
        fmt = "f" if attr is None else attr.value
        need(fmt == "f", f"weight already {fmt}", node)
        path = _attr(node, "path") or node.name or "sparse_linear"
        # Refused, not approximated (as the native experts): the kernel reads one format only.
        refusal = unreadable_format(self.block, self.symmetric, f"the SparseLinear kernel (liblayerzero_ort.so, "
                                    f"projection {path})", "no activation sparsity")  # fmt: skip
        if refusal is not None:
            raise refusal
        need(len(node.inputs) >= 3, "an input is missing", node)
        w = node.inputs[1]
        array = const_array(w)
        need(array is not None and w is not None and w.const_value is not None,
             f"weight {w.name if w is not None else ''} is not an initializer", node)  # fmt: skip
        need(w.const_value.dtype in _FLOATS, f"weight {w.name} is {w.const_value.dtype}, not a float type", node)
        need(array.ndim == 2, f"weight {w.name} has rank {array.ndim}, not 2", node)
        need(len(node.inputs) < 6 or node.inputs[5] is None, "w_scales given with weight_format f", node)
        k, n = array.shape
        need(n % EXPERT_BLOCK == 0, f"N={n} is not a multiple of the kernel's block {EXPERT_BLOCK}: kept f", node)
        need(k % EXPERT_BLOCK == 0, f"K={k} is not a multiple of the kernel's block {EXPERT_BLOCK}: kept f", node)
        codes, scales = sparse_linear_codes(array, self.bits)
        fmt = f"q{self.bits}"
        inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
        inputs[1] = builder.initializer(f"{path}.weight_{fmt}", codes)
        inputs[5] = builder.initializer(f"{path}.weight_scales", scales)
        node.resize_inputs(6)
        for i, value in enumerate(inputs):
            if node.inputs[i] is not value:
                node.replace_input_with(i, value)
        node.attributes["weight_format"] = ir.AttrString("weight_format", fmt)
        node.attributes["block_size"] = ir.AttrInt64("block_size", EXPERT_BLOCK)
        node.attributes["code_layout"] = ir.AttrInt64("code_layout", SPARSE_LINEAR_CODE_LAYOUT)
        drop_if_unused(w)


def _attr(node: ir.Node, name: str) -> str | None:
    value = node.attributes.get(name)
    return None if value is None else value.value


def sparse_linear_formats(model: ir.Model) -> dict[str, str]:
    """``path -> weight_format`` of every ``ai.layerzero::SparseLinear`` of ``model`` (every graph)."""
    return {
        _attr(n, "path") or n.name or "": _attr(n, "weight_format") or "f"
        for g in model.graphs()
        for n in g
        if _is_sparse_linear(n)
    }


def sparse_linear_projections(model: ir.Model) -> dict[str, tuple[str, ...]]:
    """``path -> projections`` of every ``ai.layerzero::SparseLinear`` of ``model`` (every graph): the scopes of the
    MatMuls it computes (``projections``, where ``SparsifyActivations`` fused a group's into one node; else its path
    alone)."""
    out: dict[str, tuple[str, ...]] = {}
    for g in model.graphs():
        for n in g:
            if _is_sparse_linear(n):
                path = _attr(n, "path") or n.name or ""
                fused = n.attributes.get("projections")
                strings = fused is not None and fused.type == ir.AttributeType.STRINGS and len(fused.value) > 0
                out[path] = tuple(fused.value) if strings else (path,)
    return out


def as_dense_sparse_linear(model: ir.Model, wanted: Mapping[str, Sequence[str]] | Iterable[str]) -> list[str]:
    """The quantized-dense reference's form of the projections a compile made SparseLinear (issue 23). ``wanted``
    maps a compiled node's path to the scopes of the MatMuls it computes (``sparse_linear_projections``; a plain
    iterable of paths: each its own MatMul). Each such set of MatMuls of ``model``'s main graph (scope =
    ``_graph.scope_of``, a constant float 2-D weight each, all reading one x) becomes ``SparseLinear(x, W,
    thresholds = 0)`` with ``weight_format "f"`` under that path (several: fused as the compile fuses them,
    ``fuse_projections``; thresholds 0 keep every nonzero entry: the dense product, in the kernel's order), which
    ``QuantizeWeights`` then quantizes exactly as the compiled node (blocks of 32 along N; a MatMulNBits' blocks
    along K would be other codes). Returns the paths rewritten, in graph order; the caller checks none is
    missing."""
    from layerzero.passes.sparsify_activations import fuse_projections

    spec = {p: (p,) for p in wanted} if not isinstance(wanted, Mapping) else {p: tuple(s) for p, s in wanted.items()}
    path_of = {scope: path for path, scopes in spec.items() for scope in scopes}
    found: dict[str, dict[str, tuple[ir.Node, np.ndarray]]] = {}
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        scope = scope_of(node) or node.name or ""
        w = node.inputs[1]
        array = const_array(w)
        if scope not in path_of or array is None or array.ndim != 2 or w.dtype not in _FLOATS:
            continue
        found.setdefault(path_of[scope], {}).setdefault(scope, (node, array))
    done: list[str] = []
    names = NameFactory(model.graph)
    for path, scopes in spec.items():
        members = [found.get(path, {}).get(s) for s in scopes]
        if any(m is None for m in members) or len({m[0].inputs[0] for m in members}) != 1:
            continue  # missing (or reading another x): the caller names it
        nodes = [m[0] for m in members]
        # the first MatMul's name scope (metadata): the nodes still read as part of their module (scope_of)
        b = Builder.for_model(
            model, names, node_prefix=f"{nodes[0].name or path}/reference_", metadata=nodes[0].metadata_props
        )
        zero = b.initializer(f"{path}.reference_thresholds", np.zeros((), np.float32))
        fuse_projections(model, b, nodes, [m[1] for m in members], [nodes[0].inputs[0], zero], path)
        done.append(path)
    if done:
        model.opset_imports.setdefault(MOE_DOMAIN, 1)
    order = {node: i for i, node in enumerate(model.graph)}
    first = {_attr(n, "path"): order[n] for n in model.graph if _is_sparse_linear(n)}
    return sorted(done, key=lambda p: first.get(p, 0))


def _is_sparse_linear(node: ir.Node) -> bool:
    return node.domain == MOE_DOMAIN and node.op_type == SPARSE_LINEAR_OP


def check_expert_block(path: str, name: str, k: int, block: int) -> None:
    """An MoE block's experts are quantized whole or the compile is refused: the quantized-dense reference quantizes
    each expert matrix whose K the block divides, so a block left float for one matrix would not be that model."""
    if k % block:
        raise InvalidInputError(
            f"option quant_block: MoE block {path}: expert weight {name} has K={k}, not a multiple of the block "
            f"{block}; its experts cannot be quantized (choose a --quant-block dividing the hidden and expert sizes)"
        )


def _case(node: ir.Node) -> str | None:
    if node.domain in ("", "ai.onnx") and node.op_type == "MatMul":
        return "matmul"
    if node.domain in ("", "ai.onnx") and node.op_type == "Gemm":
        return "gemm"
    if is_moe_node(node):
        return "moe"
    if node.domain == MS_DOMAIN and node.op_type == "MoE":
        return "qmoe"
    if _is_sparse_linear(node):
        return "sparse_linear"
    return None


# What a router's logits pass through on their way to the choice (shape, type, bias, scores; Where: the
# solidify reference's expert forced off with -inf).
_ROUTE_THROUGH = frozenset(
    {"Reshape", "Cast", "Add", "Softmax", "Sigmoid", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Div", "Mul",
     "Where"}
)  # fmt: skip


def is_router(node: ir.Node, depth: int = 6) -> bool:
    """Whether ``node``'s output chooses experts: it reaches a ``TopK``, an ``ai.layerzero::MoE``'s logits (input
    1) or a ``com.microsoft`` ``MoE`` / ``QMoE``'s router probabilities (input 1) through at most ``depth`` nodes
    of ``_ROUTE_THROUGH``."""
    frontier = [node.outputs[0]]
    for _ in range(depth):
        nxt = []
        for value in frontier:
            for user, index in value.uses():
                if user.op_type == "TopK" and index == 0:
                    return True
                if index == 1 and (is_moe_node(user) or (user.domain == MS_DOMAIN and user.op_type in ("MoE", "QMoE"))):
                    return True
                if user.domain in ("", "ai.onnx") and user.op_type in _ROUTE_THROUGH:
                    nxt.extend(user.outputs)
        frontier = nxt
    return False


def _constant_weight(value: ir.Value | None) -> tuple[np.ndarray, ir.Value] | None:
    """``(array, initializer)`` of a constant weight: an initializer (not a graph input), or the 2-D ``Transpose`` of
    one (a tied ``lm_head`` whose table is too large for constant folding: ``Gather`` reads the table, the MatMul
    its transpose); None otherwise."""
    array = const_array(value)
    if array is not None:
        return array, value
    producer = value.producer() if value is not None else None
    if producer is None or producer.op_type != "Transpose" or producer.domain not in ("", "ai.onnx"):
        return None
    source = producer.inputs[0]
    table = const_array(source)
    perm = producer.attributes.get("perm")
    if table is None or table.ndim != 2 or (perm is not None and list(perm.value) != [1, 0]):
        return None
    return table.T, source
