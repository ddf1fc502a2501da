"""Quantized experts (issue 22): liblayerzero_ort.so's ``ai.layerzero::MoE`` with ``weight_format`` q4 / q8 against
ONNX Runtime's ``com.microsoft.QMoE`` (int4 / int8, block 32) on the same weights, and against the native fp32 op.

One MoE block (E experts, top-k 8, softmax, renormalised, silu), 1 token by default. Every variant is a router
``Gemm`` plus the MoE node over the same drawn weights: fp32 for the native float op; the q4 / q8 codes and
float16 scales of ``plugins/quant.py`` for the native quantized op; the same codes for QMoE (int4: the same
offset-8 nibbles, low nibble first, QMoE's default zero point 8; int8: the codes + 128, zero point 128; scales
as float32 of the same values; fc1 = gate and up rows interleaved, ``swiglu_fusion=1``).

Also in the same interleaved rounds: ``floor`` (an ``Identity`` session run the same way: what any run costs before
the block's work) and ``stream`` (``LayerZeroOrtStreamRead``, the kernels' read pattern without arithmetic, over
the routed experts' quantized bytes: codes and scales; one core). Sessions as bench/moe.py's: ORT_ENABLE_ALL,
idle workers block rather than spin, IO binding. Each round runs every variant once in a shuffled order (the
others' hundreds of MB between two runs of one: cold weights); the table gives p50 over the rounds, the
1-minute load average before and after.

    python bench/moe_quant.py                       # E64 k8 H1024 F512 and E128 k8 H512 F256, 1 and 2 threads
    python bench/moe_quant.py --rounds 60 --experts 64
    python bench/moe_quant.py --experts 8 32         # bench/decode.py's blocks (Mixtral-, Qwen3-MoE-style)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from layerzero.plugins import ort_library
from layerzero.plugins.quant import chunk_q4_rows, dequantize_blocks, moe_quant_reference, quantize_moe_weights
from layerzero.plugins.reference import moe_reference

# 8 / 32: bench/decode.py's mixtral / qwen3_moe blocks
SHAPES = {8: (8, 2, 1024, 1536), 32: (32, 4, 1024, 384), 64: (64, 8, 1024, 512), 128: (128, 8, 512, 256)}


def _graph(node: onnx.NodeProto, hidden: int, experts: int, inits: list, domain: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["hidden", "router"], ["logits"], transB=1), node],
        "moe",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", hidden])],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)], ir_version=10
    )


def floor_model(hidden: int) -> onnx.ModelProto:
    """An ``Identity`` of the hidden input: what any run costs before the block's work."""
    floor = helper.make_graph(
        [helper.make_node("Identity", ["hidden"], ["y"])],
        "floor",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", hidden])],
    )
    return helper.make_model(floor, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def build(experts: int, top_k: int, hidden: int, ffn: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    router = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    w = [
        (rng.standard_normal((experts, ffn, hidden)) / np.sqrt(hidden)).astype(np.float32),
        (rng.standard_normal((experts, ffn, hidden)) / np.sqrt(hidden)).astype(np.float32),
        (rng.standard_normal((experts, hidden, ffn)) / np.sqrt(ffn)).astype(np.float32),
    ]
    attrs = dict(top_k=top_k, normalize=1, scoring="softmax", activation="silu")
    models, quant = {}, {}
    r = numpy_helper.from_array(router, "router")
    node = helper.make_node(
        "MoE", ["hidden", "logits", "wg", "wu", "wd"], ["y", "mask"], domain="ai.layerzero", **attrs
    )
    models["native f32"] = _graph(
        node,
        hidden,
        experts,
        [r] + [numpy_helper.from_array(a, n) for a, n in zip(w, ("wg", "wu", "wd"))],
        "ai.layerzero",
    )
    for bits in (4, 8):
        codes, scales = quantize_moe_weights(*w, bits)
        quant[bits] = (codes, scales)
        names = ["cg", "cu", "cd", "sg", "su", "sd"]
        # q4 in code_layout chunk16: what layerzero compile writes (the reference and QMoE read the plain rows).
        stored = [chunk_q4_rows(c) for c in codes] if bits == 4 else codes
        inits = [r] + [numpy_helper.from_array(a, n) for a, n in zip(stored + scales, names)]
        node = helper.make_node(
            "MoE",
            ["hidden", "logits", "cg", "cu", "cd", "", "", "", "", "", "sg", "su", "sd"],
            ["y", "mask"],
            domain="ai.layerzero",
            weight_format=f"q{bits}",
            **({"code_layout": "chunk16"} if bits == 4 else {}),
            **attrs,
        )
        models[f"native q{bits}"] = _graph(node, hidden, experts, inits, "ai.layerzero")
        # QMoE: uint8 codes with the default zero point (8 / 128), float32 scales of the same values.
        u = [c if bits == 4 else (c.view(np.uint8) ^ 0x80) for c in codes]
        fc1 = np.empty((experts, 2 * ffn, u[0].shape[2]), np.uint8)
        fc1[:, 0::2], fc1[:, 1::2] = u[0], u[1]
        s1 = np.empty((experts, 2 * ffn, scales[0].shape[2]), np.float32)
        s1[:, 0::2], s1[:, 1::2] = scales[0], scales[1]
        node = helper.make_node(
            "QMoE",
            ["hidden", "logits", "fc1", "s1", "", "fc2", "s2"],
            ["y"],
            domain="com.microsoft",
            k=top_k,
            activation_type="swiglu",
            swiglu_fusion=1,
            normalize_routing_weights=1,
            expert_weight_bits=bits,
            block_size=32,
        )
        inits = [
            r,
            numpy_helper.from_array(fc1, "fc1"),
            numpy_helper.from_array(s1, "s1"),
            numpy_helper.from_array(u[2], "fc2"),
            numpy_helper.from_array(scales[2].astype(np.float32), "s2"),
        ]
        models[f"QMoE int{bits}"] = _graph(node, hidden, experts, inits, "com.microsoft")
    models["floor"] = floor_model(hidden)
    return models, router, w, quant


class Runner:
    def __init__(self, model: onnx.ModelProto, threads: int, x: np.ndarray, lib: str):
        o = ort.SessionOptions()
        o.intra_op_num_threads = threads
        o.log_severity_level = 3
        o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        o.add_session_config_entry("session.intra_op.allow_spinning", "0")
        o.register_custom_ops_library(lib)
        self.session = ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])
        self.y = np.empty_like(x)
        self.binding = self.session.io_binding()
        self.binding.bind_cpu_input("hidden", x)
        self.binding.bind_output("y", "cpu", 0, np.float32, list(x.shape), self.y.ctypes.data)
        self.times: list[float] = []

    def run(self) -> None:
        start = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        self.times.append(time.perf_counter() - start)


