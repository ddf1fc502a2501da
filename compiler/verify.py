"""Numerical verification: run the reference and the compiled model with ORT and compare outputs.

Two pieces, as in Polygraphy: *runners*, which run one model on feeds (``Runner.run(feeds) -> (names,
outputs)``: ``OrtRunner``, the whole model in one session; ``layerzero.chunked.ChunkedRunner``, a few layers at
a time), made for a verification by one ``Runners`` (``verification_runners`` picks ``WholeModelRunners`` or
``ChunkedRunners`` from the compiled model's weights), and the ``Comparator``, which decides which outputs are
compared (the user's: ``contract.is_runtime_output`` ones are left out), with which tolerances, and words the
failure. ``compile.verify_compiled`` and its per-pass bisection use the two and never ask how a model is run.
"""

from __future__ import annotations

import abc
import dataclasses
import decimal
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import onnx_ir as ir

from layerzero.chunked import ChunkedRunner, weight_bytes
from layerzero.contract import ACTIVATION_SCALE_INPUT, THRESHOLD_INPUT, is_runtime_output
from layerzero.errors import InvalidInputError, LayerZeroError, UnsupportedModelError, VerificationError

__all__ = [
    "ChunkedRunners",
    "Comparator",
    "InputSet",
    "OrtRunner",
    "OutputComparison",
    "Runner",
    "Runners",
    "VerificationResult",
    "WholeModelRunners",
    "compare_outputs",
    "comparison_points",
    "input_sets",
    "make_inputs",
    "merge_comparisons",
    "pass_hint",
    "quantization_deviation",
    "run_model",
    "tolerance_at_least",
    "verification_runners",
]

logger = logging.getLogger(__name__)

_INT_TYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


@dataclasses.dataclass
class OutputComparison:
    name: str
    max_abs: float
    max_rel: float
    needed_atol: float  # the smallest atol that passes at the configured rtol
    passed: bool

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VerificationResult:
    passed: bool
    atol: float
    rtol: float
    inputs: dict[str, list[int]]
    outputs: list[OutputComparison]
    impact: list[OutputComparison] | None = None  # deviation of the bypassed reference from the original
    # Every input set verification ran (label and shapes); ``inputs`` is the first one's shapes.
    input_sets: list[dict] = dataclasses.field(default_factory=list)
    # With a zeroing threshold > 0 the compiled model deviates on purpose: an output passes when its max abs
    # deviation is at most ``max_deviation`` (None: reported, never failed) instead of atol/rtol.
    zeroing_threshold: float = 0.0
    max_deviation: float | None = None
    # With quantized weights (--weights int4|int8): the reference is the original quantized the same way, and this
    # is the quantization's own deviation from the float original (``quantization_deviation``), kept apart.
    quantization: dict | None = None
    # With activation sparsity (--activation-sparsity S) the compiled model deviates from the dense reference on
    # purpose, accepted under ``max_deviation`` as a zeroing threshold's; ``dense_at_scale_0``: the compiled model
    # run with ``layerzero::activation_scale`` 0 was checked equal to the reference at the tolerances.
    activation_sparsity: float = 0.0
    dense_at_scale_0: bool | None = None

    @property
    def needed_atol(self) -> float:
        return max((o.needed_atol for o in self.outputs), default=0.0)

    @property
    def compared(self) -> str:
        """What was compared with what, and the rule an output passes by (for messages)."""
        reference = (
            "the original with its bypassed layers taken out (declared zero flags, groups off, solidified paths)"
            if self.impact is not None
            else "the original"
        )
        if self.quantization is not None:
            reference += f", its weights quantized the same way ({self.quantization['weights']}, nothing skipped)"
        if self.zeroing_threshold > 0 or self.activation_sparsity > 0:
            rule = (
                f"passes when max |compiled - reference| <= --max-deviation {self.max_deviation:g}"
                if self.max_deviation is not None
                else "deviation reported, not checked (no --max-deviation)"
            )
            if self.activation_sparsity > 0:
                return (
                    f"compiled with --activation-sparsity {self.activation_sparsity:g} vs the dense reference = "
                    f"{reference}; {rule}"
                )
            return (
                f"compiled with --threshold {self.zeroing_threshold:g} vs the reference = {reference} "
                f"(exact routing); {rule}"
            )
        return (
            f"compiled vs the reference = {reference}; passes when |compiled - reference| <= atol + rtol * |reference| "
            f"(--atol {self.atol:g}, --rtol {self.rtol:g})"
        )

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["needed_atol"] = self.needed_atol
        return out


