"""The ONNX Runtime backend.

Options (``Engine.load(path, backend="onnxruntime", **options)``):

- ``device``: ``"cpu"`` (default) or ``"cuda"`` / ``"cuda:N"``, which needs the ``onnxruntime-gpu`` package.
- ``providers``: an explicit ONNX Runtime provider list; overrides ``device``.
- ``graph_optimization_level``: a ``GraphOptimizationLevel``, or ``"disable"``, ``"basic"``, ``"extended"``,
  ``"layout"``, ``"all"`` (default ``ORT_ENABLE_ALL``).
- ``intra_op_num_threads``, ``inter_op_num_threads``: thread pool sizes (default: ONNX Runtime's choice).
- ``allow_spinning``: False makes idle intra-op workers sleep instead of spinning between parallel ops (default:
  ONNX Runtime's, spinning). On a machine whose cores other processes share, a spinning worker takes the core the
  session's own main thread needs next: measured here (2 cores, load 9.5), a 2-thread decode of bench/decode.py's
  Qwen3-MoE-style model ran at 11.1 tok/s spinning and 32.3 tok/s sleeping (1 thread: 15.4).
- ``enable_profiling``: write an ONNX Runtime profile; ``end_profiling()`` returns its path.
- ``profile_file_prefix``: the profile's file name prefix.
- ``mmap_weights``: True keeps every external weight in ONNX Runtime's mapping of the data file. By default the
  weights ``liblayerzero_ort.so``'s kernels read in place (MoE experts, SparseLinear) are read into anonymous huge
  pages instead (``_in_place.py``: a 4 KiB-page file mapping cost 16 % of a MoE decode step here, and the page
  cache can drop it mid-generation); the price is that memory is private to the process.

Custom-op libraries: a bundle whose manifest lists ``libraries`` (``liblayerzero_ort.so`` for the native MoE
lowering) has them registered with the session; a missing one is an ``UnsupportedModelError`` naming it. A plain
``.onnx`` file gets ``liblayerzero_ort.so`` registered when it is built.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from layerzero.errors import InvalidInputError, LayerZeroError, UnsupportedModelError
from layerzero.ort_runner import create_session, first_line
from layerzero.runtime.backends.base import TensorSpec, reject_unknown_options

__all__ = ["OrtBackend"]

logger = logging.getLogger(__name__)

_ORT_DTYPES: dict[str, np.dtype] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(int16)": np.dtype(np.int16),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(uint16)": np.dtype(np.uint16),
    "tensor(uint32)": np.dtype(np.uint32),
    "tensor(uint64)": np.dtype(np.uint64),
    "tensor(bool)": np.dtype(np.bool_),
    "tensor(string)": np.dtype(object),
}

_OPTIONS = (
    "device",
    "providers",
    "graph_optimization_level",
    "intra_op_num_threads",
    "inter_op_num_threads",
    "allow_spinning",
    "enable_profiling",
    "profile_file_prefix",
    "mmap_weights",
)


class OrtBackend:
    """Runs a model with an ``onnxruntime.InferenceSession``."""

    name = "onnxruntime"
    #: Bundle targets this backend can run (``Engine.load`` checks the manifest's ``target``).
    targets = ("onnxruntime",)
    #: ``load`` takes any ONNX file.
    loads_onnx = True
    #: ``load`` takes ``device``: ``Engine.load`` passes the manifest's device (a bundle compiled for cuda).
    takes_device = True

    def __init__(self) -> None:
        self._session: Any = None
        self._run_options: Any = None
        self._model_path: Path | None = None
        self._label = "the model"
        self._input_specs: list[TensorSpec] = []
        self._output_names: list[str] = []
        self._profiling = False

    def load(
        self,
        model_path: Path | bytes,
        *,
        device: str = "cpu",
        providers: list[Any] | None = None,
        graph_optimization_level: Any = None,
        intra_op_num_threads: int | None = None,
        inter_op_num_threads: int | None = None,
        allow_spinning: bool | None = None,
        enable_profiling: bool = False,
        profile_file_prefix: str | None = None,
        mmap_weights: bool = False,
        **unknown: Any,
    ) -> None:
        reject_unknown_options(self.name, unknown, _OPTIONS)
        import onnxruntime as ort

        from layerzero.runtime.backends._in_place import in_place_weights

        # On the CPU only (another device copies its initializers into its own memory anyway).
        cpu = device == "cpu" and providers is None
        in_place = cpu and not mmap_weights and isinstance(model_path, Path | str)
        shared = in_place_weights(Path(model_path)) if in_place else None
        session = create_session(
            model_path,
            shared_initializers=shared,
            device=device,
            providers=providers,
            libraries=_libraries(model_path),
            graph_optimization_level=graph_optimization_level,
            intra_op_num_threads=intra_op_num_threads,
            inter_op_num_threads=inter_op_num_threads,
            allow_spinning=allow_spinning,
            enable_profiling=enable_profiling,
            profile_file_prefix=profile_file_prefix,
        )
        self._session = session
        # run() re-raises failures with their message; keep ORT from also logging them to stderr.
        self._run_options = ort.RunOptions()
        self._run_options.log_severity_level = 4
        # Serialised bytes (verification's in-memory original) run the same way as a file.
        self._model_path = None if isinstance(model_path, bytes) else Path(model_path)
        self._label = str(self._model_path) if self._model_path is not None else "the model"
        self._profiling = bool(enable_profiling)
        self._input_specs = _input_specs(session, model_path)
        self._output_names = [o.name for o in session.get_outputs()]
        logger.debug("loaded %s with providers %s", self._label, session.get_providers())

    @property
    def input_specs(self) -> list[TensorSpec]:
        return list(self._input_specs)

    @property
    def output_names(self) -> list[str]:
        return list(self._output_names)

    @property
    def providers(self) -> list[str]:
        """The execution providers the session actually uses, in priority order."""
        return list(self._require_session().get_providers())

    @property
    def session(self) -> Any:
        """The underlying ``onnxruntime.InferenceSession`` (for advanced use: IO binding, run options)."""
        return self._require_session()

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        session = self._require_session()
        try:
            return list(session.run(None, feeds, self._run_options))
        except Exception as e:
            # INVALID_ARGUMENT is about the feeds (shape/dtype the checks upstream could not see); the rest is
            # a failure inside the model (e.g. a Reshape that does not fit these dims).
            kind = InvalidInputError if type(e).__name__ == "InvalidArgument" else LayerZeroError
            raise kind(f"onnxruntime failed to run {self._label}: {first_line(e)}") from e

    def end_profiling(self) -> str:
        """Stop profiling and return the path of the written JSON profile."""
        if not self._profiling:
            raise LayerZeroError("profiling is off; load the engine with enable_profiling=True")
        self._profiling = False
        return str(self._require_session().end_profiling())

    def _require_session(self) -> Any:
        if self._session is None:
            raise LayerZeroError("the onnxruntime backend has no model; call load() first")
        return self._session


def _libraries(model: Path | bytes) -> list[str] | None:
    """The custom-op libraries the bundle's manifest lists; None (ours, when built) for a plain model."""
    import json

    if isinstance(model, bytes):
        return None
    manifest_path = Path(model).parent / "manifest.json"
    if not manifest_path.is_file():
        return None
    try:
        return list(json.loads(manifest_path.read_text(encoding="utf-8")).get("libraries") or [])
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"{manifest_path}: cannot read the custom-op libraries it lists: {e}") from e


