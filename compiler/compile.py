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

from layerzero.chunked import weight_bytes
from layerzero.contract import ACTIVATION_SCALE_INPUT, reserved_name_problem
from layerzero.errors import InvalidInputError, UnsupportedModelError, VerificationError
from layerzero.loader import has_bfloat16, load_model, upcast_bfloat16
from layerzero.options import CompileOptions
from layerzero.passes._dynamic import read_dynamic_paths
from layerzero.pipeline import (
    bypass_declared_layers,
    fuse_decoder,
    fuse_expert_masks,
    fuse_skip_norms,
    lower_for_target,
    native_attention,
    native_linear,
    native_moe_lowering,
    native_router,
    needs_dynamic_reference,
    quantize_weights,
    run_dynamic_passes,
    run_static_passes,
    sparsify_activations,
)
from layerzero.result import CompileResult, PipelineResult, RemovedScope
from layerzero.summary import ModelSummary, natural_key, summarize
from layerzero.targets import get_target
from layerzero.verify import (
    Comparator,
    InputSet,
    OrtRunner,
    OutputComparison,
    Runners,
    VerificationResult,
    compare_outputs,
    input_sets,
    make_inputs,
    merge_comparisons,
    quantization_deviation,
    verification_runners,
)

if TYPE_CHECKING:
    from layerzero.targets.tensorrt import TensorRTOptions

__all__ = ["CompileResult", "RemovedScope", "compile_file", "compile_model", "quantized_dense_reference"]

logger = logging.getLogger(__name__)

#: What a long compile reports as it goes: ``say(message)``, or ``say(message, done=k, total=n)`` for counted work
#: (verification's model runs; a chunked run also names its chunk). The CLI draws it as a bar on a terminal.
Progress = Callable[..., None]


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
    say = progress or (lambda *_a, **_k: None)
    start = time.perf_counter()
    say("loading")
    if isinstance(source, (str, Path)):
        source_path: Path | None = Path(source)
        model = load_model(source_path)
    elif isinstance(source, onnx.ModelProto):
        # A copy: the IR shares the proto's tensors, and renaming a value would rename the caller's initializer.
        copied = onnx.ModelProto()
        copied.CopyFrom(source)
        source_path, model = None, ir.from_proto(copied)
    else:
        source_path, model = None, source
    _check_reserved_names(model)
    if has_bfloat16(model):  # ORT's CPU kernels take no bf16 MatMul: compiled (and verified) as float32, lazily
        logger.info("bfloat16 model: computed in float32 (%d tensors and values upcast)", upcast_bfloat16(model))
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
    activation = None
    if options.activation_sparsity and options.dynamic:
        # --profile with a profile --activations: calibrated from its distributions, else on requests; the
        # requests are where the groups' probes (and --impact-tolerance's deviation) are measured either way.
        from layerzero.activation_calibration import profiled_activations

        profiled = profiled_activations(options.profile) if options.profile is not None else None
        requests, on = _calibration_requests(source_path, original_proto, options)
        label = on if profiled is None else f"the profile {options.profile} (deviation measured on {on})"
        say(f"calibrating activation sparsity {options.activation_sparsity:g} on {label}")
        logger.info("activation sparsity: calibrating on %s", label)
        activation = sparsify_activations(model, options, requests, target.name, profiled=profiled)
        activation["calibration"] = label
        activation["calibration_source"] = "requests" if profiled is None else "profile"
        changed = True
    say(f"lowering for {target.name}")
    changed |= lower_for_target(model, options, target)
    if changed:
        bypassed = pipeline.bypassed
        pipeline = run_static_passes(model, options)
        pipeline.bypassed = bypassed + pipeline.bypassed
    fuse_decoder(model, options)  # a float rewrite for ONNX Runtime's kernels, before the quantization
    if options.quant_bits:
        say(f"quantizing weights ({options.weights})")
    quantizer = quantize_weights(model, options)  # last: what the passes removed is never quantized
    native_linear(model, options)  # --linear-kernel native: MatMulNBits -> QLinear
    native_attention(model, options)  # --linear-kernel native: the attention cores -> Attention
    fuse_expert_masks(model, options)  # activation-sparse experts that stayed float: into the native kernel
    native_router(model, options)  # --linear-kernel native: the routers into their MoE nodes
    fuse_skip_norms(model, options)  # and the residual Add + RMS norm pairs into one ONNX Runtime kernel
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
        verification = verify_compiled(source_path, original_proto, checked, pipeline, options, progress=say)
    if activation is not None and verification is not None:
        # The sparsity's impact: the compiled model's deviation from the dense one (max abs per output).
        activation["deviation"] = {o.name: float(o.max_abs) for o in verification.outputs}
    seconds = time.perf_counter() - start
    quantization = None
    if quantizer is not None:
        quantization = {
            "weights": options.weights,
            "bits": options.quant_bits,
            "block": options.quant_block,
            "symmetric": options.quant_symmetric,
            "accuracy_level": options.quant_accuracy_level,
            "quantized": {kind: len(nodes) for kind, nodes in quantizer.quantized.items()},
            "kept_float": [r.to_json() for r in quantizer.kept],
            "deviation": None if verification is None else verification.quantization,
        }
    return CompileResult(
        model,
        options,
        before,
        after,
        removed,
        pipeline,
        verification,
        seconds,
        backend=target.backend,
        solidified=solidified,
        solidify_plan=plan,
        quantization=quantization,
        activation_sparsity=activation,
    )