def _softmax64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def quantization_deviation(
    names: list[str], floats: list[list[np.ndarray]], quantized: list[list[np.ndarray]], logits: str = "logits"
) -> dict:
    """The quantization's own deviation: the float model's outputs against the quantized one's on the same input sets
    (one list of outputs per set, in ``names``' order; runtime outputs left out).

    Per float output: ``rel_l2`` = the worst over the sets of ``||q - f|| / ||f||``. For a causal LM's ``logits``
    (``[batch, seq, vocab]`` or ``[batch, vocab]``), at every position: the next-token distribution's KL divergence
    ``KL(softmax(f) || softmax(q))`` (nats; mean and max) and ``top1_agreement``, the fraction of positions whose
    argmax is the same. ``worst_rel_l2``: the largest ``rel_l2`` (what ``--max-quant-deviation`` bounds)."""
    outputs: dict[str, dict] = {}
    kls: list[np.ndarray] = []
    agree: list[np.ndarray] = []
    for i, name in enumerate(names):
        if is_runtime_output(name):
            continue
        worst = 0.0
        for fs, qs in zip(floats, quantized):
            f, q = np.asarray(fs[i]), np.asarray(qs[i])
            if not np.issubdtype(f.dtype, np.floating) or f.shape != q.shape or f.size == 0:
                break
            f64, q64 = f.astype(np.float64), q.astype(np.float64)
            norm = float(np.linalg.norm(f64))
            err = float(np.linalg.norm(q64 - f64))
            worst = max(worst, err / norm if norm > 0 else (0.0 if err == 0 else math.inf))
            if name == logits and f.ndim in (2, 3):
                p, r = _softmax64(f64), _softmax64(q64)
                with np.errstate(divide="ignore", invalid="ignore"):
                    terms = np.where(p > 0, p * (np.log(p) - np.log(np.maximum(r, 1e-300))), 0.0)
                kls.append(terms.sum(axis=-1).ravel())
                agree.append((f.argmax(axis=-1) == q.argmax(axis=-1)).ravel())
        else:
            outputs[name] = {"rel_l2": worst}
    result: dict = {
        "outputs": outputs,
        "worst_rel_l2": max((o["rel_l2"] for o in outputs.values()), default=0.0),
        "input_sets": len(floats),
    }
    if kls:
        kl = np.concatenate(kls)
        result["logits"] = {
            "next_token_kl_mean": float(kl.mean()),
            "next_token_kl_max": float(kl.max()),
            "top1_agreement": float(np.concatenate(agree).mean()),
            "positions": int(kl.size),
        }
    return result


def compare_outputs(
    names: list[str], expected: list[np.ndarray], actual: list[np.ndarray], atol: float, rtol: float
) -> list[OutputComparison]:
    result = []
    for name, a, b in zip(names, expected, actual):
        a = np.asarray(a)
        b = np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            result.append(OutputComparison(name, float("inf"), float("inf"), float("inf"), False))
            continue
        if a.size == 0:
            result.append(OutputComparison(name, 0.0, 0.0, 0.0, True))
            continue
        if not np.issubdtype(a.dtype, np.number):
            same = bool(np.array_equal(a, b))
            err = 0.0 if same else float("inf")
            result.append(OutputComparison(name, err, err, err, same))
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        both_nan = np.isnan(a64) & np.isnan(b64)
        same_inf = np.isinf(a64) & (a64 == b64)
        diff = np.where(both_nan | same_inf, 0.0, np.abs(a64 - b64))
        diff = np.where(np.isnan(diff), np.inf, diff)
        denom = np.abs(a64)
        rel = np.where(denom > 0, diff / np.where(denom > 0, denom, 1.0), np.where(diff > 0, np.inf, 0.0))
        needed = float(np.max(np.maximum(diff - rtol * np.where(np.isfinite(denom), denom, 0.0), 0.0)))
        max_abs = float(diff.max())
        result.append(OutputComparison(name, max_abs, float(rel.max()), needed, needed <= atol))
    return result


