"""GPU check of the LayerZero MoE kernels (and the TensorRT plugin where TensorRT exists), offline.

    python scripts/gpu_check.py --build-dir DIR [--driver EXE] [--json OUT] [--quick]

Run by ``scripts/gpu_check.sh``, which checks the machine (nvidia-smi, nvcc, cmake, CuPy), builds the kernels and
the sanitizer driver, then calls this. Nothing is installed and nothing is downloaded: the project is used from
the source tree (``layerzero.plugins.loader`` / ``reference`` are loaded by path when ``layerzero`` is not
installed), device memory, streams, events and the dense baseline come from CuPy.

Checks, each ``passed`` / ``failed`` / ``skipped`` (with the reason) in the JSON report:

1. correctness: ``liblayerzero_kernels.so`` against the numpy reference (``plugins/reference.py``), fp32 / fp16 /
   bf16, T = 0 / 1 / few (GEMV path) / many (tiled path), E up to 256, top_k up to 8 and top_k = E, every scoring
   and activation, zeroing thresholds, dims that are not multiples of 8; ``lz_moe_route`` must agree with the
   forward's mask;
2. sanitizer: ``compute-sanitizer`` memcheck (with leak check) and racecheck on ``tests/plugins/harness/
   kernel_driver.cpp`` (exact-size allocations, both paths, all dtypes); any finding fails;
3. timing (fp16, CUDA events): the routed kernels (top-k) against a real dense baseline, every expert on every
   token through cuBLAS (CuPy matmul: gate/up as one [T, H] x [H, E*F] GEMM each, down as a batched GEMM), and
   against the routed kernels at top_k = E; Mixtral-sized (H=4096, F=14336, E=8, top-2) and fine-grained
   (H=2048, F=1408, E=64, top-6) blocks at T = 1, 16, 64, 256 (``--quick``: smaller blocks);
4. tensorrt: only where ``import tensorrt`` works, liblayerzero_trt.so is built and ``layerzero`` is installed
   (``pip install --no-deps --no-build-isolation -e .``): compile an example MoE model for TensorRT (fp32, fp16)
   and compare the plan with ONNX Runtime; elsewhere a skip.

Exit codes: 0 every check ran and passed; 1 a check failed; 2 incomplete (the machine lacks what the check needs:
no GPU, no CuPy, no kernels library; the last line says what); 3 every check that ran passed but some were
skipped (listed): a skip is never reported as a pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

EXIT_PASSED, EXIT_FAILED, EXIT_INCOMPLETE, EXIT_SKIPPED = 0, 1, 2, 3
CHECKS = ("correctness", "sanitizer", "timing", "tensorrt")

# Max |error| / max(1, max |reference|) that passes, per dtype (inputs are rounded to the dtype for both sides;
# the kernels accumulate in fp32 and round y once).
TOLERANCE = {"float32": 2e-4, "float16": 6e-3, "bfloat16": 4e-2}

CASES = [
    # tokens, H, F, E, top_k, normalize, scoring, activation, threshold
    (0, 64, 96, 8, 2, 1, "softmax", "silu", 0.0),  # T = 0: a no-op
    (1, 64, 96, 8, 2, 1, "softmax", "silu", 0.0),
    (3, 64, 96, 8, 2, 0, "sigmoid", "gelu", 0.3),
    (8, 64, 96, 8, 1, 1, "softmax", "relu", 0.0),
    (5, 36, 52, 6, 6, 1, "softmax", "silu", 0.0),  # dims not multiples of 8: scalar GEMV loads; top_k = E
    (9, 64, 96, 8, 2, 1, "softmax", "silu", 0.0),  # first tiled case
    (64, 64, 96, 8, 2, 1, "softmax", "silu", 0.2),
    (64, 36, 52, 6, 3, 0, "sigmoid", "gelu", 0.0),  # partial tiles in every direction
    (300, 128, 160, 16, 4, 1, "softmax", "silu", 0.1),
    (130, 64, 96, 64, 8, 1, "softmax", "relu", 0.0),  # many experts, some idle
    (1, 128, 64, 256, 8, 1, "softmax", "silu", 0.0),  # E = 256, top-8, GEMV path
    (7, 64, 48, 256, 8, 0, "sigmoid", "silu", 0.5),
    (512, 64, 48, 256, 8, 1, "softmax", "gelu", 0.05),  # E = 256, tiled, most experts busy
]

SANITIZER_TOOLS = (("memcheck", ["--leak-check", "full"]), ("racecheck", []))


class EnvironmentMissing(RuntimeError):
    """The machine lacks something the check needs (exit 2)."""


@dataclasses.dataclass
class Outcome:
    """One check's result: ``passed`` / ``failed`` / ``skipped``, why, and every figure it measured."""

    status: str
    reason: str = ""
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)


