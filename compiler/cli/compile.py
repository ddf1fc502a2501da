"""Compile an ONNX model into an engine bundle, verified against the original.

Runs the static passes (zero flags, constant folding, uniform propagation, dead code) to a
fixpoint, runs the original and the compiled model with onnxruntime on sample inputs, and writes
OUT/ (model.onnx + manifest.json, which records their sha256) atomically. On a verification mismatch
nothing is written and the exit code is 1. Bad input (malformed model, unknown op, missing external data)
exits 2. An existing OUT is replaced only with --force and only when it is a LayerZero bundle; temporary
directories left by killed compiles are removed.

examples:
  layerzero compile model.onnx -o model.lz
  layerzero compile model.onnx -o model.lz --shape input_ids:2,16 --atol 1e-5
  layerzero compile model.onnx -o model.lz --inputs calib.npz
  layerzero compile model.onnx -o model.lz --groups spec.yaml
  layerzero compile moe.onnx -o moe.lz --threshold 0.3 --max-deviation 0.05
  layerzero compile moe.onnx -o moe.lz --device cuda
  layerzero compile model.onnx -o model.lz --target tensorrt --precision fp16 --shape hidden:1,64/32,64/256,64
  layerzero compile moe.onnx -o solid.lz --profile profile.json --stability-window 100 --impact-tolerance 0.01
  layerzero compile model.onnx -o model-int4.lz --weights int4 --max-quant-deviation 0.05

--weights int4|int8 quantizes the weights after the zeroing passes (what is removed is never quantized): dense
MatMuls / Gemms become ONNX Runtime's MatMulNBits (blocks of --quant-block along K, symmetric unless
--quant-asymmetric, --quant-accuracy-level 4: int8 activations), the native MoE op reads q4 / q8 experts (blocks
of 32), the ort-moe lowering writes QMoE. Verification then compares the compiled model with the original quantized
the same way (nothing skipped), at --atol / --rtol, and measures the quantization's own deviation from the float
original on the same inputs (relative L2 per output; next-token KL and top-1 agreement of a causal LM's logits),
printed and recorded in the manifest ("quantization"); above --max-quant-deviation (relative L2) the compile is
refused (exit 2, nothing written).

--profile (written by `layerzero profile` on a bundle of the same model) solidifies: a dynamic path (MoE expert,
gated branch, group) skipped at least --stability-window consecutive requests (--stability-unit tokens: tokens)
whose measured impact (relative L2 change of the output when forced off) is below --impact-tolerance is
removed for good: an expert from its router and weights, a branch or group takes its else path. The manifest
lists what went ("solidified"), verified against the original with those paths forced off.

--activation-sparsity S thresholds each projection's input (per channel, calibrated: TEAL's greedy allocation to
S model-wide) on --activation-calibration requests, or on the distributions a `layerzero profile --activations`
profile given as --profile recorded. With --impact-tolerance T as well, S is a cap: the largest sparsity <= S (on
the greedy path, 0.05 apart, and S) whose measured deviation (the largest relative L2 change of an output from
the dense model on the calibration requests, the unit of solidify's impact) stays <= T; the manifest records the
sparsity chosen, its deviation and each level measured ("activation_sparsity": chosen, impact, curve).

--target tensorrt also lowers the MoE blocks to the LayerZero TensorRT plugin, builds a TensorRT engine
(model.plan, next to the lowered model.onnx) and checks it against onnxruntime; it needs the tensorrt package,
a GPU and the plugin library (`layerzero plugins build`). Its --shape takes NAME:MIN/OPT/MAX, the optimisation
profile; verification runs at OPT.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from layerzero.cli._common import (
    add_device,
    add_flag_pattern,
    add_force,
    add_impact_tolerance,
    add_moe_lowering,
    add_stability_unit,
    add_stability_window,
    check_output_dir,
    console,
    integer,
    number,
    one_line_errors,
    parse_shapes,
    progress,
)
from layerzero.compile import CompileResult, compile_file
from layerzero.errors import InvalidInputError, VerificationError
from layerzero.options import CompileOptions
from layerzero.passes._dynamic import read_dynamic_paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("model", type=Path, help="the .onnx model to compile")
    p.add_argument("-o", "--output", type=Path, required=True, help="the bundle directory to write")
    add_force(p, "replace OUTPUT if it exists")
    p.add_argument("--shape", action="append", metavar="NAME:D0,D1", help="dims of a dynamic input for verification")
    p.add_argument("--inputs", type=Path, metavar="NPZ", help="sample inputs for verification (.npz)")
    p.add_argument("--atol", type=number(0), default=1e-4, help="absolute tolerance (default 1e-4)")
    p.add_argument("--rtol", type=number(0), default=1e-3, help="relative tolerance (default 1e-3)")
    p.add_argument("--seed", type=integer(0, 2**32 - 1), default=0, help="seed of the random sample inputs")
    p.add_argument("--no-verify", action="store_true", help="skip the numerical verification (not recommended)")
    p.add_argument("--no-fuse", action="store_true", help="keep RMSNorm and rotary embeddings unfused (A/B)")
    p.add_argument(
        "--no-assume-finite",
        action="store_true",
        help="do not fold x*0 to 0 (x*0 is NaN when x is NaN or Inf)",
    )
    add_flag_pattern(p)
    p.add_argument(
        "--groups",
        type=Path,
        metavar="SPEC",
        help="group-mask spec (YAML/JSON): groups of scopes a router switches on and off per request",
    )
    p.add_argument(
        "--threshold",
        type=number(0, 1),
        default=0.0,
        metavar="T",
        help="zeroing threshold: skip a routed expert whose weight is below T × the token's largest weight "
        "(default 0: exact); verification then reports the deviation instead of failing on it",
    )
    p.add_argument(
        "--max-deviation",
        type=number(0),
        metavar="D",
        help="with --threshold > 0 or --activation-sparsity: fail verification when an output deviates by more than "
        "D (max abs)",
    )
    add_activation_arguments(p)
    add_moe_lowering(p)
    solid = p.add_argument_group("solidify (--profile)")
    solid.add_argument("--profile", type=Path, metavar="JSON", help="a profile of a bundle of this model")
    add_stability_window(
        solid, "remove paths skipped at least N consecutive requests (or tokens) in the profile (default 100)"
    )
    add_stability_unit(solid, "what --stability-window counts (default requests)")
    add_impact_tolerance(
        solid,
        "... and whose measured impact on the output (relative L2) is below T (default 0.01); "
        "with --activation-sparsity S: the largest sparsity <= S whose deviation is <= T",
    )
    # Given or not: --activation-sparsity searches only when it is given (the default is compile's, marked).
    p.set_defaults(impact_tolerance=_Default(CompileOptions.impact_tolerance))
    add_quant_arguments(p)
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    add_target_arguments(p)


def add_activation_arguments(p: argparse.ArgumentParser) -> None:
    """``--activation-sparsity`` and its calibration (``CompileOptions.activation_*``)."""
    from layerzero.options import ACTIVATION_METHODS, ACTIVATION_ROTATIONS, MAX_ACTIVATION_SPARSITY

    a = p.add_argument_group("activation sparsity (--activation-sparsity)")
    a.add_argument(
        "--activation-sparsity",
        type=number(0, MAX_ACTIVATION_SPARSITY),
        metavar="S",
        help="zero the entries of each projection's input below calibrated per-channel thresholds, S of them "
        "model-wide (parameter-weighted, TEAL's greedy allocation); needs --max-deviation",
    )
    a.add_argument(
        "--activation-calibration",
        type=Path,
        metavar="FILE",
        help="calibration requests (.npz: one; .json: one or a list); default: --inputs, else the seeded sample sets",
    )
    a.add_argument(
        "--activation-method",
        choices=ACTIVATION_METHODS,
        default="wina",
        help="per-channel criterion: wina (|x|·‖W row‖) or magnitude (|x|) (default wina)",
    )
    a.add_argument(
        "--activation-refine",
        type=int,
        default=0,
        metavar="N",
        help="N rounds moving sparsity between groups at the allocation by their measured marginal deviation "
        "(each round ~2 x groups runs of the calibration requests; default 0)",
    )
    a.add_argument(
        "--activation-rotation",
        choices=ACTIVATION_ROTATIONS,
        default="heads",
        help="an exact rotation folded into the weights before the calibration: heads (each attention's value "
        "heads by the PCA of o_proj's input, so fewer entries carry its energy) or none (default heads)",
    )


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    """``--weights`` and its options (``CompileOptions.weights``, ``quant_*``, ``max_quant_deviation``)."""
    from layerzero.options import WEIGHTS

    q = p.add_argument_group("weight quantization (--weights)")
    q.add_argument("--weights", choices=WEIGHTS, default="float", help="weight precision of the bundle (default float)")
    q.add_argument(
        "--quant-block", type=integer(16, 1 << 20), default=32, metavar="N",
        help="block length along K (a power of two >= 16; default 32; the native MoE kernel reads 32 only)",
    )  # fmt: skip
    q.add_argument("--quant-asymmetric", action="store_true", help="blocks with zero points (default symmetric)")
    q.add_argument(
        "--quant-accuracy-level", type=integer(0, 4), default=4, metavar="N",
        help="MatMulNBits' accuracy_level: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 activations (default 4)",
    )  # fmt: skip
    q.add_argument(
        "--linear-kernel", choices=("ort", "native"), default="ort",
        help="dense quantized MatMuls: ONNX Runtime's MatMulNBits (ort, default) or liblayerzero_ort.so's QLinear "
        "(native: symmetric blocks of 32, accuracy level 4; the projections reading one x merged, and each layer's "
        "attention as its Attention op)",
    )  # fmt: skip
    q.add_argument(
        "--max-quant-deviation", type=number(0), metavar="X",
        help="refuse the compile when the quantization moves an output by more than X (relative L2)",
    )  # fmt: skip


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    from layerzero.targets import TARGETS
    from layerzero.targets.tensorrt import PRECISIONS

    p.add_argument("--target", choices=TARGETS, default="onnxruntime", help="what the bundle runs on")
    add_device(
        p,
        "where an onnxruntime bundle runs: cuda lowers MoE to com.microsoft.MoE only (never per-expert If) "
        "and the runtime picks the CUDA provider (pip install 'layerzero[gpu]')",
    )
    trt = p.add_argument_group("--target tensorrt")
    trt.add_argument("--precision", choices=PRECISIONS, default="fp32", help="engine precision (default fp32)")
    trt.add_argument("--workspace-mb", type=integer(1, 2**40), metavar="MB", help="TensorRT builder workspace limit")
    trt.add_argument("--plugin-library", type=Path, metavar="SO", help="liblayerzero_trt.so (default: the built one)")
    trt.add_argument("--no-verify-plan", action="store_true", help="do not run the engine against onnxruntime")


def _shapes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    if getattr(args, "target", "onnxruntime") != "tensorrt":
        if any("/" in item for item in args.shape or []):
            raise InvalidInputError("--shape NAME:MIN/OPT/MAX is for --target tensorrt; give NAME:D0,D1")
        return parse_shapes(args.shape)
    from layerzero.targets.tensorrt import parse_profile_shapes

    return {name: opt for name, (_lo, opt, _hi) in parse_profile_shapes(args.shape).items()}


def tensorrt_options_from(args: argparse.Namespace):
    """The TensorRT build options (``--target tensorrt``), else None."""
    if getattr(args, "target", "onnxruntime") != "tensorrt":
        return None
    from layerzero.targets.tensorrt import TensorRTOptions, parse_profile_shapes

    return TensorRTOptions(
        precision=args.precision,
        profiles=parse_profile_shapes(args.shape),
        workspace_mb=args.workspace_mb,
        plugin_library=args.plugin_library,
        verify=not args.no_verify and not args.no_verify_plan,
    )


class _Default(float):
    """A default that says it is one (``--impact-tolerance`` not given)."""


def options_from(args: argparse.Namespace) -> CompileOptions:
    tolerance = getattr(args, "impact_tolerance", None)
    tolerance = None if tolerance is None or isinstance(tolerance, _Default) else float(tolerance)  # None: not given
    return CompileOptions(
        assume_finite=not args.no_assume_finite,
        flag_pattern=args.flag_pattern,
        groups=args.groups,
        verify=not args.no_verify,
        atol=args.atol,
        rtol=args.rtol,
        seed=args.seed,
        shapes=_shapes(args),
        sample_inputs=args.inputs,
        target=getattr(args, "target", "onnxruntime"),
        device=getattr(args, "device", "cpu"),
        zeroing_threshold=getattr(args, "threshold", 0.0),
        max_deviation=getattr(args, "max_deviation", None),
        moe_lowering=getattr(args, "moe_lowering", "auto"),
        profile=getattr(args, "profile", None),
        stability_window=getattr(args, "stability_window", 100),
        stability_unit=getattr(args, "stability_unit", "requests"),
        impact_tolerance=CompileOptions.impact_tolerance if tolerance is None else tolerance,
        weights=getattr(args, "weights", "float"),
        quant_block=getattr(args, "quant_block", 32),
        quant_symmetric=not getattr(args, "quant_asymmetric", False),
        quant_accuracy_level=getattr(args, "quant_accuracy_level", 4),
        max_quant_deviation=getattr(args, "max_quant_deviation", None),
        linear_kernel=getattr(args, "linear_kernel", "ort"),
        activation_sparsity=getattr(args, "activation_sparsity", None),
        activation_calibration=getattr(args, "activation_calibration", None),
        activation_method=getattr(args, "activation_method", "wina"),
        activation_refine=getattr(args, "activation_refine", 0) if getattr(args, "activation_sparsity", None) else 0,
        activation_rotation=getattr(args, "activation_rotation", "heads"),
        fuse=not getattr(args, "no_fuse", False),
        activation_impact_tolerance=tolerance if getattr(args, "activation_sparsity", None) else None,
    )


def print_result(result: CompileResult) -> None:
    b, a = result.before, result.after
    dynamic = read_dynamic_paths(result.model)
    console.print(f"nodes       {b.nodes:>10,} → {a.nodes:,}")
    if a.nodes > b.nodes and dynamic:
        # A skipping form (per-expert If subgraphs, routing, masks) has more nodes than the dense block it
        # replaces; it runs fewer of them per token. Without this line the count reads as a regression.
        console.print(
            "            more nodes: each dynamic block below is rewritten into a skipping form (routing, "
            "per-path branches, mask outputs) that has more nodes but runs only the routed paths"
        )
    console.print(f"parameters  {b.params:>10,} → {a.params:,}")
    if a.structured_params_removed:
        console.print(f"  structured zeros removed {a.structured_params_removed:>10,} params (pruned neurons / heads)")
    console.print(f"layers      {len(b.layers):>10} total: {layer_counts(result)}")
    for r in result.removed:
        console.print(f"  removed {r.scope:<40} {r.kind:<14} {r.nodes:>5} nodes {r.params:>10,} params")
    for d in dynamic:
        how = f" ({d.detail['lowering']})" if d.detail.get("lowering") else ""
        console.print(
            f"  dynamic {d.path:<40} {d.kind:<14} {len(d.subpaths):>5} paths {sum(d.params):>10,} params{how}"
        )
    print_solidified(result)
    print_quantization(result.quantization)
    print_activation_sparsity(result.activation_sparsity)
    print_verification(result.verification)


def print_activation_sparsity(a: dict | None) -> None:
    """The activation-sparsity allocation: target, realized on the calibration inputs, the groups' levels."""
    if not a:
        return
    console.print(
        f"activation sparsity {a['target']:g} ({a['method']}, {a['form']} form): realized "
        f"{a['realized_on_calibration']:.3f} on {a['calibration']}; {len(a['groups'])} groups, levels "
        f"{min(a['groups'].values(), default=0):.2f}-{max(a['groups'].values(), default=0):.2f}"
    )
    if a.get("impact_tolerance") is not None:
        console.print(
            f"  impact tolerance {a['impact_tolerance']:g}: chose sparsity {a['chosen']:g} (deviation "
            f"{a['impact']:.3g}; measured at {len(a['curve']) - 1} levels)"
        )


