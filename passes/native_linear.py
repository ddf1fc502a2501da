"""``NativeLinear``: the dense quantized MatMuls ``QuantizeWeights`` wrote (``com.microsoft::MatMulNBits``) into
liblayerzero_ort.so's ``ai.layerzero::QLinear`` (``layerzero compile --weights int4|int8 --linear-kernel native``).

Why: at batch-1 decode a quantized projection costs the bytes of its weight, and ONNX Runtime's MatMulNBits reads
them below one core's stream on the hosts measured here (bench/README ``decode.py``: the lm_head of the Qwen3-MoE
shape, [1024, 32000] int4, ~1.4x slower than QLinear at 1 thread on the Zen 4 host); QLinear runs the MoE experts'
row kernels (``plugins/ort/src/qdot_rows.cpp``, llama.cpp's order: per output row, int8 x against 4-bit / 8-bit
codes in blocks of 32 along K) on the same codes.

What it rewrites, in every graph: a MatMulNBits with ``bits`` 4 or 8, ``block_size`` 32, ``accuracy_level`` 4 (x
rounded to int8 per block: what QLinear does, with llama.cpp's rounding, not MLAS'), a constant ``B``, constant
``scales`` that float16 holds exactly (``QuantizeWeights``' symmetric scales are float16 values), no zero points
(the default ``2^(bits-1)``, the symmetric format), no ``g_idx``, an optional constant bias. ``A`` float32, or
float16 / bfloat16 (a model saved in half precision; its scales and bias have A's type): cast to float32 for QLinear
and the output back, one Cast per x shared by the projections that read it (so they still merge, below), the bias
made float32. ``B``'s bytes are QLinear's q4 codes (``[N, K/2]``: element ``2j`` of a block in the low nibble of
byte ``j``, code + 8), each row's bytes permuted into 16-block chunks (``code_layout="chunk16"``,
``plugins/quant.py`` ``chunk_q4_rows``: one 32-bit lane per block in the row kernel's 64-byte steps, an exact
integer dot per block over a chunk; the lm_head of the Qwen3-MoE decode bench 16 % faster than the plain rows in a
standalone kernel A/B); q8 codes are ``B - 128`` as int8. Anything else is left as it is (``kept`` says why), so
an already rewritten or foreign graph comes through unchanged and a second run changes nothing.

Then, in every graph, the QLinear nodes that read the same x (a decoder layer's q / k / v projections, a dense MLP's
gate and up) are merged into one with several outputs (the ``splits`` attribute: output i gets columns
[sum(n_<i), sum(n_<=i)) of the product, its rows written straight into it). Why: each node quantized the same x
to int8 and paid its own ONNX Runtime dispatch (~3 us a node) and thread-pool split, a small projection's few rows
split alone; merged, x is quantized once and one split runs the rows of all of them. The nodes merged: the
same ``weight_format`` and ``block_size``, codes / scales (and biases) constant initializers, all with a bias or
all without, no ``splits`` yet, two or more of them. Their codes, scales and biases are concatenated along N;
each output keeps its projection's value (name, type, shape: consumers and graph outputs see no change); the node
keeps the first one's name and place (x is defined before all of them, each consumer comes after its own
projection: the order stays topological); ``merged`` records ``(name, [the names merged])``. The result is the
same bitwise: a row's arithmetic does not depend on the node it runs in. A merged node (it has ``splits``) is not
merged again, so a second run changes nothing here either.

The verification's quantized-dense reference gets the same pass after its quantization (``compiler/compile.py``
``quantized_dense_reference``): the zeroing is judged on the same kernel and codes, the int8 rounding of x being
QLinear's in both.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from layerzero.contract import MOE_DOMAIN, QLINEAR_OP
from layerzero.passes._builder import Builder, model_opset
from layerzero.passes._graph import NameFactory, const_array
from layerzero.passes._quant_codes import chunk_q4_rows
from layerzero.passes._quantized import MS_DOMAIN

__all__ = ["NativeLinear"]

_MERGE_MIN = 2  # QLinear nodes reading one x, merged into one
_X_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)  # MatMulNBits' A types


def _attr(node: ir.Node, name: str, default: int) -> int:
    a = node.attributes.get(name)
    return default if a is None else int(a.value)


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


def _initializer(value: ir.Value | None) -> np.ndarray | None:
    """A constant initializer's array (None for anything else: a graph input, a computed value, a Constant node)."""
    if value is None or not value.is_initializer():
        return None
    return const_array(value)


