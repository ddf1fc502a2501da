"""A small Llama-style transformer built directly as an ONNX model, with zero flags.

The model is the test bed of the zeroing passes: every block, rotary embedding and input norm can carry
a flag tensor, either *declared* (a one-element initializer or metadata entry that no node reads, so the
compiler must bypass the scope itself) or *consumed* (the graph computes with the flag, so constant
propagation removes the layer). The ``omit_*`` options build the hand-pruned oracle a compiled model is
compared against, and :func:`reference_forward` is an independent numpy implementation of the same weights.

Naming follows ``torch.onnx``: a node name is its scope path plus the op type, e.g.
``/layers.3/attention/rotary_emb/Mul_1``; its scope is the path minus the last component with ``/`` read
as ``.`` (``layers.3.attention.rotary_emb``). Initializers are dotted (``layers.3.mlp.down_proj.weight``);
projection weights are stored ``[in, out]`` so that ``y = x @ W``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "TransformerConfig",
    "build_transformer",
    "example_feeds",
    "parameter_count",
    "reference_forward",
]

logger = logging.getLogger(__name__)

OPSET = 18
IR_VERSION = 10
# Finite so that the masked scores never produce inf - inf = NaN when a compiler folds around them.
MASK_VALUE = -1e9
# SeedSequence key of the weights outside the blocks; blocks use [seed, i], a length-3 key never collides.
_GLOBAL_STREAM = 1 << 20
_EMBED, _NORM, _LM_HEAD = 0, 1, 2

_FLAG_FORMS = ("declared", "consumed")
_DECLARED_IN = ("initializer", "metadata")

Scope = tuple[str, ...]


@dataclass(frozen=True)
class TransformerConfig:
    """Shape, weights and zero flags of the example transformer.

    ``zero_*`` set a flag to 0 (the flag still exists); ``omit_*`` build the hand-pruned oracle, in which
    the layer does not exist at all. ``zero_weight_blocks`` zeroes ``o_proj`` and ``down_proj`` with no flag,
    which makes the block an identity that only weight analysis can find.
    """

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 4
    num_heads: int = 4
    ffn: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-6
    seed: int = 0
    flags: bool = True
    flag_form: str = "declared"
    declared_in: str = "initializer"
    zero_blocks: tuple[int, ...] = ()
    zero_rotary: tuple[int, ...] = ()
    zero_norms: tuple[int, ...] = ()
    zero_weight_blocks: tuple[int, ...] = ()
    disable_rotary_inv_freq: bool = False
    omit_blocks: tuple[int, ...] = ()
    omit_rotary: tuple[int, ...] = ()
    omit_norms: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.flag_form not in _FLAG_FORMS:
            raise ValueError(f"flag_form={self.flag_form!r}; expected one of {_FLAG_FORMS}")
        if self.declared_in not in _DECLARED_IN:
            raise ValueError(f"declared_in={self.declared_in!r}; expected one of {_DECLARED_IN}")
        for field in (
            "zero_blocks",
            "zero_rotary",
            "zero_norms",
            "zero_weight_blocks",
            "omit_blocks",
            "omit_rotary",
            "omit_norms",
        ):
            bad = [i for i in getattr(self, field) if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"{field} has blocks {bad} outside 0..{self.num_layers - 1}")
        if not self.flags and (self.zero_blocks or self.zero_rotary or self.zero_norms):
            raise ValueError("zero_blocks / zero_rotary / zero_norms need flags=True")
        for field, omitted in (
            ("zero_blocks", self.omit_blocks),
            ("zero_rotary", (*self.omit_blocks, *self.omit_rotary)),
            ("zero_norms", (*self.omit_blocks, *self.omit_norms)),
        ):
            both = sorted(set(getattr(self, field)) & set(omitted))
            if both:
                raise ValueError(f"{field} names blocks {both} that are omitted, so they have no flag")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


# ----------------------------------------------------------------------------------------------- weights


def _normal(rng: np.random.Generator, shape: Sequence[int], std: float) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _inv_freq(config: TransformerConfig) -> np.ndarray:
    if config.disable_rotary_inv_freq:
        return np.zeros(config.head_dim // 2, dtype=np.float32)
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    return (1.0 / config.rope_theta**exponents).astype(np.float32)


def _block_weights(config: TransformerConfig, i: int) -> dict[str, np.ndarray]:
    """Weights of block ``i``, from their own stream so omitting a block changes no other weight."""
    rng = np.random.default_rng([config.seed, i])
    h, f = config.hidden, config.ffn
    p = f"layers.{i}."
    # Draw every tensor in a fixed order whatever the config, so zeroing one never shifts another.
    weights = {
        p + "input_layernorm.weight": (1.0 + _normal(rng, [h], 0.1)).astype(np.float32),
        p + "attention.q_proj.weight": _normal(rng, [h, h], h**-0.5),
        p + "attention.k_proj.weight": _normal(rng, [h, h], h**-0.5),
        p + "attention.v_proj.weight": _normal(rng, [h, h], h**-0.5),
        p + "attention.o_proj.weight": _normal(rng, [h, h], 0.5 * h**-0.5),
        p + "post_attention_layernorm.weight": (1.0 + _normal(rng, [h], 0.1)).astype(np.float32),
        p + "mlp.gate_proj.weight": _normal(rng, [h, f], h**-0.5),
        p + "mlp.up_proj.weight": _normal(rng, [h, f], h**-0.5),
        p + "mlp.down_proj.weight": _normal(rng, [f, h], 0.5 * f**-0.5),
    }
    if i in config.zero_weight_blocks:
        weights[p + "attention.o_proj.weight"] = np.zeros([h, h], np.float32)
        weights[p + "mlp.down_proj.weight"] = np.zeros([f, h], np.float32)
    return weights


def _global_weights(config: TransformerConfig) -> dict[str, np.ndarray]:
    def rng(stream: int) -> np.random.Generator:
        return np.random.default_rng([config.seed, _GLOBAL_STREAM, stream])

    h, v = config.hidden, config.vocab_size
    return {
        "embed_tokens.weight": _normal(rng(_EMBED), [v, h], 1.0),
        "norm.weight": (1.0 + _normal(rng(_NORM), [h], 0.1)).astype(np.float32),
        "lm_head.weight": _normal(rng(_LM_HEAD), [h, v], h**-0.5),
        "rotary_emb.inv_freq": _inv_freq(config),
    }


def _flag_values(config: TransformerConfig) -> dict[str, float]:
    """Flag name -> value for every flag the model carries (none for omitted layers)."""
    if not config.flags:
        return {}
    flags: dict[str, float] = {}
    for i in _built_blocks(config):
        flags[f"layers.{i}.flag"] = 0.0 if i in config.zero_blocks else 1.0
        if i not in config.omit_rotary:
            flags[f"layers.{i}.attention.rotary_emb.flag"] = 0.0 if i in config.zero_rotary else 1.0
        if i not in config.omit_norms:
            flags[f"layers.{i}.input_layernorm.flag"] = 0.0 if i in config.zero_norms else 1.0
    return flags


def _built_blocks(config: TransformerConfig) -> list[int]:
    return [i for i in range(config.num_layers) if i not in config.omit_blocks]


# ----------------------------------------------------------------------------------------------- graph


class _GraphBuilder:
    """Appends nodes named ``/<scope path>/<OpType>[_k]`` with outputs ``<node name>_output_<j>``."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._counts: dict[tuple[Scope, str], int] = {}

    def op(
        self,
        scope: Scope,
        op_type: str,
        inputs: Sequence[str],
        *,
        n_out: int = 1,
        output_names: Sequence[str] | None = None,
        **attrs: object,
    ) -> list[str]:
        k = self._counts.get((scope, op_type), 0)
        self._counts[(scope, op_type)] = k + 1
        name = "/" + "/".join((*scope, op_type if k == 0 else f"{op_type}_{k}"))
        outputs = list(output_names or [f"{name}_output_{j}" for j in range(n_out)])
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=name, **attrs))
        return outputs

    def op1(self, scope: Scope, op_type: str, inputs: Sequence[str], **attrs: object) -> str:
        return self.op(scope, op_type, inputs, **attrs)[0]

    def const(self, scope: Scope, value: np.ndarray) -> str:
        return self.op1(scope, "Constant", [], value=numpy_helper.from_array(value))

    def initializer(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value, name))
        return name


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _f32(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float32)


