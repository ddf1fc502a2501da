"""Activation-sparse experts (issue 23, "composes with MoE"): liblayerzero_ort.so's float ``ai.layerzero::MoE`` with
``gate_up_layout="input_major"`` and x thresholds, against the same op dense, one block, 1 token.

The experts' gate / up are stored input-major (``[E, H, F]``: row i = input channel i), so an x channel at or below
its threshold is a weight row of every routed expert's gate and up not read; down reads all of h (stored as the
dense op stores it). At sparsity s of x the block reads ``1 - 2 s / 3`` of the dense bytes (gate, up, down equal in
size): the ideal speed-up is ``1 / (1 - 2 s / 3)`` (1.25x at s = 0.3, 1.5x at 0.5).

Variants, interleaved in shuffled rounds (each variant's hundreds of MB between two runs of one: cold weights),
p50 of each: ``dense`` (the op as bench/moe.py runs it), ``sparse s`` for s in ``--levels`` (per-channel thresholds
at the s-quantile of ``|x|`` over a calibration draw of x, the same threshold vector kernel test
``|x_i| <= t_i``; the realized sparsity of the timed token is the op's kept output), ``floor`` (an Identity
session) and ``stream s`` (``LayerZeroOrtStreamRead`` over the bytes that variant reads: its routed experts' kept
gate / up rows and their down matrices). Every variant's y is checked against the float64 reference of the same
thresholds first.

Target (printed, exit 1 on a miss): at s = 0.5, dense / sparse >= 1.2 at every thread count (the bound 1.5).

    python bench/moe_sparse.py                       # E64 k8 H1024 F512, 1 and 2 threads
    python bench/moe_sparse.py --experts 128 --rounds 20
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
from moe_quant import SHAPES, Runner, _graph, finish, floor_model, native, timed_stream  # bench/ is sys.path[0]
from onnx import TensorProto, helper, numpy_helper

from layerzero.plugins.reference import moe_reference

TARGET = (0.5, 1.2)  # sparsity, dense / sparse


def build(experts: int, top_k: int, hidden: int, ffn: int, levels: list[float], seed: int = 0):
    rng = np.random.default_rng(seed)
    router = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden)).astype(np.float32)
    wg, wu = ((rng.standard_normal((experts, ffn, hidden)) / np.sqrt(hidden)).astype(np.float32) for _ in range(2))
    wd = (rng.standard_normal((experts, hidden, ffn)) / np.sqrt(ffn)).astype(np.float32)
    attrs = dict(top_k=top_k, normalize=1, scoring="softmax", activation="silu")
    r = numpy_helper.from_array(router, "router")
    models = {}
    dense = helper.make_node("MoE", ["hidden", "logits", "wg", "wu", "wd"], ["y", "mask"], domain="ai.layerzero",
                             **attrs)  # fmt: skip
    inits = [r] + [numpy_helper.from_array(a, n) for a, n in ((wg, "wg"), (wu, "wu"), (wd, "wd"))]
    models["dense"] = _graph(dense, hidden, experts, inits, "ai.layerzero")
    # Calibration draw of x (the timed token is drawn separately): per-channel s-quantiles of |x|.
    calib = np.abs(rng.standard_normal((512, hidden)).astype(np.float32))
    major = [np.ascontiguousarray(np.transpose(w, (0, 2, 1))) for w in (wg, wu)]
    thresholds = {}
    for s in levels:
        t = np.quantile(calib, s, axis=0).astype(np.float32) if s > 0 else np.zeros(hidden, np.float32)
        thresholds[s] = t
        names = ["hidden", "logits", "wg", "wu", "wd"] + [""] * 8 + ["t", "scale"]
        node = helper.make_node("MoE", names, ["y", "mask", "kept"], domain="ai.layerzero",
                                gate_up_layout="input_major", **attrs)  # fmt: skip
        sparse_inits = [r, numpy_helper.from_array(major[0], "wg"), numpy_helper.from_array(major[1], "wu"),
                        numpy_helper.from_array(wd, "wd"), numpy_helper.from_array(t, "t"),
                        numpy_helper.from_array(np.array(1.0, np.float32), "scale")]  # fmt: skip
        model = _graph(node, hidden, experts, sparse_inits, "ai.layerzero")
        model.graph.output.append(helper.make_tensor_value_info("kept", TensorProto.INT64, ["T"]))
        models[f"sparse {s:g}"] = model
    models["floor"] = floor_model(hidden)
    return models, router, (wg, wu, wd), major, thresholds, attrs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[64], choices=sorted(SHAPES))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--levels", type=float, nargs="+", default=[0.0, 0.3, 0.5])
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    found = native()
    if found is None:
        return 2
    lib, cdll, stream = found
    levels = sorted(set(args.levels) | {TARGET[0]})
    print(f"kernels: {cdll.LayerZeroOrtIsa().decode()}; load {os.getloadavg()[0]:.2f}/{os.cpu_count()} at start")
    ok, misses = True, []
    for experts in args.experts:
        e, k, h, f = SHAPES[experts]
        models, router, w, major, thresholds, attrs = build(e, k, h, f, levels)
        x = np.random.default_rng(1).standard_normal((1, h)).astype(np.float32)
        logits = x @ router.T
        _, mask = moe_reference(x, logits, *w, **attrs)
        used = np.flatnonzero(mask.any(axis=0))
        regions = {}
        for s, t in thresholds.items():  # the bytes each sparse variant reads
            rows = np.flatnonzero(~(np.abs(x[0]) <= t))
            arrays = [m[i][rows] for i in used for m in major] + [w[2][i] for i in used]
            regions[s] = ([np.ascontiguousarray(a) for a in arrays], 1.0 - rows.size / h)
        for threads in args.threads:
            load0 = os.getloadavg()[0]
            runners = {name: Runner(m, threads, x, str(lib)) for name, m in models.items()}
            for name, r in runners.items():  # correctness on the timed input
                r.session.run_with_iobinding(r.binding)
                if name == "floor":
                    continue
                t = thresholds.get(float(name.split()[1]), None) if name.startswith("sparse") else None
                xm = x if t is None else np.where(np.abs(x) <= t, np.float32(0), x)
                ref, _ = moe_reference(xm, logits, *w, **attrs)
                err = np.abs(r.y - ref).max() / np.abs(ref).max()
                if err > 1e-5:
                    print(f"{name}: relative error {err:.2e} against the float64 reference")
                    ok = False
            for _ in range(3):
                for r in runners.values():
                    r.run()
            for r in runners.values():
                r.times.clear()
            streams = {s: [] for s in regions}
            for _ in range(args.rounds):
                order = list(runners.items()) + [(f"stream {s:g}", s) for s in regions]
                random.shuffle(order)
                for _name, r in order:
                    if isinstance(r, Runner):
                        r.run()
                        continue
                    streams[r].append(timed_stream(stream, regions[r][0]))
            p50 = {name: float(np.median(r.times)) * 1e3 for name, r in runners.items()}
            print(f"\nE{e} k{k} H{h} F{f} float32, 1 token, {threads} thread(s), {len(used)} experts routed, "
                  f"{args.rounds} rounds, load {load0:.2f} -> {os.getloadavg()[0]:.2f}/{os.cpu_count()}")  # fmt: skip
            print(f"  dense        {p50['dense']:7.3f} ms")
            print(f"  floor        {p50['floor']:7.3f} ms")
            for s in thresholds:
                ms, realized = p50[f"sparse {s:g}"], regions[s][1]
                st = float(np.median(streams[s])) * 1e3
                ideal = 1.0 / (1.0 - 2.0 * realized / 3.0)
                ratio, vs_stream = p50["dense"] / ms, ms / (st + p50["floor"])
                print(f"  sparse {s:<4g}  {ms:7.3f} ms  realized {realized:5.1%}  dense / sparse {ratio:4.2f} (ideal "
                      f"{ideal:4.2f}), sparse / (stream + floor) {vs_stream:4.2f}  [stream {st:.3f} ms]")  # fmt: skip
            speedup = p50["dense"] / p50[f"sparse {TARGET[0]:g}"]
            met = speedup >= TARGET[1]
            print(f"  target: dense / sparse {TARGET[0]:g} >= {TARGET[1]}: {speedup:.2f} {'met' if met else 'MISSED'}")
            if not met:
                misses.append(f"E{e} at {threads} thread(s): dense / sparse {TARGET[0]:g} = {speedup:.2f}")
    return finish(ok, misses)


if __name__ == "__main__":
    raise SystemExit(main())
