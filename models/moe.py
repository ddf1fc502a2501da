"""Mixture-of-experts blocks built directly as ONNX models, in the forms exporters produce.

Each model reads ``hidden`` ``[tokens, H]`` (float32) and writes ``y`` ``[tokens, H]``; with ``layers > 1``
the blocks are chained (``x = x + block(x)`` when ``residual``, else ``x = block(x)``). One block:

    logits = x @ router.T (+ router_bias)                     # Gemm, [T, E]
    probs = softmax(logits) | sigmoid(logits); w, idx = TopK(probs, k)   (w /= sum(w) when normalize)
    y = Σ_{e in idx} w_e · down_e(act(gate_e x) ⊙ up_e x)

Forms (``MoEConfig.form``):

- ``batched_mm``: what ``torch.onnx`` makes of Hugging Face's ``batched_mm`` experts (tokens repeated k
  times, ``GatherND`` of the stacked ``[E, 2F, H]`` gate/up and ``[E, H, F]`` down weights per (token, slot),
  batched ``MatMul``, weighted, ``ReduceSum`` over the k slots).
- ``dense``: every expert on every token (``MatMul`` of ``[T, H]`` by stacked ``[E, H, F]``), combined with a
  ``[T, E]`` routing matrix built by ``ScatterElements`` (into zeros of ``Shape(logits)``, or of
  ``Concat(Shape(x)[0], [E])`` as TorchScript writes ``torch.zeros``: ``scatter-rows``) or ``OneHot``
  (``routing``), by ``Einsum`` or
  ``Transpose``/``Mul``/``ReduceSum`` (``combine``).
- ``unrolled``: one FFN per expert (``MatMul`` by ``[H, F]``), each scaled by its column of the routing matrix,
  summed with ``Add``.
- ``skipping``: the compiler's own skipping form, one ``ai.layerzero::MoE`` node (outputs ``y`` and ``mask``).

Weights are drawn per layer from their own stream, the same for every form, so all forms of one config
compute the same function (``layerzero.plugins.reference.moe_reference`` per block). ``never_routed`` experts
get a router bias of -100: no token ever picks them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "FORMS",
    "MoEConfig",
    "build_moe",
    "build_qmoe",
    "moe_feeds",
    "moe_layer_weights",
    "moe_parameter_count",
    "with_expert_biases",
]

logger = logging.getLogger(__name__)

FORMS = ("batched_mm", "dense", "unrolled", "skipping")
_ROUTINGS = ("scatter", "scatter-rows", "onehot")
_COMBINES = ("einsum", "sum")
_SCORINGS = ("softmax", "sigmoid")
_ACTIVATIONS = ("silu", "gelu", "relu")
IR_VERSION = 10
NEVER_ROUTED_BIAS = -100.0


@dataclass(frozen=True)
class MoEConfig:
    """Shape, routing and graph form of the example MoE model."""

    hidden: int = 64
    ffn: int = 128
    experts: int = 4
    top_k: int = 2
    layers: int = 1
    residual: bool = False
    normalize: bool = True
    scoring: str = "softmax"
    activation: str = "silu"
    form: str = "batched_mm"
    # dense / unrolled: how the [T, E] routing matrix is built; "scatter-rows" scatters into zeros of shape
    # Concat(Shape(x)[0], [E]), as TorchScript writes torch.zeros(x.shape[0], E)
    routing: str = "scatter"
    combine: str = "einsum"  # dense: how expert outputs are combined with it
    fused_gate_up: bool = False  # dense / unrolled: one [.., 2F] projection split in two (batched_mm: always)
    never_routed: tuple[int, ...] = ()
    zeroing_threshold: float = 0.0  # form "skipping" only
    router_std: float = 1.0
    seed: int = 0
    opset: int = 18

    def __post_init__(self) -> None:
        for field, value, allowed in (
            ("form", self.form, FORMS),
            ("routing", self.routing, _ROUTINGS),
            ("combine", self.combine, _COMBINES),
            ("scoring", self.scoring, _SCORINGS),
            ("activation", self.activation, _ACTIVATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"{field}={value!r}; expected one of {allowed}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..experts={self.experts}")
        bad = [e for e in self.never_routed if not 0 <= e < self.experts]
        if bad:
            raise ValueError(f"never_routed has experts {bad} outside 0..{self.experts - 1}")
        if self.experts - len(set(self.never_routed)) < self.top_k:
            raise ValueError("never_routed leaves fewer than top_k experts")
        if self.opset < 16:
            raise ValueError(f"opset={self.opset}: the builders need opset 16 or later")

    def path(self, layer: int) -> str:
        """The block's scope, e.g. ``layers.0.moe``."""
        return f"layers.{layer}.moe"