def _seq_positions(g: _GraphBuilder, scope: Scope) -> str:
    """``Range(0, seq)`` with ``seq`` read from ``Shape(input_ids)``, so the sequence length stays dynamic."""
    shape = g.op1(scope, "Shape", ["input_ids"])
    seq = g.op1(scope, "Gather", [shape, g.const(scope, np.array(1, np.int64))], axis=0)
    positions = g.op1(
        scope, "Range", [g.const(scope, np.array(0, np.int64)), seq, g.const(scope, np.array(1, np.int64))]
    )
    # ONNX shape inference gives Range a fresh unknown dim; without this annotation cos, sin and the mask
    # would not be known to be [seq, ...] and a block's output would not be known to have its input's shape.
    g.value_info.append(helper.make_tensor_value_info(positions, TensorProto.INT64, ["seq"]))
    return positions


def _rotary_tables(g: _GraphBuilder, inv_freq: str) -> tuple[str, str]:
    """cos, sin of shape [seq, head_dim], computed in the graph so that inv_freq = 0 folds to 1 and 0."""
    scope: Scope = ("rotary_emb",)
    positions = g.op1(scope, "Cast", [_seq_positions(g, scope)], to=TensorProto.FLOAT)
    column = g.op1(scope, "Unsqueeze", [positions, g.const(scope, _i64(1))])
    freqs = g.op1(scope, "Mul", [column, inv_freq])
    emb = g.op1(scope, "Concat", [freqs, freqs], axis=-1)
    return g.op1(scope, "Cos", [emb]), g.op1(scope, "Sin", [emb])


