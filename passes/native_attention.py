"""``NativeAttention``: the attention core of each decoder layer into one ``ai.layerzero::Attention`` node
(liblayerzero_ort.so; ``layerzero compile --weights int4|int8 --linear-kernel native``).

Why: at batch-1 decode the exporters' ``scaled_dot_product_attention`` is ~14 small nodes a layer (the scaled query,
the key's transpose and scale, the grouped views of ``FuseDecoder``'s repeat_kv rewrite, two MatMuls, the mask's Add,
Softmax, the ``Where(IsNaN(p), 0, p)`` of fully masked rows, the head transpose), each paying ONNX Runtime's
per-node time (~3 µs here) and a kernel of a few µs on a few KB: a profile of the Qwen3-MoE shape of
bench/decode.py (8 layers) put ~1 ms of a ~3.4 ms int4 step there. One node reads the key cache as it is (no
transposed copy of it a step) and writes the heads in the layout the output projection reads.

The pattern, after ``FuseDecoder`` (``passes/fuse_decoder.py``), from the Softmax::

    s = MatMul(V1(Mul(q, sq)), Mul(Transpose(k, [0, 1, 3, 2]), sk))    # the two Muls optional (scale 1)
    p = Softmax(Add(V2(s), mask), axis=-1)                              # the Add optional (no mask)
    p = Where(IsNaN(p), 0, p)                                           # optional
    o = V2(MatMul(V1(p), v))                                            # then optionally Transpose(o, [0, 2, 1, 3])

with ``V1`` / ``V2`` both absent (as many query as kv heads) or both ``Reshape``s to ``[0, Hk, -1, 0]`` /
``[0, H, -1, 0]`` (grouped-query attention: ``FuseDecoder``'s repeat_kv form, query head ``h`` reading kv head
``h // (H / Hk)``), q ``[B, H, T, D]``, k and v ``[B, Hk, L, D]`` of static head counts, float32 throughout, every
intermediate read only by the pattern. -> ``Attention(q, k, v, mask, q_scale=sq, k_scale=sk,
output_layout="bhtd" | "bthd")``; where k and v are ``Concat(past, new, axis=2)`` read only by the pattern and as
graph outputs (the presents the exporters write), the op's past form takes ``past`` and ``new`` (inputs 4, 5 and 1, 2)
and writes the presents as its outputs 1 and 2 (the semantics: ``plugins/ort/src/attention.h``; reference
``plugins/reference.py`` ``attention_reference``). The same products and softmax in float32; not bitwise ONNX
Runtime's (its MLAS sums in another order): the verification compares the compiled model with the
quantized-dense reference, which gets this pass too (``compiler/compile.py``), at the usual tolerances.

With the past form, when q, k and v are the projections' outputs split into heads by a Reshape (``[B, T, heads * D]``
-> ``[B, T, heads, D]``, proved by ``SymbolicShapes``), each through an optional ``SimplifiedLayerNormalization`` over
the head (Qwen3's q / k norm, constant weight), the ``[0, 2, 1, 3]`` Transpose and (q and k alike) a non-interleaved
``com.microsoft.RotaryEmbedding`` over the whole head, and the output is viewed back to ``[B, T, H * D]``, all of
that goes into the op too (``input_layout="bsh"``: the projections' outputs in, ``[B, T, H * D]`` out): a decoder
layer's attention is then one node between its q/k/v and o projections.

A candidate that does not match is left as it is with a ``Refusal`` (kind ``attention``) in ``refused``; a second run
changes nothing (no Softmax of the pattern is left).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from layerzero.contract import ATTENTION_OP, CACHE_BUFFER_META_KEY, MOE_DOMAIN
from layerzero.passes._builder import Builder, model_opset
from layerzero.passes._fuse_match import int_attr, last_dim, only_reader, other_input, rank_of, scalar_of
from layerzero.passes._graph import NameFactory, const_array, replace_value, scope_of
from layerzero.passes._match import NoMatch, Refusal, need
from layerzero.passes._shapes import SymbolicShapes
from layerzero.passes.attention_mask import fold_mask
from layerzero.passes.dead_code import RemoveDeadCode

__all__ = ["NativeAttention"]

_FLOAT = ir.DataType.FLOAT


@dataclass
class _Attention:
    q: ir.Value
    k: ir.Value
    v: ir.Value
    mask: ir.Value | None
    q_scale: float
    k_scale: float
    bthd: bool
    out: ir.Value  # the pattern's last value (replaced by the op's output)
    end: ir.Node  # its producer
    pasts: tuple[ir.Value, ir.Value] | None = None  # the caches' Concat inputs (k, v are then the new rows)
    presents: tuple[ir.Value, ir.Value] | None = None  # the Concats' outputs (the op's outputs 1 and 2)


def _producer(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    """The node of that kind (default: the onnx domain) producing ``value``, else None."""
    node = value.producer() if value is not None else None
    domains = (domain,) if domain else ("", "ai.onnx")
    return node if node is not None and node.op_type == op_type and node.domain in domains else None


def _view(value: ir.Value | None) -> tuple[int, ...] | None:
    """The constant target shape of the Reshape producing ``value`` as ``(0, heads, -1, 0)``, else None."""
    node = _producer(value, "Reshape")
    shape = const_array(node.inputs[1]) if node is not None and len(node.inputs) > 1 else None
    if shape is None or shape.size != 4 or int_attr(node, "allowzero", 0):
        return None
    dims = tuple(int(d) for d in shape.reshape(-1))
    return dims if dims[0] == 0 and dims[2] == -1 and dims[3] == 0 and dims[1] > 0 else None


def _scaled(value: ir.Value, reader: ir.Node, seen: list[ir.Node]) -> tuple[ir.Value, float, ir.Node]:
    """``(x, s, mul)`` of ``value = Mul(x, s)`` with a scalar constant s, ``value`` read only by ``reader``;
    ``(value, 1, reader)`` when ``value`` is no such Mul. The third item is what reads ``x`` in the pattern."""
    mul = _producer(value, "Mul")
    if mul is not None:
        for i in (0, 1):
            s, x = scalar_of(mul.inputs[i]), mul.inputs[1 - i]
            if s is not None and x is not None and const_array(x) is None:
                only_reader(value, reader, *seen)
                seen.append(mul)
                return x, s, mul
    return value, 1.0, reader


def _is_product(value: ir.Value | None) -> bool:
    """A MatMul's output, or a Reshape of one (the attention scores, grouped or not)."""
    view = _producer(value, "Reshape")
    return _producer(view.inputs[0] if view is not None else value, "MatMul") is not None


