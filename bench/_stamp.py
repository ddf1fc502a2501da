"""A stamp of the LayerZero code a cached bench bundle was compiled with, so a bench never times a stale bundle.

The benches cache their compiled bundles (~minutes each at their sizes); the cache keys hash the model's config and
the sizes, not the compiler. ``code_stamp()`` hashes the sources that decide what a compile writes and how it runs:
the ``layerzero`` package's Python files (compiler, passes, runtime, plugins) and the native library's sources
(``plugins/ort/src``, its CMakeLists). ``fresh(bundle)`` says whether ``bundle`` was stamped with the current code;
``stamp(bundle)`` records it once the bundle is written (a file beside the bundle: ``<bundle>.code-stamp``);
``native_library`` does the same for a bench's own build of ``liblayerzero_ort.so``.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

import layerzero
import layerzero.passes
import layerzero.plugins
import layerzero.runtime

_SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".txt")


@cache
def code_stamp() -> str:
    """sha256 (16 hex digits) of the installed package's compile- and run-relevant sources."""
    digest = hashlib.sha256()
    for package in (layerzero, layerzero.passes, layerzero.runtime, layerzero.plugins):
        base = Path(package.__file__).resolve().parent
        for path in sorted(p for p in base.rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES):
            if {"__pycache__", "build"} & set(path.relative_to(base).parts):
                continue
            digest.update(f"{package.__name__}/{path.relative_to(base)}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _file(bundle: Path) -> Path:
    return bundle.with_name(bundle.name + ".code-stamp")


def fresh(bundle: Path) -> bool:
    """Whether ``bundle`` exists and was compiled by the code installed now."""
    f = _file(bundle)
    return bundle.exists() and f.is_file() and f.read_text().strip() == code_stamp()


def op_count(bundle: Path, op_type: str) -> int:
    """How many ``op_type`` nodes the main graph of ``bundle``'s model.onnx has (its weights not loaded)."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    return sum(node.op_type == op_type for node in model.graph.node)


def stamp(bundle: Path) -> None:
    """Record that ``bundle`` was just compiled by the current code."""
    _file(bundle).write_text(code_stamp() + "\n")


def native_library(plugin_dir: Path, say, what: str) -> str | None:
    """A bench's own ``liblayerzero_ort.so`` (``plugin_dir``, what ``LAYERZERO_PLUGIN_DIR`` points at): built when
    missing or when the sources changed since its build (an incremental CMake build); a library found elsewhere is
    used as it is. None when there, else why not (a missing compiler or header set)."""
    from layerzero.plugins import ort_library

    found = ort_library.find_ort_library()
    if found is not None and (found.parent.resolve() != plugin_dir.resolve() or fresh(found)):
        return None
    say(f"building liblayerzero_ort.so ({what}) into {plugin_dir}")
    try:
        library = ort_library.build_ort_library(plugin_dir, jobs=2, fetch_headers=False)
    except Exception as exc:  # a missing compiler / header set: the caller's table says so
        return f"not built: {str(exc).splitlines()[0]}"
    stamp(library)
    return None
