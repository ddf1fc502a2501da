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
dim is an ``InvalidInputError`` naming the input, not a backend stack trace; so is a named dim (``batch``,
``seq``) that two inputs give different values, an ``attention_mask`` whose length is not past + seq (a model
with ``past_key_values.*`` inputs), and an ``input_ids`` value outside the vocabulary (the rows of the embedding
``Gather`` it indexes, else the ``vocab_size`` ``layerzero export`` recorded, else the logits' last dim): ONNX
Runtime's ``Gather`` would wrap -1 to the last row and answer without a word. Python lists and scalars are
converted to the input's dtype when that is lossless (ints to any int/float type that holds them exactly;
floats to any float type, rounding as a float literal would, but not overflowing to inf). numpy arrays (and
other objects with a dtype) must already have the input's dtype: a silent float64 -> float32 cast hides bugs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from layerzero.contract import ACTIVATION_SCALE_INPUT, MASK_PREFIX, ROUTER_PREFIX, THRESHOLD_INPUT
from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.runtime.backends.base import Backend, TensorSpec, get_backend
from layerzero.runtime.bundle import check_external_data, read_bundle
from layerzero.runtime.report import Report, index_dynamic

if TYPE_CHECKING:
    from layerzero.runtime.report import Generation

__all__ = ["ACTIVATION_SCALE_INPUT", "MASK_PREFIX", "ROUTER_PREFIX", "THRESHOLD_INPUT", "Engine", "Result"]

