"""Decode tokens/s of a dense Llama-1B shape: fp32 / int4, dense / activation-sparse, LayerZero against ONNX Runtime.

The model is bench/serve_batch.py's ``--size 1b`` Llama (hidden 2048, 16 layers, 32 heads / 8 kv heads,
intermediate 8192, vocab 32000, random weights seeded: 1.2 B parameters, 4.9 GB float32), read from its cache
~/.cache/layerzero/serve_batch/1b/ (``hf/``, ``onnx/model.onnx`` = the ``layerzero export``, ``model.lz`` = the fp32
compile; built by serve_batch's ``_bundle("llama", "1b")`` when the folder does not exist). Everything this bench
writes goes under ~/.cache/layerzero/decode_dense/<size>-<key>/ (the key hashes the export's size and mtime).

Batch 1, a 32-token prompt, 128 new tokens (greedy), at each ``--threads`` count (default 1 and 2), through
``Engine.generate`` (the same decode loop for every column). Columns:

- ORT fp32: the export as it is; LZ fp32: ``layerzero compile`` (serve_batch's model.lz);
- ORT int4: the export through ONNX Runtime's own ``onnxruntime.quantization.matmul_nbits_quantizer`` (MatMulNBits,
  block 32, symmetric, accuracy_level 4: ONNX Runtime's best int4 form; every constant-weight MatMul, lm_head too);
- LZ int4: ``compile --weights int4`` (LayerZero's MatMulNBits, the same block / symmetry / accuracy level);
- LZ int4 native: the same with ``--linear-kernel native`` (liblayerzero_ort.so's QLinear on the same codes, q/k/v and
  gate/up one node each, and its Attention: one node per layer's attention core), ``--no-verify`` (LZ int4's
  compile is the verified one; its greedy ids are printed against ORT fp32's like every column's);
- LZ fp32 sparse s, LZ int4 sparse s, LZ int4 native sparse s for s in ``--sparsity`` (default 0.3,0.5): ``compile
  --activation-sparsity s`` (+ ``--weights int4``, + ``--linear-kernel native``: SparseLinear for the sparse
  projections, QLinear for the rest, the native Attention), the thresholds calibrated on 8 seeded prompts of their
  own (``calibration.json``, not the bench prompt). The realized sparsity of each is printed from its run's report
  (the parameter-weighted share of the projections' input rows not read, over 16 decode steps, and on the prompt's
  prefill).

Memory: an fp32 session holds ~5 GB (ONNX Runtime's MatMul may prepack a second copy), so no two sessions are held
at once: each (column, threads) is loaded, warmed up, run and dropped; the rounds still interleave (every column at
every thread count once per round, in a rotated order). The peak RSS is printed.

Compiles: LZ int4 is the one verified compile of int4 (LayerZero's chunked verification; its time is printed);
fp32's is serve_batch's model.lz (compiled with verification); the sparse ones are ``--no-verify`` (their deviation
is printed instead). ``--verify none`` verifies none, ``all`` every one (the sparse ones then need
``--max-deviation``: ``--max-deviation D``, default 1e9: report, not judge).

Printed: the table (column, threads, decode tok/s, time to first token, median step, the ratios to LZ fp32 and to
the column's dense LayerZero / ORT counterpart), each quantized / sparse column's deviation from the fp32 export on
the prompt (top-1 agreement of the greedy id at every position, relative L2 of the prefill logits, as bench/decode.py)
and how many of its 128 greedy ids equal ORT fp32's from the start, then the targets; exit 1 on a miss (not judged
at ``--quick``):

- issue 22: LZ int4 >= 0.95 x ORT int4, at 1 and 2 threads (and LZ int4 native);
- issue 23: at s = 0.5, LZ fp32 sparse >= 1.4 x LZ fp32, LZ int4 sparse >= 1.3 x LZ int4 and >= 1.3 x ORT int4
  (LZ int4 native sparse the same against LZ int4 native and ORT int4); at s = 0.3 each sparse column >= 1.2 x
  its dense LZ.

    python bench/decode_dense.py                        # 1B, 1 and 2 threads, 3 rounds
    python bench/decode_dense.py --rounds 1 --threads 1 --new 64
    python bench/decode_dense.py --quick                # 2 layers, hidden 256, 16 new tokens, 1 round (the path)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layerzero"
CACHE = ROOT_CACHE / "decode_dense"
# liblayerzero_ort.so (SparseLinear) of this bench, built here when missing: other checkouts' libraries are untouched.
os.environ.setdefault("LAYERZERO_PLUGIN_DIR", str(CACHE / "plugins"))
sys.path.insert(0, str(BENCH))

import _stamp  # noqa: E402  # bench/_stamp.py (BENCH is on sys.path): which cached bundles the current code compiled
import numpy as np  # noqa: E402

from layerzero.compile import compile_file  # noqa: E402
from layerzero.options import CompileOptions  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402

#: (numerator, denominator, at least, issue) on median decode tokens/s, per thread count; ``{s}`` is a sparsity.
TARGETS_INT4 = (("LZ int4", "ORT int4", 0.95, 22), ("LZ int4 native", "ORT int4", 0.95, 22))
TARGETS_SPARSE = {
    0.5: (("LZ fp32 sparse {s}", "LZ fp32", 1.4, 23), ("LZ int4 sparse {s}", "LZ int4", 1.3, 23),
          ("LZ int4 sparse {s}", "ORT int4", 1.3, 23), ("LZ int4 native sparse {s}", "LZ int4 native", 1.3, 23),
          ("LZ int4 native sparse {s}", "ORT int4", 1.3, 23)),
    0.3: (("LZ fp32 sparse {s}", "LZ fp32", 1.2, 23), ("LZ int4 sparse {s}", "LZ int4", 1.2, 23),
          ("LZ int4 native sparse {s}", "LZ int4 native", 1.2, 23)),
}  # fmt: skip
CALIBRATION_PROMPTS = 8


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def native_library() -> str | None:
    """liblayerzero_ort.so in LAYERZERO_PLUGIN_DIR (this bench's), built when missing or stale; None when there,
    else why (the sparse columns then run the reference form)."""
    return _stamp.native_library(Path(os.environ["LAYERZERO_PLUGIN_DIR"]), say, "SparseLinear")


def source(size: str) -> dict[str, Path]:
    """serve_batch's folder of ``size`` (its export and fp32 bundle), built by it only when there is no folder at all
    (a folder without its bundle is being built, or was left half-made: this bench does not touch it)."""
    root = ROOT_CACHE / "serve_batch" / size
    if not root.exists():
        import serve_batch

        say(f"building {root} with bench/serve_batch.py (export and fp32 compile)")
        serve_batch._bundle("llama", size)
    out = {"root": root, "hf": root / "hf", "export": root / "onnx" / "model.onnx", "lz": root / "model.lz"}
    if not (out["lz"] / "manifest.json").is_file() or not out["export"].is_file():
        raise SystemExit(f"bench/decode_dense.py: {root} has no model.lz yet (being built? run serve_batch.py --size "
                         f"{size} or remove the folder)")  # fmt: skip
    return out


def cache_dir(src: dict[str, Path], size: str) -> Path:
    st = src["export"].stat()
    data = src["export"].with_name("model.onnx.data")
    extra = [data.stat().st_size, data.stat().st_mtime_ns] if data.is_file() else []
    key = hashlib.sha256(json.dumps([st.st_size, st.st_mtime_ns, *extra]).encode()).hexdigest()[:10]
    root = CACHE / f"{size}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def model_info(export: Path) -> dict[str, Any]:
    """Vocabulary, kv heads / head dim and layers of the export (its graph inputs / outputs), parameters."""
    import onnx

    model = onnx.load(str(export), load_external_data=False)
    dims = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    past = [i for i in model.graph.input if i.name.startswith("past_key_values.")]
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    return {"vocab": dims["logits"][-1], "layers": len(past) // 2, "params": params,
            "kv": [d.dim_value for d in past[0].type.tensor_type.shape.dim][1::2]}  # fmt: skip


def calibration_file(root: Path, info: dict[str, Any], prompt_len: int) -> Path:
    """8 seeded prompts (seed 1: not the bench prompt's stream), each a prefill with an empty cache (.json)."""
    path = root / "calibration.json"
    if path.is_file():
        return path
    rng = np.random.default_rng(1)
    heads, head_dim = info["kv"]
    empty = {"shape": [1, heads, 0, head_dim], "values": []}
    requests = []
    for _ in range(CALIBRATION_PROMPTS):
        ids = rng.integers(0, info["vocab"], size=prompt_len).tolist()
        req = {"input_ids": [ids], "attention_mask": [[1] * prompt_len], "position_ids": [list(range(prompt_len))]}
        for i in range(info["layers"]):
            req[f"past_key_values.{i}.key"] = req[f"past_key_values.{i}.value"] = empty
        requests.append(req)
    path.write_text(json.dumps(requests))
    return path


def ort_int4(src: dict[str, Path], root: Path) -> tuple[Path, str]:
    """The export through ONNX Runtime's MatMulNBitsQuantizer (block 32, symmetric, accuracy_level 4), once."""
    out = root / "ort-int4" / "model.onnx"
    note_file = out.with_name("note.txt")
    if out.is_file() and note_file.is_file():
        return out, note_file.read_text()
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    say("ORT int4: onnxruntime.quantization.matmul_nbits_quantizer on the export")
    start = time.perf_counter()
    model = onnx.load(str(src["export"]))
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=32, is_symmetric=True, accuracy_level=4)
    quantizer.process()
    model = quantizer.model.model
    n = sum(1 for node in model.graph.node if node.op_type == "MatMulNBits")
    left = sum(1 for node in model.graph.node if node.op_type == "MatMul")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(".model.onnx")
    onnx.save(model, str(tmp), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    tmp.replace(out)
    note = (f"ORT int4: {n} MatMuls as MatMulNBits (block 32, symmetric, accuracy_level 4), {left} MatMuls left "
            f"(no constant weight); quantized in {time.perf_counter() - start:.0f} s")  # fmt: skip
    note_file.write_text(note)
    return out, note


def lz_bundle(src: dict[str, Path], root: Path, name: str, verify: bool, max_deviation: float,
              **options: Any) -> tuple[Path, str]:  # fmt: skip
    """One LayerZero bundle of the export (compiled when missing, or unverified where verification is asked)."""
    out = root / name
    manifest_file = out / "manifest.json"
    verified = manifest_file.is_file() and json.loads(manifest_file.read_text())["options"].get("verify", False)
    if manifest_file.is_file() and _stamp.fresh(out) and (verified or not verify):
        return out, "compiled with verification (cached)" if verified else "compiled --no-verify (cached)"
    if verify and options.get("activation_sparsity"):
        options["max_deviation"] = max_deviation
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items())
    say(f"compiling {name}: {flags}{'' if verify else ' --no-verify'}")
    start = time.perf_counter()
    compile_file(src["export"], out, CompileOptions(verify=verify, **options), overwrite=True)
    if options.get("linear_kernel") == "native" and not _stamp.op_count(out, "QLinear"):
        # the compile fell back to MatMulNBits (the library was not found): never timed, never cached as fresh
        raise SystemExit(f"{name}: compiled without QLinear (liblayerzero_ort.so not found by the compile)")
    _stamp.stamp(out)
    seconds = time.perf_counter() - start
    return out, f"compiled {'with verification' if verify else '--no-verify'} in {seconds:.0f} s"


def prefill_logits(engine: Engine, prompt: list[int]) -> tuple[np.ndarray, Any]:
    """One forward pass over the prompt (empty past): [n, vocab] logits and the run's report."""
    from layerzero.runtime.generate import cache_layout

    layout = cache_layout(engine)
    n = len(prompt)
    feeds = {"input_ids": np.asarray([prompt], np.int64), "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n, dtype=np.int64)[None, :]}  # fmt: skip
    feeds.update(layout.empty(1))
    result = engine.run(feeds)
    return np.asarray(result.outputs["logits"])[0], result.report


def activation_entries(path: Path) -> dict[str, tuple[int, int]]:
    """The bundle's activation-sparsity groups: path -> (input channels, parameters)."""
    if not (path / "manifest.json").is_file():
        return {}  # a plain ONNX file
    manifest = json.loads((path / "manifest.json").read_text())
    out = {}
    for entry in manifest.get("dynamic", []):
        if entry.get("kind") == "activation":
            out[str(entry["path"])] = (int(entry["detail"]["channels"]), sum(int(p) for p in entry["params"]))
    return out


def weighted(sparsity: dict[str, float], groups: dict[str, tuple[int, int]]) -> float:
    """Parameter-weighted mean of per-group sparsities (the model-wide figure ``--activation-sparsity`` targets)."""
    total = sum(groups[g][1] for g in sparsity if g in groups)
    return sum(s * groups[g][1] for g, s in sparsity.items() if g in groups) / total if total else float("nan")


def decode_sparsity(engine: Engine, groups: dict[str, tuple[int, int]], prompt: list[int], steps: int) -> float:
    """The realized activation sparsity over ``steps`` decode steps (the per-step kept counts of the run's report)."""
    gen = engine.generate(prompt, max_new_tokens=steps + 1, stop_tokens=(), masks=True)
    per_group: dict[str, list[float]] = {}
    for step in gen.report.steps[1:]:
        for g, kept in step.masks.items():
            if g in groups:
                per_group.setdefault(g, []).append(1.0 - float(np.mean(kept)) / groups[g][0])
    return weighted({g: float(np.mean(v)) for g, v in per_group.items()}, groups)


def deviation(logits: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    from decode import _deviation  # bench/decode.py's: top-1 agreement, relative L2

    return _deviation(logits, reference)


def _common_prefix(a: list[int], b: list[int]) -> int:
    from decode import _common_prefix as prefix

    return prefix(a, b)


def run_column(path: Path, threads: int, prompt: list[int], new: int) -> dict[str, Any]:
    """Load, warm up, one timed generation, drop (one session at a time)."""
    engine = Engine.load(path, intra_op_num_threads=threads)
    engine.generate(prompt[:4], max_new_tokens=2, stop_tokens=())  # warm-up: the session's first runs
    out = engine.generate(prompt, max_new_tokens=new, stop_tokens=())
    step = statistics.median(s.seconds for s in out.report.steps[1:]) if new > 1 else 0.0
    del engine
    gc.collect()
    return {"ids": out.ids, "ttft": out.report.time_to_first_token_s, "tps": out.report.decode_tokens_per_s or 0.0,
            "step": step}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 layers, hidden 256, 16 new tokens, 1 round (no target)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, --quick 1)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", "--new-tokens", dest="new", type=int, default=None, help="default 128, --quick 16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--sparsity", default="0.3,0.5", help="activation sparsities of the sparse columns")
    p.add_argument("--columns", default=None, help="only these columns (comma-separated names as in the table)")
    p.add_argument("--verify", choices=("once", "all", "none"), default="once",
                   help="once (default): LZ int4 verified, the rest --no-verify; all; none")  # fmt: skip
    p.add_argument("--max-deviation", type=float, default=1e9, help="the sparse compiles' bound under --verify all")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    size = "quick" if args.quick else "1b"
    rounds = args.rounds or (1 if args.quick else 3)
    new = args.new or (16 if args.quick else 128)
    threads = [int(t) for t in args.threads.split(",") if t]
    sparsities = [float(s) for s in args.sparsity.split(",") if s]
    load_before = os.getloadavg()

    native_why = native_library()
    src = source(size)
    root = cache_dir(src, size)
    info = model_info(src["export"])
    prompt = np.random.default_rng(0).integers(0, info["vocab"], size=args.prompt).tolist()
    calibration = calibration_file(root, info, args.prompt)

    paths: dict[str, Path] = {"ORT fp32": src["export"], "LZ fp32": src["lz"]}
    lz_fp32_verified = json.loads((src["lz"] / "manifest.json").read_text())["options"].get("verify", False)
    how = "compiled with verification" if lz_fp32_verified else "compiled --no-verify"
    notes = [f"ORT fp32: {src['export']}", f"LZ fp32: {src['lz']} ({how}, serve_batch's)"]
    wanted = None if args.columns is None else {c.strip() for c in args.columns.split(",")}

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    if want("ORT int4"):
        paths["ORT int4"], note = ort_int4(src, root)
        notes.append(note)
    q = dict(weights="int4", quant_block=32, quant_accuracy_level=4)
    if want("LZ int4"):
        paths["LZ int4"], note = lz_bundle(src, root, "lz-int4", args.verify != "none", args.max_deviation, **q)
        notes.append(f"LZ int4: {note}")
    if want("LZ int4 native") and native_why is None:
        paths["LZ int4 native"], note = lz_bundle(src, root, "lz-int4-native", False, args.max_deviation,
                                                  linear_kernel="native", **q)  # fmt: skip
        notes.append(f"LZ int4 native: {note} (QLinear + Attention of liblayerzero_ort.so)")
    elif want("LZ int4 native"):
        notes.append(f"LZ int4 native: not run (liblayerzero_ort.so {native_why})")
    for s in sparsities:
        native_q = dict(q, linear_kernel="native")
        for prec, extra in (("fp32", {}), ("int4", q), ("int4 native", native_q)):
            name = f"LZ {prec} sparse {s:g}"
            if not want(name) or (prec == "int4 native" and native_why is not None):
                continue
            opts = dict(extra, activation_sparsity=s, activation_calibration=calibration)
            folder = f"lz-{prec.replace(' ', '-')}-s{s:g}"
            paths[name], note = lz_bundle(src, root, folder, args.verify == "all", args.max_deviation, **opts)
            form = json.loads((paths[name] / "manifest.json").read_text()).get("activation_sparsity") or {}
            notes.append(f"{name}: {note}; {form.get('form', '?')} form, {form.get('realized_on_calibration', 0):.3f} "
                         f"on its calibration ({CALIBRATION_PROMPTS} prompts of {args.prompt})")  # fmt: skip
    names = [n for n in paths if want(n)]

    # Deviation from the fp32 export on the prompt, the ids' agreement and the realized sparsity: one session each.
    say("deviation and realized sparsity (one session at a time)")
    engine = Engine.load(paths["ORT fp32"], intra_op_num_threads=threads[-1])
    reference, _ = prefill_logits(engine, prompt)
    del engine
    gc.collect()
    dev: dict[str, tuple[float, float]] = {}
    realized: dict[str, tuple[float, float]] = {}
    for name in names:
        if name == "ORT fp32":
            continue
        engine = Engine.load(paths[name], intra_op_num_threads=threads[-1])
        logits, report = prefill_logits(engine, prompt)
        dev[name] = deviation(logits, reference)
        groups = activation_entries(paths[name])
        if groups:
            realized[name] = (weighted(report.activation_sparsity, groups),
                              decode_sparsity(engine, groups, prompt, min(16, new)))  # fmt: skip
        del engine
        gc.collect()

    timings: dict[tuple[str, int], list[dict[str, Any]]] = {(n, t): [] for n in names for t in threads}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotated: no column always first
        say(f"round {r + 1}/{rounds} (load {os.getloadavg()[0]:.1f}, peak RSS {peak_rss_gb():.1f} GB)")
        for t in threads:
            for name in order:
                timings[(name, t)].append(run_column(paths[name], t, prompt, new))
    reference_ids = timings[("ORT fp32", threads[0])][0]["ids"] if "ORT fp32" in names else None

    print(f"\nLlama {size}: {info['params'] / 1e6:.0f} M parameters, {info['layers']} layers, prompt {args.prompt}, "
          f"{new} new tokens, batch 1, threads {','.join(map(str, threads))}, {rounds} interleaved round(s); "
          "medians")  # fmt: skip
    for note in notes:
        print(f"  {note}")
    if native_why:
        print(f"  liblayerzero_ort.so {native_why}: the sparse columns run the reference form")
    print(f"  {'column':<25} {'thr':>3} {'tok/s':>8} {'TTFT':>8} {'step':>9} {'/LZ fp32':>8} {'/dense':>7} "
          f"{'/ORT':>6} {'top-1':>6} {'rel L2':>9} {'sparsity prefill/decode':>23}  ids == ORT fp32")  # fmt: skip
    tps: dict[tuple[str, int], float] = {}
    results = []
    for t in threads:
        for name in names:
            values = timings[(name, t)]
            tps[(name, t)] = statistics.median(v["tps"] for v in values)
    for t in threads:
        for name in names:
            values = timings[(name, t)]
            rate = tps[(name, t)]
            ttft = statistics.median(v["ttft"] for v in values)
            step = statistics.median(v["step"] for v in values)
            prec = "int4" if "int4" in name else "fp32"
            dense = name.split(" sparse")[0] if "sparse" in name else None  # LZ fp32 / LZ int4 / LZ int4 native
            ort = f"ORT {prec}" if name.startswith("LZ") else None

            def ratio(other: str | None, rate: float = rate, t: int = t) -> str:
                b = tps.get((other, t)) if other else None
                return f"{rate / b:.2f}x" if b else "-"

            top1, rel = dev.get(name, (1.0, 0.0))
            sp = realized.get(name)
            shown = f"{sp[0]:.3f} / {sp[1]:.3f}" if sp else "-"
            if reference_ids is None:  # ORT fp32 not among --columns
                lead, shown_ids = None, "-"
            else:
                lead = _common_prefix(values[0]["ids"], reference_ids)
                shown_ids = "all" if values[0]["ids"] == reference_ids else str(lead)
            print(f"  {name:<25} {t:>3} {rate:>8.2f} {ttft * 1e3:>6.0f}ms {step * 1e3:>7.1f}ms "
                  f"{ratio('LZ fp32'):>8} {ratio(dense):>7} {ratio(ort):>6} {top1:>6.3f} {rel:>9.2e} {shown:>23}  "
                  f"{shown_ids}")  # fmt: skip
            results.append(dict(column=name, threads=t, decode_tokens_per_s=rate, time_to_first_token_s=ttft,
                                median_step_s=step, top1_vs_fp32=top1, rel_l2_vs_fp32=rel,
                                realized_sparsity_prefill=sp[0] if sp else None,
                                realized_sparsity_decode=sp[1] if sp else None, ids_equal_leading=lead,
                                rounds=[v["tps"] for v in values]))  # fmt: skip

    misses: list[str] = []
    checks = [(a, b, want_, issue) for a, b, want_, issue in TARGETS_INT4]
    for s in sparsities:
        for a, b, want_, issue in TARGETS_SPARSE.get(s, ()):
            checks.append((a.format(s=f"{s:g}"), b, want_, issue))
    for t in threads:
        for a, b, want_, issue in checks:
            x, y = tps.get((a, t)), tps.get((b, t))
            if x is None or y is None:
                print(f"  target (issue {issue}) {a} / {b} >= {want_} at {t} thread(s): not measured")
                continue
            ratio_ = x / y if y else 0.0
            verdict = "no target at --quick" if args.quick else "met" if ratio_ >= want_ else "NOT met"
            print(f"  target (issue {issue}) {a} / {b} >= {want_} at {t} thread(s): {ratio_:.2f} {verdict}")
            if not args.quick and ratio_ < want_:
                misses.append(f"{a} / {b} at {t} thread(s): {ratio_:.2f} < {want_}")
    load_after = os.getloadavg()
    print(f"\nmachine: {os.cpu_count()} cores, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
          f"(shared: other processes run on the same cores); peak RSS {peak_rss_gb():.1f} GB")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "notes": notes, "load": [load_before, load_after],
                                         "peak_rss_gb": peak_rss_gb()}, indent=1))  # fmt: skip
    for miss in misses:
        print(f"MISSED: {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
