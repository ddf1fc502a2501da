"""Build the example transformer, compile it, run both, and show what went to zero.

The example is a small Llama-style transformer (layerzero.models) with declared zero flags: a quarter
of the blocks declared off (`layers.N.flag = 0`) and the rotary encoding of block 0 off
(`layers.0.attention.rotary_emb.flag = 0`). The demo compiles it, runs the original and the compiled
bundle with the LayerZero runtime, and prints nodes, parameters and p50 latency before → after.

Two comparisons are printed. Verification compares the compiled model with the reference: the original
with the flagged layers bypassed (they must agree to atol/rtol). A declared flag does not change the
original's own math, so the original (flagged layers still computed) differs from the compiled model by
those layers' contribution; that difference is printed (after verification, and last) and is expected: the demo
removes those layers on purpose.

examples:
  layerzero demo
  layerzero demo --layers 8 --workdir demo-out
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from rich.table import Table

from layerzero.cli._common import console, integer, one_line_errors, progress
from layerzero.cli.compile import print_verification
from layerzero.compile import compile_file
from layerzero.models import TransformerConfig, build_transformer, example_feeds
from layerzero.options import CompileOptions
from layerzero.runtime import Engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("--layers", type=integer(1, 1024), default=8, help="transformer blocks (default 8)")
    p.add_argument("--hidden", type=integer(8, 65536), default=256, help="hidden size (default 256)")
    p.add_argument("--seq", type=integer(1, 1 << 20), default=32, help="tokens per request (default 32)")
    p.add_argument("--runs", type=integer(1, 10**6), default=50, help="timed runs per model (default 50)")
    p.add_argument("--workdir", type=Path, help="keep the model and bundle here (default: a temporary dir)")


def _p50_ms(engines: list[Engine], feeds: dict[str, np.ndarray], runs: int) -> list[float]:
    """p50 latency of each engine, runs interleaved round-robin so machine noise hits all alike."""
    for engine in engines:
        for _ in range(3):
            engine.run(feeds)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(runs):
        for engine, bucket in zip(engines, times):
            start = time.perf_counter()
            engine.run(feeds)
            bucket.append(time.perf_counter() - start)
    return [float(np.median(t) * 1e3) for t in times]


def run(args: argparse.Namespace) -> int:
    n = max(args.layers, 4)
    config = TransformerConfig(
        num_layers=n,
        hidden=args.hidden,
        num_heads=max(args.hidden // 64, 1),
        ffn=args.hidden * 4,
        vocab_size=1024,
        zero_blocks=tuple(range(1, n, 2))[: n // 4 or 1],  # a quarter of the blocks, declared off
        zero_rotary=(0,),
    )
    with tempfile.TemporaryDirectory(prefix="layerzero-demo-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        source = workdir / "transformer.onnx"
        bundle = workdir / "transformer.lz"
        onnx.save_model(build_transformer(config), source)
        console.print(
            f"example: {n}-block transformer, hidden {config.hidden}; declared zero flags on blocks "
            f"{list(config.zero_blocks)} and on the rotary encoding of block 0 → {source}"
        )
        with progress("compiling") as say:
            result = compile_file(source, bundle, CompileOptions(), progress=say, overwrite=True)
        feeds = example_feeds(config, batch=1, seq=args.seq)
        original = Engine.load(source)
        compiled = Engine.load(bundle)
        out_o = original.run(feeds).outputs["logits"]
        run_c = compiled.run(feeds)
        with progress("timing"):
            t_o, t_c = _p50_ms([original, compiled], feeds, args.runs)
        table = Table(title=f"LayerZero demo ({args.seq} tokens, ORT CPU)")
        for col in ("", "original", "compiled", "ratio"):
            table.add_column(col, justify="right")
        b, a = result.before, result.after
        table.add_row("nodes", f"{b.nodes:,}", f"{a.nodes:,}", f"{a.nodes / b.nodes:.2f}")
        table.add_row("parameters", f"{b.params:,}", f"{a.params:,}", f"{a.params / b.params:.2f}")
        table.add_row("p50 latency", f"{t_o:.2f} ms", f"{t_c:.2f} ms", f"{t_c / t_o:.2f}")
        console.print(table)
        for r in result.removed:
            console.print(f"removed {r.scope} ({r.kind}, {r.nodes} nodes, {r.params:,} parameters)")
        print_verification(result.verification)
        deviation = float(np.abs(out_o - run_c.outputs["logits"]).max())
        console.print(f"report: {run_c.report.summary()}")
        console.print(
            f"original (flagged layers still computed) vs compiled (layers removed): max abs {deviation:.3g}: "
            "what the layers the demo removes on purpose contribute, not an error (a declared flag does not change "
            "the original's math; verification above compared the compiled model with the original minus them)"
        )
        console.print(f"bundle: {bundle}" if args.workdir else "(pass --workdir DIR to keep the model and bundle)")
    return 0