def _causal_mask(g: _GraphBuilder) -> str:
    """[seq, seq] float: 0 where key <= query, MASK_VALUE above the diagonal."""
    scope: Scope = ("causal_mask",)
    positions = _seq_positions(g, scope)
    rows = g.op1(scope, "Unsqueeze", [positions, g.const(scope, _i64(1))])
    cols = g.op1(scope, "Unsqueeze", [positions, g.const(scope, _i64(0))])
    future = g.op1(scope, "Greater", [cols, rows])
    return g.op1(scope, "Where", [future, g.const(scope, _f32(MASK_VALUE)), g.const(scope, _f32(0.0))])


def _rms_norm(g: _GraphBuilder, scope: Scope, x: str, weight: str, eps: float) -> str:
    squared = g.op1(scope, "Pow", [x, g.const(scope, _f32(2.0))])
    mean = g.op1(scope, "ReduceMean", [squared, g.const(scope, _i64(-1))], keepdims=1)
    shifted = g.op1(scope, "Add", [mean, g.const(scope, _f32(eps))])
    root = g.op1(scope, "Sqrt", [shifted])
    normed = g.op1(scope, "Div", [x, root])
    return g.op1(scope, "Mul", [normed, weight])


def _flag_gate(g: _GraphBuilder, scope: Scope, flag: str, on: str, off: str) -> str:
    # Where(flag > 0.5, on, off): the consumed form of a rotary / norm flag.
    keep = g.op1(scope, "Greater", [flag, g.const(scope, _f32(0.5))])
    return g.op1(scope, "Where", [keep, on, off])


def _rotary(g: _GraphBuilder, scope: Scope, qk: str, cos: str, sin: str, flag: str | None, half: int) -> str:
    """qk * cos + rotate_half(qk) * sin on the stacked [batch, 2*heads, seq, head_dim] tensor."""
    axis = g.const(scope, _i64(3))
    x1 = g.op1(scope, "Slice", [qk, g.const(scope, _i64(0)), g.const(scope, _i64(half)), axis])
    x2 = g.op1(scope, "Slice", [qk, g.const(scope, _i64(half)), g.const(scope, _i64(2 * half)), axis])
    rotated_half = g.op1(scope, "Concat", [g.op1(scope, "Neg", [x2]), x1], axis=-1)
    rotated = g.op1(scope, "Add", [g.op1(scope, "Mul", [qk, cos]), g.op1(scope, "Mul", [rotated_half, sin])])
    return rotated if flag is None else _flag_gate(g, scope, flag, rotated, qk)