def tolerance_at_least(value: float) -> str:
    """``value`` written with 3 significant digits, rounded up: a suggested tolerance that passes when used."""
    if not math.isfinite(value) or value <= 0:
        return "0" if value == 0 else f"{value:g}"
    exact = decimal.Decimal(value)  # exact: no float rounding can take the suggestion below value
    exponent = exact.adjusted() - 2
    rounded = exact.scaleb(-exponent).to_integral_value(decimal.ROUND_CEILING).scaleb(exponent)
    return f"{rounded:.3g}"


def pass_hint(result: VerificationResult, output: OutputComparison) -> str:
    """What the user can change so that ``output`` passes (a phrase; every option it names works as printed)."""
    if result.activation_sparsity > 0:
        if not math.isfinite(output.max_abs):
            return "the outputs differ in shape or type; no tolerance passes"
        return (
            f"it would pass with --max-deviation {tolerance_at_least(output.max_abs)}, "
            f"or sparsify less with a lower --activation-sparsity (now {result.activation_sparsity:g})"
        )
    if result.zeroing_threshold > 0:
        if not math.isfinite(output.max_abs):
            return "the outputs differ in shape or type; no tolerance passes"
        return (
            f"it would pass with --max-deviation {tolerance_at_least(output.max_abs)}, "
            f"or skip less with a lower --threshold (now {result.zeroing_threshold:g})"
        )
    if not math.isfinite(output.needed_atol):
        return "the outputs differ in shape, type or NaN/Inf positions; no tolerance passes"
    return f"it would pass with --atol {tolerance_at_least(output.needed_atol)} --rtol {result.rtol:g}"


def _gather_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Inputs used as Gather indices get values below the gathered axis' size (token ids < vocab)."""
    sizes = {t.name: list(t.dims) for t in model.graph.initializer}
    bounds: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in sizes:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = sizes[node.input[0]]
            if dims:
                bounds[node.input[1]] = int(dims[axis])
    return bounds


def _batch_1_else(size: int) -> Callable[[str], int]:
    """A ``dynamic_size``: 1 for a dim whose name says batch, ``size`` for any other."""
    return lambda dim_param: 1 if "batch" in dim_param.lower() else size


_default_size = _batch_1_else(8)


