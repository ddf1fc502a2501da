"""Export a bundle as a Triton Inference Server model repository (``layerzero triton-export``).

    export_triton_repository("model.lz", "repo/")

writes two models::

    repo/
        layerzero/                  # Python backend: the LayerZero runtime with the guard and metrics
            config.pbtxt            #   backend "python"; user inputs/outputs only (skip masks stripped)
            1/model.py              #   TritonPythonModel = make_triton_python_model(pb_utils)
            1/model.lz/             #   a copy of the bundle
            1/reference/<name>.onnx #   the reference model, when there is one (guard fallback, kill switch)
        layerzero_onnx/             # onnxruntime backend: the compiled graph alone, as is
            config.pbtxt            #   platform "onnxruntime_onnx"; every graph output, masks included;
                                    #   model_operations { op_library_filename } for the manifest's libraries
            1/model.onnx (+ .data)
            1/liblayerzero_ort.so   #   when the bundle needs it (the native MoE lowering)

Both configs say ``max_batch_size: 0`` and list dims as the model declares them, -1 for a dynamic dim; a
scalar is ``dims: [ 1 ]`` with ``reshape: { shape: [ ] }``. ``layerzero::threshold`` is an initializer, not an
input, so neither config lists it (the ONNX model runs at its compiled threshold).

The Python-backend model needs ``layerzero`` (``pip install 'layerzero[serve]'`` minus PyTriton is enough:
numpy, onnx, onnxruntime) in the Python environment Triton's Python backend runs. Its guard settings are the
``layerzero.guard`` parameter (GuardConfig as JSON); at run time it reads ``control.json`` in its version
directory (or the file the ``layerzero.control_file`` parameter names) whenever that file changes:
``{"kill_switch": true}``, ``{"threshold": 0.1}``, ``{"thresholds": {"chat": 0.05}}``. A request picks its
segment with the request parameter ``segment``. Counters are Triton custom metrics (``layerzero_*``) on
Triton's own /metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from layerzero.contract import RUNTIME_PREFIX
from layerzero.errors import InvalidInputError

__all__ = [
    "INTERNAL_PREFIX",
    "ONNX_TO_TRITON",
    "IOSpec",
    "export_triton_repository",
    "make_triton_python_model",
    "model_io",
    "render_config",
]

logger = logging.getLogger(__name__)

#: Graph outputs named with this prefix (``layerzero::mask::``, ``layerzero::router::``) are the runtime's.
INTERNAL_PREFIX = RUNTIME_PREFIX

#: ONNX TensorProto element type -> (Triton data type, numpy dtype).
ONNX_TO_TRITON: dict[int, tuple[str, Any]] = {
    1: ("TYPE_FP32", np.float32),
    2: ("TYPE_UINT8", np.uint8),
    3: ("TYPE_INT8", np.int8),
    4: ("TYPE_UINT16", np.uint16),
    5: ("TYPE_INT16", np.int16),
    6: ("TYPE_INT32", np.int32),
    7: ("TYPE_INT64", np.int64),
    8: ("TYPE_STRING", np.bytes_),
    9: ("TYPE_BOOL", np.bool_),
    10: ("TYPE_FP16", np.float16),
    11: ("TYPE_FP64", np.float64),
    12: ("TYPE_UINT32", np.uint32),
    13: ("TYPE_UINT64", np.uint64),
    16: ("TYPE_BF16", None),
}

_MODEL_PY = '''\
"""LayerZero on Triton's Python backend (written by `layerzero triton-export`; see layerzero.runtime.triton_repo)."""

import triton_python_backend_utils as pb_utils

from layerzero.runtime.triton_repo import make_triton_python_model

