"""``MoENode``: the one reader and writer of the skipping form ``ai.layerzero::MoE``, and its layout.

Layout (each input has one meaning, at one position; an absent optional input is an empty slot, and trailing
empty slots are dropped, so a v1 block is a 5-input node)::

    y [T, H], mask [T, E] bool = ai.layerzero::MoE(
        0 hidden [T, H], 1 router_logits [T, E],
        2 w_gate [E, F, H], 3 w_up [E, F, H], 4 w_down [E, H, F],     expert weights, [out, in]
        5 b_gate [E, F], 6 b_up [E, F], 7 b_down [E, H],                 optional: expert biases (absent = 0)
        8 score_bias [E],                                                optional: the selection bias (v2 routing)
        9 threshold [] float32,                                          optional: the run-time zeroing threshold
                                                                         (the graph input ``layerzero::threshold``,
                                                                         given by the native lowering)
        10 s_gate [E, F, H/32], 11 s_up [E, F, H/32], 12 s_down [E, H, F/32] float16,
                                                                         the quantized experts' scales (only with
                                                                         weight_format q8 / q4: 13 inputs)
        13 x_thresholds [H] float32, 14 activation_scale [] float32,    activation-sparse experts (only with
                                                                         gate_up_layout "input_major": 15 inputs)
        15 router_weight [E, H] float32, 16 router_bias [E] float32)    the router in the op (``native_router.py``:
                                                                         logits = hidden @ router_weight^T + bias,
                                                                         input 1 then absent; liblayerzero_ort.so)

With the router in the op the node may have a fourth output, ``confidence [T]`` float32 (each token's top-1
routing probability, the ``layerzero::router::<path>`` output), and its hidden state and y may keep the block's
shape ``[..., H]`` (T = the product of the leading dims).

Activation-sparse experts (issue 23; ``gate_up_layout`` "input_major", float experts, the native kernel only:
written by ``sparsify_experts.FuseExpertActivationMask`` after the lowering): w_gate and w_up stored ``[E, H, F]``
(row i = input channel i), an x channel dropped for every expert's gate and up when ``|x_i| <= x_thresholds[i] *
activation_scale`` (NaN kept); w_down as ever. A third output, ``kept [T]`` int64, counts each token's kept
channels.

Quantized experts (``weight_format`` "q8" / "q4", ``block_size`` 32; default "f", float weights): inputs 2-4 hold
the codes (q8 int8 ``[E, out, in]``, q4 uint8 ``[E, out, in/2]``, two codes a byte) and 10-12 their float16
scales, blocks of 32 along each row's ``in`` axis (``plugins/quant.py`` ``quantize_blocks(axis=-1)``;
``passes/quantize_weights.py`` writes them). ``code_layout`` "chunk16" (q4 only; what ``QuantizeWeights`` writes):
each row's code bytes permuted into 16-block chunks for the row kernels (``plugins/quant.py`` ``chunk_q4_rows``);
"rows" (the default) the plain order.

Attributes: ``top_k`` (1), ``normalize`` (0), ``scoring`` ("softmax"), ``activation`` ("silu"),
``zeroing_threshold`` (0.0, the compiled threshold), ``path`` (the node's name); ``activation_alpha`` (1.702) and
``activation_limit`` (7.0) for ``swiglu_oai``; ``n_group`` / ``topk_group`` (1 / 1), ``routed_scaling_factor``
(1.0), ``routing`` ("topk"; "sparsemixer": PhiMoE, with ``jitter_eps`` 0.01). ``to_node`` writes the v2
attributes only where they differ from their defaults, so a v1 block stays a node every lowering runs.

Semantics: ``layerzero.plugins.reference``. Readers by position elsewhere: ``plugins/ort/src/custom_op.cpp``
(liblayerzero_ort.so: the threshold at 9 after the v2 slots; it also reads the 6-input layout of earlier
LayerZero versions, whose input 5 is the threshold: ``MoENode.of`` reads that one too, by its rank-0 shape) and
the TensorRT plugin (``plugins/src/moe_plugin.cpp``: inputs 0-4).
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from layerzero.passes._dynamic import MOE_DOMAIN, MOE_OP

__all__ = [
    "INPUTS",
    "QUANT_BLOCK",
    "ROUTER_SLOTS",
    "SCALE_SLOTS",
    "THRESHOLD_SLOT",
    "V2_SLOTS",
    "WEIGHT_FORMATS",
    "MoENode",
    "is_moe_node",
]

#: The inputs, by position.
INPUTS = (
    "hidden",
    "logits",
    "w_gate",
    "w_up",
    "w_down",
    "b_gate",
    "b_up",
    "b_down",
    "score_bias",
    "threshold",
    "s_gate",
    "s_up",
    "s_down",
    "x_thresholds",
    "activation_scale",
    "router_weight",
    "router_bias",
)
#: The expert biases' and the selection bias' positions (the v2 inputs), and the threshold's.
V2_SLOTS = (5, 6, 7, 8)
THRESHOLD_SLOT = 9
#: The quantized experts' scales (weight_format q8 / q4), per expert like the weights 2-4.
SCALE_SLOTS = (10, 11, 12)
#: The router's weight and bias (the logits computed in the op: ``native_router.py``).
ROUTER_SLOTS = (15, 16)
#: weight_format -> code bits ("f": the float weights).
WEIGHT_FORMATS = {"f": 0, "q8": 8, "q4": 4}
QUANT_BLOCK = 32

_SWIGLU_ALPHA = 1.702
_SWIGLU_LIMIT = 7.0


def is_moe_node(node: ir.Node) -> bool:
    return node.domain == MOE_DOMAIN and node.op_type == MOE_OP


@dataclasses.dataclass
class MoENode:
    """The skipping form's inputs (``ir.Value``; None = absent) and attributes, as the module docstring lays out."""

    hidden: ir.Value
    logits: ir.Value | None  # None only when router_weight is given
    w_gate: ir.Value
    w_up: ir.Value
    w_down: ir.Value
    b_gate: ir.Value | None = None
    b_up: ir.Value | None = None
    b_down: ir.Value | None = None
    score_bias: ir.Value | None = None
    threshold: ir.Value | None = None
    s_gate: ir.Value | None = None
    s_up: ir.Value | None = None
    s_down: ir.Value | None = None
    x_thresholds: ir.Value | None = None
    activation_scale: ir.Value | None = None
    router_weight: ir.Value | None = None
    router_bias: ir.Value | None = None
    top_k: int = 1
    normalize: bool = False
    scoring: str = "softmax"
    activation: str = "silu"
    zeroing_threshold: float = 0.0
    path: str = ""
    activation_alpha: float = _SWIGLU_ALPHA
    activation_limit: float = _SWIGLU_LIMIT
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    routing: str = "topk"
    jitter_eps: float = 0.01
    #: "f" (float experts) | "q8" | "q4" (codes at 2-4, scales at 10-12), in blocks of ``block_size``.
    weight_format: str = "f"
    block_size: int = QUANT_BLOCK
    #: "rows" | "chunk16" (q4 codes in 16-block chunks: ``plugins/quant.py`` ``chunk_q4_rows``).
    code_layout: str = "rows"
    #: "output_major" (w_gate, w_up [E, F, H]) | "input_major" ([E, H, F], with x_thresholds: module docstring).
    gate_up_layout: str = "output_major"
    #: Attributes of the node this view was read from that the layout does not know (kept by ``to_node``).
    extra: dict[str, ir.Attr] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------------------------------- read

    @classmethod
    def of(cls, node: ir.Node) -> MoENode:
        """Read an ``ai.layerzero::MoE`` node (``ValueError`` for another op or fewer than 5 inputs)."""
        if not is_moe_node(node):
            raise ValueError(f"{node.domain}::{node.op_type} node {node.name!r} is not {MOE_DOMAIN}::{MOE_OP}")
        inputs = list(node.inputs)
        routed_in_op = len(inputs) > ROUTER_SLOTS[0] and inputs[ROUTER_SLOTS[0]] is not None
        if len(inputs) < 5 or any(v is None for i, v in enumerate(inputs[:5]) if not (i == 1 and routed_in_op)):
            raise ValueError(f"{MOE_DOMAIN}::{MOE_OP} node {node.name!r} lacks one of its inputs 0-4")
        if len(inputs) == 6 and _rank(inputs[5]) == 0:
            inputs = [*inputs[:5], None, None, None, None, inputs[5]]  # the earlier layout: threshold at 5
        inputs += [None] * (len(INPUTS) - len(inputs))
        values = dict(zip(INPUTS, inputs))

        def attr(name: str, default: object) -> object:
            a = node.attributes.get(name)
            return default if a is None else a.value

        known = {f.name for f in dataclasses.fields(cls)} - set(INPUTS) - {"extra"}
        return cls(
            **values,  # type: ignore[arg-type]
            top_k=int(attr("top_k", 1)),
            normalize=bool(attr("normalize", 0)),
            scoring=str(attr("scoring", "softmax")),
            activation=str(attr("activation", "silu")),
            zeroing_threshold=float(attr("zeroing_threshold", 0.0)),
            path=str(attr("path", node.name or "")),
            activation_alpha=float(attr("activation_alpha", _SWIGLU_ALPHA)),
            activation_limit=float(attr("activation_limit", _SWIGLU_LIMIT)),
            n_group=int(attr("n_group", 1)),
            topk_group=int(attr("topk_group", 1)),
            routed_scaling_factor=float(attr("routed_scaling_factor", 1.0)),
            routing=str(attr("routing", "topk")),
            jitter_eps=float(attr("jitter_eps", 0.01)),
            weight_format=str(attr("weight_format", "f")),
            block_size=int(attr("block_size", QUANT_BLOCK)),
            code_layout=str(attr("code_layout", "rows")),
            gate_up_layout=str(attr("gate_up_layout", "output_major")),
            extra={k: a for k, a in node.attributes.items() if k not in known},
        )

    @property
    def inputs(self) -> list[ir.Value | None]:
        """The inputs by position, trailing absent ones dropped."""
        values = [getattr(self, name) for name in INPUTS]
        while values and values[-1] is None:
            values.pop()
        return values

    @property
    def expert_inputs(self) -> dict[int, ir.Value]:
        """The per-expert inputs that are present, by position: weights 2-4, biases 5-7, score_bias 8, the quantized
        experts' scales 10-12."""
        return {
            i: v
            for i, v in enumerate(self.inputs)
            if (2 <= i < THRESHOLD_SLOT or i in SCALE_SLOTS) and v is not None
        }

    @property
    def quantized(self) -> bool:
        """Whether the experts are codes + scales (``weight_format`` q8 / q4)."""
        return self.weight_format != "f"

    def format_attributes(self) -> dict[str, ir.Attr]:
        """The quantized layout's attributes (none for float experts; ``code_layout`` where not "rows")."""
        if not self.quantized:
            return {}
        attrs = {
            "weight_format": ir.AttrString("weight_format", self.weight_format),
            "block_size": ir.AttrInt64("block_size", self.block_size),
        }
        if self.code_layout != "rows":
            attrs["code_layout"] = ir.AttrString("code_layout", self.code_layout)
        return attrs

    @property
    def v2_inputs(self) -> dict[int, ir.Value]:
        """The v2 inputs present (expert biases, score_bias), by position."""
        return {i: v for i, v in self.expert_inputs.items() if i in V2_SLOTS}

    # ------------------------------------------------------------------------------------------ write

    def attributes(self) -> list[ir.Attr]:
        """The attributes ``to_node`` writes (v2 ones only where not default)."""
        attrs = [
            ir.AttrInt64("top_k", self.top_k),
            ir.AttrInt64("normalize", int(self.normalize)),
            ir.AttrString("scoring", self.scoring),
            ir.AttrString("activation", self.activation),
            ir.AttrFloat32("zeroing_threshold", self.zeroing_threshold),
            ir.AttrString("path", self.path),
        ]
        if self.activation == "swiglu_oai":
            attrs += [
                ir.AttrFloat32("activation_alpha", self.activation_alpha),
                ir.AttrFloat32("activation_limit", self.activation_limit),
            ]
        if self.n_group != 1:
            attrs += [ir.AttrInt64("n_group", self.n_group), ir.AttrInt64("topk_group", self.topk_group)]
        if self.routed_scaling_factor != 1.0:
            attrs.append(ir.AttrFloat32("routed_scaling_factor", self.routed_scaling_factor))
        if self.routing != "topk":
            attrs += [ir.AttrString("routing", self.routing), ir.AttrFloat32("jitter_eps", self.jitter_eps)]
        attrs += list(self.format_attributes().values())
        if self.gate_up_layout != "output_major":
            attrs.append(ir.AttrString("gate_up_layout", self.gate_up_layout))
        written = {a.name for a in attrs}
        attrs += [a for k, a in self.extra.items() if k not in written]
        return attrs

    def to_node(
        self, name: str | None = None, metadata_props: dict[str, str] | None = None, outputs: int = 2
    ) -> ir.Node:
        """A new ``ai.layerzero::MoE`` node (outputs ``y``, ``mask`` and, when ``outputs`` asks for them, ``kept``
        and ``confidence``; unnamed) of this view."""
        tape = ir.tape.Tape()
        values = tape.op_multi_out(
            MOE_OP,
            self.inputs,
            {a.name: a for a in self.attributes()},
            num_outputs=outputs,
            domain=MOE_DOMAIN,
            name=name,
            metadata_props=metadata_props,
        )
        node = values[0].producer()
        assert node is not None
        return node

    def write_inputs(self, node: ir.Node) -> None:
        """Make ``node`` (an ``ai.layerzero::MoE`` node) read this view's inputs, in the layout's positions."""
        inputs = self.inputs
        if len(node.inputs) > len(inputs):
            for i in range(len(inputs), len(node.inputs)):
                node.replace_input_with(i, None)
        node.resize_inputs(len(inputs))
        for i, value in enumerate(inputs):
            if node.inputs[i] is not value:
                node.replace_input_with(i, value)


def _rank(value: ir.Value | None) -> int | None:
    if value is None:
        return None
    if value.shape is not None:
        return len(value.shape)
    if value.const_value is not None:
        return len(value.const_value.shape)
    return None