def make_inputs(
    model: onnx.ModelProto,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    seed: int = 0,
    *,
    dynamic_size: Callable[[str], int] | None = None,
    points: Sequence[float] = (),
) -> dict[str, np.ndarray]:
    """Seeded sample inputs for every graph input, dynamic dims from ``shapes`` or ``dynamic_size``.

    Defaults: a symbolic dim whose name says batch is 1, any other 8 (``dynamic_size(dim_param)``
    overrides that; unnamed dims get ``dynamic_size("")``). Integer inputs named like a mask are ones,
    like positions are 0..n-1, used as Gather indices are below the table's size. With ``points`` (the
    constants the graph's comparisons split on), float inputs spread over those values, a quarter of
    them exactly on one, and integer inputs take those that fit their bounds at a quarter of positions.
    Every value is an array, a rank-0 input a 0-d array (never a numpy scalar).
    """
    shapes = dict(shapes or {})
    size_of = dynamic_size or _default_size
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    bounds = _gather_bounds(model)
    feeds: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        if inp.name in initializers:
            continue
        ttype = inp.type.tensor_type
        if not inp.type.HasField("tensor_type"):
            raise UnsupportedModelError(f"input {inp.name!r}: only tensor inputs can be generated; pass --inputs")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type)
        if inp.name in shapes:
            shape = tuple(shapes[inp.name])
            if ttype.HasField("shape") and len(ttype.shape.dim) != len(shape):
                raise InvalidInputError(
                    f"--shape {inp.name}: rank {len(shape)}, the model's input has rank {len(ttype.shape.dim)}"
                )
        else:
            shape = tuple(d.dim_value if d.HasField("dim_value") else size_of(d.dim_param) for d in ttype.shape.dim)
        lname = inp.name.lower()
        if np.issubdtype(dtype, np.bool_):
            value = np.asarray(rng.random(shape) > 0.5)  # a 0-d comparison is a numpy scalar
        elif dtype in _INT_TYPES:
            if "mask" in lname:
                value = np.ones(shape, dtype=dtype)
            elif "position" in lname and shape:
                value = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
            else:
                high = max(bounds.get(inp.name, 2), 1)
                value = rng.integers(0, high, size=shape).astype(dtype)
                fit = [int(p) for p in points if float(p).is_integer() and 0 <= p < bounds.get(inp.name, 2**31)]
                if fit:
                    at = rng.random(shape) < 0.25
                    value = np.where(at, rng.choice(fit, size=shape), value).astype(dtype)
        elif np.issubdtype(dtype, np.floating):
            if points:
                lo, hi = min(points) - 1.0, max(points) + 1.0
                value = rng.uniform(lo, hi, size=shape)
                value = np.where(rng.random(shape) < 0.25, rng.choice(list(points), size=shape), value)
                value = np.asarray(value).astype(dtype)
            else:
                value = np.asarray(rng.standard_normal(shape)).astype(dtype)
        else:
            raise UnsupportedModelError(f"input {inp.name!r}: cannot generate values of type {dtype}")
        feeds[inp.name] = np.asarray(value, dtype=dtype)  # a rank-0 input is a 0-d array, never a numpy scalar
    _continue_cache(feeds, shapes)
    return feeds