def print_quantization(q: dict | None) -> None:
    """What was quantized, and the quantization's own deviation from the float original (apart from the zeroing's
    verification below, which compares against the original quantized the same way)."""
    if q is None:
        return
    form = f"{q['weights']}, blocks of {q['block']}, {'symmetric' if q['symmetric'] else 'with zero points'}"
    counts = q["quantized"]
    done = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "nothing"
    console.print(f"weights     {form}, accuracy level {q['accuracy_level']}: quantized {done}")
    console.print("            (the parameter counts above count stored elements: an int4 byte holds two weights)")
    if q["kept_float"]:
        first = q["kept_float"][0]
        console.print(f"  {len(q['kept_float'])} kept float (e.g. {first['path']}: {first['reason']})")
    d = q.get("deviation")
    if d is None:
        console.print("  quantization deviation not measured (--no-verify)")
        return
    console.print(
        f"  quantization deviation from the float original (on {d['input_sets']} input set(s); not a zeroing error):"
    )
    for name, o in d["outputs"].items():
        console.print(f"  {name:<20} relative L2 {o['rel_l2']:.3g}")
    if "logits" in d:
        lg = d["logits"]
        console.print(
            f"  next token           KL mean {lg['next_token_kl_mean']:.3g} max {lg['next_token_kl_max']:.3g} nats, "
            f"top-1 agreement {lg['top1_agreement']:.3f} of {lg['positions']} positions"
        )


