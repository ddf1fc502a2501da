"""Find, build and register ``liblayerzero_ort.so``, the ONNX Runtime CPU custom-op library (``ai.layerzero::MoE``).

    from layerzero.plugins import ort_library

    path = ort_library.build_ort_library()              # headers (fetched once) + cmake -> the .so
    path = ort_library.find_ort_library()               # None when not built
    options = onnxruntime.SessionOptions()
    ort_library.register(options, ["liblayerzero_ort.so"])   # what a bundle's manifest lists

The library needs the ONNX Runtime C/C++ API headers, not the runtime library: ``scripts/fetch_ort_headers.sh``
fetches Debian trixie's ``libonnxruntime-dev`` (1.21, API 21) into ``~/.cache/layerzero/ort-headers``;
``LAYERZERO_ORT_INCLUDE`` names another directory holding ``onnxruntime_cxx_api.h``.

Where the library is looked for, in order (as ``loader.plugin_library_path``): ``LAYERZERO_PLUGIN_DIR``, the
build directory passed in, the default build directory ``~/.cache/layerzero/plugins`` (beside the CUDA
libraries). ``LAYERZERO_ORT_ISA=generic`` makes a loaded library use its portable kernels.

This module imports nothing of ours outside ``plugins`` (a leaf); its errors are ``PluginError``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from layerzero.contract import ATTENTION_OP, MOE_DOMAIN, MOE_OP, QLINEAR_OP, SPARSE_LINEAR_OP
from layerzero.plugins.loader import PluginError, default_build_dir, forget_foreign_cache

__all__ = [
    "CUSTOM_OP_LIBRARIES",
    "ORT_LIBRARY",
    "build_ort_library",
    "check_fresh",
    "find_ort_headers",
    "find_ort_library",
    "libraries_for_ops",
    "library_stamp",
    "missing_library_hint",
    "ort_library_path",
    "register",
    "register_if_built",
    "source_stamp",
]

logger = logging.getLogger(__name__)

ORT_LIBRARY = "liblayerzero_ort.so"

#: (domain, op_type) -> the custom-op library that implements it for ONNX Runtime's CPU provider.
CUSTOM_OP_LIBRARIES: dict[tuple[str, str], str] = {
    (MOE_DOMAIN, MOE_OP): ORT_LIBRARY,
    (MOE_DOMAIN, SPARSE_LINEAR_OP): ORT_LIBRARY,
    (MOE_DOMAIN, QLINEAR_OP): ORT_LIBRARY,
    (MOE_DOMAIN, ATTENTION_OP): ORT_LIBRARY,
}

_HEADER = "onnxruntime_cxx_api.h"


def source_dir() -> Path:
    """The CMake project of the library (``plugins/ort``)."""
    return Path(__file__).resolve().parent / "ort"


def source_stamp() -> str | None:
    """The stamp of the library's sources here (CMakeLists.txt computes the same one into the library: sha256 of
    ``"<name>:<sha256 of the file>\\n"`` over ``CMakeLists.txt`` and ``src/*`` in name order, 16 hex digits); None
    when the sources are not installed."""
    base = source_dir()
    if not (base / "CMakeLists.txt").is_file() or not (base / "src").is_dir():
        return None
    names = sorted(["CMakeLists.txt", *(f"src/{p.name}" for p in (base / "src").iterdir() if p.is_file())])
    text = "".join(f"{n}:{hashlib.sha256((base / n).read_bytes()).hexdigest()}\n" for n in names)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: What precedes the stamp's 16 hex digits in the library's bytes (custom_op.cpp kSourceStampMarker).
_STAMP_MARKER = re.compile(rb"layerzero-ort-source-stamp:([0-9a-f]{16})\x00")


def library_stamp(path: str | os.PathLike[str]) -> str | None:
    """The source stamp compiled into the library at ``path``, read from its bytes (the library is not loaded: a
    library once loaded stays mapped under its path, so a loaded stale build would hide a rebuild from the same
    process); None for a library from before the stamp, or an unreadable file."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    found = _STAMP_MARKER.findall(data)
    return found[0].decode() if len(found) == 1 else None


def stale_reason(path: str | os.PathLike[str]) -> str | None:
    """Why the library at ``path`` may not run this layerzero's bundles (one line), None when it may: built from
    other sources than this layerzero's ``plugins/ort`` (a stale build reads a newer bundle's attributes it does not
    know as absent: wrong results, no error). None when the sources are not installed or
    ``LAYERZERO_ORT_ANY_BUILD=1`` (an A/B of two builds)."""
    if os.environ.get("LAYERZERO_ORT_ANY_BUILD") == "1":
        return None
    want = source_stamp()
    if want is None:
        return None
    have = library_stamp(path)
    if have == want:
        return None
    built = f"sources {have}" if have else "sources from before the stamp"
    return (
        f"{path} was built from other {ORT_LIBRARY} sources than this layerzero's ({built}, these {want}): "
        "rebuild it with `layerzero plugins build`"
    )


def check_fresh(path: str | os.PathLike[str]) -> None:
    """``PluginError`` (one line, ``stale_reason``) when the library at ``path`` was built from other sources."""
    reason = stale_reason(path)
    if reason is not None:
        raise PluginError(reason)


def _fetch_script() -> Path:
    return Path(__file__).resolve().parents[1] / "scripts" / "fetch_ort_headers.sh"


def find_ort_headers() -> Path | None:
    """The directory holding the ONNX Runtime C/C++ API headers, if present (never downloads)."""
    env = os.environ.get("LAYERZERO_ORT_INCLUDE")
    candidates = [Path(env)] if env else []
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layerzero" / "ort-headers"
    if cache.is_dir():
        candidates += sorted(cache.glob("*/usr/include/onnxruntime"), reverse=True)
    return next((c for c in candidates if (c / _HEADER).is_file()), None)


