"""Gated residual blocks ``x + g * f(x)`` built as ONNX: the test bed of the gated-branch pass.

Block ``i`` (scope ``layers.i``) adds ``g * f(x)`` to the residual stream ``x``. The gate ``g`` is a
ReLU, so it is exactly 0 when its logit is negative:

- ``gate="input"``: ``g = Relu(gate_i)``, fed as the graph input ``gate_i`` (tests pick the gates);
- ``gate="router"``: ``g = Relu(x @ router.weight + router.bias)`` (a Mixture-of-Depths style router).

The gate is a scalar (``kind="scalar"``: shape ``[]``, the block runs or not) or one per token
(``kind="token"``: shape ``x.shape[:-1] + [1]``). ``f`` is an RMS-normed SiLU MLP (scope
``layers.i.mlp``, token-wise) or a single-head attention (scope ``layers.i.attention``, which mixes
tokens). Node names follow torch.onnx (``/layers.0/mlp/up_proj/MatMul``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["build_gated_model", "gated_feeds"]

OPSET = 18
IR_VERSION = 10


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counts: dict[tuple[str, str], int] = {}

    def op(self, scope: str, op_type: str, inputs: Sequence[str], **attrs: object) -> str:
        k = self._counts.get((scope, op_type), 0)
        self._counts[(scope, op_type)] = k + 1
        name = f"/{scope}/" if scope else "/"
        name += op_type if k == 0 else f"{op_type}_{k}"
        out = f"{name}_output_0"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name, **attrs))
        return out

    def weight(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def const(self, scope: str, value: np.ndarray) -> str:
        return self.op(scope, "Constant", [], value=numpy_helper.from_array(value))


def _mlp(b: _Builder, rng: np.random.Generator, i: int, x: str, hidden: int, ffn: int) -> str:
    s = f"layers.{i}/mlp"
    p = f"layers.{i}.mlp."
    squared = b.op(f"{s}/norm", "Pow", [x, b.const(f"{s}/norm", np.array(2.0, np.float32))])
    mean = b.op(f"{s}/norm", "ReduceMean", [squared, b.const(f"{s}/norm", np.array([-1], np.int64))], keepdims=1)
    root = b.op(
        f"{s}/norm", "Sqrt", [b.op(f"{s}/norm", "Add", [mean, b.const(f"{s}/norm", np.array(1e-6, np.float32))])]
    )
    normed = b.op(f"{s}/norm", "Div", [x, root])
    normed = b.op(f"{s}/norm", "Mul", [normed, b.weight(p + "norm.weight", 1 + 0.1 * rng.standard_normal(hidden))])
    up = b.op(
        f"{s}/up_proj",
        "MatMul",
        [normed, b.weight(p + "up_proj.weight", rng.standard_normal((hidden, ffn)) * hidden**-0.5)],
    )
    act = b.op(f"{s}/act_fn", "Mul", [up, b.op(f"{s}/act_fn", "Sigmoid", [up])])
    down = rng.standard_normal((ffn, hidden)) * ffn**-0.5
    return b.op(f"{s}/down_proj", "MatMul", [act, b.weight(p + "down_proj.weight", down)])


def _attention(b: _Builder, rng: np.random.Generator, i: int, x: str, hidden: int, rank: int) -> str:
    s = f"layers.{i}/attention"
    p = f"layers.{i}.attention."

    def proj(name: str) -> str:
        w = b.weight(p + name + ".weight", rng.standard_normal((hidden, hidden)) * hidden**-0.5)
        return b.op(f"{s}/{name}", "MatMul", [x, w])

    q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
    perm = [1, 0] if rank == 2 else [*range(rank - 2), rank - 1, rank - 2]
    scores = b.op(s, "MatMul", [q, b.op(s, "Transpose", [k], perm=perm)])
    probs = b.op(s, "Softmax", [scores], axis=-1)
    context = b.op(s, "MatMul", [probs, v])
    w_o = b.weight(p + "o_proj.weight", rng.standard_normal((hidden, hidden)) * hidden**-0.5)
    return b.op(f"{s}/o_proj", "MatMul", [context, w_o])


def build_gated_model(
    kind: str = "scalar",
    *,
    branch: str = "mlp",
    gate: str = "input",
    num_layers: int = 1,
    hidden: int = 16,
    ffn: int = 32,
    token_dims: Sequence[str | int] = ("batch", "seq"),
    seed: int = 0,
) -> onnx.ModelProto:
    """``num_layers`` gated blocks (opset 18, fp32); input ``x`` ``[*token_dims, hidden]``, output ``y``.

    Args:
        kind: ``"scalar"`` (one gate per block) or ``"token"`` (one gate per token).
        branch: ``"mlp"`` (token-wise) or ``"attention"`` (mixes tokens).
        gate: ``"input"`` (graph inputs ``gate_0``, ``gate_1``, ...: logits, ReLU'd) or ``"router"``.
    """
    if kind not in ("scalar", "token"):
        raise ValueError(f"kind={kind!r}; expected 'scalar' or 'token'")
    if branch not in ("mlp", "attention"):
        raise ValueError(f"branch={branch!r}; expected 'mlp' or 'attention'")
    if gate not in ("input", "router"):
        raise ValueError(f"gate={gate!r}; expected 'input' or 'router'")
    token_dims = list(token_dims)
    rank = len(token_dims) + 1
    b = _Builder()
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*token_dims, hidden])]
    gate_shape = [] if kind == "scalar" else [*token_dims, 1]
    x = "x"
    for i in range(num_layers):
        rng = np.random.default_rng([seed, i])
        scope = f"layers.{i}"
        if gate == "input":
            inputs.append(helper.make_tensor_value_info(f"gate_{i}", TensorProto.FLOAT, gate_shape))
            logits = f"gate_{i}"
        else:
            w = b.weight(f"{scope}.router.weight", rng.standard_normal((hidden, 1)) * hidden**-0.5)
            logits = b.op(f"{scope}/router", "MatMul", [x, w])
            logits = b.op(f"{scope}/router", "Add", [logits, b.weight(f"{scope}.router.bias", np.array([-0.2]))])
            if kind == "scalar":
                logits = b.op(f"{scope}/router", "ReduceMean", [logits], keepdims=0)
        g = b.op(f"{scope}/gate", "Relu", [logits])
        f = _mlp(b, rng, i, x, hidden, ffn) if branch == "mlp" else _attention(b, rng, i, x, hidden, rank)
        x = b.op(scope, "Add", [x, b.op(scope, "Mul", [g, f])])
    b.nodes.append(helper.make_node("Identity", [x], ["y"], name="/output/Identity"))
    graph = helper.make_graph(
        b.nodes,
        "layerzero_gated",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*token_dims, hidden])],
        initializer=b.initializers,
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="layerzero.models.gated",
    )


def gated_feeds(
    shape: Sequence[int], gates: Sequence[object], *, kind: str = "scalar", hidden: int = 16, seed: int = 0
) -> dict[str, np.ndarray]:
    """Feeds for ``gate="input"`` models: ``x`` of ``[*shape, hidden]`` and one gate logit per block.

    Each entry of ``gates`` is a number (scalar kind) or an array of ``shape`` (token kind); a logit
    <= 0 switches the gate (and so the branch) off.
    """
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal([*shape, hidden]).astype(np.float32)}
    for i, logits in enumerate(gates):
        array = np.asarray(logits, dtype=np.float32)
        feeds[f"gate_{i}"] = array.reshape(()) if kind == "scalar" else array.reshape([*shape, 1])
    return feeds
