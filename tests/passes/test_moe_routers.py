"""Router variants of the MoE matcher (``passes/_moe/router.py``) and the v2 routing of ``ai.layerzero::MoE``.

The v2 routing (moe_op_v2: ``score_bias``, ``n_group`` / ``topk_group``, ``routed_scaling_factor``, and
``routing="sparsemixer"`` with ``jitter_eps`` for PhiMoE) is checked twice (the sparsemixer reference also
against transformers' own ``sparsemixer``):

- on ``ai.layerzero::MoE`` nodes written here: the ``if`` lowering equals ``moe_reference`` (mask exactly,
  outputs to 1e-5) at 1 and 16 tokens and with a run-time threshold; ``ort-moe``, ``native`` and TensorRT
  refuse it with the reason;
- on routers exported from transformers' modules (DeepSeek-V3 with groups, a bias and a routed scaling factor;
  GLM4-MoE without normalisation; Ernie-4.5-MoE's softmax + bias + ``clamp``; PhiMoE's sparsemixer) by both
  torch.onnx exporters:
  ``SkipExperts`` rewrites the block with the right attributes, removes the router's nodes, finds nothing on
  a second run, and the lowered model equals the export at 1 and 16 tokens. A router whose normalisation
  changes the weights (``clamp(min=0.5)`` of a sigmoid sum) stays refused, with the node and the reason.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from onnx_ir.passes.common import ShapeInferencePass

from layerzero.contract import DynamicPath
from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.passes import RemoveDeadCode
from layerzero.passes._dynamic import MOE_DOMAIN, THRESHOLD_INPUT, record_dynamic_path
from layerzero.passes.lower_moe import LowerMoE, ort_moe_routing_supports
from layerzero.passes.lower_moe_native import native_supports
from layerzero.passes.lower_tensorrt import LowerMoEToTensorRT
from layerzero.passes.moe import SkipExperts
from layerzero.passes.solidify_paths import DropExperts
from layerzero.plugins.reference import moe_reference, moe_routing

ATOL = 1e-5
HIDDEN, FFN = 16, 8

# name -> (experts, top_k, node attributes, with a score bias)
VARIANTS = {
    "deepseek-groups-bias-scale": (
        8,
        2,
        {"scoring": "sigmoid", "normalize": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
        True,
    ),
    "glm-groups-no-norm": (8, 2, {"scoring": "sigmoid", "normalize": 0, "n_group": 2, "topk_group": 1}, True),
    "ernie-softmax-bias": (4, 2, {"scoring": "softmax", "normalize": 1}, True),
    "groups-no-bias": (12, 3, {"scoring": "sigmoid", "normalize": 1, "n_group": 4, "topk_group": 3}, False),
    "scale-only": (6, 2, {"scoring": "softmax", "normalize": 1, "routed_scaling_factor": 16.0}, False),
    "phimoe-sparsemixer": (6, 2, {"scoring": "softmax", "normalize": 0, "routing": "sparsemixer"}, False),
    "sparsemixer-wide-jitter": (
        4,
        2,
        {"scoring": "softmax", "normalize": 0, "routing": "sparsemixer", "jitter_eps": 0.4},
        False,
    ),
}
# The refusal each variant's first v2 feature gets from ort-moe / native / TensorRT.
FIRST_V2 = {
    "deepseek-groups-bias-scale": "score_bias",
    "glm-groups-no-norm": "score_bias",
    "ernie-softmax-bias": "score_bias",
    "groups-no-bias": "n_group",
    "scale-only": "routed_scaling_factor",
    "phimoe-sparsemixer": "routing",
    "sparsemixer-wide-jitter": "routing",
}
V2_ATTRIBUTES = ("n_group", "topk_group", "routed_scaling_factor")


def _session(model: ir.Model | onnx.ModelProto) -> ort.InferenceSession:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _weights(experts: int, bias: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {
        "w_gate": rng.normal(0, 0.3, (experts, FFN, HIDDEN)).astype(np.float32),
        "w_up": rng.normal(0, 0.3, (experts, FFN, HIDDEN)).astype(np.float32),
        "w_down": rng.normal(0, 0.3, (experts, HIDDEN, FFN)).astype(np.float32),
    }
    if bias:
        w["score_bias"] = rng.normal(0, 0.2, experts).astype(np.float32)
    return w


def _moe_node_model(variant: str) -> ir.Model:
    """One ``ai.layerzero::MoE`` node with the variant's v2 routing; graph inputs hidden [T, H], logits [T, E]."""
    experts, top_k, attributes, bias = VARIANTS[variant]
    w = _weights(experts, bias)
    inputs = ["hidden", "logits", "w_gate", "w_up", "w_down"] + (["", "", "", "score_bias"] if bias else [])
    node = helper.make_node(
        "MoE",
        inputs,
        ["y", "mask"],
        domain=MOE_DOMAIN,
        name="/block/MoE",
        top_k=top_k,
        activation="silu",
        zeroing_threshold=0.0,
        path="block",
        **attributes,
    )
    graph = helper.make_graph(
        [node],
        "moe",
        [
            helper.make_tensor_value_info("hidden", onnx.TensorProto.FLOAT, ["T", HIDDEN]),
            helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["T", experts]),
        ],
        [
            helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["T", HIDDEN]),
            helper.make_tensor_value_info("mask", onnx.TensorProto.BOOL, ["T", experts]),
        ],
        initializer=[numpy_helper.from_array(a, k) for k, a in w.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MOE_DOMAIN, 1)])
    return ir.from_proto(proto)


