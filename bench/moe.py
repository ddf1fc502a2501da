"""MoE expert skipping: LayerZero against dense compute, the batched_mm export, ORT's MoE op and the memory bound.

One MoE block (``layerzero.models.moe``, E experts, top-k, softmax, renormalised, silu) in the forms:

- dense: every expert on every token (stacked ``MatMul``), combined with a ``ScatterElements`` routing matrix
  (the E8 shapes only: on many experts it only measures how slow dense is);
- batched_mm: what torch.onnx makes of Hugging Face's ``batched_mm`` experts (``GatherND`` of the weights of
  every (token, slot) pair, so each token reads k experts' weights even when tokens share experts);
- LZ if / ort-moe / native: the skipping form (``ai.layerzero::MoE``, what the compiler's matcher makes of the
  batched_mm export: ``layerzero.models.moe`` form ``skipping``, same weights) lowered by ``LowerMoE`` with
  ``"if"`` / ``"ort-moe"`` / ``"native"`` (the node kept for liblayerzero_ort.so, ``layerzero plugins build``).
  The lowerings are deterministic functions of the matched block, so the bench builds them directly instead of
  compiling (and verifying) the export three times per shape (~20 min at E256); every variant's output is
  checked against ``plugins/reference.py`` (float64) on the timed input instead. ``--compile`` goes through
  ``compile_model`` with verification as before;
- MoE op: ``com.microsoft.MoE`` used directly (router ``Gemm`` + the op);
- memory bound: the bytes of the experts that run on this input (the union over its tokens) ÷ the memory
  bandwidth of a large numpy copy, read + write counted (the copy reads N bytes and writes N: 2N per copy time,
  STREAM's convention), timed in the same interleaved rounds. That credits a read-only workload with the copy's
  read and write traffic together: on one core of this machine a numpy read (``np.max`` of the same buffer) runs
  at ~0.5 × that rate. So the table also gives the read bound: bytes ÷ that read's bandwidth (same rounds).
  The issue-11 target stays on the copy bound.

Models are built once per shape and cached as ``.onnx`` files in a temporary directory (removed at exit) for the
sessions of every thread count.

All sessions: ORT_ENABLE_ALL, the same intra-op threads, workers that block rather than spin when idle (each
session has its own pool: a worker still spinning after its session's run would take a core from the next one),
inputs and output bound once (IO binding, as LayerZero's decode loop runs a model); every shape runs at one
thread and at all cores (``--threads``).

The column floor is an ``Identity`` session run the same way in the same rounds: what a run costs before any of
the block's work (Python, the executor; on these cold caches their code and data come from memory again:
0.1-0.3 ms here). The bound does not contain it; ``(nat-fl)/b`` shows the native block against the bound with it
taken out (information only: the targets below use the whole time). The column stream (one-thread rows) is the
native kernels' read pattern without their arithmetic over the same experts' matrices
(``LayerZeroOrtStreamRead``): ``strm/bnd`` is how close to the bound one core streams those bytes at all,
``nat/strm`` what the native op costs on top of that.

Repetitions are interleaved round-robin (shuffled each round) over every variant and the copy,
so the noise of a shared machine falls on all alike; the table gives p50 and ratios. The native output is
checked against ``plugins/reference.py`` (float64) on the timed input. The load average is printed with each
row (and at the start and end): a number measured on a loaded machine says so.

``--clock thread`` times the one-thread rows (and the copy) in the calling thread's CPU time
(``time.thread_time``; a one-thread session runs its kernels in the calling thread), so that time spent
descheduled on a shared machine is not counted; rows with more threads are always wall-clock. Memory bandwidth
is still shared with the other processes, so it only removes part of the noise. Default: ``wall``.

Targets (issue 11), each printed met / NOT met; the exit status is 1 when one is missed:
- 1 token, E64 k8 H1024 F512 and E128 k8 H512 F256: native ≤ 1.3 × the memory bound and ≤ 0.8 × the MoE op;
- every shape and token count: native ≤ the batched_mm export;
- 16 and 64 tokens: native ≤ min(LZ if, MoE op);
- every row: ``auto``'s choice without the library (``lower_moe_native.choose_by_cost``, column auto) ≤ the export;
- native output within 1e-5 relative of the reference.

    python bench/moe.py            # E64 k8 H1024 F512, E128 k8 H512 F256, E256 k8 H512 F256; 1/16/64 tokens
    python bench/moe.py --quick    # E128 only, fewer rounds
    python bench/moe.py --e8       # the E8 k2 shapes of the first measurements (with dense)
    python bench/moe.py --clock thread   # one-thread rows in CPU time (a loaded machine)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from layerzero.compile import compile_model
from layerzero.models.moe import MoEConfig, build_moe, moe_feeds, moe_layer_weights
from layerzero.options import CompileOptions
from layerzero.passes.lower_moe import LowerMoE
from layerzero.passes.lower_moe_native import BlockShape, choose_by_cost
from layerzero.plugins import ort_library
from layerzero.plugins.reference import moe_reference, moe_routing

VARIANTS = ("dense", "batched_mm", "LZ if", "LZ ort-moe", "LZ native", "MoE op")
TARGET_VS_BOUND = 1.3  # native ≤ 1.3 × the memory bound (1 token, the two issue-11 shapes)
TARGET_VS_OP = 0.8  # native ≤ 0.8 × the MoE op (1 token, the two issue-11 shapes)
TARGET_SHAPES = {(64, 8, 1024, 512), (128, 8, 512, 256)}
TARGET_RELATIVE = 1e-5  # native vs the float64 reference
MIN_ROUNDS = 7
VARIANT_RELATIVE = 1e-4  # every variant vs the float64 reference (float32 arithmetic, other summation orders)


@dataclasses.dataclass
class Variant:
    name: str
    session: ort.InferenceSession | None
    feeds: dict[str, np.ndarray]
    times: list[float] = dataclasses.field(default_factory=list)
    max_diff: float = 0.0
    binding: ort.IOBinding | None = None
    y: np.ndarray | None = None

    def bind(self, tokens: int, hidden: int) -> None:
        """Inputs and the output ``y`` bound once (IO binding, as LayerZero's decode loop runs a model): a run
        times the model, not the conversion of a feeds dict and the allocation of a result array."""
        self.binding = self.session.io_binding()
        for name, array in self.feeds.items():
            self.binding.bind_cpu_input(name, array)
        self.y = np.empty((tokens, hidden), np.float32)
        self.binding.bind_output("y", "cpu", element_type=np.float32, shape=self.y.shape, buffer_ptr=self.y.ctypes.data)

    def run(self) -> np.ndarray:
        self.session.run_with_iobinding(self.binding)
        return self.y

    @property
    def p50(self) -> float:
        return float(np.median(self.times)) * 1e3


def _options(threads: int | None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    # Idle intra-op workers block instead of spinning: each session has its own pool, and a spinning worker of the
    # session that ran last takes a core from the next session and from the copy (E64 1 token, 2 threads:
    # MoE op 7.8 -> 3.9 ms, copy 15.2 -> 20.9 GB/s without spinning; one session per process does not see that).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    ort_library.register_if_built(options)  # the native lowering's custom op
    return options


def _session(model: onnx.ModelProto | ir.Model | Path, threads: int | None) -> ort.InferenceSession:
    if isinstance(model, Path):  # cached (weights inline: ONNX Runtime copies them into its own buffers)
        return ort.InferenceSession(str(model), _options(threads), providers=["CPUExecutionProvider"])
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    return ort.InferenceSession(proto.SerializeToString(), _options(threads), providers=["CPUExecutionProvider"])


@functools.lru_cache(maxsize=1)
def _weights(config: MoEConfig) -> dict[str, np.ndarray]:
    """Layer 0's weights (drawn once per shape: ~1 s per 100 M parameters)."""
    return moe_layer_weights(config, 0)


def _ort_moe_model(config: MoEConfig) -> onnx.ModelProto:
    """Router Gemm + ``com.microsoft.MoE`` with fc1 rows interleaved [gate_0, up_0, ...] (swiglu_fusion=1)."""
    w = _weights(config)
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


def _floor_model(hidden: int) -> onnx.ModelProto:
    """The harness floor: ``y = Identity(hidden)``, run like the variants (same session options, IO binding, same
    rounds). What a run costs before any of the block's work: Python, the ONNX Runtime executor, and on this
    bench's cold caches (every round streams hundreds of MB) their code and data fetched from memory again."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["hidden"], ["y"])],
        "floor",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["tokens", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", hidden])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _load() -> str:
    """The 1-minute load average and the core count, e.g. ``load 3.1/2``."""
    return f"load {os.getloadavg()[0]:.1f}/{os.cpu_count()}"


class _Copy:
    """A large numpy copy (or, ``read=True``, a numpy read: ``np.max``), timed in the same rounds as the sessions:
    bytes moved per second, a copy's read + write counted."""

    def __init__(
        self, megabytes: int = 256, clock=time.perf_counter, buffers: _Copy | None = None, read: bool = False
    ) -> None:
        if buffers is not None:  # the same buffers timed with another clock
            self.src, self.dst = buffers.src, buffers.dst
        else:
            self.src = np.ones(megabytes * (1 << 20) // 4, np.float32)
            self.dst = np.empty_like(self.src)
            np.copyto(self.dst, self.src)  # touch every page first
        self.times: list[float] = []
        self.clock = clock
        self.read = read

    def run(self) -> None:
        t0 = self.clock()
        if self.read:
            self.src.max()
        else:
            np.copyto(self.dst, self.src)
        self.times.append(self.clock() - t0)

    @property
    def bandwidth(self) -> float:
        return (1 if self.read else 2) * self.src.nbytes / float(np.median(self.times))


class _StreamRead:
    """The native kernels' read pattern without their arithmetic (liblayerzero_ort.so's ``LayerZeroOrtStreamRead``:
    each matrix as 4 sequential streams) over the matrices of the experts this input runs, in the bench's copy of
    the weights backed by huge pages as the kernel backs the session's: how fast one core streams the bytes the
    native op reads (one-thread rows; timed in the same rounds, with the row's clock)."""

    _advised: ClassVar[set[int]] = set()  # weights already backed by huge pages

    def __init__(self, config: MoEConfig, hidden: np.ndarray, clock) -> None:
        import ctypes

        lib = ctypes.CDLL(str(ort_library.find_ort_library()))
        self._read = lib.LayerZeroOrtStreamRead
        self._read.restype = ctypes.c_float
        advise = lib.LayerZeroOrtAdviseHugePages
        advise.restype = ctypes.c_size_t
        w = _weights(config)
        matrices = [w["w_gate"], w["w_up"], w["w_down"]]
        for m in matrices:
            if m.ctypes.data not in self._advised:
                advise(ctypes.c_void_p(m.ctypes.data), ctypes.c_size_t(m.nbytes))
                self._advised.add(m.ctypes.data)
        regions = [m[e] for e in _used_experts(config, hidden) for m in matrices]
        self._n = len(regions)
        self._ptrs = (ctypes.c_void_p * self._n)(*[r.ctypes.data for r in regions])
        self._sizes = (ctypes.c_int64 * self._n)(*[r.nbytes for r in regions])
        self.clock = clock
        self.times: list[float] = []

    def run(self) -> None:
        t0 = self.clock()
        self._read(self._ptrs, self._sizes, self._n)
        self.times.append(self.clock() - t0)

    @property
    def p50(self) -> float:
        return float(np.median(self.times)) * 1e3


def _used_experts(config: MoEConfig, hidden: np.ndarray) -> np.ndarray:
    """The indices of the experts the input's tokens run (the union over its tokens)."""
    w = _weights(config)
    logits = hidden @ w["router"].T + w["router_bias"]
    _, mask = moe_routing(logits, top_k=config.top_k, normalize=config.normalize, scoring=config.scoring)
    return np.flatnonzero(mask.any(axis=0))


def _expert_bytes(config: MoEConfig, hidden: np.ndarray) -> tuple[int, int]:
    """(bytes of the experts the input's tokens run, how many experts that is)."""
    used = len(_used_experts(config, hidden))
    return used * 3 * config.hidden * config.ffn * 4, used


def _reference(config: MoEConfig, hidden: np.ndarray) -> np.ndarray:
    w = _weights(config)
    logits = hidden.astype(np.float64) @ w["router"].T.astype(np.float64) + w["router_bias"]
    y, _ = moe_reference(
        hidden.astype(np.float64),
        logits,
        w["w_gate"],
        w["w_up"],
        w["w_down"],
        top_k=config.top_k,
        normalize=config.normalize,
        scoring=config.scoring,
        activation=config.activation,
    )
    return y


def _say(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def _lowered(skipping: onnx.ModelProto, lowering: str) -> ir.Model:
    """The skipping form lowered with ``lowering`` (``LowerMoE``, as the compiler's pipeline does); ``skipping`` is
    only read (its weights are shared by the lowered models)."""
    model = ir.from_proto(skipping)
    result = LowerMoE(lowering=lowering).call(model)
    ops = {(n.domain, n.op_type) for n in model.graph.all_nodes()}
    expected = {"if": ("", "If"), "ort-moe": ("com.microsoft", "MoE"), "native": ("ai.layerzero", "MoE")}[lowering]
    if not result.modified or expected not in ops:
        raise SystemExit(f"{lowering}: LowerMoE did not lower the block that way ({sorted(ops)})")
    return model


def _compiled(batched: onnx.ModelProto, lowering: str) -> ir.Model:
    """``--compile``: the export through ``compile_model`` with verification (minutes per shape)."""
    # Whole-model verification (a few hundred MB here): chunked verification fails on the If lowering's
    # initializers in subgraphs (compiler/chunked.py, "Buffer containing the initializer must be owned").
    options = CompileOptions(moe_lowering=lowering, verify=True, atol=1e-5, rtol=1e-4, chunked_verify_bytes=8 << 30)
    result = compile_model(batched, options)
    if not result.verification.passed:
        raise SystemExit(f"{lowering}: verification failed")
    ops = {(n.domain, n.op_type) for n in result.model.graph}
    assert ("", "GatherND") not in ops, f"{lowering}: the block was not rewritten"
    if lowering == "native":
        assert ("ai.layerzero", "MoE") in ops, "native: the custom op is not in the compiled graph"
    return result.model


def build_models(config: MoEConfig, with_dense: bool, cache: Path, compile_export: bool = False) -> dict[str, Path]:
    """Every variant of ``config`` as an ``.onnx`` file under ``cache`` (built once, reused for every thread count;
    each written as soon as it is built, so that at most a few copies of the weights are in memory)."""
    _say(f"building E={config.experts} k={config.top_k} H={config.hidden} F={config.ffn}")
    t0 = time.perf_counter()
    paths: dict[str, Path] = {}

    def cache_model(name: str, model: onnx.ModelProto | ir.Model) -> None:
        proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
        path = cache / f"E{config.experts}_H{config.hidden}_F{config.ffn}_{name.replace(' ', '_')}.onnx"
        path.write_bytes(proto.SerializeToString())
        paths[name] = path

    batched = build_moe(dataclasses.replace(config, form="batched_mm"))
    cache_model("batched_mm", batched)
    cache_model("MoE op", _ort_moe_model(config))
    if with_dense:
        cache_model("dense", build_moe(dataclasses.replace(config, form="dense")))
    skipping = None if compile_export else build_moe(dataclasses.replace(config, form="skipping"))
    for lowering in ("if", "ort-moe", "native"):
        cache_model(f"LZ {lowering}", _compiled(batched, lowering) if compile_export else _lowered(skipping, lowering))
    _say(f"built and cached in {time.perf_counter() - t0:.1f} s ({_load()})")
    return paths


def run_shape(
    config: MoEConfig,
    models: dict,
    tokens_list: list[int],
    rounds: int,
    threads: int,
    meters: list[_Copy],
    clock: str,
    budget_s: float = 10.0,
) -> list:
    _say(f"timing E={config.experts} at {threads} thread(s) ({_load()})")
    # CPU time only where the work runs in this thread (one intra-op thread); see the module docstring.
    timer = time.thread_time if clock == "thread" and threads == 1 else time.perf_counter
    t0 = time.perf_counter()
    sessions = {name: _session(model, threads) for name, model in models.items()}
    floor_session = _session(_floor_model(config.hidden), threads)
    _say(f"sessions created in {time.perf_counter() - t0:.1f} s")
    names = [n for n in VARIANTS if n in sessions]
    rows = []
    for tokens in tokens_list:
        feeds = moe_feeds(config, tokens, seed=tokens)
        variants = [Variant(name, sessions[name], feeds) for name in names]
        floor = Variant("floor", floor_session, {"hidden": feeds["hidden"]})
        for v in (*variants, floor):
            v.bind(tokens, config.hidden)
        reference = _reference(config, feeds["hidden"])
        scale = max(float(np.abs(reference).max()), 1e-30)
        warm = 0.0
        for v in variants:  # warm up and check each against the float64 reference
            for _ in range(2):
                t0 = time.perf_counter()
                out = v.run()
            warm += time.perf_counter() - t0
            v.max_diff = float(np.abs(out.astype(np.float64) - reference).max()) / scale
        # Rounds within the row's time budget (the slow variants at 64 tokens take ~0.1-1 s a run), at least 7.
        n_rounds = max(MIN_ROUNDS, min(rounds, int(budget_s / max(warm, 1e-9))))
        stream = _StreamRead(config, feeds["hidden"], timer) if threads == 1 else None
        order: list[Variant | _Copy | _StreamRead] = [*variants, floor, *meters, *([stream] if stream else [])]
        for _ in range(n_rounds):
            random.shuffle(order)
            for v in order:
                if not isinstance(v, Variant):
                    v.run()
                    continue
                t0 = timer()
                v.run()
                v.times.append(timer() - t0)
        nbytes, used = _expert_bytes(config, feeds["hidden"])
        for v in (*variants, floor):
            v.session = v.binding = None  # the rows keep the times only: a shape's sessions go before the next
        cpu = timer is time.thread_time
        rows.append((config, threads, tokens, variants, floor, stream, nbytes, used, _load(), cpu))
    del sessions, floor_session
    gc.collect()
    return rows


def print_table(rows: list, meters: dict[str, tuple[_Copy, _Copy]], loads: tuple[str, str]) -> bool:
    print(f"\n{loads[0]} at the start, {loads[1]} at the end (1-minute load average / cores)")
    for clock, (copy, read) in meters.items():
        if copy.times:
            print(
                f"memory bandwidth ({clock} clock, p50 in the same rounds, 256 MB): numpy copy read + write "
                f"{copy.bandwidth / 1e9:.1f} GB/s (the bound), numpy read (np.max) {read.bandwidth / 1e9:.1f} GB/s "
                "(the read bound)"
            )
    isa = _native_isa()
    print(f"liblayerzero_ort.so kernels: {isa}")
    header = (
        f"{'shape':<22} {'thr':>3} {'T':>3} "
        + " ".join(f"{n:>11}" for n in VARIANTS)
        + f" {'floor':>9} {'bound':>9} {'read bnd':>9} {'stream':>9}  {'nat/op':>6} {'nat/bound':>9} "
        f"{'(nat-fl)/b':>10} {'strm/bnd':>8} {'nat/strm':>8} {'nat/read':>8} {'nat/if':>6} "
        f"{'rel err':>8} {'auto':>7}  {'clock':<6} load"
    )
    print(header)
    print("-" * len(header))
    verdicts = []
    for config, threads, tokens, variants, floor, stream, nbytes, used, load, cpu in rows:
        # The bounds in the row's own clock: CPU-timed rows against the CPU-timed copy / read.
        copy, read = meters["thread" if cpu else "wall"]
        bound_ms = nbytes / copy.bandwidth * 1e3
        read_ms = nbytes / read.bandwidth * 1e3
        p50 = {v.name: v.p50 for v in variants}
        native = p50["LZ native"]
        err = next(v.max_diff for v in variants if v.name == "LZ native")
        worst = max(variants, key=lambda v: v.max_diff)
        shape = f"E{config.experts} k{config.top_k} H{config.hidden} F{config.ffn}"
        cells = " ".join(f"{p50[n]:>9.3f}ms" if n in p50 else f"{'-':>11}" for n in VARIANTS)
        # auto's choice without the library (the cost model, the token count known), against what it costs.
        auto = choose_by_cost(BlockShape(config.experts, config.top_k, config.hidden, config.ffn, tokens))
        auto_ms = p50[f"LZ {auto}"]
        print(
            f"{shape:<22} {threads:>3} {tokens:>3} {cells} {floor.p50:>7.3f}ms {bound_ms:>7.3f}ms {read_ms:>7.3f}ms "
            + (f"{stream.p50:>7.3f}ms  " if stream else f"{'-':>9}  ")
            + f"{native / p50['MoE op']:>6.2f} {native / bound_ms:>9.2f} {(native - floor.p50) / bound_ms:>10.2f} "
            + (f"{stream.p50 / bound_ms:>8.2f} {native / stream.p50:>8.2f} " if stream else f"{'-':>8} {'-':>8} ")
            + f"{native / read_ms:>8.2f} "
            f"{native / p50['LZ if']:>6.2f} {err:>8.1e} {auto:>7}  {'thread' if cpu else 'wall':<6} "
            f"{load.removeprefix('load ')}"
        )
        checks = [
            ("native ≤ batched_mm export", native <= p50["batched_mm"]),
            (f"rel err ≤ {TARGET_RELATIVE:g}", err <= TARGET_RELATIVE),
            # The lowerings are built, not compiled with verification: every variant is checked here instead.
            (
                f"every variant's rel err ≤ {VARIANT_RELATIVE:g} (worst: {worst.name})",
                worst.max_diff <= VARIANT_RELATIVE,
            ),
        ]
        key = (config.experts, config.top_k, config.hidden, config.ffn)
        if tokens == 1 and key in TARGET_SHAPES:
            checks += [
                (f"native ≤ {TARGET_VS_BOUND} × bound ({used} experts)", native <= TARGET_VS_BOUND * bound_ms),
                (f"native ≤ {TARGET_VS_OP} × MoE op", native <= TARGET_VS_OP * p50["MoE op"]),
            ]
        if tokens in (16, 64):
            checks.append(("native ≤ min(LZ if, MoE op)", native <= min(p50["LZ if"], p50["MoE op"])))
        checks.append((f"auto without the library ({auto}) ≤ batched_mm export", auto_ms <= p50["batched_mm"]))
        verdicts.append((f"{shape}, {threads} thread(s), {tokens} token(s)", checks))
    print()
    all_met = True
    for what, checks in verdicts:
        all_met &= all(ok for _, ok in checks)
        print(f"{what}: " + ", ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks))
    print(f"\nall targets met: {'yes' if all_met else 'NO'}")
    return all_met


def _native_isa() -> str:
    import ctypes

    path = ort_library.find_ort_library()
    if path is None:
        return "not built"
    fn = ctypes.CDLL(str(path)).LayerZeroOrtIsa
    fn.restype = ctypes.c_char_p
    return fn().decode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="E128 k8 H512 F256 only, fewer rounds")
    p.add_argument("--e8", action="store_true", help="the E8 k2 shapes (H1024 F4096, H256 F1024) with dense")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds at most (default 30, --quick 12)")
    p.add_argument(
        "--budget",
        type=float,
        default=10.0,
        help=f"seconds of timing per row: fewer rounds (at least {MIN_ROUNDS}) where the variants are slow",
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, os.cpu_count() or 1],
        help="ORT intra-op threads, one run each (default: 1 and all cores)",
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--experts", type=int, nargs="+", default=None, help="only the shapes with these expert counts")
    p.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: one-thread rows and the copy in CPU time (a loaded machine); other rows stay wall-clock",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="build the LZ variants with compile_model (verified) from the export instead of LowerMoE directly (slow)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    random.seed(0)
    if ort_library.find_ort_library() is None:
        print(
            f"{ort_library.ORT_LIBRARY} is not built: run `layerzero plugins build --only ort` first", file=sys.stderr
        )
        return 2
    rounds = args.rounds or (12 if args.quick else 30)
    if args.e8:
        shapes = [
            MoEConfig(hidden=1024, ffn=4096, experts=8, top_k=2),
            MoEConfig(hidden=256, ffn=1024, experts=8, top_k=2),
        ]
    elif args.quick:
        shapes = [MoEConfig(hidden=512, ffn=256, experts=128, top_k=8)]
    else:
        shapes = [
            MoEConfig(hidden=1024, ffn=512, experts=64, top_k=8),
            MoEConfig(hidden=512, ffn=256, experts=128, top_k=8),
            MoEConfig(hidden=512, ffn=256, experts=256, top_k=8),
        ]
    if args.experts:
        shapes = [c for c in shapes if c.experts in args.experts]
    copy = _Copy()
    meters = {"wall": (copy, _Copy(buffers=copy, read=True))}
    if args.clock == "thread":
        meters["thread"] = tuple(_Copy(clock=time.thread_time, buffers=copy, read=read) for read in (False, True))
    start, t0 = _load(), time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="layerzero-bench-moe-") as tmp:
        for config in shapes:
            models = build_models(config, with_dense=args.e8, cache=Path(tmp), compile_export=args.compile)
            for threads in dict.fromkeys(args.threads):
                clock = "thread" if args.clock == "thread" and threads == 1 else "wall"
                rows += run_shape(
                    config, models, args.tokens, rounds, threads, list(meters[clock]), args.clock, args.budget
                )
            for path in models.values():
                with contextlib.suppress(OSError):
                    path.unlink()
            gc.collect()
    met = print_table(rows, meters, (start, _load()))
    print(f"run time {time.perf_counter() - t0:.0f} s")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
