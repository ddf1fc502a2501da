"""plugins/examples/run_bundle: a C++ program runs a bundle through ONNX Runtime's C++ API and prints what
``layerzero run BUNDLE --inputs FEEDS.npz --json`` prints (outputs and zeroing report), on a MoE bundle with the
native op (liblayerzero_ort.so registered from the manifest's ``libraries``), on an activation-sparse one
(SparseLinear: the realized sparsity per group) and on a static one.

Built with CMake against the ONNX Runtime headers (scripts/fetch_ort_headers.sh) and the onnxruntime wheel's own
libonnxruntime.so; with ``LAYERZERO_REQUIRE_NATIVE=1`` (CI) a missing prerequisite fails instead of skipping.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest

from layerzero.plugins import ort_library

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "plugins" / "examples" / "run_bundle"
BUILD_DIR = REPO / "build" / "run-bundle-test"
REQUIRE = os.environ.get("LAYERZERO_REQUIRE_NATIVE") == "1"


def _absent(reason: str):
    if REQUIRE:
        pytest.fail(f"LAYERZERO_REQUIRE_NATIVE=1: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def run_bundle(ort_lib) -> Path:
    headers = ort_library.find_ort_headers()
    if headers is None:
        _absent("ONNX Runtime headers not found: run scripts/fetch_ort_headers.sh")
    libs = sorted((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
    if not libs:
        _absent("the onnxruntime wheel ships no libonnxruntime.so")
    configure = ["cmake", "-S", str(SOURCE), "-B", str(BUILD_DIR), f"-DORT_INCLUDE_DIR={headers}",
                 f"-DORT_LIBRARY={libs[0]}"]  # fmt: skip
    for cmd in (configure, ["cmake", "--build", str(BUILD_DIR), "-j", "2"]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return BUILD_DIR / "run_bundle"


def _cpp(run_bundle: Path, *args: str | Path, lib_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("LAYERZERO_PLUGIN_DIR", None)
    env["XDG_CACHE_HOME"] = "/nonexistent"  # the library comes from --lib-dir only
    cmd = [str(run_bundle), *map(str, args)] + (["--lib-dir", str(lib_dir)] if lib_dir else [])
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _python(bundle: Path, feeds: Path, lib_dir: Path | None, *extra: str) -> dict:
    env = dict(os.environ, LAYERZERO_PLUGIN_DIR=str(lib_dir or "/nonexistent"), COLUMNS="100000")
    cmd = [sys.executable, "-m", "layerzero.cli", "run", str(bundle), "--inputs", str(feeds), "--json", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _same(a, b, path="$"):
    """Equal JSON documents; floats to 1e-12 relative (the routing confidence is a mean numpy sums pairwise)."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), path
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0), (path, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b) if isinstance(b, dict) else b)
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def _compare(cpp: subprocess.CompletedProcess, expected: dict) -> dict:
    assert cpp.returncode == 0, cpp.stderr
    got = json.loads(cpp.stdout)
    assert got.pop("latency_ms") > 0
    expected = dict(expected)
    expected.pop("latency_ms")
    _same(got, expected)
    return got


@pytest.fixture(scope="module")
def moe_bundle(tmp_path_factory, ort_lib) -> tuple[Path, Path]:
    from layerzero.compile import compile_file
    from layerzero.models.moe import MoEConfig, build_moe, moe_feeds
    from layerzero.options import CompileOptions

    tmp = tmp_path_factory.mktemp("moe")
    cfg = MoEConfig(experts=8, top_k=2)
    onnx.save(build_moe(cfg), tmp / "moe.onnx")
    os.environ["LAYERZERO_PLUGIN_DIR"] = str(ort_lib.parent)
    try:
        compile_file(tmp / "moe.onnx", tmp / "moe.lz", CompileOptions(moe_lowering="native"))
    finally:
        del os.environ["LAYERZERO_PLUGIN_DIR"]
    manifest = json.loads((tmp / "moe.lz" / "manifest.json").read_text())
    assert manifest["libraries"] == ["liblayerzero_ort.so"]
    np.savez(tmp / "feeds.npz", **moe_feeds(cfg, 3, seed=5))
    return tmp / "moe.lz", tmp / "feeds.npz"


