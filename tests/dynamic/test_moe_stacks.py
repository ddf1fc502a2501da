"""Property test: random stacks of MoE blocks, with and without residuals, compile and match (issue 10 item 3).

Blocks are matched before any is rewritten; without a residual, block ``i + 1`` reads block ``i``'s output,
which the rewrite of block ``i`` replaces. Every stack must compile (verified) to a valid graph with every
block in the skipping form, run equal to the source on fresh inputs, and a second ``SkipExperts`` run must
find nothing.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from layerzero.compile import compile_model
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds
from layerzero.options import CompileOptions
from layerzero.ort_runner import create_session
from layerzero.passes._dynamic import MASK_PREFIX, ROUTER_PREFIX, read_dynamic_paths
from layerzero.passes.moe import SkipExperts
from layerzero.passes.shape_inference import InferShapes


@st.composite
def moe_stacks(draw: st.DrawFn) -> MoEConfig:
    experts = draw(st.integers(2, 5))
    return MoEConfig(
        hidden=draw(st.sampled_from([8, 16])),
        ffn=draw(st.sampled_from([8, 24])),
        experts=experts,
        top_k=draw(st.integers(1, experts)),
        layers=draw(st.integers(1, 3)),
        residual=draw(st.booleans()),
        normalize=draw(st.booleans()),
        scoring=draw(st.sampled_from(["softmax", "sigmoid"])),
        activation=draw(st.sampled_from(["silu", "gelu", "relu"])),
        form=draw(st.sampled_from(["batched_mm", "dense", "unrolled"])),
        routing=draw(st.sampled_from(["scatter", "onehot"])),
        combine=draw(st.sampled_from(["einsum", "sum"])),
        fused_gate_up=draw(st.booleans()),
        seed=draw(st.integers(0, 3)),
    )


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    # liblayerzero_ort.so registered when it is built: the default lowering ("auto") writes ai.layerzero::MoE then.
    session = create_session(proto.SerializeToString())
    return session.run(["y"], feeds)[0]


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: each example is a full compile
    suppress_health_check=[HealthCheck.too_slow],
)
@given(config=moe_stacks(), lowering=st.sampled_from(["if", "ort-moe"]))
def test_random_moe_stacks_compile_and_match(config: MoEConfig, lowering: str) -> None:
    note(repr(config))
    source = build_moe(config)
    result = compile_model(source, CompileOptions(moe_lowering=lowering))
    assert result.verification is not None and result.verification.passed
    paths = read_dynamic_paths(result.model)
    assert [p.path for p in paths] == [config.path(i) for i in range(config.layers)]
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    assert {o.name for o in proto.graph.output if not o.name.startswith((MASK_PREFIX, ROUTER_PREFIX))} == {"y"}
    for tokens in (1, 9):
        feeds = moe_feeds(config, tokens, seed=tokens)
        np.testing.assert_allclose(_run(proto, feeds), _run(source, feeds), rtol=1e-5, atol=1e-5)
    skipped = ir.from_proto(build_moe(config))
    InferShapes()(skipped)
    assert SkipExperts()(skipped).modified
    assert not SkipExperts()(skipped).modified  # idempotent: a second run finds nothing


def test_two_blocks_without_residual_compile_to_a_valid_graph() -> None:
    # The case of issue 10: build_moe(MoEConfig(layers=2)) read a removed value after the rewrite.
    config = MoEConfig(layers=2)
    result = compile_model(build_moe(config), CompileOptions(verify=False))
    proto = ir.to_proto(result.model)
    onnx.checker.check_model(proto, full_check=True)
    feeds = moe_feeds(config, 5)
    np.testing.assert_allclose(_run(proto, feeds), _run(build_moe(config), feeds), rtol=1e-5, atol=1e-5)