def _calibration_requests(
    source_path: Path | None, original_proto: onnx.ModelProto | None, options: CompileOptions
) -> tuple[list[dict[str, np.ndarray]], str]:
    """The requests activation sparsity is calibrated on, and what they are (for the progress and the manifest):
    ``options.activation_calibration`` (.npz: one request; .json: one request or a list of them, name -> a nested
    list or ``{"shape", "values"}``, cast to the model's input types), else the ``--sample-inputs`` .npz, else the
    verification's seeded input sets (``verify.input_sets``)."""
    header = onnx.load(str(source_path), load_external_data=False) if source_path is not None else original_proto
    path = options.activation_calibration
    if path is None:
        if options.sample_inputs is not None:
            return [_sample_inputs(header, options)], f"the sample inputs {options.sample_inputs}"
        sets = input_sets(header, options.shapes, options.seed)
        return [s.feeds for s in sets], f"{len(sets)} seeded sample input sets ({', '.join(s.label for s in sets)})"
    path = Path(path)
    if path.suffix == ".npz":
        try:
            with np.load(path) as data:
                return [{k: np.asarray(data[k]) for k in data.files}], str(path)
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"{path}: cannot read activation calibration inputs (.npz): {exc}") from None
    if path.suffix != ".json":
        raise InvalidInputError(f"{path}: activation calibration inputs must be .npz or .json")
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"{path}: cannot read activation calibration inputs (.json): {exc}") from None
    items = data if isinstance(data, list) else [data]
    types = {
        i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        for i in header.graph.input
        if i.type.HasField("tensor_type")
    }
    requests = []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or not item:
            raise InvalidInputError(f"{path}: request {k} is not an object of input name -> array")
        unknown = sorted(set(item) - set(types))
        if unknown:
            raise InvalidInputError(f"{path}: request {k} names {unknown[0]!r}, which is no input of the model")
        try:
            requests.append({n: _json_array(v, types[n]) for n, v in item.items()})
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidInputError(f"{path}: request {k}: {exc}") from None
    return requests, f"{path} ({len(requests)} requests)"


def _json_array(value: object, dtype: np.dtype) -> np.ndarray:
    """A nested list, or ``{"shape": [...], "values": [...]}`` (flat; an empty dim such as an empty past cache
    cannot be told by nesting)."""
    if isinstance(value, dict):
        return np.asarray(value["values"], dtype=dtype).reshape([int(d) for d in value["shape"]])
    return np.asarray(value, dtype=dtype)


