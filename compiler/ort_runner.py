"""The one place that creates ONNX Runtime sessions.

Every ONNX Runtime session LayerZero makes comes from ``create_session``: the runtime's backend
(``runtime/backends/onnxruntime.py``, which verification runs through), chunked verification (``chunked.py``,
which lends weights with ``external_initializers``) and constant folding (``passes/constant_folding.py``, one
session per folded batch). So session options, providers, custom-op library registration and load errors
have one meaning everywhere.

    session = create_session(path_or_bytes)                         # CPU, our custom ops when built
    session = create_session(path, device="cuda", libraries=["liblayerzero_ort.so"])
    session = create_session(proto_bytes, libraries=(), graph_optimization_level="disable")

A leaf: it imports ``layerzero.errors`` and, only when a library is to be registered, ``layerzero.plugins``;
onnxruntime is imported on first use so that importing this module (a pass does) stays fast.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from layerzero.errors import InvalidInputError, UnsupportedModelError

__all__ = [
    "OPTIMIZATION_LEVELS",
    "create_session",
    "first_line",
    "optimization_level",
    "providers_for",
]

logger = logging.getLogger(__name__)

#: ``graph_optimization_level`` names -> ``onnxruntime.GraphOptimizationLevel`` members.
OPTIMIZATION_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "layout": "ORT_ENABLE_LAYOUT",
    "all": "ORT_ENABLE_ALL",
}

CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"


def first_line(error: BaseException) -> str:
    """The first line of an error's message (onnxruntime's carry a C++ stack below it)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def optimization_level(ort: Any, level: Any) -> Any:
    """``level`` (None: all, a name of ``OPTIMIZATION_LEVELS`` or a member) as a ``GraphOptimizationLevel``."""
    if level is None:
        return ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if isinstance(level, ort.GraphOptimizationLevel):
        return level
    if isinstance(level, str):
        key = OPTIMIZATION_LEVELS.get(level.lower(), level.upper())
        member = ort.GraphOptimizationLevel.__members__.get(key)
        if member is not None:
            return member
    raise InvalidInputError(
        f"graph_optimization_level {level!r} is not one of {', '.join(OPTIMIZATION_LEVELS)} "
        "or an onnxruntime.GraphOptimizationLevel"
    )


def providers_for(device: str, available: Sequence[str] | None = None) -> list[Any]:
    """The execution providers for ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``).

    CUDA needs the ``onnxruntime-gpu`` package (``pip install 'layerzero[gpu]'``): without its provider the
    error says so in one line. ``available`` defaults to ``onnxruntime.get_available_providers()``.
    """
    kind, _, index = str(device).lower().partition(":")
    if kind == "cpu" and not index:
        return [CPU_PROVIDER]
    if kind == "cuda" and (not index or index.isdigit()):
        if available is None:
            import onnxruntime as ort

            available = ort.get_available_providers()
        if CUDA_PROVIDER not in available:
            raise InvalidInputError(
                f"device {device!r} needs the onnxruntime-gpu package (pip install 'layerzero[gpu]'); "
                f"this onnxruntime offers {', '.join(available)}"
            )
        cuda: Any = (CUDA_PROVIDER, {"device_id": int(index)}) if index else CUDA_PROVIDER
        return [cuda, CPU_PROVIDER]
    raise InvalidInputError(f"device {device!r} is not one of 'cpu', 'cuda', 'cuda:N'")


