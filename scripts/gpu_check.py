"""GPU check of the LayerZero MoE kernels and TensorRT plugin (run by scripts/gpu_check.sh on a GPU machine).

    python scripts/gpu_check.py [--build-dir DIR] [--quick] [--json OUT]

1. correctness: liblayerzero_kernels.so through ctypes + cuda-python against the numpy reference
   (``layerzero.plugins.reference.moe_reference``), fp32 / fp16 / bf16, the GEMV path (T <= 8) and the tiled
   path, every scoring / activation, thresholds, top_k = 1 and top_k = E; prints the max error per dtype;
2. timing: 1 and 64 tokens of a Mixtral-sized block (H=4096, F=14336, E=8, top-2; --quick: smaller), routed
   (top-2: only the chosen experts run) against dense (top_k = E: every expert runs, same kernels), CUDA events;
3. TensorRT (only when ``tensorrt`` imports and liblayerzero_trt.so is built): compile an example MoE model with
   ``--target tensorrt`` (fp32, fp16), run the plan and compare with ONNX Runtime on the source model.

Exit 0 when every check that ran passed, 1 when one failed, 2 when the environment is missing something
(no GPU, no cuda-python, no kernels library): the last line says which.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# Max |error| / max(1, max |reference|) that passes, per dtype (inputs are rounded to the dtype for both sides;
# the kernels accumulate in fp32 and round y once).
TOLERANCE = {"float32": 2e-4, "float16": 6e-3, "bfloat16": 4e-2}

CASES = [
    # tokens, H, F, E, top_k, normalize, scoring, activation, threshold
    (1, 64, 96, 8, 2, 1, "softmax", "silu", 0.0),
    (3, 64, 96, 8, 2, 0, "sigmoid", "gelu", 0.3),
    (8, 64, 96, 8, 1, 1, "softmax", "relu", 0.0),
    (5, 36, 52, 6, 6, 1, "softmax", "silu", 0.0),  # dims not multiples of 8: scalar GEMV loads; top_k = E
    (9, 64, 96, 8, 2, 1, "softmax", "silu", 0.0),  # first tiled case
    (64, 64, 96, 8, 2, 1, "softmax", "silu", 0.2),
    (64, 36, 52, 6, 3, 0, "sigmoid", "gelu", 0.0),  # partial tiles in every direction
    (300, 128, 160, 16, 4, 1, "softmax", "silu", 0.1),
    (130, 64, 96, 64, 8, 1, "softmax", "relu", 0.0),  # many experts, some idle
]


class EnvironmentMissing(RuntimeError):
    """The machine lacks something the check needs (exit 2)."""


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


def storage(dtype: str) -> type:
    return {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}[dtype]


class Device:
    """Allocations on one CUDA device through layerzero's cuda-python helper; freed on close."""

    def __init__(self) -> None:
        from layerzero.runtime.backends._cuda import Cuda, CudaUnavailableError

        try:
            self.cuda = Cuda(0)
        except CudaUnavailableError as e:
            raise EnvironmentMissing(str(e)) from e
        except RuntimeError as e:
            raise EnvironmentMissing(f"no usable CUDA device: {e}") from e
        self.ptrs: list[int] = []

    def alloc(self, nbytes: int) -> int:
        ptr = self.cuda.malloc(nbytes)
        self.ptrs.append(ptr)
        return ptr

    def put(self, array: np.ndarray) -> int:
        ptr = self.alloc(array.nbytes)
        self.cuda.upload(ptr, array)
        return ptr

    def get(self, ptr: int, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.cuda.download(out, ptr)
        self.cuda.synchronize()
        return out

    def free_all(self) -> None:
        for ptr in self.ptrs:
            self.cuda.free(ptr)
        self.ptrs.clear()


def run_kernels(lib, dev: Device, dtype: str, hidden, logits, w_gate, w_up, w_down, **attrs) -> tuple:
    from layerzero.plugins.loader import MoEConfig

    tokens, size = hidden.shape
    experts, ffn, _ = w_gate.shape
    config = MoEConfig.make(tokens=tokens, hidden=size, ffn=ffn, experts=experts, **attrs)
    ptr = {name: dev.put(a) for name, a in dict(h=hidden, l=logits, g=w_gate, u=w_up, d=w_down).items()}
    y = dev.alloc(hidden.nbytes)
    mask = dev.alloc(tokens * experts * 4)
    ws_size = lib.workspace_size(config)
    ws = dev.alloc(ws_size)
    lib.forward(
        config,
        dtype,
        hidden=ptr["h"],
        router_logits=ptr["l"],
        w_gate=ptr["g"],
        w_up=ptr["u"],
        w_down=ptr["d"],
        y=y,
        mask=mask,
        workspace=ws,
        workspace_size=ws_size,
        stream=dev.cuda.stream_handle,
    )
    out = dev.get(y, hidden.shape, storage(dtype)), dev.get(mask, (tokens, experts), np.int32)
    # Routing only: the same decisions through lz_moe_route.
    index = dev.alloc(tokens * attrs["top_k"] * 4)
    weight = dev.alloc(tokens * attrs["top_k"] * 4)
    mask2 = dev.alloc(tokens * experts * 4)
    lib.route(config, dtype, ptr["l"], index, weight, mask2, stream=dev.cuda.stream_handle)
    routed_mask = dev.get(mask2, (tokens, experts), np.int32)
    dev.free_all()
    return out[0], out[1], routed_mask


def check_correctness(lib, dev: Device, report: dict) -> bool:
    from layerzero.plugins.reference import moe_reference

    ok = True
    worst = {d: 0.0 for d in TOLERANCE}
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
            y_ref, mask_ref = moe_reference(*ref_in, **attrs)
            y_dev, mask_dev, mask_route = run_kernels(lib, dev, dtype, *dev_in, **attrs)
            y_dev = from_device(y_dev, dtype)
            agree = mask_dev.astype(bool) == mask_ref
            rows = agree.all(axis=1)  # a near-tie may flip a choice between fp32 and float64; compare the rest
            scale = max(1.0, float(np.abs(y_ref).max()))
            err = float(np.abs(y_dev[rows] - y_ref[rows]).max(initial=0.0)) / scale
            worst[dtype] = max(worst[dtype], err)
            passed = err <= TOLERANCE[dtype] and agree.mean() >= 0.99 and np.array_equal(mask_route, mask_dev)
            if not passed:
                ok = False
                print(
                    f"FAIL {dtype} case {case_id} (T={tokens} H={size} F={ffn} E={experts} k={top_k} {scoring} "
                    f"{activation} thr={thr}): err {err:.3g}, mask agreement {agree.mean():.4f}, "
                    f"route==forward mask {np.array_equal(mask_route, mask_dev)}"
                )
    for dtype, err in worst.items():
        status = "ok" if err <= TOLERANCE[dtype] else "FAIL"
        print(
            f"kernels vs numpy reference  {dtype:<9} max rel error {err:.3g}  (tolerance {TOLERANCE[dtype]:g}) {status}"
        )
    report["correctness"] = {"max_error": worst, "tolerance": TOLERANCE, "passed": ok}
    return ok


def time_moe(lib, dev: Device, quick: bool, report: dict) -> None:
    from layerzero.plugins.loader import MoEConfig

    size, ffn, experts = (1024, 2816, 8) if quick else (4096, 14336, 8)
    dtype = "bfloat16"
    rng = np.random.default_rng(0)
    itemsize = 2
    # One random expert uploaded, copied to the others (timing does not need distinct experts).
    per_expert = ffn * size
    weights = {}
    for name in ("g", "u", "d"):
        one = bf16_bits((rng.standard_normal(per_expert) * size**-0.5).astype(np.float32))
        ptr = dev.alloc(experts * per_expert * itemsize)
        dev.cuda.upload(ptr, one)
        for e in range(1, experts):
            dev.cuda.copy(ptr + e * per_expert * itemsize, ptr, per_expert * itemsize)
        weights[name] = ptr
    rows = []
    for tokens in (1, 64):
        x = dev.put(bf16_bits(rng.standard_normal((tokens, size)).astype(np.float32)))
        logits = dev.put(bf16_bits(rng.standard_normal((tokens, experts)).astype(np.float32)))
        y = dev.alloc(tokens * size * itemsize)
        timings = {}
        for label, top_k in (("routed top-2", 2), (f"dense (all {experts})", experts)):
            config = MoEConfig.make(tokens=tokens, hidden=size, ffn=ffn, experts=experts, top_k=top_k)
            ws_size = lib.workspace_size(config)
            ws = dev.alloc(ws_size)

            def call(config=config, ws=ws, ws_size=ws_size, x=x, logits=logits, y=y) -> None:
                lib.forward(
                    config,
                    dtype,
                    hidden=x,
                    router_logits=logits,
                    w_gate=weights["g"],
                    w_up=weights["u"],
                    w_down=weights["d"],
                    y=y,
                    mask=None,
                    workspace=ws,
                    workspace_size=ws_size,
                    stream=dev.cuda.stream_handle,
                )

            for _ in range(3):
                call()
            iterations = 20
            start, end = dev.cuda.event_timer()
            dev.cuda.record(start)
            for _ in range(iterations):
                call()
            dev.cuda.record(end)
            ms = dev.cuda.elapsed_ms(start, end) / iterations
            timings[label] = ms
        routed, dense = timings["routed top-2"], timings[f"dense (all {experts})"]
        weight_gb = 2 * 3 * per_expert * itemsize / 1e9  # top-2 experts' weights, read once at T=1
        line = (
            f"MoE bf16 H={size} F={ffn} E={experts}  T={tokens:<3} routed top-2 {routed * 1e3:8.1f} us   "
            f"dense {dense * 1e3:8.1f} us   speed-up x{dense / routed:.2f}"
        )
        if tokens == 1:
            line += f"   ({weight_gb / (routed / 1e3):.0f} GB/s of expert weights)"
        print(line)
        rows.append({"tokens": tokens, "routed_ms": routed, "dense_ms": dense})
    report["timing"] = {"hidden": size, "ffn": ffn, "experts": experts, "dtype": dtype, "rows": rows}
    dev.free_all()


def check_tensorrt(build_dir: Path | None, report: dict) -> bool:
    try:
        import tensorrt
    except ImportError as e:
        print(f"SKIP TensorRT: the tensorrt package does not import here ({e})")
        report["tensorrt"] = {"skipped": str(e)}
        return True
    from layerzero.compile import compile_file
    from layerzero.models.moe import MoEConfig, build_moe, moe_feeds
    from layerzero.options import CompileOptions
    from layerzero.plugins.loader import PluginError, plugin_library_path
    from layerzero.runtime import Engine
    from layerzero.targets.tensorrt import TensorRTOptions

    try:
        library = plugin_library_path("trt", build_dir)
    except PluginError as e:
        print(f"SKIP TensorRT {tensorrt.__version__}: {e}")
        report["tensorrt"] = {"skipped": str(e)}
        return True
    import onnx

    ok = True
    config = MoEConfig(hidden=256, ffn=512, experts=8, top_k=2, layers=2, residual=True)
    results = {}
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
            results[precision] = {"max_abs": worst, "limit": limit, "build_s": built_s}
            print(
                f"TensorRT {tensorrt.__version__} {precision} engine vs ONNX Runtime: max abs {worst:.3g} "
                f"(limit {limit:g}, build {built_s:.1f} s) {'ok' if passed else 'FAIL'}"
            )
    report["tensorrt"] = results
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, help="where liblayerzero_*.so are (default: the loader's search)")
    parser.add_argument("--quick", action="store_true", help="smaller timing problem")
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    report: dict = {}
    try:
        from layerzero.plugins.loader import PluginError, load_kernels

        try:
            lib = load_kernels(build_dir=args.build_dir)
        except PluginError as e:
            raise EnvironmentMissing(str(e)) from e
        print(f"kernels: {lib.path}")
        dev = Device()
        ok = check_correctness(lib, dev, report)
        time_moe(lib, dev, args.quick, report)
        ok &= check_tensorrt(args.build_dir, report)
    except EnvironmentMissing as e:
        print(f"GPU CHECK INCOMPLETE: {e}")
        return 2
    finally:
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2, default=str))
    print("GPU CHECK PASSED" if ok else "GPU CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
