"""``Engine``: load a bundle, validate feeds, run, strip skip masks, report.

    engine = Engine.load("model.lz")                 # or a plain .onnx file, run uncompiled
    result = engine.run({"input_ids": ids})
    result.outputs["logits"], result.report.summary()

Skip decisions of the compiler's dynamic passes are graph outputs named ``layerzero::mask::<path>``. They
are not the user's: ``run`` removes them (and the ``layerzero::router::<path>`` confidence outputs) from
``Result.outputs`` and turns them into ``Report.skipped_paths`` (the subpaths, per the manifest's ``dynamic``
section, whose mask column is all zero on this request), ``zeroed_params_ratio``, ``routing_confidence`` and,
when asked, ``Report.masks``.

Feeds are checked against the model's inputs before anything runs, so a wrong name, dtype, rank or static
dim is an ``InvalidInputError`` naming the input, not a backend stack trace. Python lists and scalars are
converted to the input's dtype when that is lossless (ints to any int/float type that holds them exactly;
floats to any float type, rounding as a float literal would, but not overflowing to inf). numpy arrays (and
other objects with a dtype) must already have the input's dtype: a silent float64 -> float32 cast hides bugs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from layerzero.contract import MASK_PREFIX, ROUTER_PREFIX, THRESHOLD_INPUT
from layerzero.errors import InvalidInputError
from layerzero.runtime.backends.base import Backend, TensorSpec, get_backend
from layerzero.runtime.bundle import check_external_data, read_bundle
from layerzero.runtime.report import Report, index_dynamic

if TYPE_CHECKING:
    from layerzero.runtime.report import Generation

__all__ = ["MASK_PREFIX", "ROUTER_PREFIX", "THRESHOLD_INPUT", "Engine", "Result"]

logger = logging.getLogger(__name__)

#: The backend of a plain ``.onnx`` file (and of a bundle whose manifest names none).
DEFAULT_BACKEND = "onnxruntime"


@dataclasses.dataclass
class Result:
    """The user's outputs (mask outputs removed), by name, in graph order, and this request's report."""

    outputs: dict[str, np.ndarray]
    report: Report


class Engine:
    """A loaded model, ready to run. Create with ``Engine.load``."""

    def __init__(self, backend: Backend, manifest: Mapping[str, Any], *, path: Path, model_path: Path) -> None:
        self._backend = backend
        self._manifest = dict(manifest)
        self._path = path
        self._model_path = model_path
        self._specs = {spec.name: spec for spec in backend.input_specs}
        all_outputs = backend.output_names
        # Per request, run() sorts the backend's outputs (in this order) into the user's and the dynamic ones.
        self._all_outputs = list(all_outputs)
        self._dynamic_outputs = frozenset(n for n in all_outputs if n.startswith((MASK_PREFIX, ROUTER_PREFIX)))
        self._output_names = [n for n in all_outputs if n not in self._dynamic_outputs]
        self._mask_paths = [n[len(MASK_PREFIX) :] for n in all_outputs if n.startswith(MASK_PREFIX)]
        self._template = Report.from_manifest(self._manifest)
        self._dynamic_index = index_dynamic(self._manifest.get("dynamic"))  # once, not per request
        self._has_threshold: bool | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, backend: str | None = None, **backend_options: Any) -> Engine:
        """Load a bundle directory, or a plain ``.onnx`` file (run as is, with an empty manifest).

        Args:
            path: The bundle written by ``layerzero compile``, or an ``.onnx`` file.
            backend: A registered backend name (``"onnxruntime"``/``"ort"``, ``"tensorrt"``); None: the one the
                bundle's manifest names (``backend``, written by its compile target), ONNX Runtime for a plain
                ``.onnx`` file.
            **backend_options: Passed to the backend's ``load`` (e.g. ``device="cuda"``). Without ``device`` (or
                ``providers``), a bundle runs on the device its manifest records (``layerzero compile --device``).

        Raises:
            InvalidInputError: a bad path, bundle, backend name or option, or a bundle compiled for a target
                this backend cannot run.
            UnsupportedModelError: the backend cannot load the model.
        """
        root = Path(path)
        if root.is_file() and root.suffix == ".onnx":
            logger.info("%s is a plain ONNX file: running it uncompiled (no zeroing report)", root)
            check_external_data(root)
            manifest: dict[str, Any] = {}
            model_path = root
            backend_cls = get_backend(backend or DEFAULT_BACKEND)
        else:
            bundle = read_bundle(root)
            manifest, model_path = bundle.manifest, bundle.model_path
            backend_cls = get_backend(backend or _manifest_backend(manifest))
            _check_target(manifest, backend_cls, root)
        _use_manifest_device(manifest, backend_cls, backend_options, root)
        instance = backend_cls()
        instance.load(model_path, **backend_options)
        return cls(instance, manifest, path=root, model_path=model_path)

    @property
    def manifest(self) -> dict[str, Any]:
        """The bundle's manifest (empty for a plain ``.onnx`` file). Treat it as read-only."""
        return self._manifest

    @property
    def path(self) -> Path:
        return self._path

    @property
    def model_path(self) -> Path:
        return self._model_path

    @property
    def backend(self) -> Backend:
        """The backend instance (e.g. ``OrtBackend``, for ``end_profiling()``)."""
        return self._backend

    @property
    def input_specs(self) -> list[TensorSpec]:
        return list(self._specs.values())

    @property
    def output_names(self) -> list[str]:
        """The user's outputs: every graph output except the ``layerzero::mask::`` / ``::router::`` ones."""
        return list(self._output_names)

    @property
    def mask_paths(self) -> list[str]:
        """Paths with a dynamic skip mask output, in graph order."""
        return list(self._mask_paths)

    def report_template(self) -> Report:
        """A fresh report holding the static fields (from the manifest); per-request fields empty."""
        return self._template.copy()

    @property
    def has_threshold_input(self) -> bool:
        """Whether the model reads its zeroing threshold from ``layerzero::threshold`` (``run(threshold=)``)."""
        if self._has_threshold is None:
            import onnx

            graph = onnx.load(str(self._model_path), load_external_data=False).graph
            self._has_threshold = any(i.name == THRESHOLD_INPUT for i in graph.input)
        return self._has_threshold

    def run(self, feeds: Mapping[str, Any], *, masks: bool = False, threshold: float | None = None) -> Result:
        """Validate ``feeds``, run the model, and return the user outputs and this request's report.

        Args:
            feeds: Input name -> numpy array (or a Python list/scalar, converted when lossless).
            masks: Also return each path's mask array in ``report.masks``.
            threshold: The zeroing threshold for this request, fed to ``layerzero::threshold``; None runs
                with the compiled default. A model without that input raises ``InvalidInputError``.

        Raises:
            InvalidInputError: a feed is unknown, missing, or has the wrong dtype, rank or static dim (the
                message names the input), or the backend rejected the feeds.
            LayerZeroError: the backend failed while running.
        """
        arrays = self.validate_feeds(feeds)
        if threshold is not None:
            if not self.has_threshold_input:
                raise InvalidInputError(
                    f"{self._model_path} has no {THRESHOLD_INPUT!r} input: its zeroing threshold is fixed at "
                    "compile time (run it with threshold=None)"
                )
            arrays[THRESHOLD_INPUT] = np.asarray(threshold, dtype=np.float32)
        values = self._backend.run(arrays)
        return self.result_from(dict(zip(self._all_outputs, values, strict=True)), masks=masks)

    def result_from(self, values: Mapping[str, np.ndarray], *, masks: bool = False) -> Result:
        """The ``Result`` of one run from the backend's outputs by name (what ``run`` returns; the generate loop,
        which runs the session through an IO binding, turns its outputs into reports with it)."""
        report = self.report_template()
        outputs: dict[str, np.ndarray] = {}
        dynamic: dict[str, np.ndarray] = {}
        for name in self._all_outputs:
            if name in values:
                (dynamic if name in self._dynamic_outputs else outputs)[name] = values[name]
        # Masks and router outputs -> skipped_paths (per subpath of the manifest's ``dynamic`` entries),
        # zeroed_params_ratio of this request, routing_confidence and, when asked, the masks.
        report.add_dynamic(
            dynamic,
            self._dynamic_index,
            mask_prefix=MASK_PREFIX,
            router_prefix=ROUTER_PREFIX,
            keep_masks=masks,
        )
        return Result(outputs=outputs, report=report)

    def generate(self, prompt_ids: Sequence[int], **options: Any) -> Generation:
        """Generate tokens after ``prompt_ids`` with a KV cache (``layerzero.runtime.generate.generate``:
        ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_tokens``, ``on_token``,
        ``masks``); returns the new ids and a report with tokens/s and the per-step skipped paths."""
        from layerzero.runtime.generate import generate

        return generate(self, prompt_ids, **options)

    def validate_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check ``feeds`` against the inputs; return arrays of the inputs' dtypes (see the module doc)."""
        if not isinstance(feeds, Mapping):
            raise InvalidInputError(
                f"feeds must be a mapping of input name to array, got {type(feeds).__name__}; "
                f"inputs: {self._describe_inputs()}"
            )
        unknown = [name for name in feeds if name not in self._specs]
        if unknown:
            raise InvalidInputError(
                f"unknown input {', '.join(map(repr, unknown))}; the model's inputs are {self._describe_inputs()}"
            )
        missing = [spec for name, spec in self._specs.items() if name not in feeds]
        if missing:
            raise InvalidInputError("missing input " + ", ".join(f"{s.name!r} ({s.describe()})" for s in missing))
        return {name: _check_feed(spec, feeds[name]) for name, spec in self._specs.items()}

    def _describe_inputs(self) -> str:
        return ", ".join(f"{s.name!r} ({s.describe()})" for s in self._specs.values()) or "(none)"

    def __repr__(self) -> str:
        return (
            f"Engine({str(self._path)!r}, backend={self._backend.name!r}, inputs={list(self._specs)}, "
            f"outputs={self._output_names}, mask_paths={len(self._mask_paths)})"
        )


