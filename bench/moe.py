"""MoE expert skipping: LayerZero against dense compute, the batched_mm export, ORT's MoE op and the memory bound.

One MoE block (``layerzero.models.moe``, E experts, top-k, softmax, renormalised, silu) in the forms:

- dense: every expert on every token (stacked ``MatMul``), combined with a ``ScatterElements`` routing matrix;
- batched_mm: what torch.onnx makes of Hugging Face's ``batched_mm`` experts (``GatherND`` of the weights of
  every (token, slot) pair, so each token reads k experts' weights even when tokens share experts);
- LayerZero if / ort-moe: ``compile_model`` of the batched_mm export with ``moe_lowering="if"`` / ``"ort-moe"``;
- MoE op: ``com.microsoft.MoE`` used directly (router ``Gemm`` + the op), the reference for "as fast as ORT's
  own kernel";
- memory bound: the bytes of the experts that run on this input (the union over its tokens) ÷ the memory
  bandwidth of a large numpy copy (read + write counted), timed in the same interleaved rounds.

All sessions: ORT_ENABLE_ALL, the same threads (``--threads``, default 1). Repetitions are interleaved
round-robin (shuffled each round) over every variant and the copy, so the noise of a shared machine falls on
all alike; the table gives p50 and ratios, and whether each target is met.

    python bench/moe.py            # E=8, k=2, H=1024, F=4096 (≈400 MB fp32) and H=256, F=1024; 1 and 64 tokens
    python bench/moe.py --quick    # the small shape only, fewer rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from layerzero.compile import compile_model
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds, moe_layer_weights
from layerzero.options import CompileOptions
from layerzero.plugins.reference import moe_routing

VARIANTS = ("dense", "batched_mm", "LZ if", "LZ ort-moe", "MoE op")
TARGET_VS_OP = 1.1  # LayerZero ≤ 1.1 × the MoE op (1 and 64 tokens)
TARGET_VS_BOUND = 1.3  # LayerZero ≤ 1.3 × the memory bound (1 token)
TARGET_VS_DENSE = 3.0  # LayerZero ≥ 3 × faster than dense (1 token)


@dataclasses.dataclass
class Variant:
    name: str
    session: ort.InferenceSession
    feeds: dict[str, np.ndarray]
    times: list[float] = dataclasses.field(default_factory=list)
    max_diff: float = 0.0

    @property
    def p50(self) -> float:
        return float(np.median(self.times)) * 1e3


def _options(threads: int | None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    return options


def _session(model: onnx.ModelProto | ir.Model, threads: int | None) -> ort.InferenceSession:
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    return ort.InferenceSession(proto.SerializeToString(), _options(threads), providers=["CPUExecutionProvider"])


def _ort_moe_model(config: MoEConfig) -> onnx.ModelProto:
    """Router Gemm + ``com.microsoft.MoE`` with fc1 rows interleaved [gate_0, up_0, ...] (swiglu_fusion=1)."""
    w = moe_layer_weights(config, 0)
    e, f, h = w["w_gate"].shape
    fc1 = np.empty((e, 2 * f, h), np.float32)
    fc1[:, 0::2], fc1[:, 1::2] = w["w_gate"], w["w_up"]
    nodes = [
        helper.make_node("Gemm", ["hidden", "router", "router_bias"], ["logits"], transB=1),
        helper.make_node(
            "MoE",
            ["hidden", "logits", "fc1", "", "fc2"],
            ["y"],
            domain="com.microsoft",
            k=config.top_k,
            activation_type="swiglu",
            swiglu_fusion=1,
            normalize_routing_weights=int(config.normalize),
        ),
    ]
    inits = [
        numpy_helper.from_array(w["router"], "router"),
        numpy_helper.from_array(w["router_bias"], "router_bias"),
        numpy_helper.from_array(fc1, "fc1"),
        numpy_helper.from_array(w["w_down"], "fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "ort_moe",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["tokens", h])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", h])],
        initializer=inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )


class _Copy:
    """A large numpy copy, timed in the same rounds as the sessions: bytes moved (read + write) per second."""

    def __init__(self, megabytes: int = 256) -> None:
        self.src = np.ones(megabytes * (1 << 20) // 4, np.float32)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # touch every page first
        self.times: list[float] = []

    def run(self) -> None:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        self.times.append(time.perf_counter() - t0)

    @property
    def bandwidth(self) -> float:
        return 2 * self.src.nbytes / float(np.median(self.times))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _expert_bytes(config: MoEConfig, hidden: np.ndarray) -> tuple[int, int]:
    """(bytes of the experts the input's tokens run, how many experts that is)."""
    w = moe_layer_weights(config, 0)
    logits = hidden @ w["router"].T + w["router_bias"]
    _, mask = moe_routing(logits, top_k=config.top_k, normalize=config.normalize, scoring=config.scoring)
    used = int(mask.any(axis=0).sum())
    return used * 3 * config.hidden * config.ffn * 4, used


def run_shape(config: MoEConfig, tokens_list: list[int], rounds: int, threads: int | None, copy: _Copy) -> list:
    say = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"building E={config.experts} k={config.top_k} H={config.hidden} F={config.ffn}")
    batched = build_moe(dataclasses.replace(config, form="batched_mm"))
    models: dict[str, object] = {
        "dense": build_moe(dataclasses.replace(config, form="dense")),
        "batched_mm": batched,
        "MoE op": _ort_moe_model(config),
    }
    for lowering in ("if", "ort-moe"):
        say(f"compiling ({lowering})")
        result = compile_model(batched, CompileOptions(moe_lowering=lowering, verify=False))
        ops = {n.op_type for n in result.model.graph}
        assert "GatherND" not in ops, f"{lowering}: the block was not rewritten"
        models[f"LZ {lowering}"] = result.model
    say("creating sessions")
    sessions = {name: _session(model, threads) for name, model in models.items()}
    del models, batched
    rows = []
    for tokens in tokens_list:
        feeds = moe_feeds(config, tokens, seed=tokens)
        variants = [Variant(name, sessions[name], feeds) for name in VARIANTS]
        reference = None
        for v in variants:  # warm up and check that all agree
            for _ in range(3):
                out = v.session.run(["y"], v.feeds)[0]
            reference = out if reference is None else reference
            v.max_diff = float(np.abs(out - reference).max())
        order: list[Variant | _Copy] = [*variants, copy]
        for _ in range(rounds):
            random.shuffle(order)
            for v in order:
                if isinstance(v, _Copy):
                    v.run()
                    continue
                t0 = time.perf_counter()
                v.session.run(["y"], v.feeds)
                v.times.append(time.perf_counter() - t0)
        nbytes, used = _expert_bytes(config, feeds["hidden"])
        rows.append((config, tokens, variants, nbytes, used))
    return rows


