"""``compile_model``: load → static passes → verify → engine bundle."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir

from layerzero import __version__
from layerzero.chunked import run_in_chunks, weight_bytes
from layerzero.contract import MASK_PREFIX, ROUTER_PREFIX
from layerzero.errors import InvalidInputError, VerificationError
from layerzero.loader import load_model
from layerzero.options import CompileOptions
from layerzero.passes._dynamic import read_dynamic_paths
from layerzero.pipeline import (
    PipelineResult,
    bypass_declared_layers,
    lower_for_target,
    needs_dynamic_reference,
    run_dynamic_passes,
    run_static_passes,
)
from layerzero.summary import ModelSummary, natural_key, summarize
from layerzero.targets import get_target
from layerzero.verify import VerificationResult, compare_outputs, make_inputs, run_model

if TYPE_CHECKING:
    from layerzero.solidify_plan import SolidifyPlan
    from layerzero.targets.tensorrt import TensorRTOptions

__all__ = ["CompileResult", "RemovedScope", "compile_file", "compile_model"]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclasses.dataclass
class RemovedScope:
    scope: str
    kind: str  # "declared-flag" | "consumed-flag" | "folded"
    params: int
    nodes: int


@dataclasses.dataclass
class CompileResult:
    model: ir.Model
    options: CompileOptions
    before: ModelSummary
    after: ModelSummary
    removed: list[RemovedScope]
    pipeline: PipelineResult
    verification: VerificationResult | None
    seconds: float
    # Paths solidified from a profile (layerzero.solidify_plan): what went, with the profile's numbers; the plan.
    solidified: list[dict] = dataclasses.field(default_factory=list)
    solidify_plan: SolidifyPlan | None = None

    @property
    def zeroed_layers(self) -> list[str]:
        layers = set(self.before.layers)
        return [r.scope for r in self.removed if r.scope in layers]

    def manifest(self, source: Path | None, sha256: str | None) -> dict:
        return {
            "layerzero_version": __version__,
            "target": self.options.target,
            # The runtime backend that runs this bundle (Engine.load picks it from here).
            "backend": get_target(self.options.target).backend,
            "source": {"path": None if source is None else str(source.resolve()), "sha256": sha256},
            "options": self.options.to_dict(),
            "stats": {
                "nodes_before": self.before.nodes,
                "nodes_after": self.after.nodes,
                "params_before": self.before.params,
                "params_after": self.after.params,
                "compile_seconds": round(self.seconds, 3),
                "iterations": self.pipeline.iterations,
            },
            "layers": {"total": len(self.before.layers), "zeroed": self.zeroed_layers},
            "removed": [dataclasses.asdict(r) for r in self.removed],
            "dynamic": [d.to_dict() for d in read_dynamic_paths(self.model)],
            "solidified": self.solidified,
            "verification": None if self.verification is None else self.verification.to_dict(),
        }


def _removed_scopes(
    before: ModelSummary, after: ModelSummary, kinds: dict[str, str], dynamic: list[str]
) -> list[RemovedScope]:
    # A bypassed layer counts as removed even when side values it computed for others stay (FoldZeroFlags Case 4).
    bypassed = {s for s, kind in kinds.items() if kind == "declared-flag"}
    gone = [s for s, n in before.scope_nodes.items() if s and n and (s in bypassed or not after.scope_nodes.get(s))]
    # A scope a dynamic pass rewrote (its nodes now live in the skipping form) is not removed.
    gone = [s for s in gone if not any(s == d or s.startswith(d + ".") for d in dynamic)]
    gone_set = set(gone)
    maximal = [s for s in gone if not any(p in gone_set for p in _parents(s))]
    return [
        RemovedScope(
            s,
            kinds.get(s, "folded"),
            before.scope_params.get(s, 0) - after.scope_params.get(s, 0),
            before.scope_nodes[s] - after.scope_nodes.get(s, 0),
        )
        for s in sorted(maximal, key=natural_key)
    ]


def _parents(scope: str) -> list[str]:
    parts = scope.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def compile_model(
    source: str | Path | onnx.ModelProto | ir.Model,
    options: CompileOptions | None = None,
    progress: Progress | None = None,
) -> CompileResult:
    """Compile a model in memory; verify it unless ``options.verify`` is False.

    Raises VerificationError when the compiled model's outputs differ from the reference's.
    """
    options = options or CompileOptions()
    target = get_target(options.target)
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    say("loading")
    if isinstance(source, (str, Path)):
        source_path: Path | None = Path(source)
        model = load_model(source_path)
    elif isinstance(source, onnx.ModelProto):
        source_path, model = None, ir.from_proto(source)
    else:
        source_path, model = None, source
    plan = None
    if options.profile is not None:
        # Solidify: the profile's always-skipped, harmless paths become options.solidify (the passes remove them).
        from layerzero.runtime.bundle import sha256_file
        from layerzero.solidify_plan import plan_solidify

        plan = plan_solidify(options, sha256_file(source_path) if source_path is not None else None)
        options = dataclasses.replace(options, solidify=plan.subpaths)
    original_proto = ir.to_proto(model) if source_path is None else None
    before = summarize(model, options.flag_pattern)
    consumed = set(before.consumed_flags)
    say("static passes")
    pipeline = run_static_passes(model, options, on_iteration=lambda i: say(f"static passes, iteration {i}"))
    say("dynamic passes")
    changed = run_dynamic_passes(model, options)
    say(f"lowering for {target.name}")
    changed |= lower_for_target(model, options, target)
    if changed:
        bypassed = pipeline.bypassed
        pipeline = run_static_passes(model, options)
        pipeline.bypassed = bypassed + pipeline.bypassed
    after = summarize(model, options.flag_pattern)
    kinds = {b.scope: "declared-flag" for b in pipeline.bypassed}
    kinds.update({s: "consumed-flag" for s in consumed if s not in kinds})
    solidified: list[dict] = []
    if options.solidify:
        from layerzero.solidify_plan import check_all_removed, solidified_records

        solidified = solidified_records(model, plan)
        check_all_removed(options, solidified)
    removed = _removed_scopes(before, after, kinds, [d.path for d in read_dynamic_paths(model)])
    solid_scopes = [scope for r in solidified for scope in r.get("scopes") or []]
    for r in removed:  # a scope that went with a solidified branch or group (and its gate, its Add) was solidified
        if r.kind == "folded" and any(s == r.scope or s.startswith(r.scope + ".") for s in solid_scopes):
            r.kind = "solidified"
    verification = None
    if options.verify:
        say("verifying")
        # What ONNX Runtime runs in place of the compiled graph (TensorRT: the onnxruntime lowering of its MoE nodes).
        checked = target.verification_model(model, options)
        verification = verify_compiled(source_path, original_proto, checked, pipeline, options)
    seconds = time.perf_counter() - start
    return CompileResult(
        model,
        options,
        before,
        after,
        removed,
        pipeline,
        verification,
        seconds,
        solidified=solidified,
        solidify_plan=plan,
    )


def verify_compiled(
    source_path: Path | None,
    original_proto: onnx.ModelProto | None,
    compiled: ir.Model,
    pipeline: PipelineResult,
    options: CompileOptions,
) -> VerificationResult:
    """Compare the compiled model with the reference on sample inputs; raise on a mismatch.

    With declared flags, the reference is the original with exactly those layers bypassed; the
    original's own deviation from it is reported as those layers' measured impact. Solidified paths
    (``options.solidify``) are forced off in the reference the same way (``layerzero.solidify_plan``).
    """
    with tempfile.TemporaryDirectory(prefix="layerzero-verify-") as tmp:
        tmpdir = Path(tmp)
        if source_path is not None:
            header = onnx.load(str(source_path), load_external_data=False)
        else:
            header = original_proto
        feeds = _sample_inputs(header, options)
        chunked = weight_bytes(compiled) > options.chunked_verify_bytes

        def load_original() -> ir.Model:
            return load_model(source_path) if source_path is not None else ir.from_proto(original_proto)

        def run(model: ir.Model | None, name: str) -> tuple[list[str], list[np.ndarray]]:
            # model None: the untouched original, run from its file when there is one.
            if chunked:
                # Large models run a few layers at a time: verification never holds all the weights.
                return run_in_chunks(model or load_original(), feeds, options.chunked_verify_bytes // 2)
            if model is None:
                return run_model(source_path if source_path is not None else original_proto.SerializeToString(), feeds)
            return run_model(_save(model, tmpdir / f"{name}.onnx"), feeds)

        names, out_original = run(None, "original")
        impact = None
        reference_outputs = out_original
        if pipeline.bypassed or needs_dynamic_reference(options) or options.solidify:
            reference = load_original()
            bypass_declared_layers(reference, options)
            if options.solidify:
                from layerzero.solidify_plan import force_off_reference

                force_off_reference(reference, options)  # the solidified paths forced off
            _, reference_outputs = run(reference, "reference")
            del reference
            impact = compare_outputs(names, out_original, reference_outputs, options.atol, options.rtol)
        compiled_names, out_compiled = run(compiled, "compiled")
        user = [i for i, n in enumerate(compiled_names) if not n.startswith((MASK_PREFIX, ROUTER_PREFIX))]
        compiled_names = [compiled_names[i] for i in user]
        out_compiled = [out_compiled[i] for i in user]
        if compiled_names != names:
            raise VerificationError(f"compiled model outputs {compiled_names} differ from the original's {names}")
        outputs = compare_outputs(names, reference_outputs, out_compiled, options.atol, options.rtol)
    if options.zeroing_threshold > 0:
        # Skipping below a threshold changes the output on purpose: report the deviation, fail only
        # above --max-deviation.
        bound = options.max_deviation
        for o in outputs:
            o.passed = bound is None or o.max_abs <= bound
    result = VerificationResult(
        passed=all(o.passed for o in outputs),
        atol=options.atol,
        rtol=options.rtol,
        inputs={k: list(v.shape) for k, v in feeds.items()},
        outputs=outputs,
        impact=impact,
    )
    if not result.passed:
        worst = max(outputs, key=lambda o: o.needed_atol)
        raise VerificationError(
            f"verification failed: output {worst.name!r} differs by max abs {worst.max_abs:.3g} "
            f"(max rel {worst.max_rel:.3g}); it would pass with --atol {worst.needed_atol:.3g} "
            f"at --rtol {options.rtol}",
            result=result,
        )
    return result


def _sample_inputs(header: onnx.ModelProto, options: CompileOptions) -> dict[str, np.ndarray]:
    if options.sample_inputs is None:
        return make_inputs(header, options.shapes, options.seed)
    path = Path(options.sample_inputs)
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{path}: cannot read sample inputs (.npz expected): {exc}") from None


def _save(model: ir.Model, path: Path) -> Path:
    ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1 << 20)
    return path


def compile_file(
    source: str | Path,
    out: str | Path,
    options: CompileOptions | None = None,
    progress: Progress | None = None,
    overwrite: bool = False,
    tensorrt: TensorRTOptions | None = None,
    target_options: Any = None,
) -> CompileResult:
    """Compile ``source`` and write the engine bundle ``out`` atomically (nothing on failure).

    The bundle is written by the target (``options.target``, ``layerzero.targets``) with ``target_options``,
    its own build options: for ``tensorrt`` a ``layerzero.targets.tensorrt.TensorRTOptions`` (``tensorrt=`` is
    the older spelling; default: fp32, profiles from ``options.shapes``), a plan built with TensorRT.
    """
    from layerzero.runtime.bundle import sha256_file

    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve() or source.resolve().is_relative_to(out.resolve()):
        raise InvalidInputError(f"{out}: the output would overwrite the input model {source}")
    if out.exists() and not overwrite:
        raise InvalidInputError(f"{out}: already exists (pass --force to replace it)")
    target = get_target((options or CompileOptions()).target)
    target.check_available()  # before any work: a target whose toolkit is missing cannot build anything
    result = compile_model(source, options, progress)
    target.write_bundle(
        out,
        result,
        source=source,
        sha256=sha256_file(source),
        overwrite=overwrite,
        progress=progress,
        target_options=target_options if target_options is not None else tensorrt,
    )
    return result