def exit_code(statuses: dict[str, str]) -> int:
    """The script's exit code for the checks' statuses (a failure wins; a skip is never a pass)."""
    values = set(statuses.values())
    if "failed" in values:
        return EXIT_FAILED
    if "incomplete" in values:
        return EXIT_INCOMPLETE
    if "skipped" in values:
        return EXIT_SKIPPED
    return EXIT_PASSED


def plugin_modules() -> tuple[ModuleType, ModuleType]:
    """``layerzero.plugins.loader`` and ``.reference``: installed, else loaded from the tree (both are leaves)."""
    try:
        from layerzero.plugins import loader, reference

        return loader, reference
    except ImportError:
        pass
    modules = []
    for name in ("loader", "reference"):
        spec = importlib.util.spec_from_file_location(f"layerzero_plugins_{name}", ROOT / "plugins" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


# ------------------------------------------------------------------------------------------- dtypes


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def as_dtype(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(what goes to the device, the same values as numpy sees them for the reference)."""
    if dtype == "float32":
        a = x.astype(np.float32)
        return a, a
    if dtype == "float16":
        a = x.astype(np.float16)
        return a, a.astype(np.float32)
    bits = bf16_bits(x)
    return bits, bf16_to_f32(bits)


def from_device(y: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_to_f32(y) if dtype == "bfloat16" else y.astype(np.float32)


# ------------------------------------------------------------------------------------------- device


class Device:
    """Device memory, one stream and events through CuPy (the GPU image has it; nothing is installed)."""

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as e:
            raise EnvironmentMissing(
                f"CuPy does not import ({e}); this check uses the image's CuPy for device memory, streams and "
                "cuBLAS (offline machines cannot pip install it)"
            ) from e
        self.cp = cupy
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise EnvironmentMissing(f"no usable CUDA device: {e}") from e
        if count == 0:
            raise EnvironmentMissing("no CUDA device")
        props = cupy.cuda.runtime.getDeviceProperties(0)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.capability = f"{props['major']}.{props['minor']}"
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def put(self, array: np.ndarray) -> Any:
        with self.stream:
            return self.cp.asarray(np.ascontiguousarray(array))

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        with self.stream:
            return self.cp.empty(shape, dtype)

    @staticmethod
    def ptr(array: Any) -> int:
        return int(array.data.ptr)

    def get(self, array: Any) -> np.ndarray:
        self.stream.synchronize()
        return self.cp.asnumpy(array)

    def time_ms(self, fn, iterations: int = 20, warmup: int = 3) -> float:
        """Mean milliseconds of ``fn()`` on the stream, by CUDA events."""
        with self.stream:
            for _ in range(warmup):
                fn()
            start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
            start.record(self.stream)
            for _ in range(iterations):
                fn()
            end.record(self.stream)
            end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end) / iterations


def storage(dtype: str) -> type:
    return {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]


def run_kernels(lib, loader, dev: Device, dtype: str, hidden, logits, w_gate, w_up, w_down, **attrs) -> tuple:
    """(y, mask from the forward, mask from lz_moe_route) of one problem on the device."""
    tokens, size = hidden.shape
    experts, ffn, _ = w_gate.shape
    config = loader.MoEConfig.make(tokens=tokens, hidden=size, ffn=ffn, experts=experts, **attrs)
    h, lg, g, u, d = (dev.put(a) for a in (hidden, logits, w_gate, w_up, w_down))
    y = dev.empty(hidden.shape, storage(dtype))
    mask = dev.empty((tokens, experts), np.int32)
    ws_size = lib.workspace_size(config)
    ws = dev.empty((max(ws_size, 1),), np.uint8)
    lib.forward(
        config,
        dtype,
        hidden=dev.ptr(h),
        router_logits=dev.ptr(lg),
        w_gate=dev.ptr(g),
        w_up=dev.ptr(u),
        w_down=dev.ptr(d),
        y=dev.ptr(y),
        mask=dev.ptr(mask),
        workspace=dev.ptr(ws),
        workspace_size=ws_size,
        stream=dev.stream.ptr,
    )
    k = attrs["top_k"]
    index, weight = dev.empty((tokens, k), np.int32), dev.empty((tokens, k), np.float32)
    mask2 = dev.empty((tokens, experts), np.int32)
    lib.route(config, dtype, dev.ptr(lg), dev.ptr(index), dev.ptr(weight), dev.ptr(mask2), stream=dev.stream.ptr)
    return dev.get(y), dev.get(mask), dev.get(mask2)


# ------------------------------------------------------------------------------------------- checks


def check_correctness(lib, loader, reference, dev: Device) -> Outcome:
    rows_out = []
    worst = {d: 0.0 for d in TOLERANCE}
    ok = True
    for dtype in TOLERANCE:
        for case_id, (tokens, size, ffn, experts, top_k, normalize, scoring, activation, thr) in enumerate(CASES):
            rng = np.random.default_rng(case_id)
            x = rng.standard_normal((tokens, size)).astype(np.float32)
            logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 2
            wg = (rng.standard_normal((experts, ffn, size)) * size**-0.5).astype(np.float32)
            wu = (rng.standard_normal((experts, ffn, size)) * size**-0.5).astype(np.float32)
            wd = (rng.standard_normal((experts, size, ffn)) * ffn**-0.5).astype(np.float32)
            dev_in, ref_in = zip(*(as_dtype(a, dtype) for a in (x, logits, wg, wu, wd)), strict=True)
            attrs = dict(
                top_k=top_k, normalize=normalize, scoring=scoring, activation=activation, zeroing_threshold=thr
            )
            y_ref, mask_ref = reference.moe_reference(*ref_in, **attrs)
            y_dev, mask_dev, mask_route = run_kernels(lib, loader, dev, dtype, *dev_in, **attrs)
            y_dev = from_device(y_dev, dtype)
            agree = mask_dev.astype(bool) == mask_ref
            rows = agree.all(axis=1)  # a near-tie may flip a choice between fp32 and float64; compare the rest
            scale = max(1.0, float(np.abs(y_ref).max(initial=0.0)))
            err = float(np.abs(y_dev[rows] - y_ref[rows]).max(initial=0.0)) / scale
            agreement = float(agree.mean()) if agree.size else 1.0
            route_equal = bool(np.array_equal(mask_route, mask_dev))
            passed = err <= TOLERANCE[dtype] and agreement >= 0.99 and route_equal
            worst[dtype] = max(worst[dtype], err)
            ok &= passed
            rows_out.append(
                dict(
                    dtype=dtype,
                    tokens=tokens,
                    hidden=size,
                    ffn=ffn,
                    experts=experts,
                    top_k=top_k,
                    normalize=normalize,
                    scoring=scoring,
                    activation=activation,
                    threshold=thr,
                    max_rel_error=err,
                    tolerance=TOLERANCE[dtype],
                    mask_agreement=agreement,
                    route_mask_equal=route_equal,
                    passed=passed,
                )
            )
            if not passed:
                print(
                    f"FAIL {dtype} case {case_id} (T={tokens} H={size} F={ffn} E={experts} k={top_k} {scoring} "
                    f"{activation} thr={thr}): err {err:.3g}, mask agreement {agreement:.4f}, "
                    f"route==forward mask {route_equal}"
                )
    for dtype, err in worst.items():
        status = "ok" if err <= TOLERANCE[dtype] else "FAIL"
        print(
            f"kernels vs numpy reference  {dtype:<9} max rel error {err:.3g}  (tolerance {TOLERANCE[dtype]:g}) {status}"
        )
    figures = {"max_rel_error": worst, "tolerance": TOLERANCE, "cases": rows_out}
    failed = sum(not r["passed"] for r in rows_out)
    return Outcome("passed" if ok else "failed", f"{failed} of {len(rows_out)} cases failed" if failed else "", figures)


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "compute-sanitizer").is_file():
            return str(Path(root) / "bin" / "compute-sanitizer")
    return None


def sanitizer_findings(output: str) -> int | None:
    """Errors / hazards compute-sanitizer counted (its SUMMARY line); None when it printed no summary."""
    match = re.search(r"(?:ERROR|RACECHECK) SUMMARY:\s*(\d+)\s+(?:errors?|hazards?)", output)
    return int(match.group(1)) if match else None


def check_sanitizer(driver: Path | None, timeout_s: float) -> Outcome:
    if driver is None:
        return Outcome("skipped", "no --driver given (scripts/gpu_check.sh builds tests/plugins/harness/kernel_driver)")
    if not Path(driver).is_file():
        return Outcome("failed", f"sanitizer driver {driver} does not exist (its build failed?)")
    sanitizer = find_sanitizer()
    if sanitizer is None:
        return Outcome("skipped", "compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    figures: dict[str, Any] = {}
    ok = True
    for tool, extra in SANITIZER_TOOLS:
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "86", *extra, str(driver)]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
            output, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            output, rc = f"timed out after {timeout_s:.0f} s\n{e.stdout or ''}", None
        elapsed = time.perf_counter() - started
        findings = sanitizer_findings(output)
        passed = rc == 0 and findings == 0 and "DRIVER PASSED" in output
        ok &= passed
        figures[tool] = {"exit_code": rc, "findings": findings, "seconds": elapsed, "passed": passed}
        print(
            f"compute-sanitizer {tool:<9} findings {findings}  exit {rc}  {elapsed:.1f} s  {'ok' if passed else 'FAIL'}"
        )
        if not passed:
            print("\n".join(output.strip().splitlines()[-40:]))
    return Outcome("passed" if ok else "failed", "" if ok else "sanitizer findings or driver failure", figures)


def dense_moe(dev: Device, x, logits, wg2, wu2, wd, experts: int, ffn: int, silu_mul):
    """Every expert on every token (what a model that skips nothing computes), through cuBLAS."""
    cp = dev.cp
    tokens = x.shape[0]
    g = x @ wg2.T  # [T, E*F]
    u = x @ wu2.T
    h = silu_mul(g, u).reshape(tokens, experts, ffn).transpose(1, 2, 0)  # [E, F, T]
    out = cp.matmul(wd, h)  # [E, H, T], batched GEMM
    e = cp.exp(logits - logits.max(axis=1, keepdims=True))
    probs = (e / e.sum(axis=1, keepdims=True)).T.astype(out.dtype)  # [E, T]
    return (out * probs[:, None, :]).sum(axis=0).T


def check_timing(lib, loader, dev: Device, quick: bool) -> Outcome:
    cp = dev.cp
    silu_mul = cp.ElementwiseKernel(
        "T g, T u", "T h", "float gf = (float)g; h = (T)(gf / (1.0f + expf(-gf)) * (float)u)", "lz_silu_mul"
    )
    blocks = (
        [("small", 1024, 2816, 8, 2), ("fine-grained small", 1024, 704, 64, 6)]
        if quick
        else [("Mixtral-8x7B", 4096, 14336, 8, 2), ("fine-grained (DeepSeek-V2-Lite)", 2048, 1408, 64, 6)]
    )
    rows = []
    for label, size, ffn, experts, top_k in blocks:
        rows += _time_block(lib, loader, dev, silu_mul, label, size, ffn, experts, top_k)
        cp.get_default_memory_pool().free_all_blocks()
    # Timing informs; it does not fail the check (a slower routed call is a finding to read, not a wrong answer).
    return Outcome("passed", "", {"rows": rows, "iterations": 20, "warmup": 3})


def _time_block(lib, loader, dev: Device, silu_mul, label: str, size: int, ffn: int, experts: int, top_k: int):
    cp = dev.cp
    rng = np.random.default_rng(0)
    with dev.stream:
        wg = (cp.random.standard_normal((experts, ffn, size), dtype=cp.float32) * size**-0.5).astype(cp.float16)
        wu = (cp.random.standard_normal((experts, ffn, size), dtype=cp.float32) * size**-0.5).astype(cp.float16)
        wd = (cp.random.standard_normal((experts, size, ffn), dtype=cp.float32) * ffn**-0.5).astype(cp.float16)
    wg2, wu2 = wg.reshape(experts * ffn, size), wu.reshape(experts * ffn, size)
    rows = []
    for tokens in (1, 16, 64, 256):
        x = dev.put(rng.standard_normal((tokens, size)).astype(np.float16))
        logits = dev.put(rng.standard_normal((tokens, experts)).astype(np.float16))
        y = dev.empty((tokens, size), np.float16)
        pointers = dict(
            hidden=dev.ptr(x),
            router_logits=dev.ptr(logits),
            w_gate=dev.ptr(wg),
            w_up=dev.ptr(wu),
            w_down=dev.ptr(wd),
            y=dev.ptr(y),
            mask=None,
        )
        timings = {}
        for k in (top_k, experts):
            config = loader.MoEConfig.make(tokens=tokens, hidden=size, ffn=ffn, experts=experts, top_k=k)
            ws_size = lib.workspace_size(config)
            ws = dev.empty((ws_size,), np.uint8)
            call = functools.partial(
                lib.forward,
                config,
                "float16",
                **pointers,
                workspace=dev.ptr(ws),
                workspace_size=ws_size,
                stream=dev.stream.ptr,
            )
            timings[k] = dev.time_ms(call)
        routed_ms, all_experts_ms = timings[top_k], timings[experts]
        dense_ms = dev.time_ms(functools.partial(dense_moe, dev, x, logits, wg2, wu2, wd, experts, ffn, silu_mul))
        weight_bytes = 3 * ffn * size * 2 * min(experts, tokens * top_k)  # expert weights the routed call reads
        row = {
            "block": label,
            "hidden": size,
            "ffn": ffn,
            "experts": experts,
            "top_k": top_k,
            "tokens": tokens,
            "dtype": "float16",
            "routed_ms": routed_ms,
            "routed_all_experts_ms": all_experts_ms,
            "dense_cublas_ms": dense_ms,
            "speedup_vs_dense_cublas": dense_ms / routed_ms,
            "routed_weight_gb_per_s": weight_bytes / (routed_ms / 1e3) / 1e9,
        }
        rows.append(row)
        print(
            f"{label:<32} T={tokens:<4} routed top-{top_k} {routed_ms * 1e3:9.1f} us   "
            f"dense cuBLAS {dense_ms * 1e3:9.1f} us   x{dense_ms / routed_ms:5.2f}   "
            f"(routed kernels, all {experts} experts: {all_experts_ms * 1e3:9.1f} us; "
            f"{row['routed_weight_gb_per_s']:.0f} GB/s of expert weights)"
        )
    return rows


def check_tensorrt(build_dir: Path | None) -> Outcome:
    try:
        import tensorrt
    except ImportError as e:
        return Outcome("skipped", f"the tensorrt package does not import here ({e})")
    loader, _ = plugin_modules()
    try:
        library = loader.plugin_library_path("trt", build_dir)
    except loader.PluginError as e:
        return Outcome("skipped", f"TensorRT {tensorrt.__version__}: {e}")
    try:
        import onnx

        from layerzero.compile import compile_file
        from layerzero.models.moe import MoEConfig, build_moe, moe_feeds
        from layerzero.options import CompileOptions
        from layerzero.runtime import Engine
        from layerzero.targets.tensorrt import TensorRTOptions
    except ImportError as e:
        return Outcome("skipped", f"the layerzero package is not importable for the plan check ({e})")

    ok = True
    config = MoEConfig(hidden=256, ffn=512, experts=8, top_k=2, layers=2, residual=True)
    results: dict[str, Any] = {"version": tensorrt.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "moe.onnx"
        onnx.save(build_moe(config), source)
        reference = Engine.load(source)
        for precision in ("fp32", "fp16"):
            out = Path(tmp) / f"moe-{precision}.lz"
            started = time.perf_counter()
            compile_file(
                source,
                out,
                CompileOptions(target="tensorrt", shapes={"hidden": (16, config.hidden)}),
                tensorrt=TensorRTOptions(
                    precision=precision,
                    profiles={"hidden": ((1, config.hidden), (16, config.hidden), (128, config.hidden))},
                    plugin_library=library,
                ),
            )
            built_s = time.perf_counter() - started
            engine = Engine.load(out, backend="tensorrt", plugin_library=library)
            worst = 0.0
            for tokens in (1, 16, 128):
                feeds = moe_feeds(config, tokens=tokens, seed=tokens)
                want = reference.run(feeds).outputs["y"]
                got = engine.run(feeds).outputs["y"]
                worst = max(worst, float(np.abs(got - want).max()))
            limit = 1e-3 if precision == "fp32" else 5e-2
            passed = worst <= limit
            ok &= passed
            results[precision] = {"max_abs": worst, "limit": limit, "build_s": built_s, "passed": passed}
            print(
                f"TensorRT {tensorrt.__version__} {precision} engine vs ONNX Runtime: max abs {worst:.3g} "
                f"(limit {limit:g}, build {built_s:.1f} s) {'ok' if passed else 'FAIL'}"
            )
    return Outcome("passed" if ok else "failed", "", results)


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, help="where liblayerzero_*.so are (default: the loader's search)")
    parser.add_argument("--driver", type=Path, help="the sanitizer driver (tests/plugins/harness/kernel_driver.cpp)")
    parser.add_argument("--json", type=Path, help="write every figure and each check's status here")
    parser.add_argument("--quick", action="store_true", help="smaller timing problems")
    parser.add_argument("--sanitizer-timeout", type=float, default=150.0, help="seconds per compute-sanitizer tool")
    parser.add_argument(
        "--only", choices=CHECKS, action="append", help="run only these checks (repeatable); the others are skipped"
    )
    return parser.parse_args(argv)


def environment(dev: Device | None) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__, "host": platform.node()}
    if dev is not None:
        info.update(gpu=dev.name, compute_capability=dev.capability, cupy=dev.cp.__version__)
        info["cuda_runtime"] = dev.cp.cuda.runtime.runtimeGetVersion()
        info["cuda_driver"] = dev.cp.cuda.runtime.driverGetVersion()
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    selected = set(args.only or CHECKS)
    outcomes: dict[str, Outcome] = {}
    report: dict[str, Any] = {"checks": {}}
    dev = None
    try:
        loader, reference = plugin_modules()
        try:
            lib = loader.load_kernels(build_dir=args.build_dir)
        except loader.PluginError as e:
            raise EnvironmentMissing(str(e)) from e
        print(f"kernels: {lib.path}")
        dev = Device()
        print(f"device: {dev.name} (sm {dev.capability})")
        steps = {
            "correctness": lambda: check_correctness(lib, loader, reference, dev),
            "sanitizer": lambda: check_sanitizer(args.driver, args.sanitizer_timeout),
            "timing": lambda: check_timing(lib, loader, dev, args.quick),
            "tensorrt": lambda: check_tensorrt(args.build_dir),
        }
        for name in CHECKS:
            if name not in selected:
                outcomes[name] = Outcome("skipped", "not selected (--only)")
                continue
            print(f"== {name}")
            t0 = time.perf_counter()
            try:
                outcomes[name] = steps[name]()
            except EnvironmentMissing:
                raise
            except Exception as e:  # a crash in one check is that check's failure; the others still run
                outcomes[name] = Outcome("failed", f"{type(e).__name__}: {e}")
            outcomes[name].figures.setdefault("seconds", time.perf_counter() - t0)
            if outcomes[name].status == "skipped":
                print(f"SKIP {name}: {outcomes[name].reason}")
        statuses = {name: o.status for name, o in outcomes.items()}
        report["reason"] = ""
    except EnvironmentMissing as e:
        statuses = {name: o.status for name, o in outcomes.items()} | {"environment": "incomplete"}
        report["reason"] = str(e)
        print(f"GPU CHECK INCOMPLETE: {e}")
    code = exit_code(statuses)
    report["status"] = {0: "passed", 1: "failed", 2: "incomplete", 3: "passed with skips"}[code]
    report["exit_code"] = code
    report["environment"] = environment(dev)
    report["checks"] = {name: dataclasses.asdict(o) for name, o in outcomes.items()}
    report["skipped"] = {name: o.reason for name, o in outcomes.items() if o.status == "skipped"}
    report["failed"] = {name: o.reason for name, o in outcomes.items() if o.status == "failed"}
    report["seconds"] = time.perf_counter() - started
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if code == EXIT_FAILED:
        print(f"GPU CHECK FAILED: {', '.join(f'{k} ({v})' if v else k for k, v in report['failed'].items())}")
    elif code == EXIT_SKIPPED:
        print(f"GPU CHECK PASSED WITH SKIPS (exit 3): {'; '.join(f'{k}: {v}' for k, v in report['skipped'].items())}")
    elif code == EXIT_PASSED:
        print("GPU CHECK PASSED")
    return code


if __name__ == "__main__":
    sys.exit(main())