#: Inputs the runtime feeds (graph inputs with a compiled default), never the user: ``run(threshold=,
#: activation_scale=)`` sets them.
RUNTIME_INPUTS = (THRESHOLD_INPUT, ACTIVATION_SCALE_INPUT)

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
        # The runtime's own inputs (a backend that lists initialised inputs would list them) are not the user's.
        self._specs = {spec.name: spec for spec in backend.input_specs if spec.name not in RUNTIME_INPUTS}
        all_outputs = backend.output_names
        # Per request, run() sorts the backend's outputs (in this order) into the user's and the dynamic ones.
        self._all_outputs = list(all_outputs)
        self._dynamic_outputs = frozenset(n for n in all_outputs if n.startswith((MASK_PREFIX, ROUTER_PREFIX)))
        self._output_names = [n for n in all_outputs if n not in self._dynamic_outputs]
        self._mask_paths = [n[len(MASK_PREFIX) :] for n in all_outputs if n.startswith(MASK_PREFIX)]
        self._template = Report.from_manifest(self._manifest)
        self._dynamic_index = index_dynamic(self._manifest.get("dynamic"))  # once, not per request
        self._has_threshold: bool | None = None
        self._has_activation_scale: bool | None = None
        # The activation scale every request runs with unless it says otherwise (None: the compiled 1;
        # ``--no-activation-sparsity``: 0, the dense model exactly).
        self.activation_scale: float | None = None
        self._vocab: tuple[int | None] | None = None  # (rows of input_ids,) once read from the graph

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

    @property
    def dynamic_index(self) -> dict[str, dict]:
        """The manifest's ``dynamic`` entries by mask output name (``report.index_dynamic``, computed once)."""
        return self._dynamic_index

    def report_template(self) -> Report:
        """A fresh report holding the static fields (from the manifest); per-request fields empty."""
        return self._template.copy()

    @property
    def has_threshold_input(self) -> bool:
        """Whether the model reads its zeroing threshold from ``layerzero::threshold`` (``run(threshold=)``)."""
        if self._has_threshold is None:
            self._read_graph()
        return bool(self._has_threshold)

    @property
    def has_activation_scale_input(self) -> bool:
        """Whether the model has activation sparsity, scaled by ``layerzero::activation_scale``
        (``run(activation_scale=)``; 1 = as compiled, 0 = dense)."""
        if self._has_activation_scale is None:
            self._read_graph()
        return bool(self._has_activation_scale)

    @property
    def vocab_size(self) -> int | None:
        """How many token ids ``input_ids`` takes (``0 <= id < vocab_size``); None when the model has no such
        input or it cannot be told (see the module doc)."""
        if self._vocab is None:
            self._read_graph()
        return self._vocab[0] if self._vocab else None

    def _read_graph(self) -> None:
        """What the graph itself tells (read once, weights not loaded): the threshold input, the vocabulary."""
        model = _graph_of(self._model_path)
        self._has_threshold = model is not None and any(i.name == THRESHOLD_INPUT for i in model.graph.input)
        self._has_activation_scale = model is not None and any(
            i.name == ACTIVATION_SCALE_INPUT for i in model.graph.input
        )
        spec = self._specs.get("input_ids")
        ids = model is not None and spec is not None and spec.dtype.kind in "iu"
        self._vocab = (_token_rows(model, "input_ids") if ids else None,)

    def first_step_feeds(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """``feeds`` completed as the first step of a generation would be, for a causal LM (``layerzero export``).

        Of the inputs the caller did not give: ``attention_mask`` is ones over past + seq, ``position_ids`` count
        the tokens the mask keeps (``past .. past + seq - 1`` under an all-ones mask; as the generate loop), and
        the ``past_key_values.*`` an empty past ``[batch, kv_heads, 0, head_dim]`` (the generate loop's prefill
        past, read from the inputs' specs). A given input is used as is; a 1-D ``input_ids`` is one sequence
        ``[1, seq]``. Any other model, or feeds without ``input_ids``, come back unchanged (``run`` then names
        what is missing).
        """
        from layerzero.runtime.generate import cache_layout

        out = dict(feeds)
        names = self._specs
        if "input_ids" not in out or not {"input_ids", "attention_mask", "position_ids"} <= names.keys():
            return out
        ids = out["input_ids"]
        try:
            ids = ids if hasattr(ids, "ndim") else np.asarray(ids)
            mask = None if "attention_mask" not in out else np.asarray(out["attention_mask"])
        except (ValueError, TypeError):  # ragged lists: said in one line naming the input, as validate_feeds does
            for name in ("input_ids", "attention_mask"):
                if name in out:
                    _check_feed(names[name], out[name])
            return out
        if ids.ndim == 1 and names["input_ids"].rank == 2:
            out["input_ids"] = ids = ids.reshape(1, -1)
        if ids.ndim != 2:
            return out  # validate_feeds names the rank
        try:
            layout = cache_layout(self)
        except UnsupportedModelError:
            layout = None
        batch, seq = (int(d) for d in ids.shape)
        past = 0
        if layout is not None:
            given = [out[p] for p, _ in layout.names if p in out]
            if not given:  # an empty past, as the generate loop's prefill; a partial one is the caller's to finish
                out.update(layout.empty(batch))
            elif np.ndim(given[0]) == 4:
                past = int(np.shape(given[0])[2])
        if "attention_mask" not in out:
            out["attention_mask"] = np.ones((batch, past + seq), dtype=names["attention_mask"].dtype)
        if "position_ids" not in out:
            mask = np.asarray(out["attention_mask"]) if mask is None else mask
            if mask.ndim == 2 and mask.shape[0] == batch and mask.shape[1] >= seq:
                # As the generate loop (and transformers): positions count the real tokens, pads sit at 0.
                keep = mask != 0
                positions = np.where(keep, np.cumsum(keep, axis=1) - 1, 0)[:, mask.shape[1] - seq :]
                out["position_ids"] = positions.astype(names["position_ids"].dtype)
            else:  # a mask of the wrong shape: validate_feeds names it, not a missing position_ids
                positions = np.arange(past, past + seq, dtype=names["position_ids"].dtype)
                out["position_ids"] = np.broadcast_to(positions, (batch, seq)).copy()
        return out

    def run(
        self,
        feeds: Mapping[str, Any],
        *,
        masks: bool = False,
        threshold: float | None = None,
        activation_scale: float | None = None,
    ) -> Result:
        """Validate ``feeds``, run the model, and return the user outputs and this request's report.

        Args:
            feeds: Input name -> numpy array (or a Python list/scalar, converted when lossless).
            masks: Also return each path's mask array in ``report.masks``.
            threshold: The zeroing threshold for this request, fed to ``layerzero::threshold``; None runs
                with the compiled default. A model without that input raises ``InvalidInputError``.
            activation_scale: The multiplier of the activation-sparsity thresholds, fed to
                ``layerzero::activation_scale`` (0: the dense model exactly); None: ``self.activation_scale``, else
                the compiled 1 (``validate_feeds``). Ignored (dense already) by a model without activation sparsity.

        Raises:
            InvalidInputError: a feed is unknown, missing, or has the wrong dtype, rank or static dim, a named
                dim another input gives another size, a mask not past + seq long, an ``input_ids`` value
                outside the vocabulary (the message names the input), or the backend rejected the feeds.
            LayerZeroError: the backend failed while running.
        """
        arrays = self.validate_feeds(feeds)
        scale = activation_scale if activation_scale is not None else self.activation_scale
        if scale is not None and ACTIVATION_SCALE_INPUT not in feeds:
            arrays.update(self._scale_feed(scale))
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

        if self.activation_scale is not None and self.has_activation_scale_input:
            # The bound decode loop cannot feed the scale (an initialised input): every step through run() instead.
            from layerzero.runtime.guard import GuardConfig, GuardedEngine

            return generate(GuardedEngine(self, None, GuardConfig(sample_rate=0.0)), prompt_ids, **options)
        return generate(self, prompt_ids, **options)

    def validate_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check ``feeds`` against the inputs; return arrays of the inputs' dtypes (see the module doc).

        ``layerzero::activation_scale`` is the runtime's input, not the user's (``input_specs`` leaves it out, no
        request misses it): a feed of it is checked (a finite number >= 0) and kept (dropped for a model without
        activation sparsity: dense already). ``run`` adds ``self.activation_scale`` when set; ONNX Runtime's IO
        binding cannot bind it (an initialised input), so the generate loop's bound steps run at the compiled 1.
        """
        scale: dict[str, np.ndarray] = {}
        if isinstance(feeds, Mapping) and ACTIVATION_SCALE_INPUT in feeds:
            scale = self._scale_feed(feeds[ACTIVATION_SCALE_INPUT])
            feeds = {k: v for k, v in feeds.items() if k != ACTIVATION_SCALE_INPUT}
        return {**self._validate_user_feeds(feeds), **scale}

    def _scale_feed(self, value: Any) -> dict[str, np.ndarray]:
        """``{layerzero::activation_scale: value}`` for a model with activation sparsity, else nothing (dense)."""
        try:
            scale = float(np.asarray(value, dtype=np.float64).reshape(()))
        except (TypeError, ValueError):
            scale = float("nan")
        if not (np.isfinite(scale) and scale >= 0):
            raise InvalidInputError(f"{ACTIVATION_SCALE_INPUT}: expected a finite number >= 0, got {value!r}")
        return {ACTIVATION_SCALE_INPUT: np.asarray(scale, np.float32)} if self.has_activation_scale_input else {}

    def _validate_user_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
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
        arrays = {name: _check_feed(spec, feeds[name]) for name, spec in self._specs.items()}
        _check_named_dims(self._specs, arrays)
        _check_cache_lengths(self._specs, arrays)
        ids = arrays.get("input_ids")
        if ids is not None and ids.size and ids.dtype.kind in "iu" and self.vocab_size is not None:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise InvalidInputError(
                    f"input 'input_ids': token id {bad} is outside the vocabulary [0, {self.vocab_size}) of "
                    f"{self._model_path}"
                )
        return arrays

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


def _check_named_dims(specs: Mapping[str, TensorSpec], arrays: Mapping[str, np.ndarray]) -> None:
    """A named dim (``batch``, ``seq``) is one size across the inputs: ONNX Runtime would fail deep inside the graph
    (``Shape mismatch attempting to re-use buffer``), or broadcast and answer."""
    seen: dict[str, tuple[str, int]] = {}  # dim name -> (the first input giving it, its size)
    for name, spec in specs.items():
        if spec.shape is None:
            continue
        for axis, dim in enumerate(spec.shape):
            if not isinstance(dim, str):
                continue
            got = int(arrays[name].shape[axis])
            first = seen.setdefault(dim, (name, got))
            if first[1] != got:
                expected = [first[1] if d == dim else s for d, s in zip(spec.shape, arrays[name].shape, strict=True)]
                raise InvalidInputError(
                    f"input {name!r}: shape {list(arrays[name].shape)}, expected {expected} ({spec.describe()}: "
                    f"{dim} is {first[1]}, as in {first[0]!r})"
                )


def _check_cache_lengths(specs: Mapping[str, TensorSpec], arrays: Mapping[str, np.ndarray]) -> None:
    """A causal LM with a KV cache (inputs ``input_ids``, ``attention_mask``, ``past_key_values.*`` as
    ``layerzero export`` names them): at least one token, and a mask as long as past + seq."""
    pasts = [n for n in specs if n.startswith("past_key_values.") and arrays[n].ndim == 4]
    ids, mask = arrays.get("input_ids"), arrays.get("attention_mask")
    if not pasts or ids is None or mask is None or ids.ndim != 2 or mask.ndim != 2:
        return
    if ids.shape[1] == 0:
        raise InvalidInputError(f"input 'input_ids': shape {list(ids.shape)} has no token; give at least one")
    past, seq = int(arrays[pasts[0]].shape[2]), int(ids.shape[1])
    if mask.shape[1] != past + seq:
        raise InvalidInputError(
            f"input 'attention_mask': shape {list(mask.shape)}, expected {[mask.shape[0], past + seq]} (its length "
            f"is past + seq: {past} in {pasts[0]!r} + {seq} in 'input_ids')"
        )


def _graph_of(path: Path) -> Any:
    """The model's ONNX proto without its weights' data (dims only); None when ``path`` is not an ONNX file."""
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # a TensorRT plan, a broken file: the backend already loaded it, nothing to learn here
        logger.debug("%s: not read as ONNX (%s)", path, e)
        return None


def _token_rows(model: Any, name: str) -> int | None:
    """The ids ``name`` may hold: the rows of the weight it indexes (``Gather(W, ids)``, axis 0, an embedding), else
    the ``vocab_size`` of the export's metadata, else the static last dim of a ``logits`` output."""
    from layerzero.runtime.generate import GENERATE_META_KEY

    graph = model.graph
    rows = {t.name: int(t.dims[0]) for t in graph.initializer if len(t.dims) >= 1}
    limits = []
    for node in graph.node:
        if name not in node.input or node.op_type in ("Shape", "Size"):  # Shape reads the ids' shape only
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type == "Gather" and axis == 0 and list(node.input).index(name) == 1 and node.input[0] in rows:
            limits.append(rows[node.input[0]])
    if limits:
        return min(limits)
    for prop in model.metadata_props:
        if prop.key == GENERATE_META_KEY:
            try:
                vocab = json.loads(prop.value).get("vocab_size")
            except (ValueError, AttributeError):
                vocab = None
            if isinstance(vocab, int) and vocab > 0:
                return vocab
    for output in graph.output:
        dims = output.type.tensor_type.shape.dim
        if output.name == "logits" and dims and dims[-1].HasField("dim_value") and dims[-1].dim_value > 0:
            return int(dims[-1].dim_value)
    return None


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