def quantized_dense_reference(
    model: ir.Model, options: CompileOptions, static_zeroing: bool = False, compiled: ir.Model | None = None
) -> ir.Model:
    """The quantized-dense reference, in place: ``model`` (the original, or it with its declared layers bypassed) with
    the compile's weight quantization (``QuantizeWeights``, the same options), nothing skipped. Verification compares
    the compiled model with it; a benchmark compares a quantized bundle's greedy ids with its.

    The compile quantizes its weights after the static zeroing, which can shrink one (a pruned neuron: a zero column
    of gate / up and the matching rows of down go, the down projection's K shrinks and its blocks of ``quant_block``
    fall elsewhere); so the reference is quantized after the same zeroing: ``static_zeroing`` runs the static passes
    first (verification runs them itself, ``_check_statically_zeroed``, and checks the result equal to the float
    reference in float before quantizing: the zeroing and the quantization stay separate, each exact).

    Constants are folded first, as the compile's static passes fold them (a weight computed from a constant, e.g. a
    Transpose of one, is a constant the compiled model quantizes). Its MoE blocks are rewritten into their exact
    form first (``SkipExperts`` at threshold 0: every routed expert computed, as the original does; kept as the
    native op where the compiled model keeps it, so both run the same quantized kernel, else lowered to per-expert
    ``If`` with 2-D MatMuls): a block exported with stacked 3-D expert weights (``batched_mm``, dense
    forms) has no 2-D MatMul the quantization could reach, and the reference would keep those experts float while the
    compiled model holds them quantized. The float rewrite is what every float compile verifies against the original.

    Activation sparsity (issue 23): ``compiled`` (the compiled model verification checks) names the projections it
    holds as ``ai.layerzero::SparseLinear``; their quantized codes are blocks of 32 along K stored input-major and
    the kernel rounds x to int8 its own way (not MatMulNBits' layout or rounding), so the reference holds those
    projections as the same op at thresholds 0 (every nonzero entry kept: the dense product of the same codes and
    int8 x; ``as_dense_sparse_linear``; a group's projections fused into one node where the compile fused them) and
    ``QuantizeWeights`` quantizes them as it quantizes the compiled ones (a projection whose K or N the block does
    not divide stays float in both). The reference then needs
    liblayerzero_ort.so, as the compiled model does. A projection the reference does not have is a
    ``VerificationError``.
    """
    from layerzero.passes import FoldConstants
    from layerzero.passes._moe_node import MoENode, is_moe_node
    from layerzero.passes.lower_moe import LowerMoE
    from layerzero.passes.moe import SkipExperts
    from layerzero.passes.shape_inference import InferShapes

    if static_zeroing:
        run_static_passes(model, options)
    InferShapes()(model)
    FoldConstants(options.fold_max_elements)(model)
    InferShapes()(model)
    if options.dynamic:  # as the compile rewrites them (without dynamic passes both keep the exported form)
        SkipExperts(0.0, quantized_experts=native_moe_lowering(options))(model)
    # Float skipping forms (this one's, or a bisection checkpoint's) lowered to If; a quantized one (a checkpoint
    # already quantized) is left as it is.
    forms = [MoENode.of(n) for g in model.graphs() for n in g if is_moe_node(n)]
    if forms and not any(f.quantized for f in forms):
        InferShapes()(model)
        # A compiled model that keeps the native op runs its q4 / q8 experts in liblayerzero_ort.so's kernels, whose
        # int8 activations are rounded as llama.cpp's are, not as MatMulNBits' (per-expert If): two kernels of the
        # same codes differ by ~1e-3 on a real-size model. So the reference keeps the same op (threshold 0, every
        # routed expert; a block the native op cannot run is lowered to If in both), quantized the same way below.
        native = compiled is not None and any(is_moe_node(n) for g in compiled.graphs() for n in g)
        # Likewise ONNX Runtime's QMoE (the ort-moe lowering, quantized) rounds its int8 activations its own way,
        # not as MatMulNBits in If branches does (measured 1.8e-4 apart, E3 H32 F64 int8): the reference takes
        # the same lowering, which the same quantization makes the same QMoE nodes.
        ort_moe = compiled is not None and any(n.domain == "com.microsoft" and n.op_type in ("MoE", "QMoE")
                                               for g in compiled.graphs() for n in g)  # fmt: skip
        lowering = "native" if native else "ort-moe" if ort_moe else "if"
        LowerMoE(lowering=lowering, enabled=True, native_present=native)(model)
    if compiled is not None:
        from layerzero.passes.quantize_weights import as_dense_sparse_linear, sparse_linear_projections
        from layerzero.passes.rotate_heads import RotateHeads, read_rotations

        # The compile's head rotations (--activation-rotation): quantized after the same rotation, the reference
        # holds the compiled model's codes (a rotated o_proj's blocks are not the rotation of the unrotated ones).
        rotations = read_rotations(compiled)
        if rotations:
            InferShapes()(model)
            RotateHeads(rotations)(model)

        # SparseLinear in the reference already (a source compiled in the native form) is quantized as compiled
        have = sparse_linear_projections(model)
        wanted = {p: s for p, s in sparse_linear_projections(compiled).items() if p not in have}
        missing = sorted(set(wanted) - set(as_dense_sparse_linear(model, wanted)))
        if missing:
            raise VerificationError(
                f"the quantized-dense reference has no MatMul for the compiled model's SparseLinear {missing[0]!r} "
                f"({len(missing)} missing): its codes could not be the compiled model's"
            )
    fuse_decoder(model, options)  # as the compile fuses it: the same float graph under the same codes
    quantize_weights(model, options)
    native_linear(model, options)  # as the compile: the same kernel on the same codes
    native_attention(model, options)  # and the same attention kernel
    native_router(model, options)  # and the routers in the same MoE nodes
    fuse_skip_norms(model, options)  # and the same norm kernels
    return model


