"""A CMake build tree configured from another checkout's sources (two clones, or a reinstall to another path,
sharing ~/.cache/layerzero/plugins): the builds reconfigure it instead of failing with CMake's "does not match
the source ... used to generate cache"."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from layerzero.plugins import loader, ort_library
from tests.plugins.native_build import missing


def _project(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.16)\nproject(lz_probe NONE)\n")
    return folder


def _configure(cmake: str, source: Path, tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([cmake, "-S", str(source), "-B", str(tree)], capture_output=True, text=True, check=False)


def _home(tree: Path) -> Path:
    for line in (tree / "CMakeCache.txt").read_text().splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:INTERNAL="):
            return Path(line.split("=", 1)[1]).resolve()
    raise AssertionError("no CMAKE_HOME_DIRECTORY in the cache")


@pytest.fixture
def cmake() -> str:
    path = shutil.which("cmake")
    if path is None:
        missing("cmake not found: the build tree cannot be configured")
    return path


def test_foreign_cache_is_forgotten_and_own_cache_kept(tmp_path, cmake):
    first, second, tree = _project(tmp_path / "a"), _project(tmp_path / "b"), tmp_path / "tree"
    assert _configure(cmake, first, tree).returncode == 0
    refused = _configure(cmake, second, tree)
    assert refused.returncode != 0 and "does not match the source" in refused.stderr  # CMake's own refusal
    (tree / "keep.so").write_text("built")
    assert loader.forget_foreign_cache(tree, first) is False  # its own sources: untouched
    assert (tree / "CMakeCache.txt").is_file()
    assert loader.forget_foreign_cache(tree, second) is True
    assert not (tree / "CMakeCache.txt").exists() and not (tree / "CMakeFiles").exists()
    assert (tree / "keep.so").is_file()  # built libraries stay until a build replaces them
    assert _configure(cmake, second, tree).returncode == 0
    assert _home(tree) == second.resolve()
    assert loader.forget_foreign_cache(tmp_path / "none", second) is False  # no tree yet


def test_ort_library_builds_into_a_tree_of_other_sources(tmp_path, cmake):
    # The ort-build tree was configured from another source folder: build_ort_library still builds, from its own.
    if shutil.which("g++") is None or ort_library.find_ort_headers() is None:
        missing("g++ or ONNX Runtime headers not found: liblayerzero_ort.so cannot be built")
    assert _configure(cmake, _project(tmp_path / "other"), tmp_path / "out" / "ort-build").returncode == 0
    built = ort_library.build_ort_library(tmp_path / "out", fetch_headers=False)
    assert built.is_file()
    assert _home(tmp_path / "out" / "ort-build") == ort_library.source_dir().resolve()
    assert ort_library.stale_reason(built) is None