def _heads(value: ir.Value) -> int | None:
    shape = value.shape
    if shape is None or len(shape) != 4 or not isinstance(shape[1], int):
        return None
    return int(shape[1])


def match_attention(softmax: ir.Node) -> _Attention:
    seen: list[ir.Node] = [softmax]
    need(int_attr(softmax, "axis", -1) in (-1, 3) and rank_of(softmax.inputs[0]) == 4,
         "the Softmax is not over the last axis of a rank-4 tensor", *seen)  # fmt: skip
    scores, mask = softmax.inputs[0], None
    add = _producer(scores, "Add")
    if add is not None:
        only_reader(scores, softmax, *seen)
        seen.append(add)
        a, b = add.inputs[0], add.inputs[1]
        need(_is_product(a) or _is_product(b), "the Add reads no attention product", *seen)
        scores = a if _is_product(a) else b
        mask = other_input(add, scores)
        need(mask is not None and mask.dtype == _FLOAT and (rank_of(mask) or 0) <= 4,
             "the mask is not a float32 tensor of rank <= 4", *seen)  # fmt: skip
    reader = add if add is not None else softmax
    out_view = _view(scores)
    if out_view is not None:  # grouped: the product viewed back to [B, H, T, L]
        only_reader(scores, reader, *seen)
        view = scores.producer()
        assert view is not None
        seen.append(view)
        reader, scores = view, view.inputs[0]
    qk = _producer(scores, "MatMul")
    need(qk is not None, "the scores are not a MatMul", *seen)
    assert qk is not None and scores is not None
    only_reader(scores, reader, *seen)
    seen.append(qk)
    q_side, k_side = qk.inputs[0], qk.inputs[1]
    assert q_side is not None and k_side is not None
    in_view = _view(q_side) if out_view is not None else None
    need((out_view is None) or (in_view is not None), "the query is not viewed per kv head", *seen)
    q_reader = qk
    if in_view is not None:
        only_reader(q_side, qk, *seen)
        node = q_side.producer()
        assert node is not None
        seen.append(node)
        q_reader, q_side = node, node.inputs[0]
        assert q_side is not None
    q, q_scale, _ = _scaled(q_side, q_reader, seen)
    kt, k_scale, kt_reader = _scaled(k_side, qk, seen)
    transpose = _producer(kt, "Transpose")
    perm = transpose.attributes.get("perm") if transpose is not None else None
    need(perm is not None and list(perm.as_ints()) == [0, 1, 3, 2], "the key is not transposed [0, 1, 3, 2]", *seen)
    assert transpose is not None
    only_reader(kt, kt_reader, *seen)
    seen.append(transpose)
    k = transpose.inputs[0]
    assert k is not None
    # After the softmax: the NaN guard, the view per kv head, the MatMul with v, the view back.
    p = softmax.outputs[0]
    need(not p.is_graph_output(), "the probabilities are a graph output", *seen)
    readers = {use.node.op_type: use.node for use in p.uses()}
    if set(readers) == {"IsNaN", "Where"} and len(list(p.uses())) == 2:
        isnan, where = readers["IsNaN"], readers["Where"]
        zero = scalar_of(where.inputs[1])
        need(where.inputs[0] is isnan.outputs[0] and where.inputs[2] is p and zero == 0.0,
             "the Softmax's reader is not Where(IsNaN(p), 0, p)", *seen)  # fmt: skip
        only_reader(isnan.outputs[0], where, *seen)
        seen += [isnan, where]
        p = where.outputs[0]
    uses = list(p.uses())
    need(len(uses) == 1 and not p.is_graph_output(), "the probabilities are read outside the pattern", *seen)
    nxt = uses[0].node
    if out_view is not None:
        need(nxt.op_type == "Reshape" and _view(nxt.outputs[0]) == in_view,
             "the probabilities are not viewed per kv head", *seen)  # fmt: skip
        seen.append(nxt)
        p = nxt.outputs[0]
        uses = list(p.uses())
        need(len(uses) == 1 and not p.is_graph_output(), "the grouped probabilities are read elsewhere", *seen)
        nxt = uses[0].node
    need(nxt.op_type == "MatMul" and nxt.domain in ("", "ai.onnx") and nxt.inputs[0] is p,
         "the probabilities do not multiply v", *seen)  # fmt: skip
    seen.append(nxt)
    v, out = nxt.inputs[1], nxt.outputs[0]
    assert v is not None
    if out_view is not None:
        uses = list(out.uses())
        need(len(uses) == 1 and not out.is_graph_output() and _view(uses[0].node.outputs[0]) == out_view,
             "the output is not viewed back to the query heads", *seen)  # fmt: skip
        seen.append(uses[0].node)
        out = uses[0].node.outputs[0]
    bthd = False
    uses = list(out.uses())
    if len(uses) == 1 and not out.is_graph_output() and uses[0].node.op_type == "Transpose":
        tperm = uses[0].node.attributes.get("perm")
        if tperm is not None and list(tperm.as_ints()) == [0, 2, 1, 3]:
            seen.append(uses[0].node)
            out, bthd = uses[0].node.outputs[0], True
    # Static head counts, float32 rank-4 operands.
    for value, what in ((q, "q"), (k, "k"), (v, "v")):
        need(value.dtype == _FLOAT and rank_of(value) == 4, f"{what} is not a float32 rank-4 tensor", *seen)
    heads, kv_heads = _heads(q), _heads(k)
    need(heads is not None and kv_heads is not None and _heads(v) == kv_heads,
         "the head counts of q, k and v are not static and consistent", *seen)  # fmt: skip
    assert heads is not None and kv_heads is not None
    if out_view is not None:
        assert in_view is not None
        need(
            in_view[1] == kv_heads and out_view[1] == heads and heads % kv_heads == 0,
            f"the views ({in_view[1]}, {out_view[1]} heads) are not k's and q's ({kv_heads}, {heads})",
            *seen,
        )
    else:
        need(kv_heads in (heads, 1), f"q's {heads} heads against k's {kv_heads} are no MatMul broadcast", *seen)
    end = out.producer()
    assert end is not None
    found = _Attention(q, k, v, mask, q_scale, k_scale, bthd, out, end)
    _take_cache_concats(found, transpose, nxt)
    return found