def layer_counts(result: CompileResult) -> str:
    """What was removed, counted: whole layers, layers with a part removed, and the removed scopes (listed)."""
    from layerzero.passes._graph import layer_of

    whole = set(result.zeroed_layers)
    parts = [r.scope for r in result.removed if r.scope not in whole]
    touched = {layer for s in parts if (layer := layer_of(s)) and layer not in whole}
    text = f"{len(whole)} removed whole, {len(touched)} with a part removed"
    n = len(result.removed)
    if n:
        text += f"; {n} scope{'s' if n != 1 else ''} removed (below)"
    return text


def print_solidified(result: CompileResult) -> None:
    plan = result.solidify_plan
    if plan is None and not result.solidified:
        return
    if plan is not None:
        console.print(
            f"solidify    {len(result.solidified)} path(s) removed: skipped ≥ {plan.window} consecutive {plan.unit} "
            f"of {plan.requests} profiled, impact < {plan.tolerance:g}"
        )
    for r in result.solidified:
        stability = r.get("stability") or {}
        impact = (r.get("impact") or {}).get("model")
        impact_text = f"{impact:.3g}" if isinstance(impact, (int, float)) else "?"
        console.print(
            f"  solidified {r['subpath']:<37} {r['kind']:<14} stable {stability.get('requests', '?')} requests, "
            f"impact {impact_text}, {r['params']:,} params"
        )
    for c in plan.kept if plan is not None else []:
        console.print(f"  kept       {c.subpath:<37} {c.kind:<14} {c.reason}")


