"""Static zeroing: LayerZero against ORT, onnxsim, onnxslim and the hand-pruned oracle.

The example transformer (``layerzero.models``) with k of its N blocks flagged 0 in the *consumed* form
(``x + flag * f(x)``, so every tool sees the same math), for k = 0, N/4, N/2. Variants per k:

- original: the flagged model as built, left to ORT's own optimisation;
- onnxsim: ``onnxsim.simplify``;  onnxslim: ``onnxslim.slim``;
- LayerZero: ``compile_model`` (verified), saved;
- oracle: the model built without the flagged blocks (``omit_blocks``) and without flags, same weights.

Every variant runs under ORT ``ORT_ENABLE_ALL`` with the same thread settings. Latencies are measured in
one run, round-robin over all variants of all k (shuffled each round) so that the noise of a shared
machine falls on every variant alike. One table: nodes and parameters of the file, p50 latency, its
ratio to the oracle's p50, and the max abs difference of the logits from the oracle's.

    python bench/static_zeroing.py            # hidden 512, 8 blocks, ffn 2048, seq 64, batch 1
    python bench/static_zeroing.py --quick    # a small model, a few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from layerzero.compile import compile_model
from layerzero.models import TransformerConfig, build_transformer, example_feeds
from layerzero.options import CompileOptions

TARGET = 1.02  # LayerZero / oracle p50
VARIANTS = ("original", "onnxsim", "onnxslim", "LayerZero", "oracle")


@dataclasses.dataclass
class Variant:
    k: int
    name: str
    path: Path | None = None
    nodes: int = 0
    params: int = 0
    error: str | None = None
    session: ort.InferenceSession | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    max_diff: float | None = None
    seconds: float = 0.0  # time the tool took

    @property
    def p50(self) -> float:
        return float(np.median(self.times)) * 1e3 if self.times else float("nan")


def _flagged_blocks(n: int, k: int) -> tuple[int, ...]:
    """k blocks spread evenly over n (the last of each group of n // k)."""
    if k == 0:
        return ()
    step = n // k
    return tuple(range(step - 1, n, step))[:k]


def _count(model: onnx.ModelProto) -> tuple[int, int]:
    """Nodes of the main graph; parameters = initializer and Constant-node elements (tools move them)."""
    params = sum(int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer)
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    params += int(np.prod(attr.t.dims, dtype=np.int64))
    return len(model.graph.node), params


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path), save_as_external_data=model.ByteSize() > (1 << 30), location=path.name + ".data")
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:90]


def _onnxsim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxsim

    simplified, ok = onnxsim.simplify(model)
    if not ok:
        raise RuntimeError("onnxsim's own check failed")
    return simplified