def _cache_concat(value: ir.Value, reader: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """``(past, new)`` of ``value = Concat(past, new, axis=2)`` (rank 4) read only by ``reader`` and as a graph
    output (the present the exporters write), else None."""
    concat = _producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or rank_of(value) != 4:
        return None
    if int_attr(concat, "axis", 0) not in (2, -2) or any(u.node is not reader for u in value.uses()):
        return None
    past, new = concat.inputs
    if past is None or new is None or past.dtype != _FLOAT or new.dtype != _FLOAT:
        return None
    return past, new


def _take_cache_concats(found: _Attention, k_reader: ir.Node, v_reader: ir.Node) -> None:
    """The cache's two Concats into the op (its past form): k and v become the new rows, the presents its outputs."""
    ks, vs = _cache_concat(found.k, k_reader), _cache_concat(found.v, v_reader)
    if ks is None or vs is None or _heads(ks[1]) != _heads(found.k) or _heads(vs[1]) != _heads(found.v):
        return
    found.pasts, found.presents = (ks[0], vs[0]), (found.k, found.v)
    found.k, found.v = ks[1], vs[1]


@dataclass
class _Heads:
    """input_layout "bsh": what the op reads instead of the prepared heads (the projections' outputs), and how."""

    q: ir.Value
    k: ir.Value
    v: ir.Value
    heads: int
    kv_heads: int
    q_norm: ir.Value | None
    k_norm: ir.Value | None
    epsilon: float
    rotary: tuple[ir.Value, ir.Value, ir.Value] | None  # cos_cache, sin_cache, position ids
    out: ir.Value  # the [B, T, H * D] view of the output (replaced by the op's output 0)


def _const_ints(value: ir.Value | None) -> list[int] | None:
    array = const_array(value)
    return None if array is None or array.dtype.kind not in "iu" else [int(v) for v in array.reshape(-1)]


def _half_table(cache: ir.Value, trig: str) -> ir.Node | None:
    """The ``Cos`` / ``Sin`` node of ``cache = Reshape(Slice(trig(e), [0], [D/2], [-1]), [-1, D/2])``, else None."""
    view = _producer(cache, "Reshape")
    cut = _producer(view.inputs[0], "Slice") if view is not None else None
    table = _producer(cut.inputs[0], trig) if cut is not None else None
    if view is None or cut is None or table is None or len(cut.inputs) < 4:
        return None
    half = last_dim(cache)
    steps = _const_ints(cut.inputs[4]) if len(cut.inputs) > 4 and cut.inputs[4] is not None else [1]
    ok = isinstance(half, int) and _const_ints(view.inputs[1]) == [-1, half] and steps == [1]
    ok = ok and _const_ints(cut.inputs[1]) == [0] and _const_ints(cut.inputs[2]) == [half]
    ok = ok and _const_ints(cut.inputs[3]) in ([-1], [(rank_of(table.outputs[0]) or 0) - 1])
    return table if ok else None


def _frequencies(rotary: tuple[ir.Value, ir.Value, ir.Value]) -> tuple[ir.Value | np.ndarray, ir.Value] | None:
    """``(inv_freq [D/2], position_ids [B, T])`` when the rotary caches are the per-token tables ``FuseDecoder``
    builds from the export's ``Cos`` / ``Sin`` of ``Concat(m, m)``, ``m = float(Unsqueeze(position_ids, -1)) *
    inv_freq`` (row ``b * T + t`` for token (b, t): the op's positions a ``Range(0, n, 1)`` viewed [B, T]); the op
    can then compute ``cos / sin(float(position_ids[b, t]) * inv_freq)`` itself (``rotary_form="inv_freq"``).
    inv_freq is the constant itself when it is 1-D, else its values."""
    cos_cache, sin_cache, rows = rotary
    cos, sin = _half_table(cos_cache, "Cos"), _half_table(sin_cache, "Sin")
    if cos is None or sin is None or cos.inputs[0] is not sin.inputs[0]:
        return None
    cat = _producer(cos.inputs[0], "Concat")
    if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
        return None
    if int_attr(cat, "axis", 0) not in (-1, (rank_of(cat.outputs[0]) or 0) - 1):
        return None
    mul = _producer(cat.inputs[0], "Mul")
    if mul is None:
        return None
    for i in (0, 1):
        freq, cast = const_array(mul.inputs[i]), _producer(mul.inputs[1 - i], "Cast")
        if freq is None or cast is None or freq.dtype != np.float32:
            continue
        unsq = _producer(cast.inputs[0], "Unsqueeze")
        axes = _const_ints(unsq.inputs[1]) if unsq is not None and len(unsq.inputs) > 1 else None
        positions = unsq.inputs[0] if unsq is not None else None
        if positions is None or positions.dtype != ir.DataType.INT64 or axes not in ([-1], [rank_of(positions)]):
            continue
        if int_attr(cast, "to", 0) != ir.DataType.FLOAT.value or freq.size != last_dim(cos_cache):
            continue
        if any(d != 1 for d in freq.shape[:-1]) or rank_of(positions) != 2:
            continue
        row_ids = _producer(rows, "Reshape")
        enum = _producer(row_ids.inputs[0], "Range") if row_ids is not None else None
        if enum is None or _const_ints(enum.inputs[0]) != [0] or _const_ints(enum.inputs[2]) != [1]:
            return None
        return (mul.inputs[i] if freq.ndim == 1 else np.ascontiguousarray(freq.reshape(-1))), positions
    return None


def _single(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    """The producer of ``value`` of that kind when ``value`` has one reader and is no graph output."""
    node = _producer(value, op_type, domain)
    if node is None or value is None or value.is_graph_output() or len(list(value.uses())) != 1:
        return None
    return node


def _split_heads(value: ir.Value, shapes: SymbolicShapes) -> tuple[ir.Value, int] | None:
    """``(x, heads)`` of ``value = Reshape(x)`` that splits x's last axis [B, T, heads * D] into [B, T, heads, D]."""
    view = _single(value, "Reshape")
    x = view.inputs[0] if view is not None else None
    if view is None or x is None or x.dtype != _FLOAT:
        return None
    inner, outer = shapes.dims(x), shapes.dims(value)
    if inner is None or outer is None or len(inner) != 3 or len(outer) != 4 or inner[:2] != outer[:2]:
        return None
    if not all(isinstance(d, int) for d in (inner[2], outer[2], outer[3])) or inner[2] != outer[2] * outer[3]:
        return None
    return x, int(outer[2])


def _prepared(value: ir.Value, shapes: SymbolicShapes):
    """``(x, heads, norm weight, epsilon, rotary inputs)`` of ``value = [Rotary(]Transpose(SLN?(split(x))))[)]``
    (com.microsoft.RotaryEmbedding non-interleaved over the whole head, SimplifiedLayerNormalization over its last
    axis with a constant weight), else None."""
    rotary = None
    rot = _single(value, "RotaryEmbedding", "com.microsoft")
    if rot is not None:
        ok = int_attr(rot, "interleaved", 0) == 0 and int_attr(rot, "rotary_embedding_dim", 0) == 0
        ok = ok and int_attr(rot, "num_heads", 0) == 0 and rot.attributes.get("scale") is None
        if not ok or len(rot.inputs) != 4 or any(i is None for i in rot.inputs):
            return None
        rotary = (rot.inputs[2], rot.inputs[3], rot.inputs[1])
        value = rot.inputs[0]  # type: ignore[assignment]
    transpose = _single(value, "Transpose")
    perm = transpose.attributes.get("perm") if transpose is not None else None
    if transpose is None or perm is None or list(perm.as_ints()) != [0, 2, 1, 3] or transpose.inputs[0] is None:
        return None
    value, norm, epsilon = transpose.inputs[0], None, 0.0
    sln = _single(value, "SimplifiedLayerNormalization")
    if sln is not None:
        weight = const_array(sln.inputs[1]) if len(sln.inputs) > 1 else None
        if int_attr(sln, "axis", -1) not in (-1, 3) or weight is None or weight.dtype != np.float32:
            return None
        eps = sln.attributes.get("epsilon")
        norm, epsilon, value = sln.inputs[1], float(eps.value) if eps is not None else 1e-5, sln.inputs[0]
    split = _split_heads(value, shapes)
    if split is None:
        return None
    if norm is not None and const_array(norm).shape != (last_dim(value),):  # type: ignore[union-attr]
        return None
    return split[0], split[1], norm, epsilon, rotary


def _bsh(found: _Attention, shapes: SymbolicShapes) -> _Heads | None:
    """The heads' preparation (split, RMS norm, transpose, rotary) and the output's merge into the op, when the
    pattern has its past form and q, k and v are the projections' outputs so prepared; else None."""
    if found.pasts is None or not found.bthd:
        return None
    q, k = _prepared(found.q, shapes), _prepared(found.k, shapes)
    transpose = _single(found.v, "Transpose")
    perm = transpose.attributes.get("perm") if transpose is not None else None
    if q is None or k is None or transpose is None or perm is None or list(perm.as_ints()) != [0, 2, 1, 3]:
        return None
    v = _split_heads(transpose.inputs[0], shapes)  # type: ignore[arg-type]
    if v is None or k[1] != v[1] or q[1] % k[1] or q[4] != k[4] or (q[2] and k[2] and q[3] != k[3]):
        return None
    uses = list(found.out.uses())
    view = uses[0].node if len(uses) == 1 and not found.out.is_graph_output() else None
    merged = view.outputs[0] if view is not None and view.op_type == "Reshape" else None
    outer, inner = shapes.dims(merged), shapes.dims(found.out)
    if merged is None or outer is None or inner is None or len(outer) != 3 or outer[:2] != inner[:2]:
        return None
    if not all(isinstance(d, int) for d in (outer[2], inner[2], inner[3])) or outer[2] != inner[2] * inner[3]:
        return None
    return _Heads(q[0], k[0], v[0], q[1], k[1], q[2], k[2], q[3] if q[2] is not None else k[3], q[4], merged)


def _shape_dims(node: ir.Node, rank: int) -> range:
    """The dims a ``Shape`` node reads of a rank-``rank`` input (its start / end, negative ones counted back)."""
    start, end = int_attr(node, "start", 0), int_attr(node, "end", rank)
    start, end = (start + rank if start < 0 else start), (end + rank if end < 0 else end)
    return range(max(start, 0), min(end, rank))


def _cache_buffer(model: ir.Model, names: NameFactory) -> bool:
    """Let the caches be buffers (``CACHE_BUFFER_META_KEY``): True when every past input is read only as the past of
    an Attention node with a mask and by ``Shape`` nodes; those that read its length (axis 2) then read
    ``attention_mask``'s length minus ``input_ids``' instead (the same number for an export's inputs: the mask covers
    the past and the new tokens), so a past of more rows than are in use changes nothing but where the op writes.
    False (nothing changed) otherwise."""
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    mask, ids = inputs.get("attention_mask"), inputs.get("input_ids")
    pasts = [v for v in graph.inputs if (v.name or "").startswith("past_key_values.")]
    if mask is None or ids is None or not pasts:
        return False
    length_reads: list[ir.Node] = []
    for past in pasts:
        if past.is_graph_output() or past.shape is None or len(past.shape) != 4:
            return False
        for use in past.uses():
            node = use.node
            if node.op_type == ATTENTION_OP and node.domain == MOE_DOMAIN:
                if use.idx not in (4, 5) or len(node.inputs) < 4 or node.inputs[3] is None:
                    return False
            elif node.op_type == "Shape" and node.domain in ("", "ai.onnx"):
                dims = _shape_dims(node, 4)
                if 2 in dims:
                    if list(dims) != [2]:
                        return False
                    length_reads.append(node)
            else:
                return False
    if not length_reads:  # (with the mask folded, nothing else reads the past's length)
        return True
    b = Builder(graph, names, model_opset(model), node_prefix="/lz_cache/", value_prefix="lz_cache.")
    total = b.op1("Shape", [mask], start=1, end=2)
    new = b.op1("Shape", [ids], start=1, end=2)
    length = b.op1("Sub", [total, new])
    for v in (total, new, length):
        v.dtype, v.shape = ir.DataType.INT64, ir.Shape([1])
    graph.insert_before(next(iter(graph)), b.take())
    for node in length_reads:
        replace_value(node.outputs[0], length, names)
    RemoveDeadCode()(model)
    return True


class NativeAttention(ir.passes.InPlacePass):
    """The attention cores of a decoder into ``ai.layerzero::Attention`` (module docstring). ``fused``: the new nodes'
    names; ``refused``: the Softmax nodes that looked like attention and were left."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: list[str] = []
        self.refused: list[Refusal] = []
        self.cache_buffer = False
        self.mask_folded = False

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fused, self.refused, self.cache_buffer, self.mask_folded = [], [], False, False
        names = NameFactory(model.graph)
        opset = model_opset(model)
        for graph in model.graphs():
            shapes: SymbolicShapes | None = None
            for node in list(graph):
                if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx") or node.graph is not graph:
                    continue
                try:
                    found = match_attention(node)
                except NoMatch as failure:
                    if failure.progress > 2:  # a Softmax that began like attention (a router's is not)
                        self.refused.append(Refusal.of(scope_of(node), failure, "attention"))
                    continue
                shapes = SymbolicShapes(graph) if shapes is None else shapes
                self._fuse(graph, Builder(model.graph, names, opset, metadata=found.end.metadata_props), found,
                           _bsh(found, shapes))  # fmt: skip
        if self.fused:
            model.opset_imports.setdefault(MOE_DOMAIN, 1)
            RemoveDeadCode()(model)
            self.mask_folded = fold_mask(model)
            self.cache_buffer = self.mask_folded and _cache_buffer(model, names)
            if self.cache_buffer:
                model.metadata_props[CACHE_BUFFER_META_KEY] = "1"
        return ir.passes.PassResult(model, modified=bool(self.fused))

    def _fuse(self, graph: ir.Graph, b: Builder, found: _Attention, heads: _Heads | None) -> None:
        attrs: dict[str, object] = {"q_scale": float(found.q_scale), "k_scale": float(found.k_scale),
                                    "output_layout": "bthd" if found.bthd else "bhtd"}  # fmt: skip
        inputs: list[ir.Value | None] = [found.q, found.k, found.v, found.mask]
        if found.pasts is not None:
            inputs += list(found.pasts)
        out = found.out
        if heads is not None:  # input_layout "bsh": the projections' outputs, prepared in the op
            inputs[:3] = [heads.q, heads.k, heads.v]
            rotary: list[ir.Value | None] = list(heads.rotary or ())
            found_freq = _frequencies(heads.rotary) if heads.rotary is not None else None
            if found_freq is not None:  # the angles computed in the op: the tables' nodes go
                freq = found_freq[0]
                freq = b.initializer("rotary.inv_freq", freq) if isinstance(freq, np.ndarray) else freq
                rotary = [freq, None, found_freq[1]]
                attrs["rotary_form"] = "inv_freq"
            inputs += [heads.q_norm, heads.k_norm, *rotary]
            attrs.update(input_layout="bsh", output_layout="bsh", num_heads=heads.heads, kv_num_heads=heads.kv_heads,
                         norm_epsilon=float(heads.epsilon))  # fmt: skip
            out = heads.out
        while inputs[-1] is None:
            inputs.pop()
        name = f"{found.end.name or '/lz_fuse/'}_attention"
        olds = [out, *(found.presents or ())]
        node = b.node(ATTENTION_OP, inputs, attrs, domain=MOE_DOMAIN, name=name, outputs=len(olds))
        for old, new in zip(olds, node.outputs):
            new.dtype, new.shape, new.type = old.dtype, old.shape, old.type
        graph.insert_before(found.end, b.take())
        for old, new in zip(olds, node.outputs):
            replace_value(old, new, b.names)
        self.fused.append(node.name or "")