def _reference(variant: str, hidden: np.ndarray, logits: np.ndarray, threshold: float = 0.0):
    experts, top_k, attributes, bias = VARIANTS[variant]
    w = _weights(experts, bias)
    return moe_reference(
        hidden, logits, w["w_gate"], w["w_up"], w["w_down"], top_k=top_k, zeroing_threshold=threshold,
        score_bias=w.get("score_bias"), **attributes,
    )  # fmt: skip


@functools.cache
def _lowered(variant: str, lowering: str) -> tuple[onnx.ModelProto, LowerMoE, bool]:
    model = _moe_node_model(variant)
    lower = LowerMoE(lowering=lowering)
    modified = lower(model).modified
    again = LowerMoE(lowering=lowering)(model).modified
    assert not again, "a second LowerMoE run changed the lowered model"
    return ir.to_proto(model), lower, modified


def test_reference_groups_by_hand() -> None:
    # 8 experts in 4 groups of 2, sigmoid scores of these logits, bias 0 except expert 7 (+1):
    # group sums (top-2 of 2) = [s0+s1, s2+s3, s4+s5, s6+s7+1]; keep 2 groups; top-2 experts of those.
    logits = np.array([[3.0, 2.9, -1.0, -1.0, 0.5, 0.4, -4.0, -4.0]], np.float32)
    bias = np.array([0, 0, 0, 0, 0, 0, 0, 1.0], np.float32)
    weights, mask = moe_routing(
        logits, top_k=2, normalize=1, scoring="sigmoid", score_bias=bias, n_group=4, topk_group=2,
        routed_scaling_factor=2.0,
    )  # fmt: skip
    s = 1 / (1 + np.exp(-logits[0].astype(np.float64)))
    # Groups 0 (1.90) and 3 (1.04 with the bias) beat group 2 (1.22 - no: 0.62 + 0.60 = 1.22): groups 0 and 2.
    group_sums = [s[0] + s[1], s[2] + s[3], s[4] + s[5], s[6] + s[7] + 1.0]
    kept = sorted(np.argsort(group_sums)[::-1][:2])
    assert kept == [0, 2]
    # Top-2 of the kept groups' biased scores: experts 0 and 1; weights from the unbiased scores, normalised, × 2.
    assert mask[0].tolist() == [True, True, False, False, False, False, False, False]
    expected = 2.0 * s[[0, 1]] / (s[0] + s[1] + 1e-20)
    np.testing.assert_allclose(weights[0, [0, 1]], expected, rtol=1e-12)
    # The bias chooses but does not weigh: with group 3 kept by a larger bias, expert 7 runs at its own score.
    bias[7] = 3.0
    weights, mask = moe_routing(
        logits, top_k=2, normalize=0, scoring="sigmoid", score_bias=bias, n_group=4, topk_group=1
    )
    assert mask[0].tolist() == [False] * 6 + [True, True]
    np.testing.assert_allclose(weights[0, 6:], s[6:], rtol=1e-12)