TritonPythonModel = make_triton_python_model(pb_utils)
'''


@dataclasses.dataclass(frozen=True)
class IOSpec:
    """One model input or output as Triton sees it."""

    name: str
    data_type: str  # TYPE_FP32, ...
    dims: tuple[int, ...]  # -1 for a dynamic dim; () for a scalar

    @property
    def numpy_dtype(self) -> Any:
        for data_type, dtype in ONNX_TO_TRITON.values():
            if data_type == self.data_type:
                return dtype
        raise KeyError(self.data_type)


def model_io(model_path: str | os.PathLike[str]) -> tuple[list[IOSpec], list[IOSpec]]:
    """The graph's inputs (initializers excluded) and every output, from the model's own declarations.

    Raises:
        InvalidInputError: an input or output without a declared rank or with a type Triton cannot carry.
    """
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    initializers = {t.name for t in graph.initializer}

    def spec(value: Any, what: str) -> IOSpec:
        tensor = value.type.tensor_type
        kind = ONNX_TO_TRITON.get(tensor.elem_type)
        if kind is None:
            raise InvalidInputError(f"{model_path}: {what} {value.name!r} has element type {tensor.elem_type}, "
                                    "which Triton cannot carry")  # fmt: skip
        if not tensor.HasField("shape"):
            raise InvalidInputError(
                f"{model_path}: {what} {value.name!r} has no declared rank; Triton needs one "
                "(run onnx shape inference on the source, or export with a static rank)"
            )
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tensor.shape.dim)
        return IOSpec(value.name, kind[0], dims)

    inputs = [spec(v, "input") for v in graph.input if v.name not in initializers]
    outputs = [spec(v, "output") for v in graph.output]
    return inputs, outputs


def render_config(
    name: str,
    inputs: Sequence[IOSpec],
    outputs: Sequence[IOSpec],
    *,
    backend: str | None = None,
    platform: str | None = None,
    instances: int = 1,
    kind: str = "KIND_CPU",
    parameters: Mapping[str, str] | None = None,
    op_libraries: Sequence[str] = (),
) -> str:
    """A ``config.pbtxt`` (protobuf text format of Triton's ``ModelConfig``); ``op_libraries``: custom-op
    libraries the onnxruntime backend loads (``model_operations { op_library_filename }``)."""
    lines = [f"name: {_quote(name)}"]
    if backend is not None:
        lines.append(f"backend: {_quote(backend)}")
    if platform is not None:
        lines.append(f"platform: {_quote(platform)}")
    lines.append("max_batch_size: 0")
    for field, specs in (("input", inputs), ("output", outputs)):
        lines.append(f"{field} [")
        for i, spec in enumerate(specs):
            dims = ", ".join(str(d) for d in spec.dims) if spec.dims else "1"
            lines += [
                "  {",
                f"    name: {_quote(spec.name)}",
                f"    data_type: {spec.data_type}",
                f"    dims: [ {dims} ]",
            ]
            if not spec.dims:
                lines.append("    reshape: { shape: [ ] }")
            lines.append("  }" + ("," if i < len(specs) - 1 else ""))
        lines.append("]")
    lines += ["instance_group [", "  {", f"    count: {int(instances)}", f"    kind: {kind}", "  }", "]"]
    if op_libraries:
        lines += ["model_operations {", *(f"  op_library_filename: {_quote(str(p))}" for p in op_libraries), "}"]
    for key, value in (parameters or {}).items():
        lines += ["parameters {", f"  key: {_quote(key)}", f"  value: {{ string_value: {_quote(value)} }}", "}"]
    return "\n".join(lines) + "\n"


def export_triton_repository(
    bundle: str | os.PathLike[str],
    repo: str | os.PathLike[str],
    *,
    name: str = "layerzero",
    onnx_name: str | None = None,
    reference: str | os.PathLike[str] | None = None,
    no_reference: bool = False,
    guard: Any = None,
    instances: int = 1,
    onnx_kind: str = "KIND_CPU",
    overwrite: bool = False,
) -> list[Path]:
    """Write the Python-backend model ``name`` and the onnxruntime-backend model ``onnx_name`` (default
    ``<name>_onnx``) of ``bundle`` into the repository ``repo`` (created if missing; other models there are left
    alone). Returns the two model directories.

    Args:
        reference: The reference model for the guard; default: the bundle's source (manifest ``source.path``)
            when that file still exists unchanged, else none (no sampling, no kill switch).
        no_reference: Export without a reference even when the source is there.
        guard: A ``GuardConfig`` for the Python model; default: ``GuardConfig()`` with a reference, sampling off
            without one.

    Raises:
        InvalidInputError: not a bundle, a model directory already there (without ``overwrite``), a model
            input/output Triton cannot describe.
    """
    from layerzero.runtime.bundle import read_bundle
    from layerzero.runtime.guard import GuardConfig

    bundle_info = read_bundle(Path(bundle))
    repo = Path(repo)
    onnx_name = onnx_name or f"{name}_onnx"
    for model_name in (name, onnx_name):
        if not model_name or "/" in model_name or model_name.startswith("."):
            raise InvalidInputError(f"model name {model_name!r} must be a plain directory name")
    if name == onnx_name:
        raise InvalidInputError(f"the two models need different names, both are {name!r}")
    targets = [repo / name, repo / onnx_name]
    if os.path.lexists(repo) and not repo.is_dir():
        raise InvalidInputError(f"{repo} exists and is not a directory; give a model repository directory")
    for target in targets:
        if not os.path.lexists(target):
            continue
        if not overwrite:
            raise InvalidInputError(f"{target} already exists (pass --force to replace it)")
        if not _is_exported(target):
            raise InvalidInputError(
                f"refusing to replace {target}: it is not a model written by `layerzero triton-export` "
                "(remove it yourself or choose another --name)"
            )
    if no_reference:
        reference = None
    elif reference is None:
        reference = default_reference(bundle_info.manifest)
    elif not Path(reference).exists():
        raise InvalidInputError(f"reference model {reference} does not exist")
    if guard is None:
        guard = GuardConfig() if reference is not None else GuardConfig(sample_rate=0.0)

    inputs, outputs = model_io(bundle_info.model_path)
    # Every ``layerzero::`` output (mask::, router::) is the runtime's, not the user's: (a) strips them.
    user_outputs = [o for o in outputs if not o.name.startswith(INTERNAL_PREFIX)]
    try:
        repo.mkdir(parents=True, exist_ok=True)
        _write_models(repo, name, onnx_name, bundle_info, reference, guard, inputs, outputs, user_outputs,
                      instances, onnx_kind, overwrite)  # fmt: skip
    except OSError as e:
        raise InvalidInputError(f"cannot write the model repository {repo}: {e.strerror or e}") from None
    return targets


def _write_models(
    repo: Path, name: str, onnx_name: str, bundle_info: Any, reference: Any, guard: Any, inputs: Any,
    outputs: Any, user_outputs: Any, instances: int, onnx_kind: str, overwrite: bool,
) -> None:  # fmt: skip
    from layerzero.runtime.bundle import MODEL_NAME


    # (a) the Python backend model: the runtime, with the guard and metrics.
    params = {"layerzero.guard": json.dumps(guard.to_dict(), sort_keys=True)}
    with _staged(repo, name, overwrite) as stage:
        version = stage / "1"
        version.mkdir()
        (version / "model.py").write_text(_MODEL_PY, encoding="utf-8")
        shutil.copytree(bundle_info.path, version / "model.lz")
        if reference is not None:
            ref = Path(reference)
            if ref.is_dir():
                shutil.copytree(ref, version / "reference" / ref.name)
                params["layerzero.reference"] = f"reference/{ref.name}"
            else:
                (version / "reference").mkdir()
                _copy_model(ref, version / "reference")
                params["layerzero.reference"] = f"reference/{ref.name}"
        config = render_config(name, inputs, user_outputs, backend="python", instances=instances, parameters=params)
        (stage / "config.pbtxt").write_text(EXPORT_MARKER + config, encoding="utf-8")

    # (b) the onnxruntime backend model: the compiled graph as is (mask outputs included).
    with _staged(repo, onnx_name, overwrite) as stage:
        version = stage / "1"
        version.mkdir()
        _copy_model(bundle_info.model_path, version, MODEL_NAME)
        op_libraries = _copy_op_libraries(bundle_info.manifest, version, repo.resolve() / onnx_name / "1")
        config = render_config(
            onnx_name, inputs, outputs, platform="onnxruntime_onnx", kind=onnx_kind, op_libraries=op_libraries
        )
        (stage / "config.pbtxt").write_text(EXPORT_MARKER + config, encoding="utf-8")


#: The first line of every config.pbtxt `layerzero triton-export` writes (a pbtxt comment): what --force may
#: replace. A directory without it is someone else's model.
EXPORT_MARKER = "# written by layerzero triton-export\n"


def _is_exported(target: Path) -> bool:
    if target.is_symlink() or not target.is_dir():
        return False
    try:
        with open(target / "config.pbtxt", encoding="utf-8") as f:
            return f.readline() == EXPORT_MARKER
    except (OSError, UnicodeDecodeError):
        return False


def _copy_op_libraries(manifest: Mapping[str, Any], version: Path, final: Path) -> list[str]:
    """Copy the custom-op libraries the bundle needs (manifest ``libraries``) into the version directory; their
    absolute paths once the stage is in place (Triton resolves ``op_library_filename`` on the server: move the
    repository and the path must follow)."""
    from layerzero.plugins import ort_library

    paths = []
    for lib in manifest.get("libraries") or []:
        try:
            source = ort_library.ort_library_path(name=str(lib))
        except ort_library.PluginError as e:
            raise InvalidInputError(f"the bundle needs {lib}: {e}") from e
        shutil.copy2(source, version / source.name)
        paths.append(str(final / source.name))
    return paths


def default_reference(manifest: Mapping[str, Any]) -> Path | None:
    """The bundle's source model when it can serve as the guard's reference, else None (with a warning).

    It can when the file is still where it was compiled from, unchanged (sha256), and computes what the
    bundle computes: a source with *declared* zero flags still runs those layers (the flag is only a
    declaration), so against it every sampled request would measure the layers' impact and fall back.
    """
    from layerzero.runtime.bundle import sha256_file

    source = manifest.get("source")
    path = source.get("path") if isinstance(source, Mapping) else None
    if not path or not Path(path).is_file():
        return None
    removed = manifest.get("removed")
    declared = [r.get("scope") for r in removed or [] if isinstance(r, Mapping) and r.get("kind") == "declared-flag"]
    if declared:
        logger.warning(
            "not using the source %s as the reference: it still computes the declared zero-flag layer(s) %s "
            "that the bundle removed; pass a reference that honours them (--reference)",
            path,
            ", ".join(declared),
        )
        return None
    want = source.get("sha256")
    if want and sha256_file(Path(path)) != want:
        logger.warning("%s changed since it was compiled (sha256 differs): not using it as the reference", path)
        return None
    return Path(path)


# --------------------------------------------------------------------------------- the Python backend model


def make_triton_python_model(pb_utils: Any) -> type:
    """The ``TritonPythonModel`` class for Triton's Python backend, bound to its ``pb_utils`` module."""

    class TritonPythonModel:
        def initialize(self, args: dict[str, str]) -> None:
            from layerzero.runtime.engine import Engine
            from layerzero.runtime.guard import GuardConfig, GuardedEngine

            config = json.loads(args["model_config"])
            params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
            version_dir = Path(args["model_repository"]) / str(args["model_version"])
            self.engine = Engine.load(version_dir / "model.lz")
            guard_config = GuardConfig.from_dict(json.loads(params.get("layerzero.guard") or "{}"))
            reference = params.get("layerzero.reference")
            self.guard = GuardedEngine(self.engine, version_dir / reference if reference else None, guard_config)
            self.input_names = [s.name for s in self.engine.input_specs]
            self.output_names = self.engine.output_names
            control = params.get("layerzero.control_file") or "control.json"
            self.control_file = version_dir / control
            self._control_mtime: int | None = None
            self._metrics = _TritonMetrics(pb_utils, args.get("model_name", config.get("name", "layerzero")))
            self._apply_control()

        def execute(self, requests: list) -> list:
            self._apply_control()
            responses = []
            for request in requests:
                started = time.perf_counter()
                try:
                    feeds = {}
                    for input_name in self.input_names:
                        tensor = pb_utils.get_input_tensor_by_name(request, input_name)
                        if tensor is None:
                            raise InvalidInputError(f"missing input {input_name!r}")
                        feeds[input_name] = tensor.as_numpy()
                    request_params = json.loads(request.parameters() or "{}")
                    result = self.guard.run(feeds, segment=request_params.get("segment"))
                    tensors = [pb_utils.Tensor(n, np.ascontiguousarray(result.outputs[n])) for n in self.output_names]
                    responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
                    self._metrics.observe(result, time.perf_counter() - started, self.guard)
                except Exception as e:
                    self._metrics.error()
                    responses.append(
                        pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"layerzero: {e}"))
                    )
            return responses

        def finalize(self) -> None:
            self.guard = None

        def _apply_control(self) -> None:
            # One stat per execute(); the file is read only when its mtime changes. No file = no change.
            try:
                mtime = self.control_file.stat().st_mtime_ns
            except OSError:
                return
            if mtime == self._control_mtime:
                return
            self._control_mtime = mtime
            try:
                doc = json.loads(self.control_file.read_text(encoding="utf-8") or "{}")
                if "kill_switch" in doc:
                    self.guard.set_kill_switch(bool(doc["kill_switch"]))
                if "threshold" in doc:
                    self.guard.set_threshold(float(doc["threshold"]))
                for segment, value in (doc.get("thresholds") or {}).items():
                    self.guard.set_threshold(float(value), segment)
            except Exception as e:  # a bad control file must not take the model down
                logger.error("ignoring %s: %s", self.control_file, e)

    return TritonPythonModel


class _TritonMetrics:
    """Triton custom metrics (``pb_utils.MetricFamily``), exposed on Triton's own /metrics."""

    def __init__(self, pb_utils: Any, model: str) -> None:
        family = getattr(pb_utils, "MetricFamily", None)
        self.enabled = family is not None
        if not self.enabled:
            logger.warning("this Triton has no custom metrics (pb_utils.MetricFamily): layerzero metrics are off")
            return
        labels = {"model": model}
        self._families: list[Any] = []  # a Metric is valid only while its MetricFamily lives

        def metric(name: str, description: str, kind: Any) -> Any:
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1].Metric(labels=labels)

        counter, gauge = family.COUNTER, family.GAUGE
        self.requests = metric("layerzero_requests_total", "Requests served", counter)
        self.fallbacks = metric("layerzero_fallbacks_total", "Sampled requests answered by the reference", counter)
        self.reference_runs = metric("layerzero_reference_runs_total", "Runs of the reference model", counter)
        self.errors = metric("layerzero_request_errors_total", "Requests that failed", counter)
        self.latency = metric("layerzero_request_latency_us_total", "Summed request latency, microseconds", counter)
        self.kill_switch = metric("layerzero_kill_switch", "1 while every request goes to the reference", gauge)
        self.threshold = metric("layerzero_zeroing_threshold", "Default segment's zeroing threshold", gauge)

    def observe(self, result: Any, seconds: float, guard: Any) -> None:
        if not self.enabled:
            return
        self.requests.increment(1)
        self.latency.increment(seconds * 1e6)
        if result.route == "fallback":
            self.fallbacks.increment(1)
        if result.route != "compiled":
            self.reference_runs.increment(1)
        self.kill_switch.set(float(guard.kill_switch))
        self.threshold.set(float(guard.threshold()))

    def error(self) -> None:
        if self.enabled:
            self.errors.increment(1)


# ----------------------------------------------------------------------------------------------- internals


class _staged:
    """Build a model directory in a temporary sibling, then rename it into place (replacing an old one)."""

    def __init__(self, repo: Path, name: str, overwrite: bool) -> None:
        from layerzero.runtime.bundle import clean_stale_temp_dirs

        self.target = repo / name
        self.overwrite = overwrite
        clean_stale_temp_dirs(repo, name)  # of exports that were killed
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=repo))

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        from layerzero.runtime.bundle_files import current_umask, locked

        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        self.tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes 0700; Triton's account must read it
        old = None
        try:
            with locked(self.target.parent):  # concurrent exports to one repo: one swap at a time
                if os.path.lexists(self.target):
                    if not (self.overwrite and _is_exported(self.target)):
                        raise InvalidInputError(f"{self.target} already exists (pass --force to replace it)")
                    prefix = f".{self.target.name}.old-{os.getpid()}-"
                    old = Path(tempfile.mkdtemp(prefix=prefix, dir=self.target.parent))
                    os.rmdir(old)
                    self.target.rename(old)
                self.tmp.rename(self.target)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if old is not None and not os.path.lexists(self.target):
                old.rename(self.target)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _copy_model(src: Path, dst_dir: Path, name: str | None = None) -> Path:
    """Copy an .onnx file and the external-data files it references (same relative locations)."""
    import onnx

    from layerzero.runtime.bundle import check_external_data

    check_external_data(src)
    dst = dst_dir / (name or src.name)
    shutil.copy2(src, dst)
    model = onnx.load(str(src), load_external_data=False)
    locations = set()
    for tensor in _tensors(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            locations.add(info.get("location", ""))
    for location in sorted(locations - {""}):
        target = dst_dir / location
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.parent / location, target)
    return dst


def _tensors(graph: Any) -> Any:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'