def _manifest_backend(manifest: Mapping[str, Any]) -> str:
    """The backend a bundle names: its ``backend``; bundles written before that field name only their ``target``,
    whose name was the backend's."""
    named = manifest.get("backend") or manifest.get("target") or DEFAULT_BACKEND
    return str(named)


def _use_manifest_device(
    manifest: Mapping[str, Any], backend_cls: type, backend_options: dict[str, Any], root: Path
) -> None:
    """A bundle compiled for a device (``manifest["device"]``, e.g. cuda) runs there unless the caller says otherwise.

    Only for a backend that takes a ``device`` option (``takes_device``); ``device=`` or ``providers=`` passed to
    ``Engine.load`` win. cuda without onnxruntime-gpu is one ``InvalidInputError`` line naming the bundle.
    """
    device = manifest.get("device") or "cpu"
    if device == "cpu" or not getattr(backend_cls, "takes_device", False):
        return
    if "device" in backend_options or "providers" in backend_options:
        return
    from layerzero.ort_runner import providers_for

    try:
        providers_for(device)
    except InvalidInputError as e:
        raise InvalidInputError(
            f"bundle {root} was compiled for device {device!r}: {e}; or load it with device='cpu'"
        ) from None
    backend_options["device"] = device


def _check_target(manifest: Mapping[str, Any], backend_cls: type, root: Path) -> None:
    target = manifest.get("target")
    targets = getattr(backend_cls, "targets", None)
    if target is None or targets is None or target in targets:
        return
    raise InvalidInputError(
        f"bundle {root} was compiled for target {target!r}, which the {backend_cls.name!r} backend "
        f"cannot run; load it with backend={target!r} or recompile with --target {backend_cls.name}"
    )