def print_verification(v) -> None:
    """What was compared with what, by which rule, each output's deviation, and what would make it pass."""
    from layerzero.verify import pass_hint, tolerance_at_least

    if v is None:
        console.print("verification  skipped (--no-verify)")
        return
    if v.passed:
        deviating = v.zeroing_threshold > 0 or v.activation_sparsity > 0
        status = "[green]passed[/green]" if not deviating or v.max_deviation is not None else "reported"
    else:
        status = "[red]FAILED[/red]"
    sets = v.input_sets or [{"inputs": v.inputs}]
    shapes = "; ".join(", ".join(f"{k}{s_}" for k, s_ in s["inputs"].items()) for s in sets)
    console.print(f"verification  {status}: {v.compared}")
    console.print(f"  on {len(sets)} input set(s): {shapes}")
    for o in v.outputs:
        if v.zeroing_threshold > 0 or v.activation_sparsity > 0:
            note = pass_hint(v, o) if not o.passed else f"within --max-deviation ≥ {tolerance_at_least(o.max_abs)}"
        else:
            note = pass_hint(v, o) if not o.passed else f"passes at --atol ≥ {tolerance_at_least(o.needed_atol)}"
        console.print(f"  {o.name:<20} max abs {o.max_abs:.3g}  max rel {o.max_rel:.3g}  {note}")
    print_impact(v.impact)


