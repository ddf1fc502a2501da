"""The target registry and interface, and the dynamic-pass registry: every entry resolves, names agree."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from layerzero import pipeline
from layerzero.contract import MOE_DOMAIN
from layerzero.errors import InvalidInputError
from layerzero.options import CompileOptions
from layerzero.runtime.backends.base import get_backend
from layerzero.targets import TARGET_CLASSES, TARGETS, get_target
from layerzero.targets.base import Target


@pytest.mark.parametrize("name", TARGETS)
def test_every_registered_target_resolves_and_names_a_backend(name: str) -> None:
    target = get_target(name)
    assert isinstance(target, Target)
    assert target.name == name
    backend = get_backend(target.backend)  # a typo in the registry or the backend name fails here
    assert target.name in getattr(backend, "targets", (target.name,))
    assert get_target(name) is target


def test_unknown_target_is_an_invalid_input() -> None:
    with pytest.raises(InvalidInputError, match=r"unknown target 'tensorrtx'; known targets: onnxruntime, tensorrt"):
        get_target("tensorrtx")


def test_registry_lists_the_modules_of_this_package() -> None:
    assert set(TARGET_CLASSES) == {"onnxruntime", "tensorrt"}
    assert all(ref.startswith(f"layerzero.targets.{name}:") for name, ref in TARGET_CLASSES.items())


def test_dynamic_passes_are_pass_classes() -> None:
    assert pipeline.DYNAMIC_PASSES, "no dynamic pass registered"
    for step in pipeline.DYNAMIC_PASSES:
        assert isinstance(step.cls, type) and issubclass(step.cls, ir.passes.PassBase), step
        assert type(step.build(CompileOptions())) is step.cls  # each is built from the options alone
    # Lowering is the target's step, not a dynamic pass's.
    assert "LowerMoE" not in {step.cls.__name__ for step in pipeline.DYNAMIC_PASSES}


def test_targets_lower_the_skipping_form_their_own_way() -> None:
    from layerzero.compile import compile_model
    from layerzero.models.moe import MoEConfig, build_moe

    proto = build_moe(MoEConfig(hidden=16, ffn=32, experts=4, top_k=2))
    ort = compile_model(proto, CompileOptions(target="onnxruntime", moe_lowering="if"))  # the lowering, pinned
    trt = compile_model(proto, CompileOptions(target="tensorrt", moe_lowering="if"))
    # onnxruntime lowers ai.layerzero::MoE in the compiled graph; tensorrt keeps it for its plugin and verifies the
    # onnxruntime lowering of a copy.
    assert not any(n.domain == MOE_DOMAIN for n in ort.model.graph.all_nodes())
    assert sum(n.domain == MOE_DOMAIN for n in trt.model.graph.all_nodes()) >= 1
    assert ort.verification.passed and trt.verification.passed
    checked = get_target("tensorrt").verification_model(trt.model, trt.options)
    assert not any(n.domain == MOE_DOMAIN for n in checked.graph.all_nodes())
    assert any(n.domain == MOE_DOMAIN for n in trt.model.graph.all_nodes())  # the copy was lowered, not the model
    assert ort.manifest(None, None)["backend"] == "onnxruntime"
    assert trt.manifest(None, None)["backend"] == "tensorrt"


@pytest.mark.parametrize(
    ("name", "message"),
    [("onnxruntime", "target 'onnxruntime' takes no options, got dict"),
     ("tensorrt", "target 'tensorrt' takes TensorRTOptions, got dict")],
)  # fmt: skip
def test_write_bundle_refuses_another_targets_options_before_writing(name: str, message: str, tmp_path) -> None:
    out = tmp_path / "m.lz"
    with pytest.raises(InvalidInputError, match=f"^{message}$"):
        get_target(name).write_bundle(out, None, source=None, sha256=None, target_options={"precision": "fp16"})
    assert not out.exists()