def test_reference_v1_defaults_unchanged() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(9, 6)).astype(np.float32)
    for scoring in ("softmax", "sigmoid"):
        plain = moe_routing(logits, top_k=2, normalize=1, scoring=scoring)
        explicit = moe_routing(
            logits, top_k=2, normalize=1, scoring=scoring, score_bias=None, n_group=1, topk_group=1,
            routed_scaling_factor=1.0,
        )  # fmt: skip
        np.testing.assert_array_equal(plain[0], explicit[0])
        np.testing.assert_array_equal(plain[1], explicit[1])
    with pytest.raises(ValueError, match="n_group"):
        moe_routing(logits, top_k=2, normalize=1, n_group=4)  # 6 experts are no 4 equal groups


def test_sparsemixer_reference_equals_transformers() -> None:
    """The reference's sparsemixer is transformers' PhiMoE ``sparsemixer`` at inference (weights and experts)."""
    torch = pytest.importorskip("torch")
    phimoe = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(64, 6)).astype(np.float32)
    logits[0] = [1.0, 1.0, 0.5, 0.2, -1.0, 0.0]  # a tie: the lower index first, as torch.max
    logits[1] = 0.0  # all zero: 0 / 0 gaps are NaN, nothing masked
    for eps in (0.01, 0.4):
        weights, experts = phimoe.sparsemixer(torch.from_numpy(logits), jitter_eps=eps, training=False)
        dense, mask = moe_routing(logits, top_k=2, normalize=0, routing="sparsemixer", jitter_eps=eps)
        rows = np.arange(64)[:, None]
        assert mask.sum(axis=1).tolist() == [2] * 64
        assert mask[rows, experts.numpy()].all()
        np.testing.assert_allclose(dense[rows, experts.numpy()], weights.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_if_lowering_equals_reference(variant: str, tokens: int) -> None:
    experts = VARIANTS[variant][0]
    proto, lower, modified = _lowered(variant, "if")
    assert modified and lower.lowered == [("block", "if")]
    ops = Counter(n.op_type for n in proto.graph.node)
    assert ops["If"] == experts and ops["MoE"] == 0
    rng = np.random.default_rng(tokens)
    hidden = rng.normal(size=(tokens, HIDDEN)).astype(np.float32)
    logits = rng.normal(size=(tokens, experts)).astype(np.float32)
    session = _session(proto)
    for threshold in (0.0, 0.5):
        feeds = {"hidden": hidden, "logits": logits, THRESHOLD_INPUT: np.array(threshold, np.float32)}
        y, mask = session.run(["y", "mask"], feeds)
        ref_y, ref_mask = _reference(variant, hidden, logits, threshold)
        np.testing.assert_array_equal(mask, ref_mask)
        np.testing.assert_allclose(y, ref_y, atol=ATOL, rtol=1e-4)
        assert mask.sum(axis=1).max() <= VARIANTS[variant][1]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_other_lowerings_refuse_v2_routing(variant: str, caplog) -> None:
    node = next(iter(_moe_node_model(variant).graph))
    why = ort_moe_routing_supports(node)
    assert why is not None and why.startswith(FIRST_V2[variant]), why
    # The native kernel implements moe_op_v2's routing except the sparsemixer.
    native = native_supports(node)
    if VARIANTS[variant][2].get("routing", "topk") == "topk":
        assert native is None, native
    else:
        assert native is not None and native.startswith("routing") and "liblayerzero_ort.so" in native
    # ort-moe (and native where refused) fall back to If with the reason in the log: never a wrong result.
    lowerings = ["ort-moe"] + (["native"] if native is not None else [])
    for lowering in lowerings:
        with caplog.at_level(logging.INFO):
            _, lower, _ = _lowered(variant, lowering)
        assert lower.lowered == [("block", "if")]
    with pytest.raises(UnsupportedModelError, match=rf"MoE node '/block/MoE': {FIRST_V2[variant]}"):
        LowerMoEToTensorRT()(_moe_node_model(variant))


@pytest.mark.parametrize("variant", [v for v, spec in VARIANTS.items() if spec[2].get("routing", "topk") == "topk"])
def test_native_lowering_equals_reference(variant: str) -> None:
    """The node kept for liblayerzero_ort.so (v2 inputs 5-8, the threshold at 9) computes the reference."""
    from tests.plugins.native_build import build_ort_test_library as _build

    model = _moe_node_model(variant)
    lower = LowerMoE(lowering="native", native_present=True)
    assert lower(model).modified and lower.lowered == [("block", "native")]
    node = next(n for n in model.graph if n.op_type == "MoE")
    assert node.inputs[-1].name == THRESHOLD_INPUT
    assert len(node.inputs) == 10  # the threshold in its own slot (passes/_moe_node.py)
    inputs = list(node.inputs)
    LowerMoE(lowering="native", native_present=True)(model)
    assert list(node.inputs) == inputs  # a second lowering adds no second threshold
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(_build(asan=False)))
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    experts = VARIANTS[variant][0]
    for tokens in (1, 16):
        rng = np.random.default_rng(tokens)
        hidden = rng.normal(size=(tokens, HIDDEN)).astype(np.float32)
        logits = rng.normal(size=(tokens, experts)).astype(np.float32)
        for threshold in (0.0, 0.5):
            feeds = {"hidden": hidden, "logits": logits, THRESHOLD_INPUT: np.array(threshold, np.float32)}
            y, mask = session.run(["y", "mask"], feeds)
            ref_y, ref_mask = _reference(variant, hidden, logits, threshold)
            np.testing.assert_array_equal(mask, ref_mask)
            np.testing.assert_allclose(y, ref_y, atol=ATOL, rtol=1e-4)