def _input_specs(session: Any, model_path: Path | bytes) -> list[TensorSpec]:
    args = session.get_inputs()
    label = "the model" if isinstance(model_path, bytes) else model_path
    # ONNX Runtime reports a scalar and an input of undeclared rank both as shape []; the graph knows which.
    unknown_rank = _undeclared_rank_inputs(model_path) if any(not a.shape for a in args) else set()
    specs = []
    for arg in args:
        dtype = _ORT_DTYPES.get(arg.type)
        if dtype is None:
            raise UnsupportedModelError(
                f"input {arg.name!r} of {label} has type {arg.type}, which the LayerZero runtime cannot "
                f"feed from numpy; supported: {', '.join(sorted(_ORT_DTYPES))}"
            )
        shape = None if arg.name in unknown_rank else tuple(d if isinstance(d, (int, str)) else None for d in arg.shape)
        specs.append(TensorSpec(name=arg.name, dtype=dtype, shape=shape))
    return specs


def _undeclared_rank_inputs(model_path: Path | bytes) -> set[str]:
    import onnx

    if isinstance(model_path, bytes):
        graph = onnx.load_from_string(model_path).graph
    else:
        graph = onnx.load(str(model_path), load_external_data=False).graph
    return {i.name for i in graph.input if i.type.HasField("tensor_type") and not i.type.tensor_type.HasField("shape")}
