"""Device-aware lowering (issue 13): ``CompileOptions(device="cuda")`` lowers MoE to ``com.microsoft.MoE`` only,
the manifest records the device, and ``Engine.load`` picks the CUDA provider from it (or says what is missing)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from layerzero.contract import MOE_DOMAIN
from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds
from layerzero.options import CompileOptions
from layerzero.passes.shape_inference import InferShapes
from layerzero.targets import get_target

SMALL = {"hidden": 16, "ffn": 32, "experts": 4, "top_k": 2}


def _skipping(**config: object) -> ir.Model:
    model = ir.from_proto(build_moe(MoEConfig(form="skipping", **{**SMALL, **config})))
    InferShapes()(model)
    return model


def _ops(model: ir.Model) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in model.graph.all_nodes()]


def test_cuda_lowers_every_block_to_com_microsoft_moe_never_if() -> None:
    target = get_target("onnxruntime")
    cuda = _skipping()
    assert target.lower(cuda, CompileOptions(device="cuda"))
    ops = _ops(cuda)
    assert ops.count(("com.microsoft", "MoE")) == 1
    assert not any(op == "If" for _, op in ops)
    assert not any(domain == MOE_DOMAIN for domain, _ in ops)
    # The same block on the CPU with the If lowering: the per-expert If form the cuda device never gets.
    cpu = _skipping()
    target.lower(cpu, CompileOptions(device="cpu", moe_lowering="if"))
    assert [op for _, op in _ops(cpu)].count("If") == SMALL["experts"]


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"scoring": "sigmoid", "activation": "relu", "normalize": False}, "scoring 'sigmoid'"),
        ({"activation": "gelu"}, "activation 'gelu'"),
    ],
)
def test_cuda_refuses_a_block_com_microsoft_moe_cannot_run(config: dict, why: str) -> None:
    model = _skipping(**config)
    before = _ops(model)
    with pytest.raises(UnsupportedModelError, match=rf"MoE block .*device 'cuda'.*{why}.*--device cpu") as info:
        get_target("onnxruntime").lower(model, CompileOptions(device="cuda"))
    assert "\n" not in str(info.value)
    assert _ops(model) == before  # refused before anything changed


@pytest.mark.parametrize("lowering", ["if", "native"])
def test_cuda_with_a_cpu_only_lowering_is_a_bad_option(lowering: str) -> None:
    with pytest.raises(InvalidInputError, match=rf"option moe_lowering: '{lowering}' cannot run on device 'cuda'"):
        CompileOptions(device="cuda", moe_lowering=lowering)


def test_unknown_device_is_a_bad_option() -> None:
    with pytest.raises(InvalidInputError, match=r"option device: 'tpu' is not one of cpu, cuda"):
        CompileOptions(device="tpu")


@pytest.fixture(scope="module")
def cuda_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from layerzero.compile import compile_file

    source = tmp_path_factory.mktemp("device") / "moe.onnx"
    source.write_bytes(build_moe(MoEConfig(**SMALL)).SerializeToString())
    out = source.parent / "moe.lz"
    result = compile_file(source, out, CompileOptions(device="cuda"))
    assert result.verification is not None and result.verification.passed  # verified on the CPU
    return out


def test_manifest_records_the_device_and_the_lowering(cuda_bundle: Path) -> None:
    import onnx

    manifest = json.loads((cuda_bundle / "manifest.json").read_text())
    assert manifest["device"] == "cuda"
    assert manifest["options"]["device"] == "cuda"
    ops = {(n.domain, n.op_type) for n in onnx.load(str(cuda_bundle / "model.onnx")).graph.node}
    assert ("com.microsoft", "MoE") in ops and ("", "If") not in ops


def test_engine_without_onnxruntime_gpu_says_so_in_one_line(cuda_bundle: Path) -> None:
    import onnxruntime as ort

    from layerzero.runtime.engine import Engine

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed: the missing-provider error cannot happen here")
    with pytest.raises(InvalidInputError, match=r"compiled for device 'cuda'.*onnxruntime-gpu") as info:
        Engine.load(cuda_bundle)
    assert "\n" not in str(info.value) and str(cuda_bundle) in str(info.value)
    # Asked for the CPU, the same bundle runs there (com.microsoft.MoE has a CPU kernel).
    engine = Engine.load(cuda_bundle, device="cpu")
    assert engine.backend.providers == ["CPUExecutionProvider"]
    feeds = moe_feeds(MoEConfig(**SMALL), 5)
    outputs = engine.run(feeds).outputs
    assert all(np.isfinite(v).all() for v in outputs.values())


def test_engine_picks_the_cuda_provider_from_the_manifest(cuda_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    from layerzero.runtime.backends.onnxruntime import OrtBackend
    from layerzero.runtime.engine import Engine

    asked: list[dict] = []

    def capturing(self: OrtBackend, model_path: Path, **options: object) -> None:
        asked.append(options)
        raise RuntimeError("stop: the options are what this test reads")

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(OrtBackend, "load", capturing)
    with pytest.raises(RuntimeError, match="stop"):
        Engine.load(cuda_bundle)
    with pytest.raises(RuntimeError, match="stop"):
        Engine.load(cuda_bundle, device="cpu")  # the caller's device wins
    assert asked == [{"device": "cuda"}, {"device": "cpu"}]


def test_cli_device_reaches_the_manifest(tmp_path: Path) -> None:
    from layerzero.cli import main

    source = tmp_path / "moe.onnx"
    source.write_bytes(build_moe(MoEConfig(**SMALL)).SerializeToString())
    assert main(["compile", str(source), "-o", str(tmp_path / "moe.lz"), "--device", "cuda"]) == 0
    assert json.loads((tmp_path / "moe.lz" / "manifest.json").read_text())["device"] == "cuda"
    # A CPU-only lowering for cuda is bad input: exit 2, nothing written.
    args = ["compile", str(source), "-o", str(tmp_path / "if.lz"), "--device", "cuda", "--moe-lowering", "if"]
    assert main(args) == 2
    assert not (tmp_path / "if.lz").exists()