def _continue_cache(feeds: dict[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """A cache-carrying export (``layerzero export``): the mask covers past + new tokens, positions follow the past.

    Without this the defaults (every dim 8) give a mask shorter than past + seq, which the model cannot run.
    """
    past = feeds.get("past_key_values.0.key")
    ids, mask = feeds.get("input_ids"), feeds.get("attention_mask")
    if past is None or ids is None or mask is None or past.ndim != 4 or ids.ndim != 2 or "attention_mask" in shapes:
        return
    batch, seq, offset = ids.shape[0], ids.shape[1], past.shape[2]
    feeds["attention_mask"] = np.ones((batch, offset + seq), dtype=mask.dtype)
    positions = feeds.get("position_ids")
    if positions is not None and positions.shape == (batch, seq) and "position_ids" not in shapes:
        row = np.arange(offset, offset + seq, dtype=positions.dtype)
        feeds["position_ids"] = np.broadcast_to(row, (batch, seq)).copy()


_COMPARISONS = frozenset({"Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"})


def comparison_points(model: onnx.ModelProto, limit: int = 8) -> list[float]:
    """The constants the graph's comparisons split on (a small constant compared with a computed value)."""
    consts: dict[str, np.ndarray] = {}
    graph_inputs = {i.name for i in model.graph.input}
    for t in model.graph.initializer:
        # The header is loaded without external data: a small tensor stored outside is not read here.
        external = t.data_location == onnx.TensorProto.EXTERNAL
        if t.name not in graph_inputs and not external and np.prod(t.dims, dtype=np.int64) <= 16:
            consts[t.name] = onnx.numpy_helper.to_array(t)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            array = onnx.numpy_helper.to_array(node.attribute[0].t)
            if array.size <= 16:
                consts[node.output[0]] = array
    points: set[float] = set()
    for node in model.graph.node:
        if node.op_type not in _COMPARISONS or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        a, b = (consts.get(name) for name in node.input)
        if (a is None) == (b is None):
            continue  # both constant (folding's job) or neither: no threshold to cover
        array = a if a is not None else b
        if np.issubdtype(array.dtype, np.number):
            points.update(float(v) for v in np.asarray(array, dtype=np.float64).ravel() if np.isfinite(v))
    return sorted(points)[:limit]


@dataclasses.dataclass
class InputSet:
    label: str
    feeds: dict[str, np.ndarray]

    def shapes(self) -> dict[str, list[int]]:
        return {k: list(v.shape) for k, v in self.feeds.items()}


#: The default input set's dynamic dims (batch aside) for a model verified in chunks (``input_sets(full=False)``).
BIG_MODEL_SIZE = 2


def input_sets(
    model: onnx.ModelProto,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    seed: int = 0,
    *,
    full: bool = True,
) -> list[InputSet]:
    """The input sets verification compares on; the first is the default one (``make_inputs``).

    Then, with other seeds: every dynamic dim at 1; every dynamic dim larger and all different (so that
    two dims mixed up show); and, when the graph's comparisons split on constants, values spread over
    those constants. Dims given in ``shapes`` stay as given. ``full=False`` (big models, where each set
    costs a chunked run) keeps two sets: the dims-at-1 one and a default one whose dynamic dims other than batch
    are 2, not 8 (``BIG_MODEL_SIZE``): a MoE export's batched_mm form gathers every token's routed experts'
    weights in float32 (``T * top_k`` matrices a layer: 1.07 GB at 8 tokens for OLMoE-1B-7B's gate / up), so the
    verification of a big model would hold ~4x more for the default set than for the other.
    """
    if full:
        sets = [InputSet("default", make_inputs(model, shapes, seed))]
    else:
        sets = [InputSet("default", make_inputs(model, shapes, seed, dynamic_size=_batch_1_else(BIG_MODEL_SIZE)))]
    sets.append(InputSet("dynamic dims 1", make_inputs(model, shapes, seed + 1, dynamic_size=lambda _name: 1)))
    if not full:
        return _distinct(sets)
    larger: dict[str, int] = {}

    def distinct_size(name: str) -> int:
        if name not in larger:
            larger[name] = (3 if "batch" in name.lower() else 5) + len(larger)
        return larger[name]

    sets.append(InputSet("dynamic dims larger", make_inputs(model, shapes, seed + 2, dynamic_size=distinct_size)))
    points = comparison_points(model)
    if points:
        sets.append(InputSet(f"values around {points}", make_inputs(model, shapes, seed + 3, points=points)))
    return _distinct(sets)


def _distinct(sets: list[InputSet]) -> list[InputSet]:
    """Drop a set whose feeds equal an earlier one's (a model without dynamic dims or inputs)."""
    out: list[InputSet] = []
    for s in sets:
        same = any(
            o.feeds.keys() == s.feeds.keys()
            and all(o.feeds[k].shape == v.shape and np.array_equal(o.feeds[k], v) for k, v in s.feeds.items())
            for o in out
        )
        if not same:
            out.append(s)
    return out


def merge_comparisons(per_set: list[list[OutputComparison]]) -> list[OutputComparison]:
    """Per output, the worst comparison over all input sets."""
    merged: list[OutputComparison] = []
    for column in zip(*per_set):
        worst = max(column, key=lambda o: (not o.passed, o.needed_atol, o.max_abs))
        merged.append(
            OutputComparison(
                worst.name,
                max(o.max_abs for o in column),
                max(o.max_rel for o in column),
                max(o.needed_atol for o in column),
                all(o.passed for o in column),
            )
        )
    return merged


def run_model(model: str | Path | bytes, feeds: Mapping[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
    """Run a model (path or serialized bytes) once on ORT's CPU provider, through the runtime's own backend.

    ``OrtBackend`` (session options, our custom-op library when built) is what ``Engine`` runs a bundle with,
    so verification sees what the runtime will. Feeds the model does not take are dropped.
    """
    from layerzero.runtime.backends.onnxruntime import OrtBackend

    backend = OrtBackend()
    backend.load(model if isinstance(model, bytes) else Path(model), device="cpu")
    names = backend.output_names
    # The run-time inputs with a compiled default (ONNX Runtime does not list them) are taken when fed.
    wanted = {spec.name for spec in backend.input_specs} | {THRESHOLD_INPUT, ACTIVATION_SCALE_INPUT}
    try:
        outputs = backend.run({k: v for k, v in feeds.items() if k in wanted})
    except LayerZeroError as exc:
        first = str(exc.__cause__ or exc).strip().splitlines()
        raise InvalidInputError(
            f"onnxruntime failed to run the model on the sample inputs: {first[0] if first else exc}"
        ) from None
    return names, outputs


class Runner(Protocol):
    """Runs one model: ``run(feeds)`` returns its output names and outputs, in the graph's order.

    A model ONNX Runtime cannot load or run on ``feeds`` raises ``InvalidInputError`` or ``UnsupportedModelError``.
    """

    def run(self, feeds: Mapping[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]: ...


class OrtRunner:
    """The whole model (a file or serialised bytes) in one ONNX Runtime session on the CPU (``run_model``)."""

    def __init__(self, model: str | Path | bytes) -> None:
        self.model = model

    def run(self, feeds: Mapping[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
        return run_model(self.model, feeds)


class Runners(abc.ABC):
    """How one verification runs its models: ``original()`` the untouched source; ``of(model, name)`` a model the
    compile made (the compiled graph, the bypassed reference); ``checkpoint(model)`` a pipeline checkpoint of the
    per-pass bisection.

    ``all_input_sets``: every input set is affordable (else two: ``input_sets(full=False)``);
    ``bisect_skipped``: why the per-pass bisection does not run (None: it does).
    """

    all_input_sets: bool = True
    bisect_skipped: str | None = None

    @abc.abstractmethod
    def original(self) -> Runner: ...

    @abc.abstractmethod
    def of(self, model: ir.Model, name: str) -> Runner: ...

    @abc.abstractmethod
    def checkpoint(self, model: ir.Model) -> Runner: ...


class WholeModelRunners(Runners):
    """Whole models in one session each (``OrtRunner``): the source from its file (or serialised proto), the
    compile's models saved under ``workdir``, bisection checkpoints serialised in memory."""

    def __init__(self, workdir: Path, source: Path | None, original_proto: onnx.ModelProto | None) -> None:
        self.workdir, self.source, self.original_proto = workdir, source, original_proto

    def original(self) -> Runner:
        return OrtRunner(self.source if self.source is not None else self.original_proto.SerializeToString())

    def of(self, model: ir.Model, name: str) -> Runner:
        path = self.workdir / f"{name}.onnx"
        ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1 << 20)
        return OrtRunner(path)

    def checkpoint(self, model: ir.Model) -> Runner:
        return OrtRunner(ir.to_proto(model).SerializeToString())


class ChunkedRunners(Runners):
    """Models over the chunked-verification budget, a few layers at a time (``ChunkedRunner``, chunks of
    ``budget_bytes``): verification never holds all the weights. Each run costs a pass over all of them, so
    two input sets run, and no per-pass bisection (a run for every checkpoint of the pipeline)."""

    all_input_sets = False
    bisect_skipped = "pass bisection skipped (weights over --chunked-verify-bytes)"

    def __init__(self, load_original: Callable[[], ir.Model], budget_bytes: int,
                 on_chunk: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
        self.load_original, self.budget_bytes, self.on_chunk = load_original, budget_bytes, on_chunk

    def original(self) -> Runner:
        return ChunkedRunner(self.load_original, self.budget_bytes, self.on_chunk)

    def of(self, model: ir.Model, name: str) -> Runner:
        return ChunkedRunner(model, self.budget_bytes, self.on_chunk)

    def checkpoint(self, model: ir.Model) -> Runner:
        return ChunkedRunner(model, self.budget_bytes, self.on_chunk)


def verification_runners(
    compiled: ir.Model,
    chunked_verify_bytes: int,
    workdir: Path,
    source: Path | None,
    original_proto: onnx.ModelProto | None,
    load_original: Callable[[], ir.Model],
    on_chunk: Callable[[int, int], None] | None = None,
) -> Runners:
    """The runners of one verification: chunked (chunks of half ``chunked_verify_bytes``) when the compiled
    model's weights exceed ``chunked_verify_bytes``, else whole models (files under ``workdir``). A chunked
    run calls ``on_chunk(k, n)`` before each of its ``n`` chunks (progress)."""
    if weight_bytes(compiled) > chunked_verify_bytes:
        return ChunkedRunners(load_original, chunked_verify_bytes // 2, on_chunk)
    return WholeModelRunners(workdir, source, original_proto)


@dataclasses.dataclass
class Comparator:
    """What verification compares, and how: the user's outputs (never ``contract.is_runtime_output`` ones, the
    masks and router outputs the compiler adds), each within ``atol + rtol * |reference|``; with a zeroing
    threshold > 0 the compiled model deviates on purpose and an output passes when its max abs deviation is at
    most ``max_deviation`` (None: reported, never failed)."""

    atol: float
    rtol: float
    zeroing_threshold: float = 0.0
    max_deviation: float | None = None
    activation_sparsity: float = 0.0

    @staticmethod
    def user_outputs(names: list[str], outputs: list[np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
        """``names`` and ``outputs`` without the runtime's outputs."""
        keep = [i for i, n in enumerate(names) if not is_runtime_output(n)]
        return [names[i] for i in keep], [outputs[i] for i in keep]

    def compare_all(
        self, names: list[str], expected: list[np.ndarray], got: list[np.ndarray]
    ) -> list[OutputComparison]:
        """Every output of two runs of the same outputs (``names``) at the tolerances."""
        return compare_outputs(names, expected, got, self.atol, self.rtol)

    def compare(
        self, names: list[str], expected: list[np.ndarray], got_names: list[str], got: list[np.ndarray]
    ) -> list[OutputComparison]:
        """The compiled run's user outputs against the reference's (``names``, ``expected``).

        Raises:
            VerificationError: the compiled model's user outputs are not the original's.
        """
        got_names, got = self.user_outputs(got_names, got)
        if got_names != names:
            raise VerificationError(f"compiled model outputs {got_names} differ from the original's {names}")
        return self.compare_all(names, expected, got)

    def agrees(self, names: list[str], expected: list[np.ndarray], got_names: list[str], got: list[np.ndarray]) -> bool:
        """Whether a run matches the reference at the tolerances (same user outputs, each within them)."""
        try:
            return all(o.passed for o in self.compare(names, expected, got_names, got))
        except VerificationError:
            return False

    def judge(self, outputs: list[OutputComparison]) -> None:
        """With a zeroing threshold > 0, an output passes by ``max_deviation`` instead of the tolerances."""
        if self.zeroing_threshold > 0 or self.activation_sparsity > 0:
            for o in outputs:
                o.passed = self.max_deviation is None or o.max_abs <= self.max_deviation

    @staticmethod
    def worst(outputs: list[OutputComparison], per_set: list[list[OutputComparison]]) -> tuple[OutputComparison, int]:
        """The failing output that needs the largest tolerance, and the first input set it fails on."""
        worst = max((o for o in outputs if not o.passed), key=lambda o: (o.needed_atol, o.max_abs))
        k = next(
            (i for i, comps in enumerate(per_set) for o in comps if o.name == worst.name and not o.passed),
            0,
        )
        return worst, k

    @staticmethod
    def mismatch(result: VerificationResult, worst: OutputComparison, input_set: InputSet, culprit: str) -> str:
        """The one-line failure: which output, by how much, on which inputs, which pass, what would pass."""
        return (
            f"verification failed: output {worst.name!r} differs by max abs {worst.max_abs:.3g} "
            f"(max rel {worst.max_rel:.3g}) on the {input_set.label} inputs {input_set.shapes()}; {culprit}; "
            f"{pass_hint(result, worst)}"
        )
