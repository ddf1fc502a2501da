"""The TensorRT backend: runs the engine plan of a bundle compiled with ``--target tensorrt``.

    engine = Engine.load("model.lz", backend="tensorrt")          # model.lz/model.plan next to model.onnx
    engine = Engine.load("model.lz", backend="tensorrt", device=1, plugin_library="/path/liblayerzero_trt.so")

A TensorRT bundle holds ``model.onnx`` (the lowered graph: the one to rebuild a plan from on another GPU or
TensorRT version, plans are not portable) and ``model.plan`` (the engine). ``load`` reads the plan next to the
model file it is given (``<model>.plan``, then ``model.plan``), or a ``.plan`` file directly.

Options:

- ``device``: the CUDA device index (default 0).
- ``plugin_library``: the LayerZero plugin library (``liblayerzero_trt.so``); default: found like
  ``layerzero.plugins.loader.plugin_library_path("trt")`` (``LAYERZERO_PLUGIN_DIR``, the default build dir).
  Loaded into TensorRT's plugin registry before the plan is deserialised; a plan without LayerZero plugin
  layers loads without it.

Device memory goes through cuda-python (see ``_cuda.py`` for why that library). Imports of ``tensorrt`` and
``cuda`` happen in ``load``, so registering and listing backends stays cheap. A backend instance is not
thread-safe (one execution context, one stream); create one ``Engine`` per thread.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from layerzero.errors import InvalidInputError, LayerZeroError, UnsupportedModelError
from layerzero.runtime.backends.base import TensorSpec, reject_unknown_options

__all__ = ["TensorRTBackend", "TensorRTUnavailableError", "import_tensorrt", "load_plugin_library", "trt_logger"]

logger = logging.getLogger(__name__)

_OPTIONS = ("device", "plugin_library")


class TensorRTUnavailableError(LayerZeroError):
    """TensorRT (or cuda-python) cannot be imported here; the message says what to install."""


def import_tensorrt() -> Any:
    """``import tensorrt``, or a ``TensorRTUnavailableError`` that says how to get it."""
    try:
        import tensorrt
    except ImportError as e:
        raise TensorRTUnavailableError(
            "TensorRT is not available: the tensorrt Python package cannot be imported "
            f"({e}). Install it on a machine with an NVIDIA GPU (pip install tensorrt-cu12 cuda-python, or use an "
            "NGC TensorRT container), or use the onnxruntime target/backend"
        ) from e
    return tensorrt


class _Logger:
    """A tensorrt.ILogger that forwards to Python logging (created lazily: it subclasses a tensorrt type)."""

    _instance: Any = None

    @classmethod
    def get(cls, trt: Any) -> Any:
        if cls._instance is None:

            class Forward(trt.ILogger):
                def __init__(self) -> None:
                    trt.ILogger.__init__(self)
                    self.errors: list[str] = []

                def log(self, severity: Any, msg: str) -> None:
                    if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                        self.errors.append(msg)
                        logger.error("TensorRT: %s", msg)
                    elif severity == trt.ILogger.Severity.WARNING:
                        logger.warning("TensorRT: %s", msg)
                    else:
                        logger.debug("TensorRT: %s", msg)

            cls._instance = Forward()
        return cls._instance


def trt_logger(trt: Any) -> Any:
    """The process's ``tensorrt.ILogger``: forwards to Python logging and keeps TensorRT's errors in ``.errors``
    (the builder and this backend share it, so a failed build or load can quote them)."""
    return _Logger.get(trt)


_LOADED_LIBRARIES: dict[str, Any] = {}


def load_plugin_library(trt: Any, path: str | Path | None = None, *, required: bool = False) -> Path | None:
    """Load ``liblayerzero_trt.so`` into TensorRT's global plugin registry (once per process).

    Returns the path loaded, or None when no library was given or found and ``required`` is False.

    Raises:
        InvalidInputError: ``path`` does not exist, or the library is required and not found.
        LayerZeroError: TensorRT refused the library.
    """
    if path is None:
        from layerzero.plugins.loader import PluginError, plugin_library_path

        try:
            path = plugin_library_path("trt")
        except PluginError as e:
            if required:
                raise InvalidInputError(str(e)) from None
            logger.info("no LayerZero plugin library loaded: %s", e)
            return None
    path = Path(path).resolve()
    if not path.is_file():
        raise InvalidInputError(f"plugin library {path} does not exist; build it with `layerzero plugins build`")
    key = str(path)
    if key in _LOADED_LIBRARIES:
        return path
    registry = trt.get_plugin_registry()
    try:
        handle = registry.load_library(key)
    except Exception as e:  # pybind raises RuntimeError/TypeError variants
        raise LayerZeroError(f"TensorRT could not load the plugin library {path}: {e}") from e
    if handle is None:
        raise LayerZeroError(f"TensorRT could not load the plugin library {path} (see the TensorRT log above)")
    _LOADED_LIBRARIES[key] = handle
    logger.info("loaded TensorRT plugin library %s", path)
    return path


def _find_plan(model_path: Path) -> Path:
    if model_path.suffix in (".plan", ".engine"):
        return model_path
    for candidate in (model_path.with_suffix(".plan"), model_path.parent / "model.plan"):
        if candidate.is_file():
            return candidate
    raise UnsupportedModelError(
        f"no TensorRT plan next to {model_path} (looked for {model_path.with_suffix('.plan').name}); compile the "
        "model with `layerzero compile MODEL -o OUT --target tensorrt`, or run it with backend='onnxruntime'"
    )


class TensorRTBackend:
    """Runs a serialized TensorRT engine with one execution context and one CUDA stream."""

    name = "tensorrt"
    #: Bundle targets this backend can run (``Engine.load`` checks the manifest's ``target``).
    targets = ("tensorrt",)
    #: ``load`` takes built plans only, not an ONNX file.
    loads_onnx = False

    def __init__(self) -> None:
        self._trt: Any = None
        self._cuda: Any = None
        self._engine: Any = None
        self._context: Any = None
        self._plan_path: Path | None = None
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._input_specs: list[TensorSpec] = []
        self._buffers: dict[str, Any] = {}

    def load(
        self, model_path: Path, *, device: int = 0, plugin_library: str | Path | None = None, **unknown: Any
    ) -> None:
        reject_unknown_options(self.name, unknown, _OPTIONS)
        trt = import_tensorrt()
        from layerzero.runtime.backends._cuda import Cuda, CudaUnavailableError

        plan_path = _find_plan(Path(model_path))
        try:
            self._cuda = Cuda(int(device))
        except CudaUnavailableError as e:
            raise TensorRTUnavailableError(str(e)) from e
        except RuntimeError as e:
            raise TensorRTUnavailableError(f"CUDA device {device} is not usable: {e}") from e
        load_plugin_library(trt, plugin_library, required=plugin_library is not None)
        log = trt_logger(trt)
        log.errors.clear()
        runtime = trt.Runtime(log)
        engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
        if engine is None:
            detail = "; ".join(log.errors[-3:]) or "see the TensorRT log"
            hint = ""
            if "plugin" in detail.lower() or "creator" in detail.lower():
                hint = (
                    " (the plan uses the LayerZero plugin: build it with `layerzero plugins build` or pass "
                    "plugin_library=)"
                )
            raise UnsupportedModelError(f"TensorRT cannot deserialize {plan_path}: {detail}{hint}")
        self._trt, self._runtime, self._engine = trt, runtime, engine
        self._context = engine.create_execution_context()
        if self._context is None:
            raise LayerZeroError(f"TensorRT could not create an execution context for {plan_path}")
        self._plan_path = plan_path
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self._inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self._outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self._input_specs = [self._spec(n) for n in self._inputs]
        logger.debug("loaded %s: inputs %s, outputs %s", plan_path, self._inputs, self._outputs)

    def _dtype(self, name: str) -> np.dtype:
        trt_type = self._engine.get_tensor_dtype(name)
        try:
            return np.dtype(self._trt.nptype(trt_type))
        except TypeError:
            raise UnsupportedModelError(
                f"tensor {name!r} of {self._plan_path} has TensorRT type {trt_type}, which has no numpy type "
                "(bfloat16/fp8 I/O): keep the model's inputs and outputs float32/float16"
            ) from None

    def _spec(self, name: str) -> TensorSpec:
        shape = tuple(None if d < 0 else int(d) for d in self._engine.get_tensor_shape(name))
        return TensorSpec(name=name, dtype=self._dtype(name), shape=shape)

    @property
    def input_specs(self) -> list[TensorSpec]:
        return list(self._input_specs)

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    @property
    def engine(self) -> Any:
        """The ``tensorrt.ICudaEngine`` (for inspection: layers, profiles, memory)."""
        self._require()
        return self._engine

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        from layerzero.runtime.backends._cuda import DeviceBuffer

        self._require()
        ctx, cuda = self._context, self._cuda
        for name in self._inputs:
            array = np.ascontiguousarray(feeds[name])
            if not ctx.set_input_shape(name, array.shape):
                raise InvalidInputError(
                    f"input {name!r}: shape {list(array.shape)} is outside the engine's optimisation profile "
                    f"(min {list(self._engine.get_tensor_profile_shape(name, 0)[0])}, max "
                    f"{list(self._engine.get_tensor_profile_shape(name, 0)[2])}); rebuild with --shape "
                    f"{name}:MIN/OPT/MAX"
                )
            buf = self._buffers.get(name) or self._buffers.setdefault(name, DeviceBuffer(cuda))
            ptr = buf.ensure(array.nbytes)
            cuda.upload(ptr, array)
            ctx.set_tensor_address(name, ptr)
        results = []
        for name in self._outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise LayerZeroError(f"output {name!r} has an unresolved shape {list(shape)} after setting the inputs")
            out = np.empty(shape, dtype=self._dtype(name))
            buf = self._buffers.get(name) or self._buffers.setdefault(name, DeviceBuffer(cuda))
            ctx.set_tensor_address(name, buf.ensure(out.nbytes))
            results.append(out)
        if not ctx.execute_async_v3(cuda.stream_handle):
            raise LayerZeroError(f"TensorRT failed to run {self._plan_path} (see the TensorRT log)")
        for name, out in zip(self._outputs, results, strict=True):
            cuda.download(out, self._buffers[name].ptr)
        cuda.synchronize()
        return results

    def _require(self) -> None:
        if self._context is None:
            raise LayerZeroError("the tensorrt backend has no engine; call load() first")

    def __del__(self) -> None:
        for buf in getattr(self, "_buffers", {}).values():
            buf.release()