def _attention(
    g: _GraphBuilder,
    config: TransformerConfig,
    i: int,
    x: str,
    cos: str,
    sin: str,
    mask: str,
    flags: dict[str, str],
) -> str:
    scope: Scope = (f"layers.{i}", "attention")
    p = f"layers.{i}.attention."
    heads, head_dim = config.num_heads, config.head_dim
    split_heads = g.const(scope, _i64(0, 0, heads, head_dim))

    def project(name: str) -> str:
        y = g.op1((*scope, name), "MatMul", [x, p + name + ".weight"])
        y = g.op1(scope, "Reshape", [y, split_heads])
        return g.op1(scope, "Transpose", [y], perm=[0, 2, 1, 3])

    q, k, v = project("q_proj"), project("k_proj"), project("v_proj")
    if i not in config.omit_rotary:
        qk = g.op1(scope, "Concat", [q, k], axis=1)
        qk = _rotary(g, (*scope, "rotary_emb"), qk, cos, sin, flags.get(p + "rotary_emb.flag"), head_dim // 2)
        q, k = g.op(scope, "Split", [qk], n_out=2, num_outputs=2, axis=1)
    scores = g.op1(scope, "MatMul", [q, g.op1(scope, "Transpose", [k], perm=[0, 1, 3, 2])])
    scores = g.op1(scope, "Mul", [scores, g.const(scope, _f32(head_dim**-0.5))])
    scores = g.op1(scope, "Add", [scores, mask])
    probs = g.op1(scope, "Softmax", [scores], axis=-1)
    context = g.op1(scope, "MatMul", [probs, v])
    context = g.op1(scope, "Transpose", [context], perm=[0, 2, 1, 3])
    context = g.op1(scope, "Reshape", [context, g.const(scope, _i64(0, 0, config.hidden))])
    return g.op1((*scope, "o_proj"), "MatMul", [context, p + "o_proj.weight"])


def _mlp(g: _GraphBuilder, i: int, x: str) -> str:
    scope: Scope = (f"layers.{i}", "mlp")
    p = f"layers.{i}.mlp."
    gate = g.op1((*scope, "gate_proj"), "MatMul", [x, p + "gate_proj.weight"])
    up = g.op1((*scope, "up_proj"), "MatMul", [x, p + "up_proj.weight"])
    act = (*scope, "act_fn")
    silu = g.op1(act, "Mul", [gate, g.op1(act, "Sigmoid", [gate])])
    return g.op1((*scope, "down_proj"), "MatMul", [g.op1(scope, "Mul", [silu, up]), p + "down_proj.weight"])


def _block(
    g: _GraphBuilder,
    config: TransformerConfig,
    i: int,
    x: str,
    cos: str,
    sin: str,
    mask: str,
    flags: dict[str, str],
) -> str:
    scope: Scope = (f"layers.{i}",)
    p = f"layers.{i}."
    block_flag = flags.get(p + "flag")

    def residual(stream: str, update: str) -> str:
        if block_flag is not None:
            update = g.op1(scope, "Mul", [block_flag, update])
        return g.op1(scope, "Add", [stream, update])

    attn_in = x
    if i not in config.omit_norms:
        norm_scope = (*scope, "input_layernorm")
        attn_in = _rms_norm(g, norm_scope, x, p + "input_layernorm.weight", config.eps)
        norm_flag = flags.get(p + "input_layernorm.flag")
        if norm_flag is not None:
            attn_in = _flag_gate(g, norm_scope, norm_flag, attn_in, x)
    h = residual(x, _attention(g, config, i, attn_in, cos, sin, mask, flags))
    mlp_in = _rms_norm(g, (*scope, "post_attention_layernorm"), h, p + "post_attention_layernorm.weight", config.eps)
    return residual(h, _mlp(g, i, mlp_in))


def build_transformer(config: TransformerConfig = TransformerConfig()) -> onnx.ModelProto:
    """Build the ONNX model (opset 18, fp32, dynamic ``batch`` / ``seq``) described by ``config``."""
    g = _GraphBuilder()
    blocks = _built_blocks(config)
    uses_rotary = any(i not in config.omit_rotary for i in blocks)

    weights = _global_weights(config)
    for i in blocks:
        for name, value in _block_weights(config, i).items():
            if name.endswith("input_layernorm.weight") and i in config.omit_norms:
                continue
            weights[name] = value
    if not uses_rotary:
        del weights["rotary_emb.inv_freq"]
    for name, value in weights.items():
        g.initializer(name, value)

    flag_values = _flag_values(config)
    consumed: dict[str, str] = {}
    metadata: dict[str, str] = {}
    for name, value in flag_values.items():
        if config.flag_form == "declared" and config.declared_in == "metadata":
            metadata[name] = str(int(value))
            continue
        g.initializer(name, np.array([value], dtype=np.float32))
        if config.flag_form == "consumed":
            consumed[name] = name

    x = g.op1(("embed_tokens",), "Gather", ["embed_tokens.weight", "input_ids"], axis=0)
    cos, sin = _rotary_tables(g, "rotary_emb.inv_freq") if uses_rotary else ("", "")
    mask = _causal_mask(g) if blocks else ""
    for i in blocks:
        x = _block(g, config, i, x, cos, sin, mask, consumed)
    x = _rms_norm(g, ("norm",), x, "norm.weight", config.eps)
    g.op(("lm_head",), "MatMul", [x, "lm_head.weight"], output_names=["logits"])

    graph = helper.make_graph(
        g.nodes,
        "layerzero_transformer",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", config.vocab_size])],
        initializer=g.initializers,
        value_info=g.value_info,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="layerzero.models.transformer",
    )
    helper.set_model_props(model, metadata)
    logger.debug(
        "built transformer: %d blocks, %d nodes, %d flags (%s)",
        len(blocks),
        len(g.nodes),
        len(flag_values),
        config.flag_form,
    )
    return model


def parameter_count(model: onnx.ModelProto) -> int:
    """Number of elements in all initializers of the main graph (flags and ``inv_freq`` included)."""
    return sum(int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer)


# ----------------------------------------------------------------------------------------------- reference


def _np_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    mean = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(mean + np.float32(eps))) * weight


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _np_rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    rotated_half = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated_half * sin


