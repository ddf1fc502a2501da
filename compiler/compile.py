"""``compile_model``: load → static passes → verify → engine bundle."""

from __future__ import annotations

import dataclasses
import logging
import os
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
from layerzero.contract import MASK_PREFIX, ROUTER_PREFIX, reserved_name_problem
from layerzero.errors import InvalidInputError, UnsupportedModelError, VerificationError
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
from layerzero.verify import (
    InputSet,
    OutputComparison,
    VerificationResult,
    compare_outputs,
    input_sets,
    make_inputs,
    merge_comparisons,
    pass_hint,
    run_model,
)

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
                "structured_params_removed": self.after.structured_params_removed,
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


def _check_reserved_names(model: ir.Model) -> None:
    """A graph input / output or metadata key that uses a name LayerZero reserves is refused (one line, exit 2)."""
    problem = reserved_name_problem(
        [v.name or "" for v in model.graph.inputs],
        [v.name or "" for v in model.graph.outputs],
        list(model.metadata_props),
    )
    if problem is not None:
        raise InvalidInputError(problem)


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
    _check_reserved_names(model)
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
    """Compare the compiled model with the reference on several input sets; raise on any mismatch.

    With declared flags, the reference is the original with exactly those layers bypassed; the
    original's own deviation from it is reported as those layers' measured impact. Solidified paths
    (``options.solidify``) are forced off in the reference the same way (``layerzero.solidify_plan``).

    The input sets (``layerzero.verify.input_sets``): the default one, every dynamic dim at 1, every
    dynamic dim larger, values around the constants the graph's comparisons split on, each with its own
    seed; all must agree. A set the *original* cannot run on is skipped (the default one must run: that
    is the inputs' fault, exit 2). A compiled model onnxruntime cannot load or run where the original runs
    is a compiler bug (``VerificationError``, exit 1), and so is a mismatch: both name the pass whose
    output first diverges, found by re-running the pipeline on a fresh copy of the source (``_bisect``).
    """
    with tempfile.TemporaryDirectory(prefix=f"layerzero-verify-{os.getpid()}-") as tmp:
        tmpdir = Path(tmp)
        if source_path is not None:
            header = onnx.load(str(source_path), load_external_data=False)
        else:
            header = original_proto
        chunked = weight_bytes(compiled) > options.chunked_verify_bytes
        if options.sample_inputs is not None:
            sets = [InputSet(str(options.sample_inputs), _sample_inputs(header, options))]
        else:
            # Big models run a few layers at a time, each set costing a pass over all weights: two sets.
            sets = input_sets(header, options.shapes, options.seed, full=not chunked)

        def load_original() -> ir.Model:
            return load_model(source_path) if source_path is not None else ir.from_proto(original_proto)

        def run(model: ir.Model | None, name: str, feeds: dict) -> tuple[list[str], list[np.ndarray]]:
            # model None: the untouched original, run from its file when there is one.
            if chunked:
                # Large models run a few layers at a time: verification never holds all the weights.
                return run_in_chunks(model or load_original(), feeds, options.chunked_verify_bytes // 2)
            if model is None:
                return run_model(source_path if source_path is not None else original_proto.SerializeToString(), feeds)
            return run_model(_save(model, tmpdir / f"{name}.onnx"), feeds)

        # The original on every set; a set it cannot run on is no test of the compiler (the default must run).
        names: list[str] = []
        originals: list[tuple[InputSet, list[np.ndarray]]] = []
        for k, input_set in enumerate(sets):
            try:
                names, outs = run(None, "original", input_set.feeds)
            except (InvalidInputError, UnsupportedModelError):
                if k == 0:
                    raise
                logger.info("verification: the original cannot run on the %s inputs; set skipped", input_set.label)
                continue
            originals.append((input_set, outs))
        impact = None
        references: list[list[np.ndarray]] = [outs for _, outs in originals]
        if pipeline.bypassed or needs_dynamic_reference(options) or options.solidify:
            reference = load_original()
            bypass_declared_layers(reference, options)
            if options.solidify:
                from layerzero.solidify_plan import force_off_reference

                force_off_reference(reference, options)  # the solidified paths forced off
            saved = reference if chunked else _save(reference, tmpdir / "reference.onnx")
            references = []
            for input_set, _ in originals:
                if chunked:
                    references.append(run(reference, "reference", input_set.feeds)[1])
                else:
                    references.append(run_model(saved, input_set.feeds)[1])
            del reference
            impact = compare_outputs(names, originals[0][1], references[0], options.atol, options.rtol)
        compiled_path = None if chunked else _save(compiled, tmpdir / "compiled.onnx")
        per_set: list[list[OutputComparison]] = []
        for (input_set, _), reference_outputs in zip(originals, references):
            try:
                if chunked:
                    compiled_names, out_compiled = run_in_chunks(
                        compiled, input_set.feeds, options.chunked_verify_bytes // 2
                    )
                else:
                    compiled_names, out_compiled = run_model(compiled_path, input_set.feeds)
            except (InvalidInputError, UnsupportedModelError) as exc:
                # The original ran on these inputs: the compiler made a model the runtime cannot run.
                culprit = _bisect(load_original, options, input_set, reference_outputs, names, chunked)
                raise VerificationError(
                    f"the compiled model fails in onnxruntime on the {input_set.label} inputs "
                    f"{input_set.shapes()} where the original runs ({exc}); {culprit}"
                ) from None
            user = [i for i, n in enumerate(compiled_names) if not n.startswith((MASK_PREFIX, ROUTER_PREFIX))]
            compiled_names = [compiled_names[i] for i in user]
            out_compiled = [out_compiled[i] for i in user]
            if compiled_names != names:
                raise VerificationError(f"compiled model outputs {compiled_names} differ from the original's {names}")
            per_set.append(compare_outputs(names, reference_outputs, out_compiled, options.atol, options.rtol))
        outputs = merge_comparisons(per_set)
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
        inputs=originals[0][0].shapes(),
        outputs=outputs,
        impact=impact,
        input_sets=[{"label": s.label, "inputs": s.shapes()} for s, _ in originals],
        zeroing_threshold=options.zeroing_threshold,
        max_deviation=options.max_deviation,
    )
    if not result.passed:
        worst = max((o for o in outputs if not o.passed), key=lambda o: (o.needed_atol, o.max_abs))
        k = next(
            (i for i, comps in enumerate(per_set) for o in comps if o.name == worst.name and not o.passed),
            0,
        )
        failing = originals[k][0]
        culprit = _bisect(load_original, options, failing, references[k], names, chunked)
        raise VerificationError(
            f"verification failed: output {worst.name!r} differs by max abs {worst.max_abs:.3g} "
            f"(max rel {worst.max_rel:.3g}) on the {failing.label} inputs {failing.shapes()}; {culprit}; "
            f"{pass_hint(result, worst)}",
            result=result,
        )
    return result