#: The scale-0 check's allowance where the model computes in half precision, in units of that type's epsilon: the
#: native sparse form computes a float16 / bfloat16 projection in float32 and rounds once, ONNX Runtime's dense
#: MatMul rounds its own way, so they agree to a few units of the last place (of the output's largest magnitude,
#: whatever type the output is cast to after), not to float32's tolerances.
HALF_ULPS = 8
_HALF_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def _dense_at_0(
    names: list[str], want: list[np.ndarray], got: list[np.ndarray], comparator: Comparator, half_eps: float = 0.0
) -> list[OutputComparison]:
    """The scale-0 run's outputs against the reference's at the compile's tolerances, widened to ``HALF_ULPS`` of
    an epsilon (relative, and absolute at the output's largest magnitude): the output's own for a float16 /
    bfloat16 output, else ``half_eps`` (that of the half-precision inputs of the native groups; 0: none)."""
    out = []
    for name, a, b in zip(names, want, got, strict=True):
        atol, rtol = comparator.atol, comparator.rtol
        a = np.asarray(a)
        eps = max(_HALF_EPS.get(a.dtype.name, 0.0), half_eps)
        if eps > 0 and a.size and (a.dtype.kind == "f" or a.dtype.name in _HALF_EPS):
            finite = np.abs(a.astype(np.float64))
            finite = finite[np.isfinite(finite)]
            atol = max(atol, HALF_ULPS * eps * (float(finite.max()) if finite.size else 0.0))
            rtol = max(rtol, HALF_ULPS * eps)
        out += compare_outputs([name], [a], [b], atol, rtol)
    return out


