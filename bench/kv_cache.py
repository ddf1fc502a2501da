"""What the KV cache costs a decode step as the context grows (issue 24): the exported graph's Concat copies.

``layerzero export`` writes each present as ``Concat(past, new)`` (torch's ``DynamicCache.update`` is a
``torch.cat``): every decode step copies the whole cache into fresh present tensors, in ONNX Runtime, whoever
drives it (``Engine.generate``'s IO binding or the batcher's ``run``). This bench measures that copy against the
rest of the step on serve_batch.py's dense Llama-style bundles (``--size quick|l3|1b``, cached under
~/.cache/layerzero/serve_batch/<size>/, built by serve_batch.py when missing):

1. the decode step's time (one token per row, ``past`` cached, random cache values: the cost does not depend on
   them) at each ``--pasts`` and ``--rows``, run directly on the engine (median of ``--runs``);
2. the bytes the present Concats write per step (rows x kv heads x (past + 1) x head_dim x 4 bytes, per layer,
   keys and values; each also reads the past once);
3. ONNX Runtime's profiler on a second session of the same bundle (the same feeds): the kernel time of the present
   Concats and of every other node with a tensor as long as the cache (past + 1: the GQA ``repeat_kv`` Expand,
   the key Transpose, the attention MatMuls, Softmax, the mask's nodes), per op type, and their share of the
   profiled step (``model_run``).

    python bench/kv_cache.py --size 1b                       # pasts 64, 512, 2048 at 1 and 8 rows
    python bench/kv_cache.py --size l3 --pasts 64,2048 --rows 1 --runs 3
    python bench/kv_cache.py --quick                         # the 2-layer model: checks the path, not the speed

The machine's 1-minute load average is printed beside the figures (a shared machine: read them with it).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _feeds(layout: Any, rows: int, past: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.ones((rows, 1), np.int64), "attention_mask": np.ones((rows, past + 1), np.int64),
             "position_ids": np.full((rows, 1), past, np.int64)}  # fmt: skip
    for name, _ in layout.names:  # one array per tensor, as a real cache (not one array read 2 x layers times)
        heads, dim = layout.shapes[name]
        feeds[name] = rng.random((rows, heads, past, dim), dtype=np.float32).astype(layout.dtype)
    return feeds


def concat_bytes(layout: Any, rows: int, past: int) -> int:
    """Bytes the present Concats write in one decode step (each reads as many, less one token)."""
    import numpy as np

    per_row = sum(heads * dim for heads, dim in layout.shapes.values())
    return rows * (past + 1) * per_row * np.dtype(layout.dtype).itemsize


def step_times(bundle: Path, configs: list[tuple[int, int]], runs: int, threads: int | None) -> dict:
    """Median decode step (seconds) per (rows, past), on a plain session."""
    from layerzero.runtime import Engine
    from layerzero.runtime.generate import cache_layout

    engine = Engine.load(bundle, intra_op_num_threads=threads)
    layout = cache_layout(engine)
    out = {}
    for rows, past in configs:
        feeds = _feeds(layout, rows, past)
        engine.run(feeds)  # warm-up: this shape's allocations
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            engine.run(feeds)
            samples.append(time.perf_counter() - start)
        out[rows, past] = statistics.median(samples)
        del feeds
    return out


def _present_concats(model_path: Path) -> set[str]:
    """The names of the nodes that write a ``present.*`` graph output with a Concat."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    presents = {o.name for o in graph.output if o.name.startswith("present.")}
    return {n.name for n in graph.node if n.op_type == "Concat" and set(n.output) & presents}


def _dims(shapes: Any) -> set[int]:
    """Every dim of a profiler event's ``input_type_shape`` / ``output_type_shape`` ([{dtype: [dims]}, ...])."""
    out: set[int] = set()
    for entry in shapes or []:
        for dims in entry.values():
            out.update(int(d) for d in dims)
    return out