def reference_forward(config: TransformerConfig, input_ids: np.ndarray) -> np.ndarray:
    """Logits [batch, seq, vocab] computed in numpy float32 with the weights of :func:`build_transformer`.

    A consumed flag of 0 bypasses its layer; a declared flag changes nothing (the graph does not read it, a
    compiler bypasses the layer); an omitted layer is absent.
    """
    consumed = config.flags and config.flag_form == "consumed"
    glob = _global_weights(config)
    batch, seq = input_ids.shape
    heads, head_dim = config.num_heads, config.head_dim

    positions = np.arange(seq, dtype=np.float32)[:, None]
    freqs = positions * glob["rotary_emb.inv_freq"]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.where(np.triu(np.ones((seq, seq), bool), k=1), np.float32(MASK_VALUE), np.float32(0.0))
    scale = np.float32(head_dim**-0.5)

    def to_heads(y: np.ndarray) -> np.ndarray:
        return y.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)

    x = glob["embed_tokens.weight"][input_ids]
    for i in _built_blocks(config):
        if consumed and i in config.zero_blocks:
            continue  # x + 0 * attn, then h + 0 * mlp
        w = {name.removeprefix(f"layers.{i}."): value for name, value in _block_weights(config, i).items()}
        attn_in = x
        if i not in config.omit_norms and not (consumed and i in config.zero_norms):
            attn_in = _np_rms_norm(x, w["input_layernorm.weight"], config.eps)
        q = to_heads(attn_in @ w["attention.q_proj.weight"])
        k = to_heads(attn_in @ w["attention.k_proj.weight"])
        v = to_heads(attn_in @ w["attention.v_proj.weight"])
        if i not in config.omit_rotary and not (consumed and i in config.zero_rotary):
            q, k = _np_rotate(q, cos, sin), _np_rotate(k, cos, sin)
        probs = _np_softmax((q @ k.transpose(0, 1, 3, 2)) * scale + mask)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, config.hidden)
        h = x + context @ w["attention.o_proj.weight"]
        m = _np_rms_norm(h, w["post_attention_layernorm.weight"], config.eps)
        gate = m @ w["mlp.gate_proj.weight"]
        silu = gate / (np.float32(1.0) + np.exp(-gate))
        x = h + (silu * (m @ w["mlp.up_proj.weight"])) @ w["mlp.down_proj.weight"]
    x = _np_rms_norm(x, glob["norm.weight"], config.eps)
    return (x @ glob["lm_head.weight"]).astype(np.float32)


def example_feeds(config: TransformerConfig, batch: int = 1, seq: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded ``{"input_ids": int64 [batch, seq]}`` with ids in ``[0, vocab_size)``."""
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, config.vocab_size, size=(batch, seq), dtype=np.int64)}
