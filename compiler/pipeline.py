"""Which passes run, in what order: the static passes to a bounded fixpoint."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import onnx_ir as ir

from layerzero.errors import CompilerError, LayerZeroError
from layerzero.groups import GroupMasksFromFile
from layerzero.options import CompileOptions
from layerzero.passes import (
    BypassedLayer,
    FoldConstants,
    FoldZeroFlags,
    PropagateUniforms,
    RemoveDeadCode,
    SimplifyConcatSplit,
)
from layerzero.passes._graph import node_subgraphs, read_round_trip_sources
from layerzero.passes.fuse_decoder import FuseDecoder
from layerzero.passes.gated_branches import SkipGatedBranches
from layerzero.passes.moe import SkipExperts
from layerzero.passes.quantize_weights import QuantizeWeights
from layerzero.passes.shape_inference import InferShapes
from layerzero.passes.solidify_paths import DropExperts, RemoveSkippedBranches
from layerzero.passes.structured_zeros import RemoveStructuredZeros
from layerzero.result import PipelineResult

if TYPE_CHECKING:
    from layerzero.targets.base import Target

__all__ = [
    "DYNAMIC_PASSES",
    "DynamicPass",
    "PipelineResult",
    "bypass_declared_layers",
    "fuse_decoder",
    "fuse_expert_masks",
    "fuse_skip_norms",
    "lower_for_target",
    "native_attention",
    "native_router",
    "needs_dynamic_reference",
    "quantize_weights",
    "run_dynamic_passes",
    "run_static_passes",
    "sparsify_activations",
]

logger = logging.getLogger(__name__)


class _Iteration(ir.passes.InPlacePass):
    """One iteration of the static fixpoint: shape inference, then each pass in order.

    ``modified`` when a pass changed the model (new shapes alone do not count); ``modified_by`` counts, per pass
    name, the iterations in which it did.
    """

    def __init__(
        self,
        passes: list[ir.passes.PassBase],
        on_iteration: Callable[[int], None] | None,
        after_pass: Callable[[str, ir.Model], None] | None = None,
    ) -> None:
        super().__init__()
        self.passes = passes
        self.on_iteration = on_iteration
        self.after_pass = after_pass
        self.modified_by = {type(p).__name__: 0 for p in passes}
        self.count = 0
        self.last_modified = False

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.count += 1
        InferShapes()(model)
        changed = False
        for p in self.passes:
            if run_pass(p, model).modified:
                self.modified_by[type(p).__name__] += 1
                changed = True
                if self.after_pass is not None:
                    self.after_pass(f"{type(p).__name__} (static iteration {self.count})", model)
        if self.on_iteration is not None:
            self.on_iteration(self.count)
        self.last_modified = changed
        return ir.passes.PassResult(model, modified=changed)


def run_static_passes(
    model: ir.Model,
    options: CompileOptions,
    on_iteration: Callable[[int], None] | None = None,
    after_pass: Callable[[str, ir.Model], None] | None = None,
) -> PipelineResult:
    """flags → constants → uniforms → DCE, repeated until no pass changes the model (onnx-ir's ``PassManager``:
    at most ``options.max_iterations`` steps, early stop on ``modified``).

    ``after_pass(name, model)`` is called after each pass that changed the model (verification's bisect).
    """
    flags = FoldZeroFlags(options.flag_pattern)
    passes: list[ir.passes.PassBase] = [
        flags,
        FoldConstants(options.fold_max_elements),
        PropagateUniforms(options.assume_finite),
        SimplifyConcatSplit(),
        RemoveStructuredZeros(options.assume_finite),
        RemoveDeadCode(),
    ]
    iteration = _Iteration(passes, on_iteration, after_pass)
    manager = ir.passes.PassManager([iteration], steps=options.max_iterations, early_stop=True)
    try:
        manager(model)
    except ir.passes.PassError as exc:
        # PassManager wraps what a pass raised; our errors (a scope that is not a layer, ...) go out as they are.
        ours = _our_error(exc)
        if ours is None:
            raise
        raise ours from None
    converged = not iteration.last_modified
    if not converged:
        logger.warning("static passes did not reach a fixpoint in %d iterations", options.max_iterations)
    sidestep_round_trips(model)
    return PipelineResult(iteration.count, converged, iteration.modified_by, list(flags.bypassed))


def sidestep_round_trips(model: ir.Model) -> bool:
    """Every node with subgraphs (``If``, ``Loop``, ``Scan``; the model's own too) reads the source of a lossless
    Cast round trip rather than its result (``read_round_trip_sources``: the same value).

    onnxruntime 1.32 removes such a round trip and rewires the main graph's readers only, so a subgraph reading the
    result fails with "Missing Input". Whether it fires depends on what feeds the round trip:
    ``Cast(Cast(Expand(x, Shape(x))))`` ran, and once the static passes made it ``Cast(Cast(x))`` the model's own
    ``If`` could not. Runs after the static passes (the last thing a compile does); returns whether anything changed.
    """
    changed = False
    for graph in list(model.graphs()):
        for node in list(graph):
            if node_subgraphs(node):
                changed |= read_round_trip_sources(node)
    return changed


def run_pass(p: ir.passes.PassBase, model: ir.Model) -> ir.passes.PassResult:
    """Run one pass; an exception that is not one of ours is a compiler bug, reported as ``CompilerError``
    naming the pass (one line, exit 1), never a traceback blamed on the model."""
    try:
        return p(model)
    except Exception as exc:
        ours = _our_error(exc)
        if ours is not None:
            raise ours from None
        cause = exc
        while isinstance(cause, ir.passes.PassError) and cause.__cause__ is not None:
            cause = cause.__cause__
        first = (str(cause).strip().splitlines() or [""])[0]
        raise CompilerError(
            f"internal error in pass {type(p).__name__}: {type(cause).__name__}: {first} "
            "(a LayerZero bug: please report it with the model; nothing was written)"
        ) from exc


def _our_error(exc: BaseException) -> LayerZeroError | None:
    """The ``LayerZeroError`` that ``exc`` (onnx-ir's ``PassError``) wraps, if any."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, LayerZeroError):
            return cause
        cause = cause.__cause__
    return None


def bypass_declared_layers(model: ir.Model, options: CompileOptions) -> list[BypassedLayer]:
    """The verification reference for declared flags: only those layers bypassed, nothing else.

    With a group spec (``options.groups``), each group's layers are also bypassed where its router
    says so, computed densely (``Where``), since skipping them changes the output on purpose.
    """
    InferShapes()(model)
    flags = FoldZeroFlags(options.flag_pattern)
    flags(model)
    RemoveDeadCode()(model)
    if needs_dynamic_reference(options):
        from layerzero.groups import apply_group_reference

        InferShapes()(model)
        apply_group_reference(model, options)
    return list(flags.bypassed)


def needs_dynamic_reference(options: CompileOptions) -> bool:
    """Whether verification compares against a reference built by ``bypass_declared_layers``."""
    return options.dynamic and options.groups is not None


@dataclasses.dataclass(frozen=True)
class DynamicPass:
    """One dynamic pass of the pipeline: its class and how it is built from the options (the typed values the
    pass takes: a threshold, the subpaths to solidify, ...)."""

    cls: type[ir.passes.PassBase]
    build: Callable[[CompileOptions], ir.passes.PassBase]


# Dynamic passes: each built from the options by its ``build`` and run once, in order, after the static fixpoint. A
# pass records what it made dynamic with ``layerzero.passes._dynamic.record_dynamic_path``; the target then lowers
# the skipping forms (``lower_for_target``) and the static passes run once more to clean up. A new dynamic pass is
# one entry here.
DYNAMIC_PASSES: list[DynamicPass] = [
    # Group masks first: a group's scopes must still be plain layers (no other pass's mask inside).
    # The spec is read here, in the compiler (passes know no file system).
    DynamicPass(GroupMasksFromFile, GroupMasksFromFile),
    # MoE: rewrite each block into the skipping form ai.layerzero::MoE (each target lowers it afterwards).
    DynamicPass(SkipExperts, lambda o: SkipExperts(o.zeroing_threshold, quantized_experts=native_moe_lowering(o))),
    # Solidify (options.solidify, from a profile): drop experts from the skipping form, before lowering.
    DynamicPass(DropExperts, lambda o: DropExperts(frozenset(o.solidify or ()))),
    # Gated branches last: an MoE's weighted expert sum looks like x + g * f(x) too (here it is one MoE node).
    DynamicPass(SkipGatedBranches, lambda o: SkipGatedBranches(o.zeroing_threshold)),
    # Solidify: gates and groups always skipped take their else path (constant folding inlines it).
    DynamicPass(RemoveSkippedBranches, lambda o: RemoveSkippedBranches(frozenset(o.solidify or ()))),
]


def run_dynamic_passes(
    model: ir.Model, options: CompileOptions, after_pass: Callable[[str, ir.Model], None] | None = None
) -> bool:
    """Run the registered dynamic passes; returns whether any changed the model (``after_pass``: as above)."""
    if not options.dynamic:
        return False
    modified = False
    stale = True
    for step in DYNAMIC_PASSES:
        if stale:  # shapes are current until a pass changes the model (inference is most of a small compile)
            InferShapes()(model)
        changed = run_pass(step.build(options), model).modified
        stale = changed
        modified |= changed
        if changed and after_pass is not None:
            after_pass(step.cls.__name__, model)
    return modified


def quantize_weights(
    model: ir.Model, options: CompileOptions, after_pass: Callable[[str, ir.Model], None] | None = None
) -> QuantizeWeights | None:
    """``--weights int4|int8``: ``QuantizeWeights`` on the compiled model, after the zeroing passes and the
    lowering (what is removed is never quantized); the verification's quantized-dense reference gets the same
    pass. Returns the pass (what it quantized and kept), None for float weights."""
    if options.quant_bits == 0:
        return None
    InferShapes()(model)  # the pass reads the activations' dtypes and ranks
    step = QuantizeWeights(
        options.quant_bits, options.quant_block, options.quant_symmetric, options.quant_accuracy_level
    )
    if run_pass(step, model).modified and after_pass is not None:
        after_pass(f"QuantizeWeights ({options.weights})", model)
    return step


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A warning a compile would otherwise give twice (the compile's pass and its quantized-dense reference's)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def native_linear(model: ir.Model, options: CompileOptions) -> list[str]:
    """``--linear-kernel native``: the dense MatMulNBits into liblayerzero_ort.so's ``QLinear`` (``NativeLinear``), for
    the onnxruntime CPU target when the library is built, after ``quantize_weights`` (the compile's and the
    quantized-dense reference's alike). Returns the rewritten nodes' names."""
    if options.quant_bits == 0 or options.linear_kernel != "native":
        return []
    if options.target != "onnxruntime" or options.device != "cpu":
        return []
    from layerzero.passes.native_linear import NativeLinear
    from layerzero.plugins.ort_library import find_ort_library

    if find_ort_library() is None:
        _warn_once("--linear-kernel native: liblayerzero_ort.so is not built (`layerzero plugins build`, or "
                   "LAYERZERO_PLUGIN_DIR): the dense MatMuls stay ONNX Runtime's MatMulNBits")  # fmt: skip
        return []
    step = NativeLinear()
    if run_pass(step, model).modified:
        RemoveDeadCode()(model)
    if step.kept:  # said, not silent: the user asked for the native kernel
        name, why = step.kept[0]
        _warn_once(f"--linear-kernel native: {len(step.kept)} of {len(step.kept) + len(step.rewritten)} quantized "
                   f"MatMuls stay ONNX Runtime's MatMulNBits (the first, {name!r}: {why})")  # fmt: skip
    return list(step.rewritten)


def _native_fusions(options: CompileOptions) -> bool:
    """Whether ``--linear-kernel native``'s fusions beyond the linears run: quantized weights, ``fuse`` on, the
    onnxruntime CPU target, liblayerzero_ort.so built."""
    if options.quant_bits == 0 or options.linear_kernel != "native" or not options.fuse:
        return False
    if options.target != "onnxruntime" or options.device != "cpu":
        return False
    from layerzero.plugins.ort_library import find_ort_library

    return find_ort_library() is not None


def native_attention(model: ir.Model, options: CompileOptions) -> list[str]:
    """``--linear-kernel native``: each decoder layer's attention core into liblayerzero_ort.so's ``Attention``
    (``NativeAttention``), under the same conditions as ``native_linear`` and ``options.fuse`` (the compile's and the
    quantized-dense reference's alike). Returns the new nodes' names."""
    if not _native_fusions(options):
        return []
    from layerzero.passes.native_attention import NativeAttention

    InferShapes()(model)  # the matcher reads ranks and static head counts
    step = NativeAttention()
    run_pass(step, model)
    return list(step.fused)


def native_router(model: ir.Model, options: CompileOptions) -> list[str]:
    """``--linear-kernel native``: each native MoE node computes its own router logits and confidence
    (``NativeRouter``), under the same conditions as ``native_attention`` (the compile's and the quantized-dense
    reference's alike). Returns the paths of the blocks rewritten."""
    if not _native_fusions(options):
        return []
    from layerzero.passes.native_router import NativeRouter

    InferShapes()(model)  # the output view's shape is proved against the block's input
    step = NativeRouter()
    run_pass(step, model)
    return list(step.fused)


def fuse_skip_norms(model: ir.Model, options: CompileOptions) -> list[str]:
    """``--linear-kernel native``: each residual Add and the RMS norm after it into ONNX Runtime's
    SkipSimplifiedLayerNormalization (``FuseSkipNorm``), under the same conditions as ``native_attention`` (the
    compile's and the quantized-dense reference's alike). Returns the new nodes' names."""
    if not _native_fusions(options):
        return []
    from layerzero.passes.skip_norm import FuseSkipNorm

    InferShapes()(model)  # the Add's two inputs are proved of one shape
    step = FuseSkipNorm()
    run_pass(step, model)
    return list(step.fused)


def fuse_expert_masks(
    model: ir.Model, options: CompileOptions, after_pass: Callable[[str, ir.Model], None] | None = None
) -> list[str]:
    """Activation-sparse MoE experts into liblayerzero_ort.so's kernel (``FuseExpertActivationMask``): with
    ``--activation-sparsity`` for the onnxruntime CPU target when the library is built, after the quantization (so
    only experts that stayed float). Returns the mask outputs it fused."""
    if not options.activation_sparsity or not options.dynamic:
        return []
    if options.target != "onnxruntime" or options.device != "cpu":
        return []
    from layerzero.passes.sparsify_experts import FuseExpertActivationMask
    from layerzero.plugins.ort_library import find_ort_library

    if find_ort_library() is None:
        return []
    step = FuseExpertActivationMask()
    if run_pass(step, model).modified and after_pass is not None:
        after_pass("FuseExpertActivationMask", model)
    return list(step.fused)


def fuse_decoder(
    model: ir.Model, options: CompileOptions, after_pass: Callable[[str, ir.Model], None] | None = None
) -> FuseDecoder | None:
    """RMSNorm and rotary embeddings into ONNX Runtime's fused kernels (``FuseDecoder``), for the onnxruntime target
    on the CPU (the CUDA kernels are not tested yet) unless ``options.fuse`` is off: after the lowering and the static
    passes, before ``quantize_weights`` (the quantized-dense reference gets it too). Returns the pass (what it fused
    and refused), None when it did not run."""
    if not options.fuse or options.target != "onnxruntime" or options.device != "cpu":
        return None
    InferShapes()(model)  # the matcher reads dtypes, ranks and the last dims
    step = FuseDecoder()
    if run_pass(step, model).modified and after_pass is not None:
        after_pass("FuseDecoder", model)
    return step


def lower_for_target(
    model: ir.Model,
    options: CompileOptions,
    target: Target,
    after_pass: Callable[[str, ir.Model], None] | None = None,
) -> bool:
    """The target's lowering of the skipping forms (``Target.lower``); returns whether it changed the model."""
    InferShapes()(model)  # lowerings read dtypes and shapes
    changed = target.lower(model, options)
    if changed and after_pass is not None:
        after_pass(f"{target.name} lowering", model)
    return changed


def sparsify_activations(
    model: ir.Model,
    options: CompileOptions,
    requests: list[dict],
    target: str = "onnxruntime",
    after_pass: Callable[[str, ir.Model], None] | None = None,
    profiled: dict | None = None,
) -> dict | None:
    """``--activation-sparsity S``: calibrate on ``requests`` (``activation_calibration.collect_activations``), or
    from ``profiled`` (a profile's ``"activations"``, ``activation_calibration.profiled_groups``) when given, TEAL's
    greedy allocation to ``S`` (``options.activation_method``'s per-channel criterion), then ``SparsifyActivations``
    with those thresholds: the native form (``ai.layerzero::SparseLinear``) when liblayerzero_ort.so is built and the
    bundle runs on ONNX Runtime's CPU, else the reference form. Runs after the dynamic passes, before the lowering.

    Returns the manifest's ``activation_sparsity`` record (target, the sparsity realized on the calibration inputs,
    method, form, each group's level, the calibration curve), None without activation sparsity.

    Raises:
        InvalidInputError: the model has no projection group (no float MatMul with a constant weight in a layer), or
            no calibration request ran.
    """
    if not options.activation_sparsity or not options.dynamic:
        return None
    from layerzero.activation_calibration import profiled_groups
    from layerzero.errors import InvalidInputError
    from layerzero.passes._graph import scope_of
    from layerzero.passes.quantize_weights import unreadable_format
    from layerzero.passes.sparsify_activations import find_groups, group_refusal, quantized_moe_nodes, record_refusals

    if options.quant_bits and _native_activation_form(options, target):
        # Said before the calibration (minutes on a real model), not by the quantization after it.
        kernel = "--activation-sparsity compiles to the SparseLinear kernel (liblayerzero_ort.so), which"
        refusal = unreadable_format(options.quant_block, options.quant_symmetric, kernel, "no activation sparsity")
        if refusal is not None:
            raise refusal

    InferShapes()(model)
    groups = find_groups(model)
    # A group the pass cannot rewrite in either form (its input's rank unknown: a model without value_info past an
    # op onnx cannot infer) is neither calibrated nor allocated: recorded as refused here, as the pass would.
    unknown = [r for r in (group_refusal(g, native=False) for g in groups) if r is not None]
    record_refusals(model, unknown)
    refused = {r.path for r in unknown}
    groups = [g for g in groups if g.name not in refused]
    quantized_experts = [g for g in groups if g.experts] if options.quant_bits else []
    if quantized_experts:
        # Quantized experts keep the dense kernel (the input-major layout is float only): a sparsified expert group
        # would cost accuracy and save nothing, so the allocation never sees one.
        groups = [g for g in groups if not g.experts]
    if not groups:
        where = f"--activation-sparsity {options.activation_sparsity:g}"
        if quantized_experts:
            raise InvalidInputError(
                f"{where} with --weights {options.weights}: the model's only projection groups are MoE experts "
                f"({len(quantized_experts)}, the first {quantized_experts[0].name!r}), and quantized experts keep the "
                "dense kernel (the sparse kernels' input-major layout is float), so nothing to sparsify; compile "
                "the experts activation-sparse with float weights, or without --activation-sparsity"
            )
        given = quantized_moe_nodes(model)  # quantized in the model itself (QMoE), not by --weights
        if given:
            first = given[0]
            raise InvalidInputError(
                f"{where}: the model's only projection groups would be MoE experts, and its {len(given)} MoE "
                f"block(s) hold quantized experts (the first {scope_of(first) or first.name!r}, {first.op_type}), "
                "which keep the dense kernel (the sparse kernels' input-major layout is float), so nothing to "
                "sparsify; a MoE router is never thresholded"
            )
        if unknown:
            raise InvalidInputError(
                f"{where}: the input rank of every projection group is unknown ({len(unknown)}, the first "
                f"{unknown[0].path!r}); give the model its value_info shapes, or export it with them"
            )
        raise InvalidInputError(
            f"{where}: the model has no float MatMul with a constant 2-D weight inside a layer (model.layers.<i>...), "
            "so nothing to sparsify"
        )
    rotation = None
    if profiled is not None:  # recorded on the unrotated model: no rotation
        samples = profiled_groups(groups, profiled, f"--profile {options.profile}")
        rows = max((g.rows for g in samples), default=0)
    else:
        samples, rows, groups, rotation = _calibrate_on(model, groups, requests, options.activation_rotation)
    experts = {g.name for g in groups if g.experts}
    record = _sparsify(model, options, samples, rows, target, after_pass, requests, experts)
    record["refused"] = [r.to_json() for r in unknown] + record["refused"]
    record["rotation"] = rotation
    return record


def native_moe_lowering(options: CompileOptions) -> bool:
    """Whether the MoE blocks of this compile may be lowered to liblayerzero_ort.so's native kernel (the only
    lowering that runs quantized experts): a bundle for ONNX Runtime's CPU, ``moe_lowering`` auto or native, the
    library built. A block the kernel cannot run still falls back (``lower_moe``)."""
    if options.target != "onnxruntime" or options.device != "cpu" or options.moe_lowering not in ("auto", "native"):
        return False
    from layerzero.plugins.ort_library import find_ort_library

    return find_ort_library() is not None


def _native_activation_form(options: CompileOptions, target: str) -> bool:
    """Whether ``SparsifyActivations`` writes its native form (``ai.layerzero::SparseLinear``): a bundle for ONNX
    Runtime's CPU with liblayerzero_ort.so built."""
    if target != "onnxruntime" or options.device != "cpu":
        return False
    from layerzero.plugins.ort_library import find_ort_library

    return find_ort_library() is not None


def _calibrate_on(
    model: ir.Model, groups: list, requests: list[dict], rotation: str = "none"
) -> tuple[list, int, list, dict | None]:
    """``--activation-sparsity``'s own calibration: the groups' inputs on ``requests`` (after ``rotation``, folded
    into ``model`` here: ``activation_rotation.rotate_heads``), their row count, the groups (found again after a
    rotation) and the rotation's manifest record (None: none asked for)."""
    from layerzero.activation_calibration import collect_activations, group_samples
    from layerzero.errors import InvalidInputError

    def collect(groups: list) -> dict:
        try:
            return collect_activations(model, groups, requests)
        except LayerZeroError:
            raise
        except Exception as exc:  # ONNX Runtime refusing the feeds: the calibration inputs' fault, in one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InvalidInputError(
                f"--activation-sparsity: the calibration inputs do not run on the model: {first}"
            ) from None

    activations = collect(groups)
    record = None
    if rotation == "heads" and activations:
        from layerzero.activation_rotation import rotate_heads

        groups, activations, record = rotate_heads(model, groups, activations, collect)
    samples = group_samples(groups, activations)
    if not samples:
        raise InvalidInputError("--activation-sparsity: the calibration inputs gave no activations")
    return samples, int(max((len(v) for v in activations.values()), default=0)), groups, record


#: The lowest level at which a MoE block's experts are sparsified: below it liblayerzero_ort.so's input-major float
#: kernel reads the kept rows slower than the dense kernel reads them all (bench/moe_sparse.py, E64 k8 H1024
#: F512, 1 token, quiet: dense / sparse 0.76 at 0, 0.97 at 0.3, 1.18 at 0.5), so such a group stays dense.
EXPERT_MIN_LEVEL = 0.4


def _sparsify(model: ir.Model, options: CompileOptions, samples: list, rows: int, target: str,
              after_pass: Callable[[str, ir.Model], None] | None, requests: list[dict],
              experts: set[str] = frozenset()) -> dict:  # fmt: skip
    """Allocate on the calibrated ``samples`` (greedy to S; with ``activation_impact_tolerance`` T the largest
    sparsity <= S whose deviation, measured on ``requests``, is <= T) and run ``SparsifyActivations``; the
    manifest's record."""
    from layerzero.activation_calibration import (
        PROBE_LEVELS,
        greedy,
        max_error,
        probe_sensitivity,
        refine,
    )
    from layerzero.activation_runs import cached_output_deviation
    from layerzero.passes.sparsify_activations import SparsifyActivations

    tolerance = options.activation_impact_tolerance
    method = options.activation_method
    # The greedy's errors in the model output's unit: each group probed alone at PROBE_LEVELS on the requests
    # (bench/sparsity.py's allocation; without requests, the projections' own errors). Deviations measured before
    # on the same model and requests come from the probe cache (activation_runs.ProbeCache).
    evaluate, cache = cached_output_deviation(model, requests) if requests else (None, None)
    sensitivity = None if evaluate is None else probe_sensitivity(samples, evaluate, PROBE_LEVELS, method)
    if tolerance is None:
        alloc = greedy(samples, options.activation_sparsity, method, sensitivity)
    else:
        alloc = max_error(samples, tolerance, evaluate, method, sensitivity, cap=options.activation_sparsity)
    if options.activation_refine and evaluate is not None:  # only moves that lower the measured deviation
        alloc = refine(samples, alloc, evaluate, method, rounds=options.activation_refine)
    native = _native_activation_form(options, target)
    # Expert groups the allocation put below EXPERT_MIN_LEVEL stay dense (their level 0, the realized sparsity
    # counted again without them): slower sparse than dense, and less accurate.
    dense_experts = sorted(n for n in experts if 0 < alloc.levels.get(n, 0.0) < EXPERT_MIN_LEVEL)
    if dense_experts:
        thresholds = {n: t for n, t in alloc.thresholds.items() if n not in dense_experts}
        total = sum(g.params for g in samples) or 1
        realized = sum(g.params * g.realized(thresholds[g.name], method) for g in samples if g.name in thresholds)
        alloc = dataclasses.replace(
            alloc,
            thresholds=thresholds,
            sparsity=float(realized / total),
            levels={n: (0.0 if n in dense_experts else v) for n, v in alloc.levels.items()},
        )
    step = SparsifyActivations(alloc.thresholds, native=native)
    if run_pass(step, model).modified and after_pass is not None:
        after_pass("SparsifyActivations", model)
    return {
        "target": float(options.activation_sparsity),
        "realized_on_calibration": float(alloc.sparsity),
        "method": options.activation_method,
        "allocation": alloc.method,
        "form": "native" if native else "reference",
        "calibration_rows": int(rows),
        "probes": None if sensitivity is None else list(PROBE_LEVELS),
        "probe_cache": None if cache is None else {"measured": cache.misses, "cached": cache.hits},
        "groups": {name: float(level) for name, level in alloc.levels.items()},
        "curve": [[float(a), float(b)] for a, b in alloc.curve],
        "refused": [r.to_json() for r in step.refused],
        "experts_kept_dense": dense_experts,
        "refine": None if alloc.trace is None else {"rounds": int(options.activation_refine), "deviation": alloc.trace},
        **(
            {}
            if tolerance is None
            else {
                "impact_tolerance": float(tolerance),
                "chosen": float(alloc.chosen),
                "impact": float(alloc.deviation),
            }
        ),
    }