def fetch_ort_headers(timeout_s: float = 600) -> Path:
    """The header directory, fetched with ``scripts/fetch_ort_headers.sh`` when absent."""
    found = find_ort_headers()
    if found is not None:
        return found
    script = _fetch_script()
    if not script.is_file():
        raise PluginError(f"{script} not found: set LAYERZERO_ORT_INCLUDE to a directory holding {_HEADER}")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PluginError(f"fetching the ONNX Runtime headers failed ({script}): {tail}")
    path = Path(proc.stdout.strip().splitlines()[-1])
    if not (path / _HEADER).is_file():
        raise PluginError(f"{script} printed {path}, which has no {_HEADER}")
    return path


def _search_dirs(build_dir: str | os.PathLike[str] | None) -> list[Path]:
    dirs = []
    if os.environ.get("LAYERZERO_PLUGIN_DIR"):
        dirs.append(Path(os.environ["LAYERZERO_PLUGIN_DIR"]))
    if build_dir is not None:
        dirs.append(Path(build_dir))
    dirs.append(default_build_dir())
    return dirs


_stale_warned: set[str] = set()


def find_ort_library(build_dir: str | os.PathLike[str] | None = None, name: str = ORT_LIBRARY) -> Path | None:
    """The built library, or None. A liblayerzero_ort.so built from other sources (``stale_reason``) counts as not
    built (a warning, once a path): where the library is optional (the ``auto`` lowering, the demo) the compile
    goes on without it; a bundle that needs it is still refused by ``register``."""
    for d in _search_dirs(build_dir):
        path = d / name
        if not path.is_file():
            continue
        reason = stale_reason(path) if name == ORT_LIBRARY else None
        if reason is None:
            return path
        if str(path) not in _stale_warned:
            _stale_warned.add(str(path))
            logger.warning("%s; it is not used", reason)
    return None


def ort_library_path(build_dir: str | os.PathLike[str] | None = None, name: str = ORT_LIBRARY) -> Path:
    """The built library; ``PluginError`` (one line: where it looked, how to build it) when absent."""
    found = find_ort_library(build_dir, name)
    if found is None:
        stale = [d / name for d in _search_dirs(build_dir) if (d / name).is_file()]
        if stale:  # only builds from other sources: say so (find_ort_library passed them over)
            check_fresh(stale[0])
        searched = ", ".join(str(d) for d in _search_dirs(build_dir))
        raise PluginError(
            f"{name} not found (searched {searched}); build it with `layerzero plugins build` "
            "or point LAYERZERO_PLUGIN_DIR at the directory that holds it"
        )
    return found