def _check_feed(spec: TensorSpec, value: Any) -> np.ndarray:
    name = spec.name
    if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array__"):
        # numpy arrays and other array objects (torch, jax) carry a dtype: it must match.
        array = np.asarray(value)
        if array.dtype != spec.dtype and not _same_string_kind(array.dtype, spec.dtype):
            raise InvalidInputError(
                f"input {name!r}: dtype is {array.dtype}, the model expects {spec.dtype} "
                f"(convert with .astype(np.{spec.dtype}))"
            )
    else:
        array = _convert_literal(spec, value)
    if spec.dtype.kind == "O" and array.dtype.kind != "O":
        array = array.astype(object)

    if spec.shape is None:
        return array
    if array.ndim != len(spec.shape):
        raise InvalidInputError(
            f"input {name!r}: rank is {array.ndim} (shape {list(array.shape)}), "
            f"the model expects rank {len(spec.shape)} ({spec.describe()})"
        )
    for axis, (got, want) in enumerate(zip(array.shape, spec.shape, strict=True)):
        if isinstance(want, int) and got != want:
            raise InvalidInputError(
                f"input {name!r}: dim {axis} is {got}, the model expects {want} "
                f"(shape {list(array.shape)}, expected {spec.describe()})"
            )
    return array


def _same_string_kind(got: np.dtype, want: np.dtype) -> bool:
    return want.kind == "O" and got.kind in "USO"


def _convert_literal(spec: TensorSpec, value: Any) -> np.ndarray:
    """Python list / scalar -> array of ``spec.dtype``, only when no value changes (see the module doc)."""
    name, want = spec.name, spec.dtype
    try:
        raw = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise InvalidInputError(f"input {name!r}: cannot make an array of the given {type(value).__name__}: {e}") from e
    if raw.dtype == want:
        return raw
    if raw.size == 0 and raw.dtype == np.float64 and want.kind != "O":  # np.asarray([]) is float64
        return raw.astype(want)
    if _same_string_kind(raw.dtype, want):
        return raw.astype(object)
    lossless, why = False, ""
    if raw.dtype.kind in "iu" and want.kind in "iuf":
        with np.errstate(all="ignore"):
            converted = raw.astype(want)
        # int -> narrower int wraps, int -> float rounds above 2**24/2**53: both show up as a changed value.
        lossless = bool(np.array_equal(converted.astype(raw.dtype), raw)) and bool(np.array_equal(converted, raw))
        why = f" (a value does not fit in {want} exactly)"
    elif raw.dtype.kind == "f" and want.kind == "f":
        with np.errstate(all="ignore"):
            converted = raw.astype(want)
        lossless = bool(np.all(np.isfinite(converted) | ~np.isfinite(raw)))
        why = f" (a value overflows {want})"
    if not lossless:
        raise InvalidInputError(
            f"input {name!r}: got {type(value).__name__} of {raw.dtype} values, the model expects {want}{why}"
        )
    return converted