def verify_compiled(
    source_path: Path | None,
    original_proto: onnx.ModelProto | None,
    compiled: ir.Model,
    pipeline: PipelineResult,
    options: CompileOptions,
    progress: Progress | None = None,
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

    Models run through the verification's runners (``layerzero.verify.verification_runners``: whole models, or
    a few layers at a time above ``chunked_verify_bytes``) and are judged by one ``Comparator``.

    With quantized weights (``options.weights`` int4 / int8) the reference is quantized the same way
    (``quantized_dense_reference``: nothing skipped) after the static passes, so that it holds the compiled model's
    codes also for a weight the zeroing shrank; the static passes' output is first checked equal to the float
    reference in float (``_check_statically_zeroed``), so the comparison above judges the zeroing alone; the
    quantization's own deviation (the float reference against the quantized one, on the same sets:
    ``verify.quantization_deviation``) is reported apart and refused above ``max_quant_deviation`` (exit 2).
    """
    sparsity = float(options.activation_sparsity or 0.0) if options.dynamic else 0.0
    comparator = Comparator(options.atol, options.rtol, options.zeroing_threshold, options.max_deviation, sparsity)
    say = progress or (lambda *_a, **_k: None)
    # Progress: one unit per model run (the original, the reference and the compiled model on each set).
    state = {"what": "", "done": 0, "total": 1}

    def tell(chunk: tuple[int, int] | None = None) -> None:
        where = f", chunk {chunk[0]}/{chunk[1]}" if chunk else ""
        say(f"verifying: {state['what']}{where}", done=state["done"], total=state["total"])

    def running(what: str) -> None:
        state["what"] = what
        tell()

    def load_original() -> ir.Model:
        if source_path is None:
            return ir.from_proto(original_proto)
        model = load_model(source_path)
        if has_bfloat16(model):  # as compile_model loaded it: float32, each weight upcast when read
            upcast_bfloat16(model)
        return model

    with tempfile.TemporaryDirectory(prefix=f"layerzero-verify-{os.getpid()}-") as tmp:
        runner_source, runner_proto = source_path, original_proto
        if source_path is not None:
            header = onnx.load(str(source_path), load_external_data=False)
            if has_bfloat16(load_model(source_path)):  # the graph only: no weight is read
                _upcast_header(header)
                if weight_bytes(compiled) <= options.chunked_verify_bytes:
                    # A small bfloat16 source runs whole in ORT as its float32 form (never the file: ORT's CPU
                    # kernels take no bf16 MatMul); a large one runs chunked, each chunk's weights upcast when lent.
                    runner_source, runner_proto = None, ir.to_proto(load_original())
        else:
            header = original_proto
        runners = verification_runners(
            compiled,
            options.chunked_verify_bytes,
            Path(tmp),
            runner_source,
            runner_proto,
            load_original,
            on_chunk=lambda i, n: tell((i, n)),
        )
        if options.sample_inputs is not None:
            sets = [InputSet(str(options.sample_inputs), _sample_inputs(header, options))]
        else:
            # Big models run a few layers at a time, each set costing a pass over all weights: two sets.
            sets = input_sets(header, options.shapes, options.seed, full=runners.all_input_sets)

        bypassing = bool(pipeline.bypassed or needs_dynamic_reference(options) or options.solidify)
        quantizing = options.quant_bits > 0
        reference_runs = bypassing + 2 * quantizing  # model runs per set besides the original and the compiled one
        state["total"] = len(sets) * (2 + reference_runs)
        # The original on every set; a set it cannot run on is no test of the compiler (the default must run).
        original = runners.original()
        names: list[str] = []
        originals: list[tuple[InputSet, list[np.ndarray]]] = []
        for k, input_set in enumerate(sets):
            running(f"the original on the {input_set.label} inputs")
            try:
                names, outs = original.run(input_set.feeds)
                state["done"] += 1
            except (InvalidInputError, UnsupportedModelError):
                if k == 0:
                    raise
                logger.info("verification: the original cannot run on the %s inputs; set skipped", input_set.label)
                continue
            originals.append((input_set, outs))
        del original
        impact = None
        references: list[list[np.ndarray]] = [outs for _, outs in originals]
        state["total"] = state["done"] + len(originals) * (1 + reference_runs)
        if bypassing:
            reference = load_original()
            bypass_declared_layers(reference, options)
            if options.solidify:
                from layerzero.solidify_plan import force_off_reference

                force_off_reference(reference, options)  # the solidified paths forced off
            run_reference = runners.of(reference, "reference")
            references = []
            for input_set, _ in originals:
                running(f"the reference on the {input_set.label} inputs")
                references.append(run_reference.run(input_set.feeds)[1])
                state["done"] += 1
            del reference, run_reference
            impact = comparator.compare_all(names, originals[0][1], references[0])
        deviation = None
        if quantizing:
            # The zeroing is verified against the quantized-dense model; the quantization's own deviation from the
            # float model (the original, or it bypassed as above) is measured here, apart. The quantized-dense
            # model is the float reference after the static passes (checked equal to it in float first, at the
            # tolerances), quantized by the compile's pass: it holds the bundle's codes for every weight the bundle
            # keeps, also where the static zeroing shrank a weight (a pruned neuron: blocks along the shrunk K).
            reference = load_original()
            if bypassing:
                bypass_declared_layers(reference, options)
                if options.solidify:
                    from layerzero.solidify_plan import force_off_reference

                    force_off_reference(reference, options)
            floats = references
            zeroed_atol = _check_statically_zeroed(reference, options, runners, comparator, originals, names, floats,
                                                   running, state)  # fmt: skip
            quantized_reference = quantized_dense_reference(reference, options, compiled=compiled)
            run_reference = runners.of(quantized_reference, "quantized-reference")
            references = []
            for input_set, _ in originals:
                running(f"the quantized-dense reference on the {input_set.label} inputs")
                ref_names, ref_outputs = Comparator.user_outputs(*run_reference.run(input_set.feeds))
                if ref_names != names:
                    raise VerificationError(f"the quantized-dense reference's outputs {ref_names} are not {names}")
                references.append(ref_outputs)
                state["done"] += 1
            del reference, run_reference, quantized_reference
            deviation = quantization_deviation(names, floats, references)
            deviation["weights"] = options.weights
            deviation["reference"] = QUANTIZED_REFERENCE
            deviation["zeroed_float_needed_atol"] = zeroed_atol
            _check_quant_deviation(deviation, options)
        run_compiled = runners.of(compiled, "compiled")
        per_set: list[list[OutputComparison]] = []
        for (input_set, _), reference_outputs in zip(originals, references):
            running(f"the compiled model on the {input_set.label} inputs")
            try:
                compiled_names, out_compiled = run_compiled.run(input_set.feeds)
                state["done"] += 1
            except (InvalidInputError, UnsupportedModelError) as exc:
                # The original ran on these inputs: the compiler made a model the runtime cannot run.
                culprit = _bisect(load_original, options, input_set, reference_outputs, names, runners, comparator)
                raise VerificationError(
                    f"the compiled model fails in onnxruntime on the {input_set.label} inputs "
                    f"{input_set.shapes()} where the original runs ({exc}); {culprit}"
                ) from None
            per_set.append(comparator.compare(names, reference_outputs, compiled_names, out_compiled))
        dense_at_0 = None
        scaled = any(i.name == ACTIVATION_SCALE_INPUT for i in compiled.graph.inputs)
        if sparsity > 0 and scaled and isinstance(run_compiled, OrtRunner):
            # Scale 0 is the dense model exactly: checked at the tolerances on the first set (a sparse form that
            # is wrong besides the thresholds fails here, not under --max-deviation). Whole-model runs only (the
            # chunked runner feeds each chunk the graph inputs it lists).
            (input_set, _), want = originals[0], references[0]
            running(f"the compiled model at activation scale 0 on the {input_set.label} inputs")
            feeds = {**input_set.feeds, ACTIVATION_SCALE_INPUT: np.array(0.0, np.float32)}
            got_names, got = comparator.user_outputs(*run_compiled.run(feeds))
            if got_names != names:
                raise VerificationError(f"compiled model outputs {got_names} differ from the original's {names}")
            halves = [_HALF_EPS.get(str(p.detail.get("x_dtype")), 0.0) for p in read_dynamic_paths(compiled)
                      if p.kind == "activation" and p.detail.get("form") == "native"]  # fmt: skip
            for o in _dense_at_0(names, want, got, comparator, max(halves, default=0.0)):
                if not o.passed:
                    raise VerificationError(
                        f"verification failed: at {ACTIVATION_SCALE_INPUT} 0 (dense) the compiled model differs "
                        f"from the reference in output {o.name!r} by max abs {o.max_abs:.3g} on the "
                        f"{input_set.label} inputs (a LayerZero bug: the sparse form is wrong besides its thresholds)"
                    )
            dense_at_0 = True
        del run_compiled
        outputs = merge_comparisons(per_set)
    # Skipping below a threshold changes the output on purpose: report the deviation, fail only
    # above --max-deviation.
    comparator.judge(outputs)
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
        quantization=deviation,
        activation_sparsity=sparsity,
        dense_at_scale_0=dense_at_0,
    )
    if not result.passed:
        worst, k = comparator.worst(outputs, per_set)
        failing = originals[k][0]
        culprit = _bisect(load_original, options, failing, references[k], names, runners, comparator)
        raise VerificationError(comparator.mismatch(result, worst, failing, culprit), result=result)
    return result


def _upcast_header(header: onnx.ModelProto) -> onnx.ModelProto:
    """The weightless header of a bfloat16 source, in place: its graph inputs and outputs made float32 as
    ``upcast_bfloat16`` makes them (the verification's inputs are drawn from it)."""
    bf16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    for value in (*header.graph.input, *header.graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type == bf16:
            value.type.tensor_type.elem_type = f32
    return header


#: What the zeroing of a ``--weights int4|int8`` compile is verified against (the manifest's
#: ``quantization.deviation.reference``).
QUANTIZED_REFERENCE = (
    "the float reference after the static passes (verified equal to it in float), quantized by QuantizeWeights "
    "with the compile's options, nothing skipped"
)


def _check_statically_zeroed(
    reference: ir.Model,
    options: CompileOptions,
    runners: Runners,
    comparator: Comparator,
    originals: list[tuple[InputSet, list[np.ndarray]]],
    names: list[str],
    floats: list[list[np.ndarray]],
    running: Callable[[str], None],
    state: dict,
) -> float:
    """The float reference's static zeroing, in place (``run_static_passes``, as the compile runs it first), checked
    against the float reference's outputs on every set at the tolerances (no threshold: the static passes are
    exact); returns the atol it needed. A mismatch is a compiler bug (``VerificationError``)."""
    run_static_passes(reference, options)
    run_zeroed = runners.of(reference, "zeroed-reference")
    needed = 0.0
    for (input_set, _), want in zip(originals, floats):
        running(f"the statically zeroed float reference on the {input_set.label} inputs")
        got_names, got = run_zeroed.run(input_set.feeds)
        state["done"] += 1
        for o in comparator.compare(names, want, got_names, got):
            needed = max(needed, o.needed_atol)
            if not o.passed:
                raise VerificationError(
                    f"verification failed: the float model after the static passes differs from the float "
                    f"reference in output {o.name!r} by max abs {o.max_abs:.3g} (max rel {o.max_rel:.3g}) on the "
                    f"{input_set.label} inputs {input_set.shapes()} (before any quantization: a static pass is "
                    "wrong; compile without --weights to find which)"
                )
    del run_zeroed
    return needed


def _check_quant_deviation(deviation: dict, options: CompileOptions) -> None:
    """``--max-quant-deviation``: a quantization that moves an output further (relative L2) is refused, one line."""
    bound = options.max_quant_deviation
    worst = deviation["worst_rel_l2"]
    if bound is None or worst <= bound:
        return
    name = max(deviation["outputs"], key=lambda n: deviation["outputs"][n]["rel_l2"])
    extra = ""
    if "logits" in deviation:
        lg = deviation["logits"]
        extra = f" (next-token KL mean {lg['next_token_kl_mean']:.3g}, top-1 agreement {lg['top1_agreement']:.3g})"
    raise InvalidInputError(
        f"--weights {options.weights}: the quantization moves output {name!r} by relative L2 {worst:.4g}{extra}, "
        f"above --max-quant-deviation {bound:g}; nothing was written (a larger bound, --weights int8, a smaller "
        "--quant-block or --quant-asymmetric deviate less)"
    )


def _bisect(
    load_original: Callable[[], ir.Model],
    options: CompileOptions,
    input_set: InputSet,
    reference_outputs: list[np.ndarray],
    names: list[str],
    runners: Runners,
    comparator: Comparator,
) -> str:
    """Which pass made the model diverge: a phrase for the error message.

    Re-runs the pipeline (static, dynamic, static again, as ``compile_model``) on a fresh copy of the
    source and checks the model after every pass that changed it (``runners.checkpoint``, judged by
    ``comparator``): the culprit is the first pass after the last checkpoint that agreed with the reference
    (the source itself is a checkpoint; with declared flags it disagrees until FoldZeroFlags has run). A
    checkpoint ORT cannot load or run disagrees. Runners that cannot bisect say why (``bisect_skipped``).
    """
    if runners.bisect_skipped is not None:
        return runners.bisect_skipped
    if options.activation_sparsity and options.dynamic:
        # The passes were checked exact at activation scale 0 (verify_compiled); what is left is the sparsity's.
        return f"the deviation is the activation sparsity's (--activation-sparsity {options.activation_sparsity:g})"

    def agrees(model: ir.Model, quantized: bool = False) -> bool:
        if options.quant_bits and not quantized:  # the reference is quantized: a checkpoint is judged quantized so
            model = quantized_dense_reference(ir.from_proto(ir.to_proto(model)), options)
        try:
            got_names, got = runners.checkpoint(model).run(input_set.feeds)
        except (InvalidInputError, UnsupportedModelError):
            return False
        return comparator.agrees(names, reference_outputs, got_names, got)

    culprit: str | None = None
    model = load_original()
    good = agrees(model)

    def check(name: str, current: ir.Model, quantized: bool = False) -> None:
        nonlocal culprit, good
        if agrees(current, quantized):
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
        fuse_decoder(model, options, after_pass=check)
        # What ONNX Runtime runs in place of the compiled graph (TensorRT: the onnxruntime lowering of its MoE nodes).
        check(f"the {target.name} target's verification model", target.verification_model(model, options))
        if options.quant_bits:  # the compile's own quantization, as the compiled model holds it
            quantize_weights(model, options)
            check(f"QuantizeWeights ({options.weights})", target.verification_model(model, options), quantized=True)
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