def print_impact(impact) -> None:
    """What the removed layers contribute: the original (them still computed) vs the reference (them off).

    They were removed on purpose (declared zero flags, groups off, solidified paths), so this difference is
    expected, not a compiler error; max rel is large where the reference is near 0.
    """
    if not impact:
        return
    changed = [o for o in impact if o.max_abs > 0]
    console.print(
        "  what the removed layers contribute (removed on purpose, not a compiler error): the original, "
        "with them still computed, vs the reference above, without them"
    )
    for o in changed:
        console.print(
            f"  {o.name:<20} changes by max abs {o.max_abs:.3g}  max rel {o.max_rel:.3g} "
            "(relative to the reference; large where it is near 0)"
        )
    unchanged = [o.name for o in impact if o.max_abs == 0]
    if unchanged:
        console.print(f"  unchanged by them: {', '.join(unchanged)}")


def check_replaceable_output(path: Path, option: str, source: Path) -> None:
    """Refuse, before the compile, an existing output that ``--force`` would not replace either: ``--force``
    replaces only a bundle LayerZero wrote (or an empty directory), never another file or directory. An output
    that is (or holds) the source model is ``compile_file``'s to refuse, with its own message."""
    from layerzero.runtime.bundle import check_replaceable

    if not os.path.lexists(path):
        return
    out, model = Path(os.path.realpath(path)), Path(os.path.realpath(source))
    if model == out or model.is_relative_to(out):
        return
    try:
        check_replaceable(Path(os.path.abspath(path)))
    except InvalidInputError:
        what = "a directory" if os.path.isdir(path) else "a file"
        raise InvalidInputError(
            f"{option} {path}: exists and is {what} that is not a LayerZero bundle (no valid manifest.json); "
            "--force replaces only a bundle LayerZero wrote: remove it yourself or choose another output path"
        ) from None


def run(args: argparse.Namespace) -> int:
    from layerzero.runtime.bundle import clean_stale_temp_dirs

    check_output_dir(args.output, "-o")  # before the compile, not after minutes of it
    check_replaceable_output(args.output, "-o", args.model)
    clean_stale_temp_dirs(Path(os.path.abspath(args.output)).parent, args.output.name)  # of killed compiles
    options = options_from(args)
    try:
        with progress(f"compiling {args.model}") as say:
            result = compile_file(
                args.model,
                args.output,
                options,
                progress=say,
                overwrite=args.force,
                tensorrt=tensorrt_options_from(args),
            )
    except VerificationError as exc:
        if exc.result is not None:
            print_verification(exc.result)
        raise
    if args.json:
        console.print_json(json.dumps(result.manifest(args.model, None)))
    else:
        print_result(result)
        console.print(f"wrote {args.output}/ in {result.seconds:.2f} s")
    return 0
