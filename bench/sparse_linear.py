"""Activation-sparse block linears (issue 23): liblayerzero_ort.so's ``ai.layerzero::SparseLinear`` (f32 / q8 / q4)
against ONNX Runtime's dense fp32 ``MatMul`` and dense int4 ``com.microsoft.MatMulNBits`` (block 32,
accuracy_level 4), on the Llama-1B shape at batch 1, one decode token.

The shape: hidden 2048, kv 512, intermediate 8192; per layer the 7 block linears q, k, v, o, gate, up (input the
hidden state, 2048) and down (input the intermediate, 8192), ``--layers`` (16) layers of distinct random weights:
fp32 3.76 GB, q8 ~1.0 GB, q4 0.53 GB, each beyond the last-level cache. One session per variant runs every
linear of every layer once a run (ms per layer = a run / layers). The activations are heavy-tailed: channel i of
x is ``σ_i · Laplace(1)`` with ``σ_i`` log-normal, thresholds ``σ_i`` per channel and the run-time scale
``-ln(1 - s)``, so each channel is zeroed with probability s (the realized sparsity is printed). s = 0: scale 0,
the dense product through the same kernel.

Weights: the fp32 matrices are shared by the MatMul sessions and ours-f (``add_external_initializers``, no
copy; ONNX Runtime's MatMul still prepacks its own copy); q8 / q4 are ``plugins/quant.py``'s input-major codes
(``quantize_k_blocks``: blocks of 32 along K, one input channel per row; our kernel quantizes x to int8 per block
as MatMulNBits' accuracy_level 4 does); MatMulNBits' are the same B quantized along K
(``quantize_blocks(B, 4, 32, axis=0)``: the
offset-8 nibbles low first and float scales MatMulNBits reads, default zero point 8), checked against numpy on a
small matrix before the run. Each round runs every column once in a shuffled order, a new token per round (every
variant the same token); p50 over the rounds. Sessions: ORT_ENABLE_ALL, ``--threads`` intra-op threads.

``ours-ql4``: LayerZero's own dense int4 path, ``ai.layerzero::QLinear`` (what ``--weights int4 --linear-kernel
native`` compiles a projection to) on MatMulNBits' codes in ``chunk16`` rows: the same weights, the same x
quantization as ours-q4 (checked: their outputs at s = 0 agree to float summation order, < 1e-4).

Targets (issue 23, the block linears at s = 0.5): ours-f >= 1.7x ORT fp32 MatMul, ours-q4 >= 1.3x ORT MatMulNBits
(dense) and >= 1.7x ours-ql4 (LayerZero's own dense path of the same precision); exits 1 on a miss, 2 when the
library is not built or memory is short.

    python bench/sparse_linear.py                 # 16 layers, 1 and 2 threads, 15 rounds (~9 GB peak memory)
    python bench/sparse_linear.py --layers 4 --rounds 30
    python bench/sparse_linear.py --f32-layers 8     # fp32 columns over 8 layers (1.9 GB): ~6 GB peak
    python bench/sparse_linear.py --threads 1 --clock cpu   # thread CPU time: on a loaded machine
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
from onnx import TensorProto, helper

from layerzero.contract import SPARSE_LINEAR_CODE_LAYOUT
from layerzero.passes._quant_codes import chunk_q4_rows
from layerzero.plugins import ort_library
from layerzero.plugins.quant import dequantize_blocks, quantize_blocks, quantize_k_blocks

HIDDEN, KV, INTER = 2048, 512, 8192
LINEARS = [
    ("q", HIDDEN, HIDDEN),
    ("k", HIDDEN, KV),
    ("v", HIDDEN, KV),
    ("o", HIDDEN, HIDDEN),
    ("gate", HIDDEN, INTER),
    ("up", HIDDEN, INTER),
    ("down", INTER, HIDDEN),
]
#: The linears that read one input, as a compile writes them: q/k/v and gate/up one node each (QLinear's splits;
#: SparseLinear's weights side by side and a Split, passes/sparsify_activations.py fuse_projections).
GROUPS = [("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",))]
SPARSITY = (0.0, 0.3, 0.5, 0.7)
#: Rounds run before the counted ones: the first touches the weights; SparseLinear learns in its first 3 calls
#: whether the session's thread pool has more than one thread (plugins/ort/src/sparse_linear.cpp run_items).
WARMUP = 3


def _external(name: str, arr: np.ndarray, dtype: int) -> onnx.TensorProto:
    """An initializer whose data is given at session creation (``add_external_initializers``)."""
    t = TensorProto()
    t.name, t.data_type = name, dtype
    t.dims.extend(arr.shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "lz-bench-shared"), ("offset", "0"), ("length", str(arr.nbytes))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


_TYPES = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int64): TensorProto.INT64,
}


class Variant:
    """A model over shared arrays: ``nodes`` and ``arrays`` (name -> array) collected by ``add``."""

    def __init__(self, name: str, domain: str | None):
        self.name, self.domain = name, domain
        self.nodes: list[onnx.NodeProto] = []
        self.arrays: dict[str, np.ndarray] = {}
        self.outputs: list[onnx.ValueInfoProto] = []
        self.layers = 0

    def session(self, lib: str, threads: int, scale_input: bool) -> ort.InferenceSession:
        inputs = [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, HIDDEN]),
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, INTER]),
        ]
        if scale_input:
            inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, []))
        inits = [_external(n, a, _TYPES[a.dtype]) for n, a in self.arrays.items()]
        graph = helper.make_graph(self.nodes, self.name, inputs, self.outputs, inits)
        opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(self.domain, 1)] if self.domain else [])
        model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
        o = ort.SessionOptions()
        o.intra_op_num_threads = threads
        o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        o.add_session_config_entry("session.intra_op.allow_spinning", "0")
        o.register_custom_ops_library(lib)
        names = list(self.arrays)
        o.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(self.arrays[n]) for n in names])
        return ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])


def _nbits_pack(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' B [N, K/32, 16] uint8 and scales [N * K/32] float32 of B [K, N] (blocks of 32 along K)."""
    codes, scales = quantize_blocks(b, 4, 32, axis=0)  # [N, K/2], [N, K/32]
    n, k = b.shape[1], b.shape[0]
    return np.ascontiguousarray(codes.reshape(n, k // 32, 16)), scales.astype(np.float32).reshape(-1)


def _nbits_node(name: str, inp: str, k: int, n: int) -> onnx.NodeProto:
    return helper.make_node(
        "MatMulNBits",
        [inp, f"{name}.b", f"{name}.s"],
        [name],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=32,
        accuracy_level=4,
        name=name,
    )


def check_nbits_packing(lib: str) -> float:
    """MatMulNBits on our packing of a small B against numpy on the dequantized weights (relative error)."""
    rng = np.random.default_rng(3)
    b = rng.standard_normal((256, 96)).astype(np.float32)
    var = Variant("check", "com.microsoft")
    var.arrays["m.b"], var.arrays["m.s"] = _nbits_pack(b)
    var.nodes.append(_nbits_node("m", "x", 256, 96))
    var.outputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, [1, 96]))
    # a graph with x [1, 256]: built by hand (the Variant's inputs are the bench's)
    graph = helper.make_graph(
        var.nodes,
        "check",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        var.outputs,
        [_external(n, a, _TYPES[a.dtype]) for n, a in var.arrays.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=9
    )
    o = ort.SessionOptions()
    names = list(var.arrays)
    o.add_external_initializers(names, [ort.OrtValue.ortvalue_from_numpy(var.arrays[n]) for n in names])
    sess = ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 256)).astype(np.float32)
    codes, scales = quantize_blocks(b, 4, 32, axis=0)
    ref = x @ dequantize_blocks(codes, scales, 4, 32, axis=0)
    return float(np.abs(sess.run(None, {"x": x})[0] - ref).max() / np.abs(ref).max())


