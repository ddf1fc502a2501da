"""What the tests of liblayerzero_ort.so's ``ai.layerzero::MoE`` share (tests/plugins/test_ort_native.py, float
experts; test_ort_quant.py, q8 / q4 experts): the one-node model, the session, the routing variants of the matrix,
the checks run on either kind of experts (threads, token counts at the kernel boundaries with an unaligned input,
peak RSS, AddressSanitizer) and the script entry point the subprocess tests use.

Both test files run as scripts too (``python tests/plugins/test_ort_native.py LIB``): they put the repository root
on ``sys.path`` first, so that ``tests.plugins`` imports.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from tests.plugins.native_build import missing

THRESHOLD = "layerzero::threshold"
NODE = "layers.0.moe/MoE"

# Every routing variant the matrix runs (x threshold x dtype x T in each test file).
VARIANTS = [
    dict(scoring=s, activation=a, normalize=n, top_k=k)
    for s in ("softmax", "sigmoid")
    for a in ("silu", "gelu", "relu")
    for n in (0, 1)
    for k in (1, 2)
]


def moe_node_model(
    names: Sequence[str],
    graph_inputs: list[onnx.ValueInfoProto],
    elem: int,
    experts: int,
    hidden: int,
    inits: list[onnx.TensorProto],
    **attrs: object,
) -> onnx.ModelProto:
    """One ``ai.layerzero::MoE`` node (inputs ``names``) giving ``y`` [T, hidden] of ``elem`` and ``mask``."""
    node = helper.make_node("MoE", list(names), ["y", "mask"], domain="ai.layerzero", name=NODE, **attrs)
    graph = helper.make_graph(
        [node],
        "moe",
        graph_inputs,
        [
            helper.make_tensor_value_info("y", elem, ["T", hidden]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["T", experts]),
        ],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.layerzero", 1)], ir_version=10
    )


def session(lib: Path, model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 4
    options.register_custom_ops_library(str(lib))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def random_feeds(
    rng: np.random.Generator, tokens: int, hidden: int, experts: int, logit_scale: float = 1.0
) -> dict[str, np.ndarray]:
    """Standard normal ``hidden`` [T, H] and ``logits`` [T, E] (times ``logit_scale``), float32."""
    return {
        "hidden": rng.standard_normal((tokens, hidden)).astype(np.float32),
        "logits": rng.standard_normal((tokens, experts)).astype(np.float32) * logit_scale,
    }


def threshold_runs(
    sess: ort.InferenceSession, x: np.ndarray, logits: np.ndarray, thresholds: Sequence[float] = (0.0, 0.3, 0.9)
) -> Iterator[tuple[float, np.ndarray, np.ndarray]]:
    """(threshold, y, mask) with each of ``thresholds`` fed as the ``layerzero::threshold`` input."""
    for threshold in thresholds:
        y, mask = sess.run(None, {"hidden": x, "logits": logits, THRESHOLD: np.array(threshold, np.float32)})
        yield threshold, y, mask


def same_at_one_and_two_threads(lib: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> bool:
    """Whether y and mask are bitwise equal on 1 and 2 intra-op threads."""
    one = session(lib, model, threads=1).run(None, feeds)
    two = session(lib, model, threads=2).run(None, feeds)
    return bool(np.array_equal(one[0], two[0]) and np.array_equal(one[1], two[1]))


def run_aligned_and_unaligned(
    sess: ort.InferenceSession, x: np.ndarray, logits: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y and mask for ``x``, and y for a copy of ``x`` one float past a 32-byte boundary (the kernel then gathers
    it onto a cache line)."""
    tokens, hidden = x.shape
    buf = np.empty(tokens * hidden + 16, np.float32)
    start = (-buf.ctypes.data % 32) // 4 + 1  # one float past a 32-byte boundary
    shifted = buf[start : start + tokens * hidden].reshape(tokens, hidden)
    shifted[...] = x
    assert shifted.ctypes.data % 32 == 4
    outs = [
        sess.run_with_ort_values(
            ["y", "mask"],
            {"hidden": ort.OrtValue.ortvalue_from_numpy(v), "logits": ort.OrtValue.ortvalue_from_numpy(logits)},
        )
        for v in (x, shifted)
    ]
    (y, mask), (y_shifted, _) = ([o.numpy() for o in out] for out in outs)
    return y, mask, y_shifted


def peak_rss_growth(lib: Path, model: onnx.ModelProto, tmp_path: Path) -> tuple[int, int]:
    """``model`` saved with external data and run (T = 1 and 64, one thread) in a fresh process: how much its
    peak RSS grew, and the size of the data file."""
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.onnx.data")
    weights = (tmp_path / "m.onnx.data").stat().st_size
    inputs = {v.name: v.type.tensor_type.shape.dim for v in model.graph.input}
    dims = {name: inputs[name][1].dim_value for name in ("hidden", "logits")}  # [T, H], [T, E]
    script = textwrap.dedent(
        f"""
        import resource, numpy as np, onnxruntime as ort
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.register_custom_ops_library({str(lib)!r})
        s = ort.InferenceSession({str(path)!r}, o, providers=["CPUExecutionProvider"])
        for t in (1, 64):
            s.run(None, {{"hidden": np.ones((t, {dims["hidden"]}), np.float32),
                          "logits": np.random.rand(t, {dims["logits"]}).astype(np.float32)}})
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    return int(out.stdout.strip().splitlines()[-1]), weights


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a test file run as a script: one OpenMP thread, this process's ``sys.path``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    env.update(extra)
    return env


def run_under_asan(script: str, lib_asan: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python script LIB_ASAN *args`` with libasan preloaded (the Python process's own leaks are not ours);
    skips (fails under ``LAYERZERO_REQUIRE_NATIVE=1``) without libasan.so."""
    libasan = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not libasan or not Path(libasan).exists():
        missing("libasan.so not found (g++ -print-file-name=libasan.so)")
    env = script_env(LD_PRELOAD=str(Path(libasan).resolve()), ASAN_OPTIONS="detect_leaks=0:abort_on_error=1")
    return subprocess.run(
        [sys.executable, script, str(lib_asan), *args], capture_output=True, text=True, env=env, timeout=1800
    )


def script_main(argv: list[str], isa_symbol: str, what: str, checks: Callable[[Path, bool], list[str]]) -> int:
    """The test file run as a script: ``LIB [--quick] [--expect-isa ISA]``: exit 1 when ``LIB``'s ``isa_symbol``
    names another ISA or ``checks(LIB, quick)`` lists mismatches (the first 50 printed), else print ok."""
    lib = Path(argv[0])
    if "--expect-isa" in argv:
        isa = getattr(ctypes.CDLL(str(lib)), isa_symbol)
        isa.restype = ctypes.c_char_p
        want = argv[argv.index("--expect-isa") + 1]
        if isa().decode() != want:
            print(f"{what} in use: {isa().decode()}, expected {want}")
            return 1
    failures = checks(lib, "--quick" in argv)
    print("\n".join(failures[:50]) or "ok")
    return 1 if failures else 0