def _bisect(
    load_original: Callable[[], ir.Model],
    options: CompileOptions,
    input_set: InputSet,
    reference_outputs: list[np.ndarray],
    names: list[str],
    chunked: bool,
) -> str:
    """Which pass made the model diverge: a phrase for the error message.

    Re-runs the pipeline (static, dynamic, static again, as ``compile_model``) on a fresh copy of the
    source and checks the model after every pass that changed it: the culprit is the first pass after the
    last checkpoint that agreed with the reference (the source itself is a checkpoint; with declared flags
    it disagrees until FoldZeroFlags has run). A checkpoint ORT cannot load or run disagrees.
    """
    if chunked:
        return "pass bisection skipped (weights over --chunked-verify-bytes)"

    def agrees(model: ir.Model) -> bool:
        try:
            got_names, got = run_model(ir.to_proto(model).SerializeToString(), input_set.feeds)
        except (InvalidInputError, UnsupportedModelError):
            return False
        user = [i for i, n in enumerate(got_names) if not n.startswith((MASK_PREFIX, ROUTER_PREFIX))]
        if [got_names[i] for i in user] != names:
            return False
        comparisons = compare_outputs(names, reference_outputs, [got[i] for i in user], options.atol, options.rtol)
        return all(o.passed for o in comparisons)

    culprit: str | None = None
    model = load_original()
    good = agrees(model)

    def check(name: str, current: ir.Model) -> None:
        nonlocal culprit, good
        if agrees(current):
            good, culprit = True, None
        elif good or culprit is None:
            culprit, good = name, False

    try:
        target = get_target(options.target)
        run_static_passes(model, options, after_pass=check)
        changed = run_dynamic_passes(model, options, after_pass=check)
        changed |= lower_for_target(model, options, target, after_pass=check)
        if changed:
            run_static_passes(model, options, after_pass=check)
        # What ONNX Runtime runs in place of the compiled graph (TensorRT: the onnxruntime lowering of its MoE nodes).
        check(f"the {target.name} target's verification model", target.verification_model(model, options))
    except Exception as exc:  # the re-run itself failed: say so rather than guess
        return f"pass bisection failed ({type(exc).__name__}: {exc})"
    if culprit is None:
        return "no pass's output diverges when the pipeline is re-run"
    return f"first diverging pass: {culprit}"


def _sample_inputs(header: onnx.ModelProto, options: CompileOptions) -> dict[str, np.ndarray]:
    """The default input set: the user's ``.npz`` when given, else ``make_inputs``."""
    if options.sample_inputs is None:
        return make_inputs(header, options.shapes, options.seed)
    path = Path(options.sample_inputs)
    try:
        with np.load(path) as data:
            return {k: np.asarray(data[k]) for k in data.files}
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
