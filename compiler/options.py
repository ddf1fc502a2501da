"""Compile options: one dataclass, checked when built, written into the bundle's manifest."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from pathlib import Path
from typing import Any

from layerzero.errors import InvalidInputError
from layerzero.targets.registry import TARGETS

__all__ = ["ACTIVATION_METHODS", "DEVICES", "MAX_ACTIVATION_SPARSITY", "MOE_LOWERINGS", "STABILITY_UNITS", "WEIGHTS",
           "CompileOptions"]  # fmt: skip

#: ``device``: where the bundle runs (the onnxruntime target lowers for it; the manifest records it).
DEVICES = ("cpu", "cuda")

#: ``moe_lowering``: "auto" | "if" (per-expert If subgraphs) | "ort-moe" (com.microsoft.MoE); the onnxruntime
#: target's choices (``passes/lower_moe.py`` ``LOWERINGS``; a test keeps the two equal).
MOE_LOWERINGS = ("auto", "if", "ort-moe", "native")
#: ``weights``: "float" (as the model has them) | "int4" | "int8" (weight-only quantization after the zeroing passes:
#: MatMulNBits, the native MoE's q4 / q8 experts, QMoE; ``passes/quantize_weights.py``).
WEIGHTS = ("float", "int4", "int8")
#: ``stability_unit``: what ``stability_window`` counts.
STABILITY_UNITS = ("requests", "tokens")
#: ``activation_method``: the per-channel criterion of the activation thresholds (``activation_calibration.CRITERIA``).
ACTIVATION_METHODS = ("wina", "magnitude")
#: ``activation_rotation``: an exact rotation folded into the weights before the calibration (passes/rotate_heads.py):
#: "heads" (each attention's value heads, o_proj's input), "none".
ACTIVATION_ROTATIONS = ("heads", "none")
#: Who runs the dense quantized MatMuls (passes/native_linear.py): ONNX Runtime's MatMulNBits, or
#: liblayerzero_ort.so's QLinear (the MoE experts' row kernels on the same codes); "native" also puts each layer's
#: attention into liblayerzero_ort.so's Attention (passes/native_attention.py).
LINEAR_KERNELS = ("ort", "native")
#: The largest model-wide activation sparsity a compile may ask for.
MAX_ACTIVATION_SPARSITY = 0.95


@dataclasses.dataclass
class CompileOptions:
    """What ``compile`` does. Building one checks every field (``InvalidInputError`` naming the option).

    ``assume_finite``: fold ``x * 0`` (and MatMul/Gemm/Conv with an all-zero weight) to 0. This is
    wrong when x holds NaN or Inf (``NaN * 0`` is NaN), which inference activations normally do not;
    the numerical verification of every compile is the guard. Turn it off for graphs that compute
    with non-finite values on purpose.
    """

    assume_finite: bool = True
    flag_pattern: str = "*.flag"
    max_iterations: int = 10
    fold_max_elements: int = 1 << 20
    verify: bool = True
    atol: float = 1e-4
    rtol: float = 1e-3
    seed: int = 0
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    sample_inputs: Path | None = None
    target: str = "onnxruntime"
    # "cpu" | "cuda": where an onnxruntime bundle runs. cuda lowers MoE to com.microsoft.MoE only (ONNX Runtime's
    # CUDA If needs its condition on the host: a copy and a sync per expert) and Engine.load picks the CUDA provider.
    device: str = "cpu"  # one of DEVICES
    # Verification of models whose weights exceed this runs layer chunks of half this size at a time.
    chunked_verify_bytes: int = 256 << 20
    # Dynamic zeroing (run-time skipping driven by routers and gates).
    dynamic: bool = True
    zeroing_threshold: float = 0.0  # skip a routed expert / gated branch below threshold × the token's largest weight
    max_deviation: float | None = None  # with a threshold > 0: fail verification above this max abs deviation
    # "auto" | "if" (per-expert If subgraphs) | "ort-moe" (com.microsoft.MoE) | "native" (ai.layerzero::MoE kept
    # for liblayerzero_ort.so, `layerzero plugins build`; the bundle then lists it and needs it at run time).
    # auto: native when the library is built, else If below 32 experts and, above, If or ort-moe by a measured cost
    # model (passes/lower_moe_native.py). A block a lowering cannot run falls back to If.
    moe_lowering: str = "auto"  # one of MOE_LOWERINGS
    groups: Path | None = None  # group-mask spec (YAML or JSON)
    # Solidify (layerzero.solidify_plan): remove for good the dynamic paths a profile (`layerzero profile`) found
    # skipped at least `stability_window` consecutive requests (or tokens, `stability_unit`) and whose measured
    # impact (relative L2 change of the model output when forced off) is below `impact_tolerance`.
    profile: Path | None = None
    stability_window: int = 100
    stability_unit: str = "requests"  # one of STABILITY_UNITS
    impact_tolerance: float = 0.01
    solidify: tuple[str, ...] = ()  # the subpaths to remove (filled from `profile`, or given directly)
    # Weight quantization (after the zeroing passes and the lowering; passes/quantize_weights.py): "int4" | "int8"
    # weights in blocks of `quant_block` (MatMulNBits' block_size: a power of two >= 16; the native MoE kernel reads
    # 32 only), symmetric or with zero points, MatMulNBits' `quant_accuracy_level` (0-4; 4: int8 activations).
    # Verification measures the quantization's deviation from the float original on the sample inputs (output
    # relative L2; next-token KL and top-1 agreement of a causal LM's logits) and refuses a compile whose worst
    # relative L2 exceeds `max_quant_deviation` (None: reported, never refused).
    weights: str = "float"  # one of WEIGHTS
    quant_block: int = 32
    quant_symmetric: bool = True
    quant_accuracy_level: int = 4
    max_quant_deviation: float | None = None
    # "native": the dense MatMulNBits become liblayerzero_ort.so's QLinear (passes/native_linear.py; onnxruntime
    # on the CPU with the library built, symmetric blocks of 32, accuracy level 4; anything else stays MatMulNBits),
    # the QLinear nodes of one x merged, and each layer's attention one ai.layerzero::Attention (native_attention.py).
    linear_kernel: str = "ort"  # one of LINEAR_KERNELS
    # Activation sparsity (issue 23; passes/sparsify_activations.py, compiler/activation_calibration.py): thresholds
    # on the input of every projection group, allocated by TEAL's greedy to reach this model-wide (parameter-weighted)
    # sparsity on the calibration inputs (`activation_calibration`: .npz / .json requests; else the sample inputs),
    # per channel by `activation_method`. It changes the output on purpose: verification measures the deviation from
    # the dense model and needs `max_deviation` to accept it. None (or 0): no activation sparsity.
    activation_sparsity: float | None = None
    activation_calibration: Path | None = None
    activation_method: str = "wina"  # one of ACTIVATION_METHODS
    # Fuse RMSNorm, rotary embeddings and key transposes into ONNX Runtime's kernels (passes/fuse_decoder.py; the
    # onnxruntime target on the CPU).
    fuse: bool = True
    # With activation_sparsity S: the largest sparsity <= S (on the greedy path, 0.05 apart, and S) whose measured
    # model-output deviation (largest relative L2 change of a user output on the calibration inputs, the unit of
    # solidify's impact_tolerance) stays <= this. None: S exactly.
    activation_impact_tolerance: float | None = None
    # Rounds of ``activation_calibration.refine`` after the allocation: at the allocation, each group's deviation one
    # step (0.05) up and one down measured on the calibration requests (2 x groups + at most 3 runs of them a round),
    # sparsity moved from the groups that cost most to those that cost least, the model-wide level held. 0: none.
    activation_refine: int = 0
    # An exact rotation folded into the weights before the calibration, chosen on the calibration inputs so that the
    # thresholds drop more entries at less error (passes/rotate_heads.py: "heads", o_proj's input per value head);
    # "none": the weights as they are. Not with a profile's activations (they were recorded unrotated).
    activation_rotation: str = "heads"  # one of ACTIVATION_ROTATIONS

    def __post_init__(self) -> None:
        # Cases: 1. flags are bools; 2. counts are ints (not bools) in range; 3. tolerances and thresholds are
        # finite numbers >= 0 (ints become floats); 4. names are one of the known ones; 5. paths are str or
        # os.PathLike (stored as Path); 6. shapes map names to dims >= 0, solidify is a sequence of names.
        for name in ("assume_finite", "verify", "dynamic", "quant_symmetric", "fuse"):
            _check_bool(name, getattr(self, name))
        _check_int("max_iterations", self.max_iterations, 1)
        _check_int("fold_max_elements", self.fold_max_elements, 0)
        _check_int("seed", self.seed, 0)
        _check_int("chunked_verify_bytes", self.chunked_verify_bytes, 1)
        _check_int("stability_window", self.stability_window, 1)
        for name in ("max_iterations", "fold_max_elements", "seed", "chunked_verify_bytes", "stability_window"):
            setattr(self, name, int(getattr(self, name)))
        for name in ("atol", "rtol", "zeroing_threshold", "impact_tolerance"):
            setattr(self, name, _finite(name, getattr(self, name)))
        if self.max_deviation is not None:
            self.max_deviation = _finite("max_deviation", self.max_deviation)
        if not isinstance(self.flag_pattern, str) or not self.flag_pattern:
            raise InvalidInputError(f"option flag_pattern: expected a non-empty pattern, got {self.flag_pattern!r}")
        _check_choice("target", self.target, TARGETS)
        self._check_quantization()
        _check_choice("moe_lowering", self.moe_lowering, MOE_LOWERINGS)
        _check_choice("device", self.device, DEVICES)
        if self.device == "cuda" and self.moe_lowering in ("if", "native"):
            # Case 4: if = per-expert If (a host copy and a sync each on CUDA); native = a CPU custom-op library.
            raise InvalidInputError(
                f"option moe_lowering: {self.moe_lowering!r} cannot run on device 'cuda' "
                "(use auto or ort-moe: com.microsoft.MoE)"
            )
        _check_choice("stability_unit", self.stability_unit, STABILITY_UNITS)
        for name in ("sample_inputs", "groups", "profile"):
            setattr(self, name, _path(name, getattr(self, name)))
        self.shapes = _shapes(self.shapes)
        if isinstance(self.solidify, str) or not all(isinstance(s, str) for s in _iterable("solidify", self.solidify)):
            raise InvalidInputError(f"option solidify: expected a sequence of subpath names, got {self.solidify!r}")
        self.solidify = tuple(self.solidify)
        self._check_activation_sparsity()

    def _check_activation_sparsity(self) -> None:
        # Case 8: the sparsity a finite number in [0, MAX_ACTIVATION_SPARSITY]; the method a known one; a calibration
        # file only with a sparsity; a verified compile with sparsity needs max_deviation (never a silent pass).
        _check_choice("activation_method", self.activation_method, ACTIVATION_METHODS)
        _check_choice("activation_rotation", self.activation_rotation, ACTIVATION_ROTATIONS)
        self.activation_calibration = _path("activation_calibration", self.activation_calibration)
        if self.activation_sparsity is not None:
            s = _finite("activation_sparsity", self.activation_sparsity)
            if s > MAX_ACTIVATION_SPARSITY:
                raise InvalidInputError(
                    f"option activation_sparsity: must be in [0, {MAX_ACTIVATION_SPARSITY}], got {s:g}"
                )
            self.activation_sparsity = s
        if self.activation_sparsity and not self.dynamic:
            raise InvalidInputError("option activation_sparsity: a dynamic pass, needs dynamic=True (not --no-dynamic)")
        if self.activation_calibration is not None and not self.activation_sparsity:
            raise InvalidInputError("option activation_calibration: needs activation_sparsity > 0")
        if self.activation_impact_tolerance is not None:
            t = _finite("activation_impact_tolerance", self.activation_impact_tolerance)
            if t < 0:
                raise InvalidInputError(f"option activation_impact_tolerance: must be >= 0, got {t:g}")
            if not self.activation_sparsity:
                raise InvalidInputError("option activation_impact_tolerance: needs activation_sparsity > 0")
            self.activation_impact_tolerance = t
        _check_int("activation_refine", self.activation_refine, 0)
        self.activation_refine = int(self.activation_refine)
        if self.activation_refine and not self.activation_sparsity:
            raise InvalidInputError("option activation_refine: needs activation_sparsity > 0")
        if self.activation_sparsity and self.verify and self.max_deviation is None:
            raise InvalidInputError(
                f"option activation_sparsity {self.activation_sparsity:g}: changes the model's outputs on purpose; "
                "give max_deviation (--max-deviation), the largest max abs deviation from the dense model that "
                "verification accepts"
            )

    def _check_quantization(self) -> None:
        # Case 7: weights is a known precision; quant_block a power of two >= 16; the accuracy level 0-4; the
        # deviation bound a finite number >= 0, meaningful only when the weights are quantized and verified.
        _check_choice("weights", self.weights, WEIGHTS)
        _check_int("quant_block", self.quant_block, 16)
        if self.quant_block & (self.quant_block - 1):
            raise InvalidInputError(f"option quant_block: must be a power of two >= 16, got {self.quant_block}")
        self.quant_block = int(self.quant_block)
        _check_int("quant_accuracy_level", self.quant_accuracy_level, 0)
        if self.quant_accuracy_level > 4:
            raise InvalidInputError(f"option quant_accuracy_level: must be 0-4, got {self.quant_accuracy_level}")
        self.quant_accuracy_level = int(self.quant_accuracy_level)
        _check_choice("linear_kernel", self.linear_kernel, LINEAR_KERNELS)
        if self.linear_kernel == "native" and self.weights == "float":
            raise InvalidInputError("option linear_kernel: 'native' runs quantized weights (weights int4 or int8)")
        if self.weights != "float" and self.target != "onnxruntime":
            raise InvalidInputError(
                f"option weights: {self.weights!r} is for target 'onnxruntime' (MatMulNBits, QMoE, the native MoE "
                f"op), not {self.target!r}"
            )
        if self.max_quant_deviation is not None:
            self.max_quant_deviation = _finite("max_quant_deviation", self.max_quant_deviation)
            if self.weights == "float":
                raise InvalidInputError("option max_quant_deviation: needs quantized weights (weights int4 or int8)")
            if not self.verify:
                raise InvalidInputError("option max_quant_deviation: the deviation is measured by verification")

    @property
    def quant_bits(self) -> int:
        """4 or 8 for quantized weights, 0 for float."""
        return {"int4": 4, "int8": 8}.get(self.weights, 0)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["sample_inputs"] = None if self.sample_inputs is None else str(self.sample_inputs)
        out["groups"] = None if self.groups is None else str(self.groups)
        out["profile"] = None if self.profile is None else str(self.profile)
        calibration = self.activation_calibration
        out["activation_calibration"] = None if calibration is None else str(calibration)
        out["solidify"] = list(self.solidify)
        out["shapes"] = {k: list(v) for k, v in self.shapes.items()}
        return out


def _is_int(value: Any) -> bool:
    # numpy integers count (a shape read from an array); bools do not, though Python makes them ints.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidInputError(f"option {name}: expected True or False, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not _is_int(value):
        raise InvalidInputError(f"option {name}: expected an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise InvalidInputError(f"option {name}: must be >= {minimum}, got {value}")


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"option {name}: expected a number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InvalidInputError(f"option {name}: must be a finite number >= 0, got {value}")
    return float(value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidInputError(f"option {name}: {value!r} is not one of {', '.join(choices)}")


def _path(name: str, value: Any) -> Path | None:
    if value is None or isinstance(value, Path):
        return value
    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise InvalidInputError(f"option {name}: expected a file path, got {type(value).__name__}")


def _iterable(name: str, value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        raise InvalidInputError(f"option {name}: expected a sequence, got {type(value).__name__}") from None


def _shapes(value: Any) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, dict):
        raise InvalidInputError(f"option shapes: expected a dict of input name to dims, got {type(value).__name__}")
    shapes: dict[str, tuple[int, ...]] = {}
    for key, dims in value.items():
        items = _iterable(f"shapes[{key!r}]", dims)
        if not isinstance(key, str) or not all(_is_int(d) and d >= 0 for d in items):
            raise InvalidInputError(f"option shapes[{key!r}]: expected integer dims >= 0, got {dims!r}")
        shapes[key] = tuple(int(d) for d in items)
    return shapes