def build_ort_library(
    build_dir: str | os.PathLike[str] | None = None,
    *,
    asan: bool = False,
    jobs: int = 2,
    fetch_headers: bool = True,
    timeout_s: float = 900,
) -> Path:
    """Configure and build ``plugins/ort`` into ``build_dir`` (default ``~/.cache/layerzero/plugins``); the path.

    ``asan``: an AddressSanitizer build (tests load it with ``LD_PRELOAD`` of libasan). The CMake tree is
    ``build_dir/ort-build`` (``ort-asan-build``); the library lands in ``build_dir``.
    """
    cmake = shutil.which("cmake")
    if cmake is None:
        raise PluginError(f"cmake not found: {ORT_LIBRARY} cannot be built (apt-get install cmake g++)")
    include = fetch_ort_headers() if fetch_headers else find_ort_headers()
    if include is None:
        raise PluginError(f"ONNX Runtime headers not found: run {_fetch_script()} or set LAYERZERO_ORT_INCLUDE")
    out = Path(build_dir) if build_dir is not None else default_build_dir()
    out.mkdir(parents=True, exist_ok=True)
    tree = out / ("ort-asan-build" if asan else "ort-build")
    lib_dir = (out / "asan" if asan else out).resolve()  # an ASan build never shadows the optimised one
    forget_foreign_cache(tree, source_dir())
    configure = [
        cmake,
        "-S",
        str(source_dir()),
        "-B",
        str(tree),
        f"-DORT_INCLUDE_DIR={include}",
        f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={lib_dir}",
        f"-DLAYERZERO_ASAN={'ON' if asan else 'OFF'}",
    ]
    for cmd in (configure, [cmake, "--build", str(tree), "-j", str(jobs)]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "error" in ln.lower()]
            raise PluginError(f"building {ORT_LIBRARY} failed: {(lines or ['see ' + str(tree)])[0].strip()}")
    built = lib_dir / ORT_LIBRARY
    if not built.is_file():
        raise PluginError(f"the build of {ORT_LIBRARY} finished but {built} is missing")
    logger.info("built %s", built)
    return built


def libraries_for_ops(ops: Iterable[tuple[str, str]]) -> list[str]:
    """The custom-op libraries (file names) that the ``(domain, op_type)`` pairs of a model need, sorted."""
    return sorted({CUSTOM_OP_LIBRARIES[op] for op in ops if op in CUSTOM_OP_LIBRARIES})


def register(options: Any, libraries: Iterable[str], build_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Register each library (a file name from a manifest, or a path) with ``onnxruntime.SessionOptions``.

    Raises ``PluginError`` (one line) when one is not found or ONNX Runtime refuses it.
    """
    paths = []
    for lib in libraries:
        path = Path(lib) if os.sep in str(lib) else ort_library_path(build_dir, str(lib))
        if not path.is_file():
            raise PluginError(f"custom-op library {path} not found")
        if path.name == ORT_LIBRARY:
            check_fresh(path)
        try:
            options.register_custom_ops_library(str(path))
        except Exception as e:  # onnxruntime's pybind error types
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise PluginError(f"onnxruntime refused the custom-op library {path}: {first}") from e
        paths.append(path)
    return paths


def register_if_built(options: Any, build_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Register ``liblayerzero_ort.so`` with ``options`` when it is built (for models that may need it); the path."""
    path = find_ort_library(build_dir)
    if path is not None:
        register(options, [str(path)])
    return path


def missing_library_hint(error: BaseException | str) -> str | None:
    """For an ONNX Runtime load error about an op this library implements: what to do (one line), else None."""
    text = str(error)
    for (domain, op), lib in CUSTOM_OP_LIBRARIES.items():
        if domain in text and op in text:
            return f"the model needs {lib} ({domain}::{op}): build it with `layerzero plugins build`"
    return None