def moe_layer_weights(config: MoEConfig, layer: int) -> dict[str, np.ndarray]:
    """Block ``layer``'s weights, ``[out, in]`` per expert: ``router [E, H]``, ``router_bias [E]``,
    ``w_gate [E, F, H]``, ``w_up [E, F, H]``, ``w_down [E, H, F]``."""
    rng = np.random.default_rng([config.seed, layer])
    e, h, f = config.experts, config.hidden, config.ffn

    def normal(shape: Sequence[int], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    weights = {
        "router": normal([e, h], config.router_std * h**-0.5),
        "w_gate": normal([e, f, h], h**-0.5),
        "w_up": normal([e, f, h], h**-0.5),
        "w_down": normal([e, h, f], f**-0.5),
    }
    bias = np.zeros(e, np.float32)
    bias[list(config.never_routed)] = NEVER_ROUTED_BIAS
    weights["router_bias"] = bias
    return weights


def moe_parameter_count(config: MoEConfig) -> int:
    e, h, f = config.experts, config.hidden, config.ffn
    return config.layers * (e * h + e + 3 * e * f * h)


def moe_feeds(config: MoEConfig, tokens: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded ``{"hidden": float32 [tokens, H]}``."""
    rng = np.random.default_rng(seed)
    return {"hidden": rng.standard_normal((tokens, config.hidden), dtype=np.float32)}


# ----------------------------------------------------------------------------------------------- graph


class _Graph:
    """Appends nodes named ``/<dotted scope>/<OpType>[_k]``, which ``scope_of`` reads back as the scope."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counts: dict[tuple[str, str], int] = {}

    def op(self, scope: str, op_type: str, inputs: Sequence[str], *, n_out: int = 1, domain: str = "", **attrs):
        k = self._counts.get((scope, op_type), 0)
        self._counts[(scope, op_type)] = k + 1
        name = f"/{scope}/{op_type if k == 0 else f'{op_type}_{k}'}"
        outputs = [f"{name}_output_{j}" for j in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=name, domain=domain or None, **attrs))
        return outputs[0] if n_out == 1 else outputs

    def const(self, scope: str, value: np.ndarray) -> str:
        return self.op(scope, "Constant", [], value=numpy_helper.from_array(np.asarray(value)))

    def init(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _act(g: _Graph, scope: str, x: str, activation: str, opset: int) -> str:
    scope = f"{scope}.act_fn"
    if activation == "silu":
        return g.op(scope, "Mul", [x, g.op(scope, "Sigmoid", [x])])
    if activation == "relu":
        return g.op(scope, "Relu", [x])
    if opset >= 20:
        return g.op(scope, "Gelu", [x])
    erf = g.op(scope, "Erf", [g.op(scope, "Div", [x, g.const(scope, np.float32(math.sqrt(2.0)))])])
    half = g.op(scope, "Mul", [x, g.const(scope, np.float32(0.5))])
    return g.op(scope, "Mul", [half, g.op(scope, "Add", [erf, g.const(scope, np.float32(1.0))])])


def _router(g: _Graph, config: MoEConfig, path: str, x: str, w: dict[str, np.ndarray]) -> tuple[str, str, str, str]:
    """(logits, routing weights [T, k], top-k indices [T, k], probs)."""
    scope = f"{path}.gate"
    weight = g.init(f"{path}.gate.weight", w["router"])
    bias = g.init(f"{path}.gate.bias", w["router_bias"])
    if config.routing == "scatter-rows":  # TorchScript's gate reads hidden.view(-1, H): rows of a new symbol
        x = g.op(scope, "Reshape", [x, g.const(scope, _i64(-1, config.hidden))])
    logits = g.op(scope, "Gemm", [x, weight, bias], transB=1)
    probs = (
        g.op(scope, "Softmax", [logits], axis=-1) if config.scoring == "softmax" else g.op(scope, "Sigmoid", [logits])
    )
    values, indices = g.op(scope, "TopK", [probs, g.const(scope, _i64(config.top_k))], n_out=2, axis=-1)
    if config.normalize:
        total = g.op(scope, "ReduceSum", [values, g.const(scope, _i64(-1))], keepdims=1)
        values = g.op(scope, "Div", [values, total])
    return logits, values, indices, probs


def _batched_mm(g: _Graph, config: MoEConfig, path: str, x: str, w: dict[str, np.ndarray]) -> str:
    _, weights, indices, _ = _router(g, config, path, x, w)
    scope = f"{path}.experts"
    h, k, f = config.hidden, config.top_k, config.ffn
    gate_up = g.init(f"{scope}.gate_up_proj", np.concatenate([w["w_gate"], w["w_up"]], axis=1))  # [E, 2F, H]
    down = g.init(f"{scope}.down_proj", w["w_down"])  # [E, H, F]
    repeated = g.op(scope, "Unsqueeze", [x, g.const(scope, _i64(1))])
    repeated = g.op(scope, "Expand", [repeated, g.const(scope, _i64(1, k, 1))])
    repeated = g.op(scope, "Reshape", [repeated, g.const(scope, _i64(-1, h))])  # [T*k, H]
    flat = g.op(scope, "Reshape", [indices, g.const(scope, _i64(-1))])
    rows = g.op(scope, "Unsqueeze", [flat, g.const(scope, _i64(1))])  # [T*k, 1]

    def batched(weight: str, inputs: str) -> str:
        picked = g.op(scope, "GatherND", [weight, rows], batch_dims=0)
        column = g.op(scope, "Unsqueeze", [inputs, g.const(scope, _i64(2))])
        return g.op(scope, "Squeeze", [g.op(scope, "MatMul", [picked, column]), g.const(scope, _i64(2))])

    gate, up = g.op(scope, "Split", [batched(gate_up, repeated), g.const(scope, _i64(f, f))], n_out=2, axis=1)
    hidden = g.op(scope, "Mul", [_act(g, scope, gate, config.activation, config.opset), up])
    out = batched(down, hidden)  # [T*k, H]
    slot = g.op(
        scope, "Unsqueeze", [g.op(scope, "Reshape", [weights, g.const(scope, _i64(-1))]), g.const(scope, _i64(1))]
    )
    out = g.op(scope, "Reshape", [g.op(scope, "Mul", [out, slot]), g.const(scope, _i64(-1, k, h))])
    return g.op(scope, "ReduceSum", [out, g.const(scope, _i64(1))], keepdims=0)


def _routing_matrix(
    g: _Graph, config: MoEConfig, path: str, x: str, logits: str, weights: str, indices: str
) -> str:
    scope = f"{path}.gate"
    if config.routing in ("scatter", "scatter-rows"):
        shape = g.op(scope, "Shape", [logits])
        if config.routing == "scatter-rows":
            rows = g.op(scope, "Gather", [g.op(scope, "Shape", [x]), g.const(scope, np.array(0, np.int64))], axis=0)
            rows = g.op(scope, "Unsqueeze", [rows, g.const(scope, _i64(0))])
            shape = g.op(scope, "Concat", [rows, g.const(scope, _i64(config.experts))], axis=0)
        zeros = g.op(scope, "ConstantOfShape", [shape], value=numpy_helper.from_array(np.zeros(1, np.float32)))
        return g.op(scope, "ScatterElements", [zeros, indices, weights], axis=1)
    hot = g.op(
        scope,
        "OneHot",
        [indices, g.const(scope, _i64(config.experts)), g.const(scope, np.array([0.0, 1.0], np.float32))],
        axis=-1,
    )
    slot = g.op(scope, "Unsqueeze", [weights, g.const(scope, _i64(-1))])
    return g.op(scope, "ReduceSum", [g.op(scope, "Mul", [hot, slot]), g.const(scope, _i64(1))], keepdims=0)


def _ffn(
    g: _Graph,
    config: MoEConfig,
    scope: str,
    x: str,
    gate_w: str,
    up_w: str,
    gate_up_w: str | None,
    down_w: str,
    axis: int,
) -> str:
    if gate_up_w is not None:
        f = config.ffn
        gate, up = g.op(
            scope,
            "Split",
            [g.op(f"{scope}.gate_up_proj", "MatMul", [x, gate_up_w]), g.const(scope, _i64(f, f))],
            n_out=2,
            axis=axis,
        )
    else:
        gate = g.op(f"{scope}.gate_proj", "MatMul", [x, gate_w])
        up = g.op(f"{scope}.up_proj", "MatMul", [x, up_w])
    hidden = g.op(scope, "Mul", [_act(g, scope, gate, config.activation, config.opset), up])
    return g.op(f"{scope}.down_proj", "MatMul", [hidden, down_w])


def _dense(g: _Graph, config: MoEConfig, path: str, x: str, w: dict[str, np.ndarray]) -> str:
    logits, weights, indices, _ = _router(g, config, path, x, w)
    matrix = _routing_matrix(g, config, path, x, logits, weights, indices)  # [T, E]
    scope = f"{path}.experts"
    gate_t, up_t = w["w_gate"].transpose(0, 2, 1), w["w_up"].transpose(0, 2, 1)  # [E, H, F]
    if config.fused_gate_up:
        fused = g.init(f"{scope}.gate_up_proj", np.concatenate([gate_t, up_t], axis=2))
        names = ("", "", fused)
    else:
        names = (g.init(f"{scope}.gate_proj", gate_t), g.init(f"{scope}.up_proj", up_t), None)
    down = g.init(f"{scope}.down_proj", w["w_down"].transpose(0, 2, 1))  # [E, F, H]
    out = _ffn(g, config, scope, x, *names, down, axis=-1)  # [E, T, H]
    if config.combine == "einsum":
        return g.op(scope, "Einsum", [matrix, out], equation="te,eth->th")
    column = g.op(scope, "Unsqueeze", [g.op(scope, "Transpose", [matrix], perm=[1, 0]), g.const(scope, _i64(2))])
    return g.op(scope, "ReduceSum", [g.op(scope, "Mul", [column, out]), g.const(scope, _i64(0))], keepdims=0)


def _unrolled(g: _Graph, config: MoEConfig, path: str, x: str, w: dict[str, np.ndarray]) -> str:
    logits, weights, indices, _ = _router(g, config, path, x, w)
    matrix = _routing_matrix(g, config, path, x, logits, weights, indices)
    total = None
    for e in range(config.experts):
        scope = f"{path}.experts.{e}"
        gate_t, up_t = w["w_gate"][e].T, w["w_up"][e].T  # [H, F]
        if config.fused_gate_up:
            names = ("", "", g.init(f"{scope}.gate_up_proj.weight", np.concatenate([gate_t, up_t], axis=1)))
        else:
            names = (g.init(f"{scope}.gate_proj.weight", gate_t), g.init(f"{scope}.up_proj.weight", up_t), None)
        down = g.init(f"{scope}.down_proj.weight", w["w_down"][e].T)
        out = _ffn(g, config, scope, x, *names, down, axis=-1)
        column = g.op(
            scope, "Slice", [matrix, g.const(scope, _i64(e)), g.const(scope, _i64(e + 1)), g.const(scope, _i64(1))]
        )
        term = g.op(scope, "Mul", [out, column])
        total = term if total is None else g.op(f"{path}.experts", "Add", [total, term])
    return total


def _skipping(g: _Graph, config: MoEConfig, path: str, x: str, w: dict[str, np.ndarray]) -> tuple[str, str]:
    scope = f"{path}.gate"
    logits = g.op(
        scope,
        "Gemm",
        [x, g.init(f"{path}.gate.weight", w["router"]), g.init(f"{path}.gate.bias", w["router_bias"])],
        transB=1,
    )
    scope = f"{path}.experts"
    return g.op(
        scope,
        "MoE",
        [
            x,
            logits,
            g.init(f"{scope}.w_gate", w["w_gate"]),
            g.init(f"{scope}.w_up", w["w_up"]),
            g.init(f"{scope}.w_down", w["w_down"]),
        ],
        n_out=2,
        domain="ai.layerzero",
        top_k=config.top_k,
        normalize=int(config.normalize),
        scoring=config.scoring,
        activation=config.activation,
        zeroing_threshold=float(config.zeroing_threshold),
        path=path,
    )


_FORMS = {"batched_mm": _batched_mm, "dense": _dense, "unrolled": _unrolled}


def build_moe(config: MoEConfig = MoEConfig()) -> onnx.ModelProto:
    """The ONNX model (fp32, dynamic ``tokens``) of ``config``; ``skipping`` models also output ``mask``."""
    g = _Graph()
    x = "hidden"
    masks: list[str] = []
    for i in range(config.layers):
        w = moe_layer_weights(config, i)
        path = config.path(i)
        if config.form == "skipping":
            out, mask = _skipping(g, config, path, x, w)
            masks.append(mask)
        else:
            out = _FORMS[config.form](g, config, path, x, w)
        x = g.op(f"layers.{i}", "Add", [x, out]) if config.residual else out
    g.nodes.append(helper.make_node("Identity", [x], ["y"], name="/output/Identity"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", config.hidden])]
    for i, mask in enumerate(masks):
        name = "mask" if len(masks) == 1 else f"mask_{i}"
        g.nodes.append(helper.make_node("Identity", [mask], [name], name=f"/output/Identity_{name}"))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.BOOL, ["tokens", config.experts]))
    graph = helper.make_graph(
        g.nodes,
        f"layerzero_moe_{config.form}",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["tokens", config.hidden])],
        outputs,
        initializer=g.initializers,
    )
    opsets = [helper.make_opsetid("", config.opset)]
    if config.form == "skipping":
        opsets.append(helper.make_opsetid("ai.layerzero", 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="layerzero.models.moe")
    logger.debug("built MoE model: %s, %d layers, %d nodes", config.form, config.layers, len(g.nodes))
    return model


def with_expert_biases(proto: onnx.ModelProto, seed: int = 3, std: float = 0.5) -> onnx.ModelProto:
    """``proto`` (a ``dense`` or ``unrolled`` model of ``build_moe``, changed in place) with every expert projection
    ``MatMul(x, W)`` followed by ``+ b``: ``[out]`` for one expert's ``[in, out]`` weight, ``[E, 1, out]`` for
    stacked ``[E, in, out]`` weights; normal(0, ``std``) from ``seed``."""
    rng = np.random.default_rng(seed)
    inits = {t.name: t for t in proto.graph.initializer}
    nodes = []
    for node in proto.graph.node:
        nodes.append(node)
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if weight is None or "_proj" not in node.input[1]:
            continue
        dims = list(weight.dims)
        shape = [dims[1]] if len(dims) == 2 else [dims[0], 1, dims[2]]
        bias = f"{node.input[1]}.bias"
        proto.graph.initializer.append(numpy_helper.from_array(rng.normal(0, std, shape).astype(np.float32), bias))
        out = node.output[0]
        node.output[0] = f"{out}.no_bias"
        nodes.append(helper.make_node("Add", [node.output[0], bias], [out], name=f"{node.name}/bias"))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return proto


def build_qmoe(*, experts: int = 8, hidden: int = 64, ffn: int = 64, top_k: int = 2, bits: int = 4,
               block: int | None = 32, accuracy: int = 0, activation: str = "swiglu", normalize: bool = True,
               biases: bool = False, oai: bool = False, zero_points: bool = False, scale_dtype: type = np.float16,
               router: bool = False, seed: int = 0) -> onnx.ModelProto:  # fmt: skip
    """One ``com.microsoft::QMoE`` (ONNX Runtime 1.32's schema) on random weights, as ONNX Runtime GenAI's model
    builder writes it: fc1 ``[E, 2F, H]`` (gate / up rows interleaved, ``swiglu_fusion`` 1), fc2 ``[E, H, F]``,
    codes uint8 (4-bit: two a byte, low nibble first; fc1 ``[E, F, H]`` for an ``activation`` other than swiglu)
    with ``scale_dtype`` scales per ``block`` along K (None: one per row); symmetric (codes + 2 ** (bits - 1), the
    default zero point) or, with ``zero_points``, asymmetric with explicit uint8 zero points (4-bit: two a byte).
    Inputs ``x [T, H]`` and ``logits [T, E]``; with ``router`` the logits are a ``MatMul`` of x in the graph
    (``/layers.0/moe/gate/MatMul``) and x the only input. Output ``y``."""
    rng = np.random.default_rng(seed)
    levels = 2**bits - 1

    def pack(q: np.ndarray) -> np.ndarray:
        q = q.astype(np.uint8)
        return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)) if bits == 4 else q

    def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        e, n, k = w.shape
        b = k if block is None else block
        blocks = w.reshape(e, n, k // b, b)
        if zero_points:
            low, high = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
            scales = ((high - low) / levels).astype(scale_dtype)
            d = scales.astype(np.float32)
            zero = np.clip(np.rint(-low / d), 0, levels).astype(np.int64)
            codes = np.clip(np.rint(blocks / d[..., None]) + zero[..., None], 0, levels)
            zero = zero.reshape(e, n) if block is None else zero
            zp = pack(zero) if bits == 8 or zero.shape[-1] % 2 == 0 else pack(np.pad(zero, [(0, 0)] * 2 + [(0, 1)]))
        else:
            qmax = 2 ** (bits - 1) - 1
            scales = (np.abs(blocks).max(-1) / qmax).astype(scale_dtype)
            d = scales.astype(np.float32)[..., None]
            codes = np.clip(np.rint(blocks / d), -qmax, qmax) + 2 ** (bits - 1)
            zp = None
        codes = pack(codes.reshape(e, n, k).astype(np.int64))
        return codes, scales.reshape(e, n) if block is None else scales, zp

    gated = 2 if activation == "swiglu" else 1  # fc1's rows: gate and up interleaved, or one projection
    fc1, s1, z1 = quantize(rng.normal(0, 0.2, (experts, gated * ffn, hidden)).astype(np.float32))
    fc2, s2, z2 = quantize(rng.normal(0, 0.2, (experts, hidden, ffn)).astype(np.float32))
    arrays = {"fc1": fc1, "s1": s1, "fc2": fc2, "s2": s2}
    inputs = ["x", "logits", "fc1", "s1", "", "fc2", "s2", ""]
    if biases:
        arrays["b1"] = rng.normal(0, 0.1, (experts, gated * ffn)).astype(np.float32)
        arrays["b2"] = rng.normal(0, 0.1, (experts, hidden)).astype(np.float32)
        inputs[4], inputs[7] = "b1", "b2"
    if zero_points:
        arrays["z1"], arrays["z2"] = z1, z2
        inputs += ["", "", "", "z1", "z2"]
    attrs = dict(k=top_k, activation_type=activation, normalize_routing_weights=int(normalize),
                 expert_weight_bits=bits, swiglu_fusion=1, accuracy_level=accuracy)  # fmt: skip
    if block is not None:
        attrs["block_size"] = block
    if oai:
        attrs.update(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)
    nodes = [helper.make_node("QMoE", inputs, ["y"], domain="com.microsoft", name="/layers.0/moe/QMoE", **attrs)]
    tensor = helper.make_tensor_value_info
    graph_inputs = [tensor("x", TensorProto.FLOAT, ["T", hidden])]
    if router:
        arrays["layers.0.moe.gate.weight"] = (rng.standard_normal((hidden, experts)) * hidden**-0.5).astype(np.float32)
        nodes.insert(0, helper.make_node("MatMul", ["x", "layers.0.moe.gate.weight"], ["logits"],
                                         name="/layers.0/moe/gate/MatMul"))  # fmt: skip
    else:
        graph_inputs.append(tensor("logits", TensorProto.FLOAT, ["T", experts]))
    inits = [numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in arrays.items()]
    graph = helper.make_graph(nodes, "qmoe", graph_inputs, [tensor("y", TensorProto.FLOAT, ["T", hidden])], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)