def build(layers: int, seed: int = 0, f32_layers: int | None = None):
    """The variants over one set of drawn weights: ort-f32, ort-int4, ours-f, ours-q8, ours-q4 (the fp32 ones
    over the first ``f32_layers`` layers only, when given)."""
    rng = np.random.default_rng(seed)
    sigma = {
        HIDDEN: np.exp(0.6 * rng.standard_normal(HIDDEN)).astype(np.float32),
        INTER: np.exp(0.6 * rng.standard_normal(INTER)).astype(np.float32),
    }
    v = {
        name: Variant(name, dom)
        for name, dom in (
            ("ort-f32", None),
            ("ort-int4", "com.microsoft"),
            ("ours-f", "ai.layerzero"),
            ("ours-q8", "ai.layerzero"),
            ("ours-q4", "ai.layerzero"),
            ("ours-q4g", "ai.layerzero"),
            ("ours-ql4", "ai.layerzero"),
        )
    }
    for ours in ("ours-f", "ours-q8", "ours-q4", "ours-q4g"):
        v[ours].arrays["thr.x"], v[ours].arrays["thr.h"] = sigma[HIDDEN], sigma[INTER]
    f32_layers = layers if f32_layers is None else min(f32_layers, layers)
    for var in v.values():
        var.layers = f32_layers if var.name in ("ort-f32", "ours-f") else layers
    for layer in range(layers):
        weights = {}
        for lin, k, n in LINEARS:
            name = f"l{layer}.{lin}"
            inp, thr = ("h", "thr.h") if lin == "down" else ("x", "thr.x")
            b = (rng.standard_normal((k, n), dtype=np.float32) / np.float32(np.sqrt(k))).astype(np.float32)
            weights[lin] = b
            out = helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, n])
            kept = helper.make_tensor_value_info(f"{name}.kept", TensorProto.INT64, [1])
            if layer < f32_layers:
                v["ort-f32"].arrays[f"{name}.w"] = b
                v["ort-f32"].nodes.append(helper.make_node("MatMul", [inp, f"{name}.w"], [name], name=name))
                v["ort-f32"].outputs.append(out)
            v["ort-int4"].arrays[f"{name}.b"], v["ort-int4"].arrays[f"{name}.s"] = _nbits_pack(b)
            v["ort-int4"].nodes.append(_nbits_node(name, inp, k, n))
            v["ort-int4"].outputs.append(out)
            v["ours-ql4"].outputs.append(out)
            v["ours-q4g"].outputs.append(out)
            for ours, fmt in (("ours-f", "f"), ("ours-q8", "q8"), ("ours-q4", "q4")):
                if fmt == "f" and layer >= f32_layers:
                    continue
                ins = [inp, f"{name}.w", thr, "scale"]
                if fmt == "f":
                    v[ours].arrays[f"{name}.w"] = b  # the same array as ort-f32's
                else:
                    codes, scales = quantize_k_blocks(b, 8 if fmt == "q8" else 4)
                    v[ours].arrays[f"{name}.w"], v[ours].arrays[f"{name}.ws"] = codes, scales
                    ins += ["", f"{name}.ws"]
                v[ours].nodes.append(
                    helper.make_node(
                        "SparseLinear",
                        ins,
                        [name, f"{name}.kept"],
                        domain="ai.layerzero",
                        name=name,
                        weight_format=fmt,
                        path=name,
                        **({} if fmt == "f" else {"code_layout": SPARSE_LINEAR_CODE_LAYOUT}),
                    )
                )
                v[ours].outputs += [out, kept]
        for group, members in GROUPS:
            _grouped(v, layer, group, members, weights)
    return v, sigma