def profile(bundle: Path, configs: list[tuple[int, int]], runs: int, threads: int | None, tmp: Path) -> dict:
    """Per (rows, past), means over ``runs`` profiled steps (a warm-up step of each left out), in µs: the session's
    step (``model_run``), the present Concats, and the other nodes with a tensor of the cache's length by op."""
    from layerzero.runtime import Engine
    from layerzero.runtime.generate import cache_layout

    engine = Engine.load(bundle, intra_op_num_threads=threads, enable_profiling=True,
                         profile_file_prefix=str(tmp / "kv_cache"))  # fmt: skip
    layout = cache_layout(engine)
    concats = _present_concats(engine.model_path)
    order: list[tuple[int, int] | None] = []  # the config of each run, None for a warm-up
    for rows, past in configs:
        feeds = _feeds(layout, rows, past)
        for k in range(runs + 1):
            engine.run(feeds)
            order.append(None if k == 0 else (rows, past))
        del feeds
    events = json.loads(Path(engine.backend.end_profiling()).read_text())  # type: ignore[attr-defined]
    sessions = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                      key=lambda e: e["ts"])  # fmt: skip
    if len(sessions) != len(order):
        raise SystemExit(f"bench/kv_cache.py: the profile has {len(sessions)} runs, {len(order)} were made")
    starts = [e["ts"] for e in sessions]
    out: dict[tuple[int, int], dict[str, Any]] = {c: {"model_run": 0.0, "concat": 0.0, "by_op": {}} for c in configs}
    for e, config in zip(sessions, order):
        if config is not None:
            out[config]["model_run"] += e["dur"] / runs
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > starts[i] + sessions[i]["dur"] or order[i] is None:
            continue
        rows, past = config = order[i]
        node = e["name"].removesuffix("_kernel_time")
        args = e.get("args", {})
        if node in concats:
            out[config]["concat"] += e["dur"] / runs
        elif past + 1 in _dims(args.get("input_type_shape")) | _dims(args.get("output_type_shape")):
            op = args.get("op_name", "?")
            out[config]["by_op"][op] = out[config]["by_op"].get(op, 0.0) + e["dur"] / runs
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("l3", "1b"), default="1b")
    parser.add_argument("--pasts", default="64,512,2048", help="cached tokens per row (comma-separated)")
    parser.add_argument("--rows", default="1,8", help="rows per step (comma-separated)")
    parser.add_argument("--runs", type=int, default=5, help="timed steps per configuration (default 5)")
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: its own)")
    parser.add_argument("--no-profile", action="store_true", help="step times and bytes only")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    try:
        pasts = [int(p) for p in args.pasts.split(",")]
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--pasts {args.pasts!r} / --rows {args.rows!r}: comma-separated integers")
    if min(pasts) < 1 or min(rows_list) < 1 or args.runs < 1:
        parser.error("--pasts, --rows and --runs must be >= 1")
    size = "quick" if args.quick else args.size

    import serve_batch

    from layerzero.runtime import Engine
    from layerzero.runtime.generate import cache_layout

    bundle = serve_batch._bundle("llama", size)
    layout = cache_layout(Engine.load(bundle))
    heads, head_dim = layout.shapes[layout.names[0][0]]  # the llama bundle's: every tensor alike
    configs = [(r, p) for r in rows_list for p in pasts]
    load0 = os.getloadavg()[0]
    times = step_times(bundle, configs, args.runs, args.threads)
    prof: dict = {}
    if not args.no_profile:
        with tempfile.TemporaryDirectory() as tmp:
            prof = profile(bundle, configs, args.runs, args.threads, Path(tmp))
    load1 = os.getloadavg()[0]
    layers = len(layout.names) // 2
    print(f"{size}: {layers} layers, {heads} kv heads x {head_dim}, {layout.dtype}; load {load0:.1f} -> {load1:.1f}")
    print(f"{'rows':>4} {'past':>5} | {'step ms':>8} | {'Concat MB':>9} | {'prof. step':>10} {'Concat ms':>9} "
          f"{'share':>6} {'GB/s':>5} | other cache-length nodes, ms (share)")  # fmt: skip
    for rows, past in configs:
        mb = concat_bytes(layout, rows, past) / 1e6
        line = f"{rows:>4} {past:>5} | {times[rows, past] * 1e3:8.1f} | {mb:9.1f} |"
        if prof:
            p = prof[rows, past]
            step, concat = p["model_run"] / 1e3, p["concat"] / 1e3
            # Each Concat reads the past and writes the present: 2 x the bytes written, less one token.
            rate = 2 * mb / concat if concat else float("nan")
            others = sorted(p["by_op"].items(), key=lambda kv: -kv[1])
            big = [(op, us / 1e3) for op, us in others if us / 1e3 >= 0.005 * step]
            small = sum(us for _, us in others) / 1e3 - sum(ms for _, ms in big)
            rest = ", ".join(f"{op} {ms:.1f} ({ms / step:.0%})" for op, ms in big) + f", the rest {small:.1f}"
            total = sum(p["by_op"].values()) / 1e3
            line += (f" {step:10.1f} {concat:9.1f} {concat / step:6.1%} {rate:5.1f} | {rest}; all cache-length "
                     f"nodes with the Concats {total + concat:.1f} ms ({(total + concat) / step:.0%})")  # fmt: skip
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