def test_v1_node_is_still_supported_everywhere() -> None:
    """A node without v2 routing keeps every lowering: the attributes are emitted only where not default."""
    model = _moe_node_model("scale-only")
    node = next(iter(model.graph))
    del node.attributes["routed_scaling_factor"]
    assert ort_moe_routing_supports(node) is None
    assert native_supports(node) is None
    assert LowerMoE(lowering="ort-moe")(model).modified
    assert Counter(n.op_type for n in model.graph)["MoE"] == 1  # com.microsoft.MoE
    assert next(n for n in model.graph if n.op_type == "MoE").domain == "com.microsoft"


def _with_dynamic_path(variant: str) -> ir.Model:
    model = _moe_node_model(variant)
    experts = VARIANTS[variant][0]
    record_dynamic_path(
        model,
        DynamicPath(
            path="block",
            kind="moe",
            subpaths=tuple(f"block.experts.{e}" for e in range(experts)),
            params=(1,) * experts,
            mask_output="mask",
        ),
    )
    return model


def test_solidify_drops_the_selection_bias_with_its_experts() -> None:
    """DropExperts slices ``score_bias`` like the weights: the kept experts route as the reference says."""
    model = _with_dynamic_path("ernie-softmax-bias")
    drop = DropExperts(["block.experts.1"])
    assert drop(model).modified
    node = next(n for n in model.graph if n.domain == MOE_DOMAIN)
    w = _weights(4, True)
    kept = [0, 2, 3]
    np.testing.assert_array_equal(node.inputs[8].const_value.numpy(), w["score_bias"][kept])
    lower = LowerMoE(lowering="if")
    assert lower(model).modified
    rng = np.random.default_rng(5)
    hidden = rng.normal(size=(16, HIDDEN)).astype(np.float32)
    logits = rng.normal(size=(16, 4)).astype(np.float32)
    y, mask = _session(model).run(["y", "mask"], {"hidden": hidden, "logits": logits})
    ref_y, ref_mask = moe_reference(
        hidden, logits[:, kept], *(w[k][kept] for k in ("w_gate", "w_up", "w_down")), top_k=2, normalize=1,
        scoring="softmax", score_bias=w["score_bias"][kept],
    )  # fmt: skip
    np.testing.assert_array_equal(mask, ref_mask)
    np.testing.assert_allclose(y, ref_y, atol=ATOL, rtol=1e-4)