def create_session(
    model: str | Path | bytes,
    *,
    device: str = "cpu",
    providers: Sequence[Any] | None = None,
    libraries: Sequence[str] | None = None,
    graph_optimization_level: Any = None,
    intra_op_num_threads: int | None = None,
    inter_op_num_threads: int | None = None,
    allow_spinning: bool | None = None,
    log_severity_level: int = 3,
    enable_profiling: bool = False,
    profile_file_prefix: str | None = None,
    external_initializers: Mapping[str, np.ndarray] | None = None,
    shared_initializers: Mapping[str, np.ndarray] | None = None,
    external_data_dir: str | Path | None = None,
    label: str | None = None,
) -> Any:
    """An ``onnxruntime.InferenceSession`` for ``model`` (a path or serialised bytes).

    Args:
        device: Chooses the providers (``providers_for``) unless ``providers`` is given.
        libraries: Custom-op library file names to register (what a bundle's manifest lists); None: ours
            (``liblayerzero_ort.so``) when it is built, as a plain model may hold ``ai.layerzero::MoE``;
            ``()``: none.
        graph_optimization_level: See ``optimization_level`` (default: all).
        allow_spinning: Whether idle intra-op workers spin (ONNX Runtime's default) or sleep until the next parallel
            op (``session.intra_op.allow_spinning``); None leaves ONNX Runtime's default.
        log_severity_level: 3 (errors only) by default: a bundle's unused-initializer warnings are noise.
        external_initializers: Initializers lent to the session without a copy (name -> C-contiguous array;
            the model names them as external data). The arrays stay referenced by the session, so they live
            as long as it does. (ONNX Runtime copies these once at session creation.)
        shared_initializers: Initializers of the model (by name) that the session uses in place instead of reading
            them (``SessionOptions.add_initializer``: user-owned memory, never copied); kept alive with the session.
        external_data_dir: The folder the external-data locations of serialised ``model`` bytes are relative to
            (a model loaded from a file with external data, then changed and serialised; a file's own folder
            otherwise).
        label: How errors name the model (default: its path, or "the model" for bytes).

    Raises:
        UnsupportedModelError: onnxruntime cannot load the model (a missing custom-op library is named), or a
            library to register is missing.
        InvalidInputError: a bad ``device`` or ``graph_optimization_level``.
    """
    import onnxruntime as ort

    name = label or (str(model) if isinstance(model, (str, Path)) else "the model")
    options = ort.SessionOptions()
    options.log_severity_level = log_severity_level
    options.graph_optimization_level = optimization_level(ort, graph_optimization_level)
    if intra_op_num_threads is not None:
        options.intra_op_num_threads = int(intra_op_num_threads)
    if inter_op_num_threads is not None:
        options.inter_op_num_threads = int(inter_op_num_threads)
    if allow_spinning is not None:
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    if enable_profiling:
        options.enable_profiling = True
        if profile_file_prefix:
            options.profile_file_prefix = profile_file_prefix
    if external_data_dir is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_data_dir))
    if providers is None:
        providers = providers_for(device)
    _register_libraries(options, libraries, name)
    lent: list[Any] = []
    if external_initializers:
        # NOTE: ORT refuses an OrtValue that owns its buffer; ortvalue_from_numpy copies (so owns) any array that
        # is not C-contiguous, aligned and native-order: the caller hands such arrays only (chunked._weight_array).
        arrays = [np.asarray(a) for a in external_initializers.values()]
        lent = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays]
        options.add_external_initializers(list(external_initializers), lent)
        lent = [*arrays, *lent]
    if shared_initializers:
        for key, array in shared_initializers.items():
            value = ort.OrtValue.ortvalue_from_numpy(array)
            options.add_initializer(key, value)
            lent += [array, value]
    source = str(model) if isinstance(model, Path) else model
    try:
        session = ort.InferenceSession(source, sess_options=options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its pybind exception types (Fail, InvalidGraph, ...)
        from layerzero.plugins.ort_library import missing_library_hint

        why = missing_library_hint(first_line(exc)) or first_line(exc)
        raise UnsupportedModelError(f"onnxruntime cannot load {name}: {why}") from None
    if lent:
        session._layerzero_lent = lent  # the lent buffers live exactly as long as the session
    logger.debug("session for %s with providers %s", name, session.get_providers())
    return session


def _register_libraries(options: Any, libraries: Sequence[str] | None, name: str) -> None:
    if libraries is not None and not libraries:
        return
    from layerzero.plugins import ort_library

    try:
        if libraries is None:
            ort_library.register_if_built(options)
        else:
            ort_library.register(options, list(libraries))
    except ort_library.PluginError as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from None