def print_table(rows: list, bandwidth: float) -> bool:
    print(
        f"\nmemory bandwidth (p50 of a 256 MB numpy copy in the same rounds, read + write): {bandwidth / 1e9:.1f} GB/s"
    )
    header = (
        f"{'shape':<22} {'T':>3} " + " ".join(f"{n:>11}" for n in VARIANTS) + f" {'bound':>8}  "
        f"{'LZ/op':>6} {'LZ/bound':>8} {'dense/LZ':>8}"
    )
    print(header)
    print("-" * len(header))
    all_met = True
    verdicts = []
    for config, tokens, variants, nbytes, used in rows:
        bound_ms = nbytes / bandwidth * 1e3
        p50 = {v.name: v.p50 for v in variants}
        best_lz = min(p50["LZ if"], p50["LZ ort-moe"])
        lz_if = p50["LZ if"]
        shape = f"E{config.experts} k{config.top_k} H{config.hidden} F{config.ffn}"
        print(
            f"{shape:<22} {tokens:>3} "
            + " ".join(f"{p50[n]:>9.3f}ms" for n in VARIANTS)
            + f" {bound_ms:>6.3f}ms  {lz_if / p50['MoE op']:>6.2f} {lz_if / bound_ms:>8.2f} "
            f"{p50['dense'] / lz_if:>8.2f}"
        )
        worst = max(v.max_diff for v in variants)
        checks = [(f"LZ if ≤ {TARGET_VS_OP} × MoE op", lz_if <= TARGET_VS_OP * p50["MoE op"])]
        if tokens == 1:
            checks += [
                (f"LZ if ≤ {TARGET_VS_BOUND} × memory bound ({used} experts)", lz_if <= TARGET_VS_BOUND * bound_ms),
                (f"LZ if ≥ {TARGET_VS_DENSE} × faster than dense", p50["dense"] >= TARGET_VS_DENSE * lz_if),
            ]
        verdicts.append((shape, tokens, checks, worst, best_lz))
    print()
    for shape, tokens, checks, worst, _ in verdicts:
        text = ", ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks)
        all_met &= all(ok for _, ok in checks)
        print(f"{shape}, {tokens} token(s): {text}; max |y - dense| = {worst:.1e}")
    return all_met


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small shape only, fewer rounds")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 30, --quick 15)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="ORT intra-op threads (default 1: on a small shared machine more threads mostly measure contention)",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    random.seed(0)
    rounds = args.rounds or (15 if args.quick else 30)
    shapes = [MoEConfig(hidden=256, ffn=1024, experts=8, top_k=2)]
    if not args.quick:
        shapes.insert(0, MoEConfig(hidden=1024, ffn=4096, experts=8, top_k=2))
    copy = _Copy()
    rows = []
    for config in shapes:
        rows += run_shape(config, args.tokens, rounds, args.threads, copy)
    print_table(rows, copy.bandwidth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