def native() -> tuple[object, ctypes.CDLL, object] | None:
    """liblayerzero_ort.so (its path, the loaded library, its ``LayerZeroOrtStreamRead``), None (said on stderr)
    when it is not built."""
    lib = ort_library.find_ort_library()
    if lib is None:
        print("liblayerzero_ort.so not built (layerzero plugins build; LAYERZERO_PLUGIN_DIR)", file=sys.stderr)
        return None
    cdll = ctypes.CDLL(str(lib))
    cdll.LayerZeroOrtQuantIsa.restype = ctypes.c_char_p
    cdll.LayerZeroOrtIsa.restype = ctypes.c_char_p
    stream = cdll.LayerZeroOrtStreamRead
    stream.restype = ctypes.c_float
    return lib, cdll, stream


def timed_stream(stream, arrays: list[np.ndarray]) -> float:
    """Seconds ``LayerZeroOrtStreamRead`` takes over ``arrays`` (the kernels' read pattern, no arithmetic)."""
    ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    sizes = (ctypes.c_int64 * len(arrays))(*[a.nbytes for a in arrays])
    start = time.perf_counter()
    stream(ptrs, sizes, len(arrays))
    return time.perf_counter() - start


def finish(ok: bool, misses: list[str]) -> int:
    """The load at the end, each missed target; the exit status (1: a wrong result or a miss)."""
    print(f"\nload {os.getloadavg()[0]:.2f}/{os.cpu_count()} at end")
    for miss in misses:
        print(f"MISSED: {miss}")
    return 0 if ok and not misses else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[64, 128], choices=sorted(SHAPES))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args(argv)
    found = native()
    if found is None:
        return 2
    lib, cdll, stream = found
    prefetch = "on" if cdll.LayerZeroOrtQuantPrefetch() else "off"
    print(f"kernels: {cdll.LayerZeroOrtQuantIsa().decode()}, row prefetch {prefetch} (LAYERZERO_ORT_PREFETCH); "
          f"load {os.getloadavg()[0]:.2f}/{os.cpu_count()} at start")  # fmt: skip
    ok = True
    misses: list[str] = []
    for experts in args.experts:
        e, k, h, f = SHAPES[experts]
        models, router, w, quant = build(e, k, h, f)
        rng = np.random.default_rng(1)
        x = rng.standard_normal((args.tokens, h)).astype(np.float32)
        logits = x @ router.T
        ref, mask = moe_reference(x, logits, *w, top_k=k, normalize=1)
        used = np.flatnonzero(mask.any(axis=0))
        # The routed experts' quantized bytes (codes + scales of the three matrices), as regions for the stream.
        regions = {}
        for bits, (codes, scales) in quant.items():
            arrays = [a[i] for i in used for a in (*codes, *scales)]
            regions[bits] = (arrays, sum(a.nbytes for a in arrays))
        for threads in args.threads:
            load0 = os.getloadavg()[0]
            runners = {name: Runner(m, threads, x, str(lib)) for name, m in models.items()}
            # correctness on the timed input
            for name, r in runners.items():
                r.session.run_with_iobinding(r.binding)
                if name.startswith("native q"):
                    bits = int(name[-1])
                    qref, _, slack = moe_quant_reference(x, logits, *quant[bits], bits, top_k=k, normalize=1)
                    err = np.abs(r.y - qref).max() / np.abs(qref).max()
                    if err > 1e-5 + slack.max() / np.abs(qref).max():
                        print(f"{name}: relative error {err:.2e} against plugins/quant.py's reference")
                        ok = False
                elif name == "native f32":
                    err = np.abs(r.y - ref).max() / np.abs(ref).max()
                    if err > 1e-5:
                        print(f"{name}: relative error {err:.2e} against the fp32 reference")
                        ok = False
                elif name.startswith("QMoE"):  # the float reference on the dequantized weights (same weights)
                    bits = int(name[-1])
                    deq = [dequantize_blocks(c, s, bits) for c, s in zip(*quant[bits])]
                    dref, _ = moe_reference(x, logits, *deq, top_k=k, normalize=1)
                    err = np.abs(r.y - dref).max() / np.abs(dref).max()
                    if err > 5e-2:
                        print(f"{name}: relative error {err:.2e} against the reference on the dequantized weights")
                        ok = False
            streams = {bits: [] for bits in regions}
            for _ in range(3):  # warm-up
                for r in runners.values():
                    r.run()
            for r in runners.values():
                r.times.clear()
            for _ in range(args.rounds):
                order = list(runners.items()) + [(f"stream q{b}", b) for b in regions]
                random.shuffle(order)
                for _name, r in order:
                    if isinstance(r, Runner):
                        r.run()
                    else:
                        streams[r].append(timed_stream(stream, regions[r][0]))
            p50 = {name: float(np.median(r.times)) * 1e3 for name, r in runners.items()}
            s50 = {b: float(np.median(v)) * 1e3 for b, v in streams.items()}
            print(
                f"\nE{e} k{k} H{h} F{f}, {args.tokens} token(s), {threads} thread(s), {len(used)} experts routed, "
                f"{args.rounds} rounds, load {load0:.2f} -> {os.getloadavg()[0]:.2f}/{os.cpu_count()}"
            )
            for name, ms in p50.items():
                print(f"  {name:12s} {ms:7.3f} ms")
            for bits, ms in s50.items():
                mb = regions[bits][1] / 1e6
                print(f"  stream q{bits}    {ms:7.3f} ms  ({mb:.2f} MB routed codes + scales, {mb / ms:.1f} GB/s)")
            for bits in (4, 8):
                nat, q = p50[f"native q{bits}"], p50[f"QMoE int{bits}"]
                bound = s50[bits] + p50["floor"]
                vs_qmoe, vs_bound = nat / q, nat / bound
                judged_bound = bits == 4 and threads == 2
                print(
                    f"  q{bits}: native / QMoE = {vs_qmoe:.2f} (target <= 0.8: {'met' if vs_qmoe <= 0.8 else 'MISSED'})"
                    f", native / f32 = {nat / p50['native f32']:.2f}, native / (stream + floor) = {vs_bound:.2f}"
                    + (f" (target <= 1.3: {'met' if vs_bound <= 1.3 else 'MISSED'})" if judged_bound else "")
                )
                where = f"E{e} q{bits} at {threads} thread(s)"
                if vs_qmoe > 0.8:
                    misses.append(f"{where}: native / QMoE {vs_qmoe:.2f} > 0.8")
                if judged_bound and vs_bound > 1.3:
                    misses.append(f"{where}: native / (stream + floor) {vs_bound:.2f} > 1.3")
    return finish(ok, misses)


if __name__ == "__main__":
    raise SystemExit(main())
