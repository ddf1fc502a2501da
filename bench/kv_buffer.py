"""Decode tokens/s of an int4 native bundle with and without its cache buffers, as the context grows.

    python bench/kv_buffer.py                          # qwen3_moe of bench/decode.py, prompts 32..2000, 1 thread
    python bench/kv_buffer.py --prompts 32,1024 --threads 1,2 --rounds 5

The same bundle (`compile --weights int4 --linear-kernel native`, bench/decode.py's Qwen3-MoE-style model and
cache) through ``Engine.generate``, batch 1, ``--new`` greedy tokens after prompts of each ``--prompts`` length,
in interleaved rounds: ``buffers`` (the default: one cache buffer bound as each layer's past and present, the
attention op writes the new rows in place) against ``copy`` (``LAYERZERO_KV_BUFFER=0``: each step's presents are
new tensors, the past copied into them). Printed: median decode tok/s of each, their ratio, and whether the greedy
ids are equal. Targets (exit 1 on a miss): ids equal everywhere; buffers / copy >= 1.15 at prompts of 1,024 tokens
or more; >= 0.95 at every length (no loss beyond the noise where the cache is small).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # bench/decode.py: the model, its cache, the native library

LONG, LONG_TARGET, FLOOR = 1024, 1.15, 0.95


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "mixtral"))
    p.add_argument("--prompts", default="32,512,1024,2000", help="prompt lengths (default 32,512,1024,2000)")
    p.add_argument("--new", type=int, default=64, help="greedy tokens after each prompt (default 64)")
    p.add_argument("--threads", default="1", help="intra-op thread counts (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = p.parse_args(argv)

    def say(msg: str) -> None:
        print(f"[{decode.time.strftime('%H:%M:%S')}] {msg}", flush=True)

    import numpy as np

    why = decode.native_library(say)
    if why is not None:
        raise SystemExit(f"liblayerzero_ort.so: {why}")
    config = decode.configs(False)[args.family]
    prompt0 = np.random.default_rng(0).integers(0, config["vocab_size"], size=32).tolist()
    prepared = decode.prepare(args.family, config, prompt0, 128, say)
    path, how = decode.lz_quantized(prepared, 4, say, verify=False, linear_kernel="native")
    if path is None:
        raise SystemExit(f"no LZ int4 bundle: {how}")
    load_before = os.getloadavg()[0]
    misses: list[str] = []
    print(f"\n{args.family} LZ int4 native ({path.name}), {args.new} new tokens, batch 1, {args.rounds} rounds")
    print(f"  {'prompt':>6} {'threads':>7} {'buffers tok/s':>14} {'copy tok/s':>11} {'ratio':>6}  ids equal")
    for threads in [int(t) for t in args.threads.split(",")]:
        engine = decode.Engine.load(path, intra_op_num_threads=threads)
        for length in [int(n) for n in args.prompts.split(",")]:
            prompt = np.random.default_rng(length).integers(0, config["vocab_size"], size=length).tolist()
            tps: dict[str, list[float]] = {"1": [], "0": []}
            ids: dict[str, list[int]] = {}
            for r in range(args.rounds):
                for mode in ("1", "0") if r % 2 == 0 else ("0", "1"):
                    os.environ["LAYERZERO_KV_BUFFER"] = mode
                    g = engine.generate(prompt, max_new_tokens=args.new, stop_tokens=())
                    tps[mode].append(g.report.decode_tokens_per_s or 0.0)
                    ids[mode] = g.ids
            os.environ.pop("LAYERZERO_KV_BUFFER", None)
            buf, copy = statistics.median(tps["1"]), statistics.median(tps["0"])
            ratio, same = buf / copy, ids["1"] == ids["0"]
            print(f"  {length:>6} {threads:>7} {buf:>14.1f} {copy:>11.1f} {ratio:>6.2f}  {same}")
            if not same:
                misses.append(f"prompt {length}, {threads} thread(s): the greedy ids differ")
            floor = LONG_TARGET if length >= LONG else FLOOR
            if ratio < floor:
                misses.append(f"prompt {length}, {threads} thread(s): buffers / copy {ratio:.2f} < {floor}")
    print(f"\nmachine: {os.cpu_count()} cores, load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    for m in misses:
        print(f"MISSED: {m}")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
