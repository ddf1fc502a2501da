"""The TensorRT target: lower the compiled graph to plugin nodes and build an engine plan.

    layerzero compile model.onnx -o model.lz --target tensorrt --precision fp16 \\
        --shape hidden:1,512/64,512/1024,512

``TensorRTTarget`` (the ``tensorrt`` entry of ``layerzero.targets``): its compile-time lowering keeps the skipping
form ``ai.layerzero::MoE`` (the plugin implements it), the compile's verification runs ONNX Runtime on the
``onnxruntime`` lowering of that form (``ort_equivalent``), its bundle is written by ``write_tensorrt_bundle`` and
the ``tensorrt`` backend runs it. Steps, after the usual passes and verification (``compile_model``):

1. lower: every ``ai.layerzero::MoE`` becomes ``trt.plugins::LayerZeroMoE`` (``passes/lower_tensorrt.py``);
2. build: TensorRT's ONNX parser reads the lowered graph with ``liblayerzero_trt.so`` loaded into the plugin
   registry; precision flags (fp32 / fp16 / bf16), one optimisation profile from ``--shape
   name:MIN/OPT/MAX`` (a plain ``name:D0,D1`` fixes min = opt = max), a workspace limit;
3. verify (default on): run the plan on the verification inputs (the OPT shapes) and compare it with ONNX Runtime
   on the compiled graph, at a tolerance that depends on the precision;
4. write the bundle atomically: ``model.onnx`` (the lowered graph; plans are tied to a GPU and a TensorRT
   version, so this is what to rebuild from), ``model.plan`` and ``manifest.json`` (``target: tensorrt`` and a
   ``tensorrt`` section: precision, profiles, TensorRT version, plugin library, plan verification).

TensorRT is imported only here and only when building; without it every entry point raises
``TensorRTUnavailableError`` (exit code 2) before any work is done.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from layerzero.contract import MOE_DOMAIN, MOE_OP
from layerzero.errors import InvalidInputError, LayerZeroError, UnsupportedModelError, VerificationError
from layerzero.passes.lower_tensorrt import LowerMoEToTensorRT
from layerzero.passes.shape_inference import InferShapes
from layerzero.runtime.backends.tensorrt import (
    TensorRTUnavailableError,
    import_tensorrt,
    load_plugin_library,
    trt_logger,
)
from layerzero.targets import PRECISIONS
from layerzero.targets.base import BundleWrite, Progress, Target

if TYPE_CHECKING:
    from layerzero.options import CompileOptions
    from layerzero.result import CompileResult

__all__ = [
    "PLAN_NAME",
    "PRECISIONS",
    "TensorRTOptions",
    "TensorRTTarget",
    "TensorRTUnavailableError",
    "build_engine",
    "lower_for_tensorrt",
    "ort_equivalent",
    "parse_profile_shapes",
    "require_tensorrt",
    "write_tensorrt_bundle",
]

logger = logging.getLogger(__name__)

PLAN_NAME = "model.plan"
# Plan vs ONNX Runtime: fp32 matches to fp32 noise; half types keep ~3 (fp16) or ~2 (bf16) significant digits.
_PLAN_ATOL = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 1e-1}

Profile = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass
class TensorRTOptions:
    """How to build the plan. ``profiles``: input name -> (min, opt, max) shapes."""

    precision: str = "fp32"
    profiles: dict[str, Profile] = dataclasses.field(default_factory=dict)
    workspace_mb: int | None = None  # the builder's workspace pool limit; None: TensorRT's default (device memory)
    plugin_library: Path | None = None  # liblayerzero_trt.so; None: found like plugin_library_path("trt")
    optimization_level: int | None = None  # builder_optimization_level 0..5; None: TensorRT's default (3)
    verify: bool = True  # run the plan on the verification inputs and compare it with ONNX Runtime

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InvalidInputError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "profiles": {k: [list(s) for s in v] for k, v in self.profiles.items()},
            "workspace_mb": self.workspace_mb,
            "optimization_level": self.optimization_level,
        }


def parse_profile_shapes(items: list[str] | None) -> dict[str, Profile]:
    """``--shape name:1,64/8,64/64,64`` -> {"name": ((1, 64), (8, 64), (64, 64))}; ``name:8,64`` -> min = opt = max.

    Raises:
        InvalidInputError: a malformed item, ranks that differ, or not min <= opt <= max.
    """
    profiles: dict[str, Profile] = {}
    for item in items or []:
        name, sep, spec = item.rpartition(":")
        if not sep or not name:
            raise InvalidInputError(
                f"--shape {item!r}: expected NAME:MIN/OPT/MAX with dims D0,D1 (e.g. x:1,64/8,64/64,64)"
            )
        parts = spec.split("/")
        if len(parts) not in (1, 3):
            raise InvalidInputError(f"--shape {item!r}: give one shape or three (MIN/OPT/MAX), got {len(parts)}")
        try:
            shapes = [tuple(int(d) for d in p.split(",") if d.strip() != "") for p in parts]
        except ValueError:
            raise InvalidInputError(f"--shape {item!r}: dims must be integers") from None
        if len(shapes) == 1:
            shapes = shapes * 3
        lo, opt, hi = shapes
        if not len(lo) == len(opt) == len(hi):
            raise InvalidInputError(f"--shape {item!r}: MIN, OPT and MAX must have the same rank")
        if any(d < 0 for s in shapes for d in s) or not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
            raise InvalidInputError(f"--shape {item!r}: need 0 <= MIN <= OPT <= MAX in every dim")
        profiles[name] = (lo, opt, hi)
    return profiles


def require_tensorrt() -> Any:
    """The ``tensorrt`` module, or ``TensorRTUnavailableError`` saying what to install (checked before compiling)."""
    return import_tensorrt()


def lower_for_tensorrt(model: ir.Model) -> tuple[ir.Model, int]:
    """A copy of ``model`` with its MoE nodes lowered to plugin nodes, and how many were lowered."""
    lowered = model.clone()
    InferShapes()(lowered)  # the lowering reads dtypes
    before = sum(1 for n in lowered.graph.all_nodes() if n.domain == MOE_DOMAIN and n.op_type == MOE_OP)
    LowerMoEToTensorRT()(lowered)
    return lowered, before


def ort_equivalent(model: ir.Model, options: CompileOptions) -> ir.Model:
    """What ONNX Runtime can run of a ``--target tensorrt`` compile: a copy with the skipping-form MoE nodes
    lowered the ``onnxruntime`` way (``passes/lower_moe.py``). The compile's verification and the plan's check
    compare against this graph; the graph that TensorRT gets keeps the nodes for the plugin."""
    if not any(n.domain == MOE_DOMAIN for n in model.graph.all_nodes()):
        return model
    from layerzero.targets import get_target

    copy = model.clone()
    get_target("onnxruntime").lower(copy, dataclasses.replace(options, target="onnxruntime"))
    return copy


class TensorRTTarget(Target):
    """Bundles TensorRT runs: the lowered graph with plugin nodes and an engine plan built from it."""

    name = "tensorrt"
    backend = "tensorrt"
    options_type = TensorRTOptions

    def check_available(self) -> None:
        require_tensorrt()  # before any work: without TensorRT this target cannot build anything

    def lower(self, model: ir.Model, options: CompileOptions) -> bool:
        # The compiled graph keeps ai.layerzero::MoE: verification lowers a copy for ONNX Runtime
        # (verification_model), the bundle lowers one to plugin nodes (write_tensorrt_bundle).
        return False

    def verification_model(self, model: ir.Model, options: CompileOptions) -> ir.Model:
        return ort_equivalent(model, options)

    def _write_bundle(self, out: str | os.PathLike[str], result: CompileResult, how: BundleWrite) -> dict[str, Any]:
        trt_options = how.target_options or TensorRTOptions(verify=result.options.verify)
        return write_tensorrt_bundle(
            out,
            result,
            result.options,
            trt_options,
            source=how.source,
            sha256=how.sha256,
            overwrite=how.overwrite,
            progress=how.progress,
        )


# ------------------------------------------------------------------------------------------------- building


def build_engine(
    onnx_path: Path,
    options: TensorRTOptions,
    verification_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> bytes:
    """Parse ``onnx_path`` with TensorRT's ONNX parser and build a serialized engine plan.

    A dynamic input takes its profile from ``options.profiles``, else min = opt = max = its verification shape.

    Raises:
        TensorRTUnavailableError: no tensorrt module.
        InvalidInputError: a dynamic input without a profile, or a profile that does not fit the input.
        UnsupportedModelError: the parser rejected the graph (its errors are in the message).
        LayerZeroError: the build failed.
    """
    trt = require_tensorrt()
    log = trt_logger(trt)
    log.errors.clear()
    library = load_plugin_library(trt, options.plugin_library, required=options.plugin_library is not None)
    builder = trt.Builder(log)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        hint = ""
        if library is None and any("LayerZeroMoE" in e or "Plugin not found" in e for e in errors):
            hint = (
                "; the LayerZero plugin library is not loaded: run `layerzero plugins build` or pass --plugin-library"
            )
        raise UnsupportedModelError(f"TensorRT cannot parse {onnx_path.name}: {' | '.join(errors)}{hint}")

    config = builder.create_builder_config()
    _set_precision(trt, config, options.precision)
    if options.workspace_mb is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_mb) << 20)
    if options.optimization_level is not None:
        config.builder_optimization_level = int(options.optimization_level)
    profile = _profile(builder, network, options.profiles, dict(verification_shapes or {}))
    if profile is not None:
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        detail = " | ".join(log.errors[-5:]) or "see the TensorRT log (layerzero -v)"
        raise LayerZeroError(f"TensorRT failed to build an engine from {onnx_path.name}: {detail}")
    return bytes(plan)


def _set_precision(trt: Any, config: Any, precision: str) -> None:
    flags = trt.BuilderFlag
    if precision == "fp32":
        if hasattr(flags, "TF32"):
            config.clear_flag(flags.TF32)  # fp32 means fp32: no TF32 tensor-core rounding
        return
    name = {"fp16": "FP16", "bf16": "BF16"}[precision]
    if not hasattr(flags, name):
        raise UnsupportedModelError(
            f"this TensorRT ({trt.__version__}) has no BuilderFlag.{name} (weakly typed precision flags were "
            f"removed): export the model in {precision} instead and build it with --precision fp32"
        )
    config.set_flag(getattr(flags, name))


def _profile(builder: Any, network: Any, profiles: dict[str, Profile], fixed: dict[str, tuple[int, ...]]) -> Any:
    unknown = set(profiles) - {network.get_input(i).name for i in range(network.num_inputs)}
    if unknown:
        names = ", ".join(network.get_input(i).name for i in range(network.num_inputs))
        raise InvalidInputError(f"--shape names unknown input(s) {', '.join(sorted(unknown))}; the inputs are {names}")
    profile, needed = builder.create_optimization_profile(), False
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        dims = tuple(tensor.shape)
        if all(d >= 0 for d in dims):
            continue
        needed = True
        if tensor.name in profiles:
            lo, opt, hi = profiles[tensor.name]
        elif tensor.name in fixed:
            lo = opt = hi = tuple(fixed[tensor.name])
        else:
            example = ",".join("1" if d < 0 else str(d) for d in dims)
            raise InvalidInputError(
                f"input {tensor.name!r} has dynamic dims {list(dims)}: give its range with --shape "
                f"{tensor.name}:MIN/OPT/MAX (e.g. {tensor.name}:{example}/{example}/{example})"
            )
        for shape in (lo, opt, hi):
            if len(shape) != len(dims) or any(d >= 0 and s != d for s, d in zip(shape, dims)):
                raise InvalidInputError(
                    f"--shape {tensor.name}: {list(shape)} does not fit the input's shape {list(dims)} "
                    "(same rank, static dims unchanged)"
                )
        profile.set_shape(tensor.name, lo, opt, hi)
    return profile if needed else None


# ------------------------------------------------------------------------------------------------- bundle


def write_tensorrt_bundle(
    out: str | os.PathLike[str],
    result: CompileResult,
    options: CompileOptions,
    trt_options: TensorRTOptions,
    *,
    source: Path | None = None,
    sha256: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Lower ``result.model``, build (and verify) the plan, and write the TensorRT bundle at ``out`` atomically.

    Returns the manifest written. Nothing is written when any step fails.

    Raises:
        TensorRTUnavailableError, InvalidInputError, UnsupportedModelError, LayerZeroError: see ``build_engine``.
        VerificationError: the plan's outputs differ from ONNX Runtime's beyond the precision's tolerance.
    """
    from layerzero.runtime import bundle as bundle_io

    say = progress or (lambda *_a, **_k: None)
    trt = require_tensorrt()
    out = Path(os.path.abspath(out))
    if out.exists() and not overwrite:
        raise InvalidInputError(f"{out}: already exists (pass --force to replace it)")
    say("lowering for TensorRT")
    lowered, moe_nodes = lower_for_tensorrt(result.model)
    manifest = result.manifest(source, sha256)
    shapes = _verification_shapes(options, trt_options)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.trt-", dir=out.parent))
    os.rmdir(staging)  # write_bundle creates it (atomically) below
    try:
        library = load_plugin_library(trt, trt_options.plugin_library, required=trt_options.plugin_library is not None)
        manifest["tensorrt"] = {
            **trt_options.to_dict(),
            "plan_file": PLAN_NAME,
            "tensorrt_version": str(trt.__version__),
            "plugin_library": None if library is None else library.name,
            "plugin_nodes": moe_nodes,
            "verification": None,
        }
        bundle_io.write_bundle(staging, lowered, manifest, protect=[] if source is None else [source])
        # What write_bundle completed (format, integrity fingerprint, libraries): kept when verification rewrites it.
        manifest = json.loads((staging / bundle_io.MANIFEST_NAME).read_text(encoding="utf-8"))
        say("building the TensorRT engine")
        plan = build_engine(staging / bundle_io.MODEL_NAME, trt_options, shapes)
        (staging / PLAN_NAME).write_bytes(plan)
        if trt_options.verify:
            say("verifying the TensorRT engine")
            manifest["tensorrt"]["verification"] = _verify_plan(staging, result, options, trt_options, shapes)
            (staging / bundle_io.MANIFEST_NAME).write_text(_json(manifest), encoding="utf-8")
        bundle_io.publish_staged(staging, out, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote TensorRT bundle %s (%d bytes of plan)", out, len(plan))
    return manifest


def _json(manifest: Mapping[str, Any]) -> str:
    import json

    return json.dumps(manifest, indent=2) + "\n"


def _verification_shapes(options: CompileOptions, trt_options: TensorRTOptions) -> dict[str, tuple[int, ...]]:
    """The shapes the plan is verified on: the OPT shape of each profile, else the compile's --shape."""
    shapes = dict(options.shapes)
    shapes.update({name: opt for name, (_lo, opt, _hi) in trt_options.profiles.items()})
    return shapes


def _verify_plan(
    bundle_dir: Path,
    result: CompileResult,
    options: CompileOptions,
    trt_options: TensorRTOptions,
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, Any]:
    """Run the plan and ONNX Runtime (the compiled graph, before lowering) on the same inputs; compare."""
    import onnx

    from layerzero.contract import MASK_PREFIX, ROUTER_PREFIX
    from layerzero.runtime.backends.tensorrt import TensorRTBackend
    from layerzero.verify import compare_outputs, make_inputs, run_model, tolerance_at_least

    with tempfile.TemporaryDirectory(prefix="layerzero-trt-verify-") as tmp:
        reference_path = Path(tmp) / "reference.onnx"
        ir.save(
            ort_equivalent(result.model, options),
            reference_path,
            external_data=reference_path.name + ".data",
            size_threshold_bytes=1 << 20,
        )
        header = onnx.load(str(reference_path), load_external_data=False)
        feeds = make_inputs(header, shapes, options.seed)
        names, expected = run_model(reference_path, feeds)
    backend = TensorRTBackend()
    backend.load(bundle_dir / PLAN_NAME, plugin_library=trt_options.plugin_library)
    feeds = {k: v for k, v in feeds.items() if k in {s.name for s in backend.input_specs}}
    got = dict(zip(backend.output_names, backend.run(feeds), strict=True))
    atol = max(options.atol, _PLAN_ATOL[trt_options.precision])
    user = [(n, e) for n, e in zip(names, expected) if not n.startswith((MASK_PREFIX, ROUTER_PREFIX))]
    missing = [n for n, _ in user if n not in got]
    if missing:
        raise VerificationError(f"the TensorRT engine lacks output(s) {missing}; it has {sorted(got)}")
    outputs = compare_outputs(
        [n for n, _ in user], [e for _, e in user], [got[n].astype(e.dtype) for n, e in user], atol, options.rtol
    )
    masks = {}
    for n, e in zip(names, expected):
        if n.startswith(MASK_PREFIX) and n in got:
            masks[n] = float(np.mean(np.asarray(got[n]).astype(bool) == np.asarray(e).astype(bool)))
    record = {
        "passed": all(o.passed for o in outputs),
        "atol": atol,
        "rtol": options.rtol,
        "inputs": {k: list(v.shape) for k, v in feeds.items()},
        "outputs": [o.to_dict() for o in outputs],
        "mask_agreement": masks,  # fraction of equal mask entries (ties at the threshold may flip)
    }
    if not record["passed"]:
        worst = max(outputs, key=lambda o: o.needed_atol)
        raise VerificationError(
            f"TensorRT engine ({trt_options.precision}) differs from ONNX Runtime on output {worst.name!r} by max abs "
            f"{worst.max_abs:.3g}; it would pass with --atol {tolerance_at_least(worst.needed_atol)} "
            f"--rtol {options.rtol:g} (or pass --no-verify-plan)",
            result=None,
        )
    return record