def test_solidify_refuses_group_limited_blocks() -> None:
    model = _with_dynamic_path("deepseek-groups-bias-scale")
    with pytest.raises(InvalidInputError, match=r"solidify: block limits top-k to the best of 4 groups"):
        DropExperts(["block.experts.1"])(model)


# ---- routers exported from transformers' modules ------------------------------------------------------------

torch = pytest.importorskip("torch", reason="exported routers need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="exported routers need transformers")

EXPORTERS = ["torchscript", pytest.param("dynamo", marks=pytest.mark.slow)]


def _deepseek_block(**config: object) -> torch.nn.Module:
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    cfg = transformers.DeepseekV3Config(
        hidden_size=HIDDEN * 2, moe_intermediate_size=FFN * 2, n_shared_experts=1, **config
    )
    cfg._experts_implementation = "batched_mm"
    block = m.DeepseekV3MoE(cfg)
    with torch.no_grad():
        block.gate.e_score_correction_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    return block


def _glm_block() -> torch.nn.Module:
    from transformers.models.glm4_moe import modeling_glm4_moe as m

    cfg = transformers.Glm4MoeConfig(
        hidden_size=HIDDEN * 2, moe_intermediate_size=FFN * 2, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
    )  # fmt: skip
    cfg._experts_implementation = "batched_mm"
    block = m.Glm4MoeMoE(cfg)
    with torch.no_grad():
        block.gate.e_score_correction_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    return block


def _ernie_block() -> torch.nn.Module:
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as m

    cfg = transformers.Ernie4_5_MoeConfig(
        hidden_size=HIDDEN * 2, moe_intermediate_size=FFN * 2, moe_num_experts=4, moe_k=2, moe_num_shared_experts=0
    )
    cfg._experts_implementation = "batched_mm"
    block = m.Ernie4_5_MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.moe_statics.e_score_correction_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    return block


def _phimoe_block() -> torch.nn.Module:
    from transformers.models.phimoe import modeling_phimoe as m

    cfg = transformers.PhimoeConfig(
        hidden_size=HIDDEN * 2, intermediate_size=FFN * 2, num_local_experts=6, num_experts_per_tok=2,
        router_jitter_noise=0.2,
    )  # fmt: skip
    cfg._experts_implementation = "batched_mm"
    return m.PhimoeSparseMoeBlock(cfg)


class _Clamped(torch.nn.Module):
    """DeepSeek-V3's router with ``clamp(sum, min=0.5)`` as the denominator: the weights change (refused)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.block.gate
        logits = torch.nn.functional.linear(x, gate.weight)
        scores = logits.sigmoid()
        indices = torch.topk(scores + gate.e_score_correction_bias, k=gate.top_k, dim=-1)[1]
        weights = scores.gather(1, indices)
        weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=0.5)
        return self.block.experts(x, indices, weights)


# name -> (module builder, expected attributes of the MoE node, the module's selection bias)
BLOCKS = {
    "deepseek-v3": (
        lambda: _deepseek_block(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        ),
        {"scoring": "sigmoid", "normalize": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5},
        lambda block: block.gate.e_score_correction_bias,
    ),
    "glm4-moe": (
        _glm_block,
        {"scoring": "sigmoid", "normalize": 0, "n_group": 2, "topk_group": 1},
        lambda block: block.gate.e_score_correction_bias,
    ),
    "phimoe": (
        _phimoe_block,
        {"scoring": "softmax", "normalize": 0, "routing": "sparsemixer", "jitter_eps": 0.2},
        None,
    ),
    "ernie-4.5-moe": (
        _ernie_block,
        {"scoring": "softmax", "normalize": 1},
        lambda block: block.gate.moe_statics.e_score_correction_bias.reshape(-1),
    ),
}


class _Tokens(torch.nn.Module):
    """[T, H] in and out (the blocks take [B, S, H]; the clamped router takes [T, H])."""

    def __init__(self, block: torch.nn.Module, batched: bool = True) -> None:
        super().__init__()
        self.block, self.batched = block, batched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x[None])[0] if self.batched else self.block(x)


def _export(module: torch.nn.Module, exporter: str, path: Path) -> None:
    x = torch.randn(5, HIDDEN * 2, generator=torch.Generator().manual_seed(0))
    if exporter == "dynamo":
        program = torch.onnx.export(
            module, (x,), dynamo=True, input_names=["x"], output_names=["y"], dynamic_shapes={"x": {0: "tokens"}}
        )
        program.save(str(path))
    else:
        torch.onnx.export(
            module, (x,), str(path), dynamo=False, input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "tokens"}, "y": {0: "tokens"}}, opset_version=17,
        )  # fmt: skip


@functools.cache
def _exported(name: str, exporter: str, tmp: Path) -> tuple[onnx.ModelProto, np.ndarray | None]:
    torch.manual_seed(0)
    if name == "clamped":
        block = _deepseek_block(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
        module, bias_of = _Tokens(_Clamped(block), batched=False), None
    else:
        build, _, bias_of = BLOCKS[name]
        block = build()
        module = _Tokens(block)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.3)
    module.eval()
    bias = None if bias_of is None else bias_of(block).detach().numpy().copy()
    path = tmp / f"{name}-{exporter}.onnx"
    _export(module, exporter, path)
    return onnx.load(str(path)), bias


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("routers")


def _skip_experts(proto: onnx.ModelProto) -> tuple[ir.Model, SkipExperts, bool]:
    model = ir.from_proto(proto)
    ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
    skip = SkipExperts()
    modified = skip(model).modified
    RemoveDeadCode()(model)  # as the pipeline's static passes do after the dynamic ones
    return model, skip, modified


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", list(BLOCKS))
def test_exported_router_is_rewritten(name: str, exporter: str, tmp: Path) -> None:
    proto, bias = _exported(name, exporter, tmp)
    before = Counter(n.op_type for n in proto.graph.node)
    model, skip, modified = _skip_experts(proto)
    assert modified and [form for _, form in skip.rewritten] == ["batched_mm"], [r.reason for r in skip.rejected]
    assert not skip.rejected, [(r.node, r.reason) for r in skip.rejected]
    (node,) = [n for n in model.graph if n.domain == MOE_DOMAIN]
    expected = BLOCKS[name][1]
    got = {k: node.attributes[k].value for k in expected}
    assert got == pytest.approx(expected)
    assert not set(V2_ATTRIBUTES) - set(expected) & set(node.attributes), "a default v2 attribute was emitted"
    if bias is None:
        assert len(node.inputs) == 5
    else:
        np.testing.assert_array_equal(node.inputs[8].const_value.numpy(), bias)
    # The router's selection (group limits included), gather, normalisation and scaling are gone.
    after = Counter(n.op_type for n in model.graph)
    assert (
        after["TopK"] == 0
        and after["ArgMax"] == 0
        and after["GatherElements"] == 0
        and after["Where"] <= before["Where"] - (1 if "n_group" in expected else 0)
    )
    # Idempotence: a second run finds no block.
    again = SkipExperts()
    assert not again(model).modified and not again.rewritten
    # Lowered, the block computes what the export computes, at 1 and 16 tokens.
    for lowering in ("if", "ort-moe"):
        lowered = ir.from_proto(ir.to_proto(model))
        lower = LowerMoE(lowering=lowering)
        assert lower(lowered).modified and lower.lowered == [(node.attributes["path"].value, "if")]
        compiled, original = _session(lowered), _session(proto)
        for tokens in (1, 16):
            x = np.random.default_rng(tokens).normal(size=(tokens, HIDDEN * 2)).astype(np.float32)
            (want,) = original.run(["y"], {"x": x})
            got_y = compiled.run(["y"], {"x": x})[0]
            np.testing.assert_allclose(got_y, want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_router_that_changes_the_weights_stays_refused(exporter: str, tmp: Path) -> None:
    proto, _ = _exported("clamped", exporter, tmp)
    model, skip, modified = _skip_experts(proto)
    assert not modified and not skip.rewritten
    (rejection,) = skip.rejected
    assert rejection.node.startswith("TopK ")
    assert "Clip" in rejection.reason and "bounds the sum below by 0.5" in rejection.reason, rejection.reason
    count = len(list(model.graph))
    again = SkipExperts()
    assert not again(model).modified
    assert [r.reason for r in again.rejected] == [rejection.reason] and len(list(model.graph)) == count


# ---- Llama 4: top-k of the logits, then a sigmoid of the k values scattered into -inf (issue 20) -------------


class _Llama4(torch.nn.Module):
    """transformers' ``Llama4TextMoe`` (shared expert included) on ``[T, H]``: each expert reads its tokens
    scaled by the sigmoid of their router logit (the router's own ``[T, E]`` matrix), every expert on every
    token, summed."""

    def __init__(self, top_k: int) -> None:
        super().__init__()
        from transformers.models.llama4 import modeling_llama4 as m

        cfg = transformers.Llama4TextConfig(
            hidden_size=HIDDEN * 2, intermediate_size=FFN * 2, intermediate_size_mlp=FFN * 4, num_local_experts=4,
            num_experts_per_tok=top_k,
        )  # fmt: skip
        self.block = m.Llama4TextMoe(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


@functools.cache
def _llama4_exported(top_k: int, exporter: str, tmp: Path) -> onnx.ModelProto:
    torch.manual_seed(0)
    module = _Llama4(top_k)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.3)
    module.eval()
    path = tmp / f"llama4-top{top_k}-{exporter}.onnx"
    _export(module, exporter, path)
    return onnx.load(str(path))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_llama4_router_is_rewritten(exporter: str, tmp: Path) -> None:
    proto = _llama4_exported(1, exporter, tmp)
    model, skip, modified = _skip_experts(proto)
    assert modified and [form for _, form in skip.rewritten] == ["input_scaled"], skip.rejected
    assert not skip.rejected, skip.rejected
    (node,) = [n for n in model.graph if n.domain == MOE_DOMAIN]
    attrs = {k: node.attributes[k].value for k in ("top_k", "normalize", "scoring")}
    assert attrs == {"top_k": 1, "normalize": 1, "scoring": "softmax"}
    # The experts read the tokens scaled by the sigmoid of their top logit; the router's matrix is gone.
    scale = node.inputs[0].producer()
    assert scale.op_type == "Mul" and scale.inputs[1].producer().op_type == "Sigmoid"
    after = Counter(n.op_type for n in model.graph)
    assert after["TopK"] == 0 and after["ScatterElements"] == 0 and after["Tile"] == 0
    assert not SkipExperts()(model).modified
    for lowering in ("if", "ort-moe"):
        lowered = ir.from_proto(ir.to_proto(model))
        assert LowerMoE(lowering=lowering)(lowered).modified
        compiled, original = _session(lowered), _session(proto)
        for tokens in (1, 16):
            x = np.random.default_rng(tokens).normal(size=(tokens, HIDDEN * 2)).astype(np.float32)
            (want,) = original.run(["y"], {"x": x})
            np.testing.assert_allclose(compiled.run(["y"], {"x": x})[0], want, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_llama4_router_with_top2_is_refused_with_the_reason(exporter: str, tmp: Path) -> None:
    """With k > 1 each expert reads its tokens scaled by its own weight: no skipping form computes that."""
    _, skip, modified = _skip_experts(_llama4_exported(2, exporter, tmp))
    assert not modified
    (rejection,) = skip.rejected
    assert "top-2 routing scales each expert's input by its own weight" in rejection.reason, rejection