def _take_over(old: ir.Value, new: ir.Value) -> None:
    """``new`` replaces ``old``: its type, its readers (a graph output too) and its name."""
    name = old.name
    new.dtype, new.shape, new.type = old.dtype, old.shape, old.type
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = None
    new.name = name


class NativeLinear(ir.passes.InPlacePass):
    """MatMulNBits → ``ai.layerzero::QLinear``, then the QLinear nodes of one x merged (module docstring).
    ``rewritten``: the nodes' names; ``kept``: ``(name, why)`` of the MatMulNBits left; ``merged``: ``(name of the
    merged node, [the names of the nodes it replaced])``."""

    def __init__(self) -> None:
        super().__init__()
        self.rewritten: list[str] = []
        self.kept: list[tuple[str, str]] = []
        self.merged: list[tuple[str, list[str]]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.rewritten, self.kept, self.merged = [], [], []
        self._casts: dict[tuple[int, int], ir.Value] = {}
        names = NameFactory(model.graph)
        self._root, self._opset = model.graph, model_opset(model)
        graphs = list(model.graphs())
        for graph in graphs:
            for node in list(graph):
                if node.domain == MS_DOMAIN and node.op_type == "MatMulNBits":
                    why = self._rewrite(graph, names, node)
                    if why:
                        self.kept.append((node.name or "", why))
        if self.rewritten:
            model.opset_imports.setdefault(MOE_DOMAIN, 1)
        for graph in graphs:
            self._merge_all(graph, names)
        return ir.passes.PassResult(model, modified=bool(self.rewritten or self.merged))

    # ------------------------------------------------------------------------------ merging one x's QLinear nodes

    @staticmethod
    def _merge_key(node: ir.Node) -> tuple | None:
        """What QLinear nodes must share to be merged (x, format, code layout, K, a bias or not); None: not
        mergeable."""
        if node.domain != MOE_DOMAIN or node.op_type != QLINEAR_OP or "splits" in node.attributes:
            return None
        if len(node.outputs) != 1 or not 3 <= len(node.inputs) <= 4 or node.inputs[0] is None:
            return None
        fmt = node.attributes.get("weight_format")
        codes, scales = _initializer(_input(node, 1)), _initializer(_input(node, 2))
        if fmt is None or codes is None or scales is None or codes.ndim != 2 or scales.ndim != 2:
            return None
        if codes.shape[0] != scales.shape[0]:
            return None
        bias = _input(node, 3)
        if bias is not None:
            b = _initializer(bias)
            if b is None or b.dtype != np.float32 or b.shape != (codes.shape[0],):
                return None
        x = node.inputs[0]
        block = _attr(node, "block_size", 32)
        layout = node.attributes.get("code_layout")
        layout_name = "rows" if layout is None else str(layout.value)
        return (id(x), str(fmt.value), block, layout_name, codes.dtype.str, codes.shape[1], scales.shape[1],
                bias is not None)  # fmt: skip

    def _merge_all(self, graph: ir.Graph, names: NameFactory) -> None:
        groups: dict[tuple, list[ir.Node]] = {}
        for node in graph:  # in graph order: a group's first node is the first of its nodes
            key = self._merge_key(node)
            if key is not None:
                groups.setdefault(key, []).append(node)
        for group in groups.values():
            if len(group) >= _MERGE_MIN:
                self._merge(graph, names, group)

    def _merge(self, graph: ir.Graph, names: NameFactory, group: list[ir.Node]) -> None:
        first = group[0]
        inputs = [list(node.inputs) for node in group]
        arrays = [[_initializer(v) for v in ins[1:]] for ins in inputs]
        splits = [int(a[0].shape[0]) for a in arrays]
        name = first.name or (first.outputs[0].name or "qlinear")
        builder = Builder(self._root, names, self._opset, metadata=first.metadata_props)
        merged_inputs: list[ir.Value | None] = [first.inputs[0]]
        for i, part in enumerate(("codes", "scales", "bias")[: len(arrays[0])]):
            merged_inputs.append(builder.initializer(f"{name}.merged_{part}", np.concatenate([a[i] for a in arrays])))
        attrs = {k: v for k, v in first.attributes.items()}
        attrs["splits"] = splits
        new = builder.node(QLINEAR_OP, merged_inputs, attrs, domain=MOE_DOMAIN, outputs=len(group), name=name)
        graph.insert_before(first, builder.take())
        for node, out in zip(group, new.outputs, strict=True):
            _take_over(node.outputs[0], out)
        graph.remove(group, safe=True)
        if first.name:  # the first node's own name (profiles and reports address nodes by it)
            new.name = first.name
        for ins in inputs:  # the nodes' codes, scales and biases, now read by nothing
            for value in ins[1:]:
                owner = value.graph if value is not None else None
                if value is not None and not value.uses() and owner is not None and value.name in owner.initializers:
                    del owner.initializers[value.name]
        self.merged.append((new.name or "", [node.name or "" for node in group]))

    def _rewrite(self, graph: ir.Graph, names: NameFactory, node: ir.Node) -> str:
        bits, block = _attr(node, "bits", 4), _attr(node, "block_size", 0)
        K, N = _attr(node, "K", 0), _attr(node, "N", 0)
        if bits not in (4, 8) or block != 32:
            return f"bits={bits} block_size={block} (QLinear: 4 or 8 bits, blocks of 32)"
        if _attr(node, "accuracy_level", 0) != 4:
            return "accuracy_level is not 4 (QLinear rounds x to int8)"
        a, b, s = node.inputs[0], _input(node, 1), _input(node, 2)
        if any(_input(node, i) is not None for i in (3, 4)):
            return "zero points or g_idx (QLinear: the symmetric format)"
        if a is None or a.dtype not in _X_TYPES:
            return "A is not float32, float16 or bfloat16"
        half = a.dtype != ir.DataType.FLOAT
        codes, scales = const_array(b), const_array(s)
        if codes is None or scales is None or K <= 0 or N <= 0 or K % 32:
            return "B or scales not constant, or K not a multiple of 32"
        if codes.dtype != np.uint8 or codes.size != N * K * bits // 8 or scales.size != N * K // 32:
            return "B / scales not of MatMulNBits' shapes"
        if s is None or s.dtype != a.dtype:
            return "scales are not of A's type"
        scales = np.asarray(scales).astype(np.float32)  # (exact from float16 / bfloat16)
        s16 = scales.astype(np.float16)
        if not np.all(np.isfinite(s16)) or not np.array_equal(s16.astype(np.float32), scales):
            return "scales are not float16 values"
        bias = _input(node, 5)
        bias_array = const_array(bias) if bias is not None else None
        if bias is not None and (bias_array is None or bias.dtype != a.dtype or bias_array.size != N):
            return "the bias is not a constant [N] of A's type"
        path = node.name or "matmul"
        if bits == 4:
            code_array = chunk_q4_rows(codes.reshape(N, K // 2))
        else:
            code_array = (codes.reshape(N, K).astype(np.int16) - 128).astype(np.int8)
        builder = Builder(self._root, names, self._opset, metadata=node.metadata_props)
        x = a
        if half:  # one Cast of each x to float32, shared by its readers (so that they still merge)
            key = (id(graph), id(a))
            if key not in self._casts:
                self._casts[key] = builder.op1("Cast", [a], to=ir.DataType.FLOAT)
            x = self._casts[key]
        inputs: list[ir.Value | None] = [
            x,
            builder.initializer(f"{path}.codes", code_array),
            builder.initializer(f"{path}.scales", s16.reshape(N, K // 32)),
        ]
        if bias is not None:
            inputs.append(bias if not half else builder.initializer(f"{path}.bias", bias_array.astype(np.float32)))
        attrs: dict = {"weight_format": f"q{bits}", "block_size": 32}
        if bits == 4:
            attrs["code_layout"] = "chunk16"
        new = builder.node(QLINEAR_OP, inputs, attrs, domain=MOE_DOMAIN, name=f"{path}__qlinear")
        y = new.outputs[0]
        if half:
            shape = node.outputs[0].shape
            y.dtype, y.shape = ir.DataType.FLOAT, None if shape is None else ir.Shape(list(shape))
            y = builder.op1("Cast", [y], to=a.dtype)
        graph.insert_before(node, builder.take())
        _take_over(node.outputs[0], y)
        name = y.name
        graph.remove(node, safe=True)
        if node.name:  # the MatMul keeps its name (profiles and reports address nodes by it)
            new.name = node.name
        for value in (b, s):  # the MatMulNBits' own initializers, now read by nothing
            if value is not None and not value.uses() and value.name in graph.initializers:
                del graph.initializers[value.name]
        self.rewritten.append(node.name or name or "")
        return ""
