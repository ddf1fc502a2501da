"""Numerical verification: run the reference and the compiled model with ORT and compare outputs."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from layerzero.errors import InvalidInputError, UnsupportedModelError

__all__ = ["OutputComparison", "VerificationResult", "compare_outputs", "make_inputs", "run_model"]

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

    @property
    def needed_atol(self) -> float:
        return max((o.needed_atol for o in self.outputs), default=0.0)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["needed_atol"] = self.needed_atol
        return out


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


def make_inputs(
    model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Seeded sample inputs for every graph input, dynamic dims from ``shapes`` or defaults.

    Defaults: a symbolic dim whose name says batch is 1, any other 8. Integer inputs named like a
    mask are ones, like positions are 0..n-1, used as Gather indices are below the table's size.
    """
    shapes = dict(shapes or {})
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
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (1 if "batch" in d.dim_param.lower() else 8)
                for d in ttype.shape.dim
            )
        lname = inp.name.lower()
        if np.issubdtype(dtype, np.bool_):
            feeds[inp.name] = rng.random(shape) > 0.5
        elif dtype in _INT_TYPES:
            if "mask" in lname:
                feeds[inp.name] = np.ones(shape, dtype=dtype)
            elif "position" in lname and shape:
                feeds[inp.name] = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
            else:
                high = bounds.get(inp.name, 2)
                feeds[inp.name] = rng.integers(0, max(high, 1), size=shape).astype(dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
        else:
            raise UnsupportedModelError(f"input {inp.name!r}: cannot generate values of type {dtype}")
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


def run_model(model: str | Path | bytes, feeds: Mapping[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
    """Run a model (path or serialized bytes) once on ORT's CPU provider."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            str(model) if isinstance(model, Path) else model, options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModelError(f"onnxruntime cannot load the model: {first}") from None
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    try:
        outputs = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidInputError(f"onnxruntime failed to run the model on the sample inputs: {first}") from None
    return names, outputs