@pytest.fixture(scope="module")
def static_bundle(tmp_path_factory) -> tuple[Path, Path]:
    from layerzero.compile import compile_file
    from layerzero.models import TransformerConfig, build_transformer, example_feeds

    tmp = tmp_path_factory.mktemp("static")
    cfg = TransformerConfig(num_layers=4, zero_blocks=(1,), zero_rotary=(0,))
    onnx.save(build_transformer(cfg), tmp / "t.onnx")
    compile_file(tmp / "t.onnx", tmp / "t.lz")
    feeds = example_feeds(cfg, seq=5)
    np.savez(tmp / "feeds.npz", **feeds)
    return tmp / "t.lz", tmp / "feeds.npz"


@pytest.fixture(scope="module")
def activation_bundle(tmp_path_factory, ort_lib) -> tuple[Path, Path]:
    """A 2-layer transformer compiled with --activation-sparsity 0.4 in the native form (SparseLinear from
    liblayerzero_ort.so); its node names are put under ``model.`` (``/model/layers.0/...``, as a transformers export
    names them) so its projections are the pass's groups."""
    from layerzero.compile import compile_file
    from layerzero.models import TransformerConfig, build_transformer, example_feeds
    from layerzero.options import CompileOptions

    tmp = tmp_path_factory.mktemp("activation")
    cfg = TransformerConfig(num_layers=2)
    proto = build_transformer(cfg)
    for node in proto.graph.node:
        if node.name.startswith("/layers."):
            node.name = "/model" + node.name
    onnx.save(proto, tmp / "t.onnx")
    os.environ["LAYERZERO_PLUGIN_DIR"] = str(ort_lib.parent)
    try:
        compile_file(tmp / "t.onnx", tmp / "t.lz", CompileOptions(activation_sparsity=0.4, max_deviation=100.0))
    finally:
        del os.environ["LAYERZERO_PLUGIN_DIR"]
    manifest = json.loads((tmp / "t.lz" / "manifest.json").read_text())
    assert manifest["activation_sparsity"]["form"] == "native" and manifest["libraries"] == ["liblayerzero_ort.so"]
    np.savez(tmp / "feeds.npz", **example_feeds(cfg, seq=6))
    return tmp / "t.lz", tmp / "feeds.npz"


def test_activation_sparse_bundle_reports_what_layerzero_run_reports(run_bundle, activation_bundle, ort_lib):
    # Per group the realized sparsity from the layerzero::mask::<group> kept counts, the weight rows not read in
    # skipped_params and zeroed_params_ratio, the summary's "activations ... zeroed": the same JSON as Python's.
    bundle, feeds = activation_bundle
    for extra in ((), ("--masks",)):
        got = _compare(_cpp(run_bundle, bundle, feeds, *extra, lib_dir=ort_lib.parent),
                       _python(bundle, feeds, ort_lib.parent, *extra))  # fmt: skip
        report = got["report"]
        groups = {f"model.layers.{i}.attention.{k}" for i in range(2) for k in ("qkv", "o")}
        groups |= {f"model.layers.{i}.mlp.{k}" for i in range(2) for k in ("gate_up", "down")}
        assert set(report["activation_sparsity"]) == groups
        assert 0.2 < sum(report["activation_sparsity"].values()) / len(groups) < 0.6, report["activation_sparsity"]
        assert report["skipped_params"] > 0 and report["zeroed_params_ratio"] > 0
        assert "activations " in report["summary"] and bool(report["masks"]) == bool(extra)
    # layerzero::activation_scale in the feeds (an overridable initializer to ONNX Runtime): 0 is the dense model.
    dense = Path(str(feeds).replace(".npz", "_dense.npz"))
    np.savez(dense, **dict(np.load(feeds)), **{"layerzero::activation_scale": np.float32(0.0)})
    got = _compare(_cpp(run_bundle, bundle, dense, lib_dir=ort_lib.parent), _python(bundle, dense, ort_lib.parent))
    assert all(v == 0 for v in got["report"]["activation_sparsity"].values()) and got["report"]["skipped_params"] == 0
    bad = Path(str(feeds).replace(".npz", "_bad.npz"))
    np.savez(bad, **dict(np.load(feeds)), **{"layerzero::activation_scale": np.float32(-1.0)})
    done = _cpp(run_bundle, bundle, bad, lib_dir=ort_lib.parent)
    assert done.returncode == 2 and "expected a finite number >= 0" in done.stderr and done.stderr.count("\n") == 1


