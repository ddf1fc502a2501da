"""``com.microsoft::QMoE`` recognised: rewritten to the skipping form ``ai.layerzero::MoE`` (``SkipExperts``' hook).

ONNX Runtime 1.32's QMoE (contrib-op schema; its CPU kernel runs ``activation_type="swiglu"`` with
``swiglu_fusion=1`` only: fc1's rows interleave gate and up) computes, per token, softmax(router_probs) -> top-k
(renormalised with ``normalize_routing_weights``) -> ``fc2(swiglu(fc1(x)))`` with weights ``(q - zp) * scale``:
codes ``[E, N, K * bits / 8]`` uint8 (``[out, in]`` rows, 4-bit low nibble first), scales ``[E, N, K / block]``
(``block_size``) or ``[E, N]`` (one per row), zero points absent (2 ** (bits - 1)) or given. That is the skipping
form's semantics with ``scoring="softmax"``, ``activation="silu"`` (``activation_alpha`` 1, ``activation_beta`` 0,
no ``swiglu_limit``) or GPT-OSS's ``swiglu_oai`` (``activation_beta`` 1: alpha and limit kept).

Two ways out, chosen so that the numbers stay ONNX Runtime's own (measured here: the float reference on the
dequantized weights against QMoE, E4 H64 I64 top-2):
- **quantized experts** (``weight_format`` q4 / q8, block 32, codes at 2-4, float16 scales at 10-12:
  plugins/ort/README.md) when QMoE itself quantizes the activations to int8 as the native kernels do (block-wise
  8-bit experts always, block-wise 4-bit at ``accuracy_level`` 4) in the same blocks of 32 (QMoE quantizes them
  per ``block_size``: blocks of 64 measured 0.14 apart), AND the format converts exactly (no zero point but the
  default; scales exact in float16: q4's nibbles are QMoE's codes, q8's codes are QMoE's XOR 0x80) — QMoE's
  output is then 2.6e-2 .. 1.25e-1 (|y| <= 12) away from float experts on the same weights, and <= 7.6e-6 from
  the native q4 / q8 op on the converted codes: the same arithmetic — AND the compile's MoE lowering runs
  quantized experts (``SkipExperts(quantized_experts=)``: liblayerzero_ort.so's native kernel; None: this build's
  ``lower_moe_native.NATIVE_ATTRIBUTES`` has ``weight_format``);
- **float experts** (the dequantized weights, ORT's arithmetic) when QMoE keeps float activations (per-row scales,
  4-bit below ``accuracy_level`` 4): the result equals QMoE's within ~2e-6, the weights take 8x (4-bit) the bytes.
Otherwise the node is left as it is, and a ``Refusal`` (kind "moe") says why; every choice is logged. So is a
node with ``normalize_routing_weights=0``: ONNX Runtime 1.32's CPU kernel renormalises the top-k weights anyway
(measured), which is not the schema's meaning.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir

from layerzero.passes import lower_moe_native
from layerzero.passes._builder import Builder
from layerzero.passes._dynamic import MASK_PREFIX, ROUTER_PREFIX, DynamicPath, record_dynamic_path
from layerzero.passes._graph import NAME_SCOPES_KEY, NameFactory, const_array, make_constant, replace_value, scope_of
from layerzero.passes._match import NoMatch, Refusal, need
from layerzero.passes._moe_node import MoENode

__all__ = ["QMOE_DOMAIN", "QMOE_OP", "rewrite_qmoe"]

logger = logging.getLogger("layerzero.passes.moe")

QMOE_DOMAIN, QMOE_OP = "com.microsoft", "QMoE"
BLOCK = 32  # the native kernels' block (plugins/quant.py BLOCK; a pass imports no plugin module)
# QMoE's inputs by position (the contrib-op schema).
_FC1, _S1, _B1, _FC2, _S2, _B2, _FC3 = 2, 3, 4, 5, 6, 7, 8
_ZP1, _ZP2, _ROUTER_WEIGHTS = 11, 12, 14


def is_qmoe(node: ir.Node) -> bool:
    return node.domain == QMOE_DOMAIN and node.op_type == QMOE_OP


@dataclasses.dataclass
class _Experts:
    """One projection of QMoE: codes ``[E, N, K]`` (int32, unpacked, zero point subtracted), scales ``[E, N, KB]``
    float32 with ``block`` rows of K each (K for one scale per row)."""

    centred: np.ndarray
    scales: np.ndarray
    block: int
    scale_dtype: np.dtype
    default_zp: bool

    def dequantize(self, dtype: np.dtype) -> np.ndarray:
        e, n, k = self.centred.shape
        blocks = self.centred.reshape(e, n, k // self.block, self.block).astype(np.float32)
        return (blocks * self.scales[..., None]).reshape(e, n, k).astype(dtype)

    def exact_blocks(self) -> str | None:
        """Why these codes are no exact q4 / q8 block-32 weight (None when they are)."""
        k = self.centred.shape[2]
        if k % BLOCK:
            return f"a reduction axis of {k}, not a multiple of {BLOCK}"
        if self.block % BLOCK:
            return f"blocks of {self.block} (a block of 32 would take two different scales)"
        if not self.default_zp:
            return "zero points other than the default (the native format has none)"
        if self.scale_dtype != np.float16 and not np.array_equal(
            self.scales.astype(np.float16).astype(np.float32), self.scales
        ):
            return f"{self.scale_dtype} scales that float16 does not hold exactly"
        return None

    def codes_and_scales(self, bits: int) -> tuple[np.ndarray, np.ndarray]:
        """``(codes, float16 scales [E, N, K / 32])`` in the native format (plugins/ort/README.md)."""
        scales = np.repeat(self.scales, self.block // BLOCK, axis=-1).astype(np.float16)
        if bits == 8:
            return self.centred.astype(np.int8), scales
        nib = (self.centred + 8).astype(np.uint8)
        return np.ascontiguousarray(nib[..., 0::2] | (nib[..., 1::2] << 4)), scales


def _attr(node: ir.Node, name: str, default: object) -> object:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if i < len(node.inputs) else None


def _constant(node: ir.Node, i: int, what: str) -> np.ndarray:
    value = _input(node, i)
    array = const_array(value)
    need(array is not None, f"{what} ({value.name if value else '?'}) is not a constant", node)
    return array  # type: ignore[return-value]


def _experts(node: ir.Node, w: int, s: int, zp: int, bits: int, block: int | None, what: str) -> _Experts:
    codes = _constant(node, w, f"{what} weights")
    scales = _constant(node, s, f"{what} scales")
    need(codes.dtype == np.uint8 and codes.ndim == 3, f"{what} weights are not uint8 [E, N, K*bits/8]", node)
    e, n, packed = codes.shape
    if bits == 8:
        q = codes.astype(np.int32)
    else:
        q = np.empty((e, n, packed * 2), np.int32)
        q[..., 0::2], q[..., 1::2] = codes & 0x0F, codes >> 4
    k = q.shape[2]
    kb = 1 if block is None else k // block
    need(block is None or k % block == 0, f"{what}: K {k} is not a multiple of block_size {block}", node)
    need(scales.shape in ((e, n, kb), (e, n)) and scales.dtype.kind == "f", f"{what} scales {scales.shape}", node)
    scale_dtype = scales.dtype
    scales = scales.reshape(e, n, kb).astype(np.float32)
    default = 2 ** (bits - 1)
    zero = np.full((e, n, kb), default, np.int32)
    if _input(node, zp) is not None:
        z = _constant(node, zp, f"{what} zero points")
        need(z.dtype == np.uint8, f"{what} zero points are not uint8", node)
        if bits == 4:  # two a byte along the last axis: K's blocks, or N with one scale per row ([E, N / 2])
            unpacked = np.empty((*z.shape[:-1], z.shape[-1] * 2), np.int32)
            unpacked[..., 0::2], unpacked[..., 1::2] = z & 0x0F, z >> 4
            z = unpacked[..., :kb] if block is not None else unpacked[..., :n]
        need(z.size == e * n * kb, f"{what} zero points {z.shape}", node)
        zero = z.reshape(e, n, kb).astype(np.int32)
    centred = (q.reshape(e, n, kb, k // kb) - zero[..., None]).reshape(e, n, k)
    return _Experts(centred, scales, k if block is None else block, scale_dtype, bool(np.all(zero == default)))


@dataclasses.dataclass
class _Plan:
    view: MoENode
    arrays: dict[str, np.ndarray | None]  # the node's new constants, by MoENode field
    form: str  # "q4" | "q8" | "float"
    why: str  # why this form (the log line)
    params: list[int]
    hidden: int
    ffn: int


def _plan(node: ir.Node, quantized: bool | None) -> _Plan:
    """How ``node`` becomes the skipping form; ``NoMatch`` when it cannot without changing its numbers."""
    need(str(_attr(node, "quant_type", "int")) == "int", f"quant_type {_attr(node, 'quant_type', '')!r}", node)
    need(int(_attr(node, "weights_prepacked", -1)) in (-1, 0), "weights_prepacked=1 (an EP's own layout)", node)
    need(not int(_attr(node, "use_sparse_mixer", 0)), "use_sparse_mixer (PhiMoE routing)", node)
    # ONNX Runtime 1.32's CPU QMoE renormalises the top-k weights whatever this attribute says (measured: its
    # outputs with 0 and 1 are equal); the schema's 0 means not to. Which one the model means is not known here.
    why = "normalize_routing_weights=0 (ONNX Runtime's CPU QMoE renormalises anyway, its schema says not to)"
    need(int(_attr(node, "normalize_routing_weights", 0)) == 1, why, node)
    need(_input(node, _ROUTER_WEIGHTS) is None, "router_weights (separate mixing weights)", node)
    need(all(v is None for v in node.inputs[15:]), "fp4 / fp8 scales inputs", node)
    need(_input(node, _FC3) is None, "a separate fc3 (ONNX Runtime's CPU QMoE does not run it)", node)
    activation = str(_attr(node, "activation_type", "relu"))
    need(activation == "swiglu", f"activation_type {activation!r}: non-gated experts (the skipping form is gated)",
         node)  # fmt: skip
    need(int(_attr(node, "swiglu_fusion", 0)) == 1, "swiglu_fusion other than 1 (interleaved gate/up)", node)
    need(not int(_attr(node, "swiglu_limit_after_activation", 0)), "swiglu_limit_after_activation", node)
    alpha, beta = float(_attr(node, "activation_alpha", 1.0)), float(_attr(node, "activation_beta", 0.0))
    limit = _attr(node, "swiglu_limit", None)
    if beta == 0.0:
        need(alpha == 1.0 and limit is None, "swiglu with alpha != 1 or a limit and beta 0 (no such activation)", node)
        act, act_alpha, act_limit = "silu", 1.702, 7.0
    else:
        need(beta == 1.0, f"activation_beta {beta:g} (only 0: silu, and 1: swiglu_oai)", node)
        act, act_alpha, act_limit = "swiglu_oai", alpha, float("inf") if limit is None else float(limit)
    hidden, logits = node.inputs[0], node.inputs[1]
    need(hidden is not None and hidden.shape is not None and len(hidden.shape) == 2, "input is not [T, H]", node)
    need(hidden.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16), f"input dtype {hidden.dtype}", node)
    need(logits is not None and logits.dtype == hidden.dtype, "router_probs and input differ in dtype", node)
    bits = int(_attr(node, "expert_weight_bits", 4))
    for i in (1, 2, 3):
        override = _attr(node, f"fc{i}_expert_weight_bits", None)
        need(override is None or int(override) == bits, f"fc{i}_expert_weight_bits other than {bits}", node)
    need(bits in (4, 8), f"expert_weight_bits {bits}", node)
    block = _attr(node, "block_size", None)
    block = None if block is None or int(block) <= 0 else int(block)
    fc1 = _experts(node, _FC1, _S1, _ZP1, bits, block, "fc1")
    fc2 = _experts(node, _FC2, _S2, _ZP2, bits, block, "fc2")
    e, n1, h = fc1.centred.shape
    f = n1 // 2
    need(fc2.centred.shape == (e, h, f), f"fc2 {fc2.centred.shape} does not fit fc1 {fc1.centred.shape}", node)
    dtype = hidden.dtype.numpy()
    biases = []
    for i, width in ((_B1, 2 * f), (_B2, h)):
        b = None if _input(node, i) is None else _constant(node, i, "expert bias").astype(dtype)
        need(b is None or b.shape == (e, width), "expert bias shape", node)
        biases.append(b)
    int8_activations = block is not None and (bits == 8 or int(_attr(node, "accuracy_level", 0)) == 4)
    view = MoENode(hidden, logits, hidden, hidden, hidden, top_k=int(_attr(node, "k", 1)),
                   normalize=bool(int(_attr(node, "normalize_routing_weights", 0))), scoring="softmax",
                   activation=act, activation_alpha=act_alpha, activation_limit=act_limit)  # fmt: skip
    arrays: dict[str, np.ndarray | None] = {
        "b_gate": None if biases[0] is None else biases[0][:, 0::2],
        "b_up": None if biases[0] is None else biases[0][:, 1::2],
        "b_down": biases[1],
    }
    exact = fc1.exact_blocks() or fc2.exact_blocks()
    lowering = "weight_format" in lower_moe_native.NATIVE_ATTRIBUTES if quantized is None else quantized
    if int8_activations:
        if exact is not None:
            raise NoMatch(f"int8 activations (as the native kernels) but {exact}: dequantized float experts would "
                          "change QMoE's numbers", node)  # fmt: skip
        if block != BLOCK:
            # QMoE quantizes the activations per block of block_size, the native kernels per 32: measured 0.14
            # apart (q4, block 64, accuracy_level 4, |y| <= 3) where blocks of 32 agree within 7.6e-6.
            raise NoMatch(f"int8 activations in blocks of {block} (the native kernels quantize them per {BLOCK}: "
                          "other numbers than QMoE's)", node)  # fmt: skip
        if not lowering:
            raise NoMatch("int8 activations, and this compile's MoE lowering runs no quantized experts (only "
                          "liblayerzero_ort.so's native kernel does): float experts would change QMoE's numbers",
                          node)  # fmt: skip
        form = f"q{bits}"
        why = f"q{bits} experts in blocks of {BLOCK}, from QMoE's blocks of {block} (exact; int8 activations in both)"
        for part, (codes, scales) in (
            ("gate", fc1.codes_and_scales(bits)),
            ("down", fc2.codes_and_scales(bits)),
        ):
            if part == "gate":
                arrays["w_gate"], arrays["w_up"] = codes[:, 0::2], codes[:, 1::2]
                arrays["s_gate"], arrays["s_up"] = scales[:, 0::2], scales[:, 1::2]
            else:
                arrays["w_down"], arrays["s_down"] = codes, scales
        view.weight_format, view.block_size = form, BLOCK
    else:
        form = "float"
        why = ("float experts, dequantized (QMoE keeps float activations: "
               f"{'one scale per row' if block is None else f'{bits}-bit at accuracy_level < 4'}; the native "
               "kernels would quantize them to int8)")  # fmt: skip
        w1 = fc1.dequantize(dtype)
        arrays["w_gate"], arrays["w_up"], arrays["w_down"] = w1[:, 0::2], w1[:, 1::2], fc2.dequantize(dtype)
    params = [3 * f * h + (2 * f if biases[0] is not None else 0) + (h if biases[1] is not None else 0)] * e
    return _Plan(view, arrays, form, why, params, h, f)


def rewrite_qmoe(
    model: ir.Model,
    names: NameFactory,
    zeroing_threshold: float,
    used_paths: set[str],
    rewritten: list[tuple[str, str]],
    rejected: list[Refusal],
    quantized: bool | None = None,
) -> bool:
    """Rewrite every QMoE node of the main graph (module docstring); ``rewritten`` gets ``(path, "qmoe-<form>")``,
    ``rejected`` a Refusal for each node left. ``quantized``: force (True) or forbid (False) quantized experts;
    None: when the MoE lowering reads them. True when a node was rewritten."""
    graph = model.graph
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    done = False
    for i, node in enumerate([n for n in graph if is_qmoe(n)]):
        path = scope_of(node) or node.name or f"qmoe_{i}"
        while path in used_paths:
            path = f"{path}_{i}"
        try:
            need(opset >= 13, f"model opset {opset} < 13", node)
            plan = _plan(node, quantized)
        except NoMatch as exc:
            rejected.append(Refusal.of(path, exc, kind="moe"))
            logger.info("QMoE at %s: left as it is: %s", path, exc.reason)
            continue
        used_paths.add(path)
        _rewrite(model, node, plan, path, names, zeroing_threshold, opset)
        rewritten.append((path, f"qmoe-{plan.form}"))
        logger.info("QMoE at %s: skipping form with %s", path, plan.why)
        done = True
    return done


def _rewrite(
    model: ir.Model, node: ir.Node, plan: _Plan, path: str, names: NameFactory, threshold: float, opset: int
) -> None:
    # y = QMoE(x, probs, fc1, s1, b1, fc2, s2, b2)   ->   y, mask = MoE(x, probs, w_gate, w_up, w_down, ...)
    graph = model.graph
    view = plan.view
    for part, array in plan.arrays.items():
        if array is not None:
            setattr(view, part, make_constant(graph, names, f"{path}.experts.{part}", np.ascontiguousarray(array)))
    view.zeroing_threshold, view.path = threshold, path
    moe = view.to_node(name=names(f"/{path}/experts/MoE"),
                       metadata_props={NAME_SCOPES_KEY: repr([path, f"{path}.experts", "moe"])})  # fmt: skip
    out = node.outputs[0]
    y, mask = moe.outputs
    y.name = names(f"{path}.moe_output")
    y.dtype, y.shape = view.hidden.dtype, view.hidden.shape
    mask.name = names(MASK_PREFIX + path)
    mask.dtype = ir.DataType.BOOL
    experts = len(plan.params)
    tokens = view.hidden.shape[0] if view.hidden.shape is not None else None
    mask.shape = ir.Shape([tokens, experts])
    build = Builder(graph, names, opset, node_prefix=f"/{path}/router/", value_prefix=f"{path}.router.")
    confidence = build.reduce("ReduceMax", build.op1("Softmax", [view.logits], axis=-1), [-1], 0)
    confidence.name = names(ROUTER_PREFIX + path)
    confidence.dtype = view.logits.dtype
    confidence.shape = ir.Shape([tokens])
    graph.insert_after(node, [moe, *build.nodes])
    replace_value(out, y, names)
    graph.outputs.extend([mask, confidence])
    graph.remove(node, safe=True)
    record_dynamic_path(
        model,
        DynamicPath(
            path=path,
            kind="moe",
            subpaths=tuple(f"{path}.experts.{e}" for e in range(experts)),
            params=tuple(plan.params),
            mask_output=mask.name,
            router_output=confidence.name,
            detail={
                "form": f"qmoe-{plan.form}",
                "experts": experts,
                "top_k": view.top_k,
                "normalize": int(view.normalize),
                "scoring": "softmax",
                "activation": view.activation,
                "hidden": plan.hidden,
                "ffn": plan.ffn,
                "zeroing_threshold": threshold,
                **({"weight_format": view.weight_format} if view.weight_format != "f" else {}),
            },
        ),
    )