def _onnxslim(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnxslim

    return onnxslim.slim(model)


def _layerzero(model: onnx.ModelProto) -> onnx.ModelProto:
    return ir.to_proto(compile_model(model, CompileOptions()).model)


def _session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _prepare(config: TransformerConfig, k: int, tmp: Path, threads: int, say: Callable[[str], None]) -> list[Variant]:
    blocks = _flagged_blocks(config.num_layers, k)
    flagged = dataclasses.replace(config, zero_blocks=blocks)
    oracle_config = dataclasses.replace(config, flags=False, omit_blocks=blocks)
    original = build_transformer(flagged)
    tools: dict[str, Callable[[], onnx.ModelProto]] = {
        "original": lambda: original,
        "onnxsim": lambda: _onnxsim(original),
        "onnxslim": lambda: _onnxslim(original),
        "LayerZero": lambda: _layerzero(original),
        "oracle": lambda: build_transformer(oracle_config),
    }
    variants = []
    for name in VARIANTS:
        v = Variant(k, name)
        say(f"k={k}: {name}")
        start = time.perf_counter()
        try:
            model = tools[name]()
            v.seconds = time.perf_counter() - start
            v.nodes, v.params = _count(model)
            v.path = _save(model, tmp / f"k{k}_{name}.onnx")
            del model
            v.session = _session(v.path, threads)
        except Exception as exc:  # a tool that fails is a row of the table, not the end of the run
            v.error = _first_line(exc)
        variants.append(v)
    return variants


def _measure(variants: list[Variant], feeds: dict[str, np.ndarray], reps: int, warmup: int, seed: int) -> None:
    live = [v for v in variants if v.session is not None]
    outputs: dict[int, np.ndarray] = {}
    for v in live:
        for _ in range(warmup):
            outputs[id(v)] = v.session.run(["logits"], feeds)[0]
    for v in live:  # max abs difference from the oracle of the same k
        oracle = next((o for o in live if o.k == v.k and o.name == "oracle"), None)
        if oracle is not None:
            v.max_diff = float(np.max(np.abs(outputs[id(v)] - outputs[id(oracle)])))
    rng = random.Random(seed)
    for _ in range(reps):
        order = live[:]
        rng.shuffle(order)
        for v in order:
            start = time.perf_counter()
            v.session.run(["logits"], feeds)
            v.times.append(time.perf_counter() - start)


def _missed(variants: list) -> bool:
    """A LayerZero/oracle ratio above the target, or a variant that could not be measured or compared."""
    for k in sorted({v.k for v in variants}):
        lz = next(v for v in variants if v.k == k and v.name == "LayerZero")
        oracle = next(v for v in variants if v.k == k and v.name == "oracle")
        if lz.error is not None or oracle.error is not None or not lz.p50 / oracle.p50 <= TARGET:
            return True
    return False


def _table(variants: list[Variant], config: TransformerConfig, args: argparse.Namespace) -> str:
    head = (
        f"{'k/N':>5}  {'variant':<10} {'nodes':>6} {'parameters':>12} {'p50 ms':>8} {'/ oracle':>8}"
        f" {'max|Δ| vs oracle':>16} {'tool s':>7}"
    )
    lines = [
        f"transformer hidden={config.hidden} blocks={config.num_layers} heads={config.num_heads} "
        f"ffn={config.ffn} vocab={config.vocab_size}; input [{args.batch}, {args.seq}]; consumed flags; "
        f"ORT {ort.__version__} ORT_ENABLE_ALL, {args.threads} intra-op thread(s); {args.reps} interleaved reps",
        head,
        "-" * len(head),
    ]
    for k in sorted({v.k for v in variants}):
        group = [v for v in variants if v.k == k]
        oracle = next(v for v in group if v.name == "oracle")
        for v in group:
            tag = f"{k}/{config.num_layers}" if v is group[0] else ""
            if v.error is not None:
                lines.append(f"{tag:>5}  {v.name:<10} FAILED {v.error}")
                continue
            ratio = v.p50 / oracle.p50 if oracle.times else float("nan")
            diff = "" if v.max_diff is None else f"{v.max_diff:.1e}"
            lines.append(
                f"{tag:>5}  {v.name:<10} {v.nodes:>6} {v.params:>12,} {v.p50:>8.2f} {ratio:>8.3f}"
                f" {diff:>16} {v.seconds:>7.1f}"
            )
        lines.append("")
    lines.append(f"target: LayerZero / oracle p50 ≤ {TARGET}")
    for k in sorted({v.k for v in variants}):
        lz = next(v for v in variants if v.k == k and v.name == "LayerZero")
        oracle = next(v for v in variants if v.k == k and v.name == "oracle")
        if lz.error is not None or oracle.error is not None:
            lines.append(f"  k={k}: not measured ({lz.error or oracle.error})")
            continue
        ratio = lz.p50 / oracle.p50
        lines.append(f"  k={k}: {ratio:.3f}  {'met' if ratio <= TARGET else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and few repetitions (seconds)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=60, help="interleaved rounds (each runs every variant once)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="ORT intra-op threads, the same for every variant")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.blocks, args.heads, args.ffn, args.seq = 128, 4, 4, 256, 16
        args.reps = max(args.reps, 300)  # sub-millisecond runs: many rounds are cheap
    logging.basicConfig(level=logging.WARNING)
    config = TransformerConfig(
        vocab_size=args.vocab,
        hidden=args.hidden,
        num_layers=args.blocks,
        num_heads=args.heads,
        ffn=args.ffn,
        flag_form="consumed",
        seed=args.seed,
    )
    ks = sorted({0, args.blocks // 4, args.blocks // 2})

    def say(msg: str) -> None:
        print(f"  preparing {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="lz-bench-") as tmp:
        variants = [v for k in ks for v in _prepare(config, k, Path(tmp), args.threads, say)]
        live = sum(v.session is not None for v in variants)
        print(f"  measuring {args.reps} rounds of {live} sessions", file=sys.stderr)
        feeds = example_feeds(config, batch=args.batch, seq=args.seq, seed=args.seed)
        _measure(variants, feeds, args.reps, args.warmup, args.seed)
        for v in variants:
            v.session = None
    print(_table(variants, config, args))
    if _missed(variants):
        print("a target was missed (or LayerZero / the oracle failed): exit 1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