def _grouped(v: dict, layer: int, group: str, members: tuple[str, ...], weights: dict[str, np.ndarray]) -> None:
    """One layer's group of linears as the compile writes it: ours-ql4 one QLinear (the dense native q4 product,
    --linear-kernel native: MatMulNBits' codes in chunk16 rows, ``splits`` when several), ours-q4g one SparseLinear
    on the weights side by side and a Split into the members' outputs."""
    b = np.concatenate([weights[m] for m in members], axis=1)
    widths = [weights[m].shape[1] for m in members]
    outs = [f"l{layer}.{m}" for m in members]
    name = f"l{layer}.{group}"
    inp, thr = ("h", "thr.h") if members == ("down",) else ("x", "thr.x")
    nb_codes, nb_scales = quantize_blocks(b, 4, 32, axis=0)  # [N, K/2], [N, K/32]
    v["ours-ql4"].arrays[f"{name}.c"] = chunk_q4_rows(nb_codes)
    v["ours-ql4"].arrays[f"{name}.s"] = np.ascontiguousarray(nb_scales.astype(np.float16))
    v["ours-ql4"].nodes.append(
        helper.make_node(
            "QLinear",
            [inp, f"{name}.c", f"{name}.s"],
            outs,
            domain="ai.layerzero",
            name=name,
            weight_format="q4",
            block_size=32,
            code_layout="chunk16",
            **({"splits": widths} if len(members) > 1 else {}),
        )
    )
    codes, scales = quantize_k_blocks(b, 4)
    v["ours-q4g"].arrays[f"{name}.w"], v["ours-q4g"].arrays[f"{name}.ws"] = codes, scales
    y = f"{name}.y" if len(members) > 1 else outs[0]
    v["ours-q4g"].nodes.append(
        helper.make_node(
            "SparseLinear",
            [inp, f"{name}.w", thr, "scale", "", f"{name}.ws"],
            [y, f"{name}.kept"],
            domain="ai.layerzero",
            name=name,
            weight_format="q4",
            path=name,
            code_layout=SPARSE_LINEAR_CODE_LAYOUT,
        )
    )
    v["ours-q4g"].outputs.append(helper.make_tensor_value_info(f"{name}.kept", TensorProto.INT64, [1]))
    if len(members) > 1:
        v["ours-q4g"].arrays[f"{name}.split"] = np.array(widths, np.int64)
        v["ours-q4g"].nodes.append(helper.make_node("Split", [y, f"{name}.split"], outs, axis=-1, name=f"{name}.split"))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--f32-layers", type=int, default=None, help="layers of the fp32 columns (default --layers; memory)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--sparsity", type=float, nargs="+", default=list(SPARSITY))
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the calling thread's CPU time (1 thread only: ONNX Runtime runs the nodes on it), robust to a "
        "loaded machine's descheduling",
    )
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != [1]:
        print("--clock cpu measures the calling thread only: use it with --threads 1", file=sys.stderr)
        return 2
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    lib = ort_library.find_ort_library()
    if lib is None:
        print(
            "liblayerzero_ort.so not built (layerzero plugins build --only ort; LAYERZERO_PLUGIN_DIR)", file=sys.stderr
        )
        return 2
    per_layer = sum(k * n for _, k, n in LINEARS)
    f32_layers = args.layers if args.f32_layers is None else min(args.f32_layers, args.layers)
    # f32 + ORT's prepacked copy; q8; q4, MatMulNBits and its prepacked copy, QLinear
    need = int(per_layer * (f32_layers * 4 * 2 + args.layers * (1 + 0.5625 * 4)) * 1.1)
    if need > _mem_available():
        print(
            f"--layers {args.layers} needs ~{need / 2**30:.1f} GiB, {_mem_available() / 2**30:.1f} GiB available: "
            "fewer --layers",
            file=sys.stderr,
        )
        return 2
    cdll = ctypes.CDLL(str(lib))
    cdll.LayerZeroOrtSparseIsa.restype = ctypes.c_char_p
    err = check_nbits_packing(str(lib))
    print(
        f"kernels: {cdll.LayerZeroOrtSparseIsa().decode()}; MatMulNBits packing vs numpy: rel. error {err:.1e}; "
        f"load {os.getloadavg()[0]:.2f}/{os.cpu_count()} at start"
    )
    if not err < 2e-2:  # accuracy_level 4 quantizes x to int8 (~1e-2); a wrong layout is off by ~1
        print("MatMulNBits does not read our packing as the same weights", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    variants, sigma = build(args.layers, f32_layers=f32_layers)
    mb = {
        name: sum(a.nbytes for n, a in var.arrays.items() if not n.startswith("thr")) / 2**20
        for name, var in variants.items()
    }
    print(
        f"{args.layers} layers ({f32_layers} for the fp32 columns) built in {time.perf_counter() - t0:.0f} s; "
        "weights MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in mb.items())
    )
    rng = np.random.default_rng(1)
    ok = True
    for threads in args.threads:
        sparse = ("ours-f", "ours-q8", "ours-q4", "ours-q4g")  # the variants with a run-time scale input
        sessions = {name: var.session(str(lib), threads, name in sparse) for name, var in variants.items()}
        columns = [("ort-f32", None), ("ort-int4", None), ("ours-ql4", None)]
        columns += [(ours, s) for ours in sparse for s in args.sparsity]
        times: dict[tuple, list[float]] = {c: [] for c in columns}
        realized: dict[float, list[float]] = {s: [] for s in args.sparsity}
        load0 = os.getloadavg()[0]
        # round 0: QLinear and SparseLinear q4 at s = 0 (the same weights); SparseLinear q4 alone / grouped at each s
        same: dict[tuple, dict[str, np.ndarray]] = {}
        names = {n: [o.name for o in sess.get_outputs()] for n, sess in sessions.items()}
        linears = [f"l{layer}.{lin}" for layer in range(args.layers) for lin, _, _ in LINEARS]
        for rnd in range(args.rounds + WARMUP):  # rounds 0 .. WARMUP - 1 not counted
            feed = {
                "x": (sigma[HIDDEN] * rng.laplace(size=HIDDEN)).astype(np.float32)[None],
                "h": (sigma[INTER] * rng.laplace(size=INTER)).astype(np.float32)[None],
            }
            order = list(columns)
            random.Random(rnd).shuffle(order)
            for name, s in order:
                f = dict(feed)
                if s is not None:
                    f["scale"] = np.array(-np.log1p(-s), np.float32)
                start = clock()
                out = sessions[name].run(None, f)
                dt = clock() - start
                if rnd == 0 and name in ("ours-ql4", "ours-q4", "ours-q4g"):
                    same[(name, s)] = dict(zip(names[name], out))
                if rnd >= WARMUP:
                    times[(name, s)].append(dt)
                    if name == "ours-q4":
                        kept = np.array([o[0] for o in out[1::2]], np.float64)
                        ks = np.array([k for _ in range(args.layers) for _, k, _ in LINEARS], np.float64)
                        realized[s].append(float(1 - kept.sum() / ks.sum()))
        load1 = os.getloadavg()[0]
        if ("ours-q4", 0.0) in same:
            # the same codes and scales, x quantized alike: only the float summation order differs
            a, b = same[("ours-q4", 0.0)], same[("ours-ql4", None)]
            dev = max(float(np.abs(a[n] - b[n]).max() / np.abs(b[n]).max()) for n in linears)
            print(f"\nQLinear q4 vs SparseLinear q4 at s = 0 (the same weights): max rel. deviation {dev:.1e}")
            if not dev < 1e-4:
                print("QLinear and SparseLinear q4 do not compute the same product", file=sys.stderr)
                ok = False
        # grouped = alone, bitwise (a column's arithmetic does not depend on the columns beside it)
        differ = [(n, s) for s in args.sparsity for n in linears
                  if not np.array_equal(same[("ours-q4", s)][n], same[("ours-q4g", s)][n])]  # fmt: skip
        print(f"SparseLinear q4 grouped vs alone, every s: {'bitwise equal' if not differ else differ[:3]}")
        if differ:
            print("grouped SparseLinear q4 differs from the separate nodes", file=sys.stderr)
            ok = False
        p50 = {c: float(np.median(t)) * 1e3 / variants[c[0]].layers for c, t in times.items()}
        print(
            f"\n{threads} thread(s), {args.rounds} rounds, load {load0:.2f} -> {load1:.2f}/{os.cpu_count()}; "
            f"ms per layer (7 linears), p50, {args.clock} clock"
        )
        ql4 = p50[("ours-ql4", None)]
        print(
            f"  ORT MatMul fp32 {p50[('ort-f32', None)]:.3f}   ORT MatMulNBits int4 {p50[('ort-int4', None)]:.3f}   "
            f"ours QLinear q4 (dense) {ql4:.3f}"
        )
        print(
            "  s     realized  ours-f  (x fp32)  ours-q8 (x fp32)  ours-q4 (x int4) (x QLinear)  "
            "ours-q4g (x int4) (x QLinear)"
        )
        for s in args.sparsity:
            f, q8, q4, q4g = (p50[(c, s)] for c in ("ours-f", "ours-q8", "ours-q4", "ours-q4g"))
            print(
                f"  {s:.1f}   {np.mean(realized[s]):.3f}    {f:6.3f}  {p50[('ort-f32', None)] / f:5.2f}x   "
                f"{q8:6.3f} {p50[('ort-f32', None)] / q8:5.2f}x   {q4:6.3f} {p50[('ort-int4', None)] / q4:5.2f}x "
                f"{ql4 / q4:5.2f}x         {q4g:6.3f} {p50[('ort-int4', None)] / q4g:5.2f}x {ql4 / q4g:5.2f}x"
            )
        if 0.5 in args.sparsity:
            rf = p50[("ort-f32", None)] / p50[("ours-f", 0.5)]
            rq = p50[("ort-int4", None)] / p50[("ours-q4g", 0.5)]
            rl = ql4 / p50[("ours-q4g", 0.5)]
            met_f, met_q, met_l = rf >= 1.7, rq >= 1.3, rl >= 1.7
            print(
                f"  targets at s=0.5: ours-f {rf:.2f}x ORT fp32 (>= 1.7: {'met' if met_f else 'NOT met'}), "
                f"ours-q4g {rq:.2f}x MatMulNBits (>= 1.3: {'met' if met_q else 'NOT met'}), "
                f"ours-q4g {rl:.2f}x ours QLinear q4 dense (>= 1.7: {'met' if met_l else 'NOT met'})"
            )
            ok = ok and met_f and met_q and met_l
        del sessions
    print(f"\nload {os.getloadavg()[0]:.2f}/{os.cpu_count()} at end")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