def test_moe_bundle_with_the_native_op_prints_what_layerzero_run_prints(run_bundle, moe_bundle, ort_lib):
    bundle, feeds = moe_bundle
    for extra in ((), ("--masks",)):
        got = _compare(_cpp(run_bundle, bundle, feeds, *extra, lib_dir=ort_lib.parent),
                       _python(bundle, feeds, ort_lib.parent, *extra))  # fmt: skip
        assert got["report"]["routing_confidence"] is not None
        assert bool(got["report"]["masks"]) == bool(extra)


def test_moe_bundle_reports_skipped_experts(run_bundle, moe_bundle, ort_lib, tmp_path):
    # One token routes to top_k of 8 experts: the other experts are skipped paths, with their parameters.
    bundle, feeds = moe_bundle
    one = {k: v[:1] for k, v in np.load(feeds).items()}  # hidden [tokens, 64]
    np.savez(tmp_path / "one.npz", **one)
    got = _compare(_cpp(run_bundle, bundle, tmp_path / "one.npz", lib_dir=ort_lib.parent),
                   _python(bundle, tmp_path / "one.npz", ort_lib.parent))  # fmt: skip
    assert len(got["report"]["skipped_paths"]) == 6 and got["report"]["skipped_params"] > 0
    assert "skipped 6 paths on this request" in got["report"]["summary"]


def test_static_bundle_prints_what_layerzero_run_prints(run_bundle, static_bundle):
    bundle, feeds = static_bundle
    got = _compare(_cpp(run_bundle, bundle, feeds), _python(bundle, feeds, None))
    assert got["report"]["zeroed_layers"] >= 1 and got["report"]["zeroed_params_ratio"] > 0


def test_missing_library_is_one_line_exit_2(run_bundle, moe_bundle, tmp_path):
    bundle, feeds = moe_bundle
    done = _cpp(run_bundle, bundle, feeds, lib_dir=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "liblayerzero_ort.so not found" in done.stderr


@pytest.mark.parametrize("case", ["missing file", "missing input", "unknown input", "dtype", "rank",
                                  "compressed", "not npz", "bad manifest"])  # fmt: skip
def test_bad_input_is_one_line_exit_2(run_bundle, static_bundle, tmp_path, case):
    bundle, feeds = static_bundle
    arrays = dict(np.load(feeds))
    name = next(iter(arrays))
    target, path = bundle, tmp_path / "f.npz"
    if case == "missing file":
        path = tmp_path / "absent.npz"
    elif case == "missing input":
        np.savez(path, **{k: v for k, v in arrays.items() if k != name})
    elif case == "unknown input":
        np.savez(path, **arrays, bogus=np.zeros(1, np.float32))
    elif case == "dtype":
        np.savez(path, **{**arrays, name: arrays[name].astype(np.float64)})
    elif case == "rank":
        np.savez(path, **{**arrays, name: arrays[name][None]})
    elif case == "compressed":
        np.savez_compressed(path, **arrays)
    elif case == "not npz":
        path.write_bytes(b"not a zip file at all")
    else:
        target = tmp_path / "b.lz"
        shutil.copytree(bundle, target)
        (target / "manifest.json").write_text('{"layers": [1, 2,')
        path = feeds
    done = _cpp(run_bundle, target, path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("run_bundle: ") and done.stderr.count("\n") == 1, done.stderr
