"""Fuzzing the weight passes: random decoder-like projection graphs through ``--weights`` / ``--linear-kernel`` /
``--activation-sparsity``, each compiled with verification on.

The differential fuzzer (``generator.py``) builds graphs of dims 2-5: no MatMul there has a K the quantization's
block divides, so the quantization, the native kernels and activation sparsity never run on it. These graphs do:
one to three layers of projections named as exporters name them (``/model/layers.<i>/mlp/up_proj/MatMul``), with
K and N multiples of 32 and not, and the shapes users' models give those passes. Kinds of layer (``KINDS``):

- ``mlp``: gate / up (one group) through SiLU, down, a residual Add; ``qkv``: q / k / v of one input (biases
  sometimes), concatenated, o; ``gemm``: ``Gemm`` with ``transB`` 0 / 1, ``alpha`` / ``beta`` 1 or not, a bias or
  none (a reshape around it for rank > 2); ``shared``: one weight read by two MatMuls; ``fp16``: a float16 weight
  between Casts; ``transposed``: the weight a ``Transpose`` of a constant; ``graph_input``: the weight also a graph
  input (a feed may override it: stays float); ``batched``: a 3-D weight; ``tied``: an embedding table a ``Gather``
  reads and a ``MatMul`` through its ``Transpose`` (a tied lm_head); ``output``: a projection whose output is a graph
  output and the next layer's input; ``qdq``: an int8 ``DequantizeLinear`` weight (per tensor or per column);
  ``k48``: a K of 48 (no block divides it); ``zero``: an all-zero weight (static zeroing removes it); ``two_layers``:
  one value read by projections of two layers; ``flag``: a layer behind a zero ``model.layers.<i>.mlp.flag``;
  ``branches``: an ``If`` whose branches hold a projection each (subgraph weights); ``gemm_bias_row``: a rank-2
  ``Gemm`` whose bias is ``[1, N]``.

A case (``check``) compiles a graph with each option set of ``OPTIONS`` (verification on: the compile's own
oracle, the quantized-dense reference and, for activation sparsity, ``max_deviation`` wide open) and passes when
every compile either succeeds, its model runs in ONNX Runtime (with ``liblayerzero_ort.so``) on a second input
size and a second compile of it succeeds or refuses in one known line, or refuses in one of the lines of
``EXPECTED_REFUSALS``. Anything else (an exception, a verification failure, an unexpected refusal, a model that
does not run) is a failure, reported with the seed and the option set.

    python -m tests.fuzz.projections --cases 300 [--start 0]    # the long run (about 1 s a case)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

__all__ = [
    "EXPECTED_REFUSALS",
    "KINDS",
    "OPTIONS",
    "QUANTIZED_OPTIONS",
    "check",
    "generate",
    "main",
    "ort_quantized",
    "refused",
    "run_seeds",
]

KINDS = ("mlp", "qkv", "gemm", "shared", "fp16", "transposed", "graph_input", "batched", "tied", "output", "qdq",
         "k48", "zero", "two_layers", "flag", "branches", "gemm_bias_row")  # fmt: skip
_WIDE = 1e9  # max_deviation with activation sparsity: its deviation is on purpose, reported not refused
OPTIONS: tuple[dict, ...] = (
    {"weights": "int4"},
    {"weights": "int8"},
    {"weights": "int4", "linear_kernel": "native"},
    {"weights": "int8", "linear_kernel": "native"},
    {"weights": "int4", "quant_symmetric": False},
    {"weights": "int4", "quant_block": 16},
    {"activation_sparsity": 0.3, "max_deviation": _WIDE},
    {"weights": "int4", "activation_sparsity": 0.3, "max_deviation": _WIDE},
    {"weights": "int4", "linear_kernel": "native", "activation_sparsity": 0.3, "max_deviation": _WIDE},
    {"weights": "int8", "activation_sparsity": 0.5, "max_deviation": _WIDE},
)
#: The refusals a valid graph may get (substrings): a graph without a projection group inside a layer; a second
#: compile of a model that holds LayerZero's own inputs / records (activation sparsity adds them).
EXPECTED_REFUSALS = (
    "so nothing to sparsify",
    "the input rank of every projection group is unknown",
    "which LayerZero reserves for the inputs and outputs it adds",
    "is where LayerZero records its dynamic paths",
)
VOCAB = 32


class _Graph:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[str] = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def const(self, array: np.ndarray, name: str | None = None) -> str:
        name = name or self.name("w")
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def weight(self, k: int, n: int, scale: float = 0.2, dtype: type = np.float32) -> str:
        return self.const((self.rng.standard_normal((k, n)) * scale).astype(dtype))

    def op(self, op: str, inputs: list[str], path: str, **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(oh.make_node(op, inputs, [out], name=path, **attrs))
        return out


def generate(seed: int) -> onnx.ModelProto:
    """A random projection graph for ``seed`` (deterministic)."""
    rng = np.random.default_rng(seed)
    g = _Graph(rng)
    opset = int(rng.choice([17, 18, 19, 21]))
    width = int(rng.choice([32, 64, 96]))
    rank = int(rng.choice([2, 3, 3, 4]))
    g.inputs.append(
        oh.make_tensor_value_info("x", TensorProto.FLOAT, {2: ["T"], 3: ["B", "T"], 4: ["B", 2, "T"]}[rank] + [width])
    )
    cur = "x"
    for layer in range(int(rng.integers(1, 4))):
        cur, width = _layer(g, layer, cur, width, rank, opset)
    g.outputs.insert(0, cur)
    outputs = [oh.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in g.outputs]
    graph = oh.make_graph(g.nodes, "projections", g.inputs, outputs, g.inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)], ir_version=8)
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {v.name: v for v in [*inferred.graph.output, *inferred.graph.value_info, *inferred.graph.input]}
    for out in model.graph.output:  # the outputs' types (a checker wants their shapes): as onnx infers them
        found = known.get(out.name)
        if found is None or not found.type.tensor_type.HasField("shape"):
            raise AssertionError(f"seed {seed}: onnx infers no shape for output {out.name}")
        out.type.CopyFrom(found.type)
    return model


def _layer(g: _Graph, layer: int, cur: str, width: int, rank: int, opset: int) -> tuple[str, int]:
    rng = g.rng
    scope = f"/model/layers.{layer}"
    if rng.random() < 0.5:  # a norm-like op first
        gamma = g.const(rng.standard_normal(width).astype(np.float32))
        if rng.random() < 0.5:
            cur = g.op("LayerNormalization", [cur, gamma], f"{scope}/norm/LayerNormalization", axis=-1)
        else:
            cur = g.op("Mul", [cur, gamma], f"{scope}/norm/Mul")
    kind = str(rng.choice(KINDS))
    n = int(rng.choice([16, 32, 40, 64, 96]))
    if kind == "mlp":
        f = int(rng.choice([32, 64, 128]))
        gate = g.op("MatMul", [cur, g.weight(width, f)], f"{scope}/mlp/gate_proj/MatMul")
        up = g.op("MatMul", [cur, g.weight(width, f)], f"{scope}/mlp/up_proj/MatMul")
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{scope}/mlp/act/Sigmoid")], f"{scope}/mlp/act/Mul")
        down = g.op("MatMul", [g.op("Mul", [act, up], f"{scope}/mlp/Mul"), g.weight(f, width)],
                    f"{scope}/mlp/down_proj/MatMul")  # fmt: skip
        return g.op("Add", [cur, down], f"{scope}/Add"), width
    if kind == "qkv":
        parts = []
        for proj in ("q_proj", "k_proj", "v_proj"):
            out = g.op("MatMul", [cur, g.weight(width, n)], f"{scope}/self_attn/{proj}/MatMul")
            if rng.random() < 0.4:
                out = g.op(
                    "Add", [out, g.const(rng.standard_normal(n).astype(np.float32))], f"{scope}/self_attn/{proj}/Add"
                )
            parts.append(out)
        cat = g.op("Concat", parts, f"{scope}/self_attn/Concat", axis=-1)
        o = g.op("MatMul", [cat, g.weight(3 * n, width, 0.1)], f"{scope}/self_attn/o_proj/MatMul")
        return g.op("Add", [cur, o], f"{scope}/Add"), width
    if kind == "gemm":
        flat = (
            cur if rank == 2 else g.op("Reshape", [cur, g.const(np.array([-1, width], np.int64))], f"{scope}/Reshape")
        )
        trans = int(rng.integers(0, 2))
        w = (rng.standard_normal((width, width)) * 0.2).astype(np.float32)
        inputs = [flat, g.const(w.T.copy() if trans else w)]
        if rng.random() < 0.6:
            inputs.append(g.const(rng.standard_normal(width).astype(np.float32)))
        out = g.op("Gemm", inputs, f"{scope}/mlp/fc/Gemm", transB=trans, alpha=float(rng.choice([1.0, 1.0, 0.5])),
                   beta=float(rng.choice([1.0, 1.0, 2.0])))  # fmt: skip
        if rank != 2:
            out = g.op("Reshape", [out, g.op("Shape", [cur], f"{scope}/Shape")], f"{scope}/Reshape2")
        return out, width
    if kind == "shared":
        w = g.weight(width, width)
        up = g.op("Relu", [g.op("MatMul", [cur, w], f"{scope}/mlp/up_proj/MatMul")], f"{scope}/mlp/Relu")
        return g.op("MatMul", [up, w], f"{scope}/mlp/down_proj/MatMul"), width
    if kind == "fp16":
        half = g.op("Cast", [cur], f"{scope}/mlp/Cast", to=TensorProto.FLOAT16)
        out = g.op("MatMul", [half, g.weight(width, n, dtype=np.float16)], f"{scope}/mlp/up_proj/MatMul")
        return g.op("Cast", [out], f"{scope}/mlp/Cast2", to=TensorProto.FLOAT), n
    if kind == "transposed":
        t = g.op("Transpose", [g.weight(n, width)], f"{scope}/mlp/Transpose", perm=[1, 0])
        return g.op("MatMul", [cur, t], f"{scope}/mlp/up_proj/MatMul"), n
    if kind == "graph_input":
        w = g.weight(width, n)
        g.inputs.append(oh.make_tensor_value_info(w, TensorProto.FLOAT, [width, n]))
        return g.op("MatMul", [cur, w], f"{scope}/mlp/up_proj/MatMul"), n
    if kind == "batched" and rank == 3:
        w = g.const((rng.standard_normal((1, width, n)) * 0.2).astype(np.float32))
        return g.op("MatMul", [cur, w], f"{scope}/mlp/up_proj/MatMul"), n
    if kind == "tied":
        table = g.weight(VOCAB, width)
        ids = f"ids{layer}"
        g.inputs.append(oh.make_tensor_value_info(ids, TensorProto.INT64, ["B", "T"]))
        emb = g.op("Gather", [table, ids], f"{scope}/embed/Gather")
        t = g.op("Transpose", [table], f"{scope}/lm/Transpose", perm=[1, 0])
        g.outputs.append(g.op("MatMul", [emb, t], f"{scope}/lm_head/MatMul"))
        return cur, width
    if kind == "output":
        out = g.op("MatMul", [cur, g.weight(width, n)], f"{scope}/mlp/up_proj/MatMul")
        g.outputs.append(out)
        return out, n
    if kind == "qdq":
        codes = g.const(rng.integers(-127, 128, size=(width, n)).astype(np.int8))
        per_column = rng.random() < 0.5
        scale = g.const(np.full(n, 0.01, np.float32) if per_column else np.float32(0.01))
        w = g.op("DequantizeLinear", [codes, scale], f"{scope}/mlp/up_proj/DequantizeLinear",
                 **({"axis": 1} if per_column else {}))  # fmt: skip
        return g.op("MatMul", [cur, w], f"{scope}/mlp/up_proj/MatMul"), n
    if kind == "k48":
        mid = g.op("MatMul", [cur, g.weight(width, 48)], f"{scope}/mlp/up_proj/MatMul")
        return g.op("MatMul", [mid, g.weight(48, n)], f"{scope}/mlp/down_proj/MatMul"), n
    if kind == "zero":
        out = g.op("MatMul", [cur, g.const(np.zeros((width, width), np.float32))], f"{scope}/mlp/up_proj/MatMul")
        return g.op("Add", [cur, out], f"{scope}/Add"), width
    if kind == "two_layers":
        a = g.op("MatMul", [cur, g.weight(width, n)], f"{scope}/mlp/up_proj/MatMul")
        b = g.op("MatMul", [cur, g.weight(width, n)], f"/model/layers.{layer + 7}/mlp/up_proj/MatMul")
        return g.op("Add", [a, b], f"{scope}/Add"), n
    if kind == "flag":
        flag = g.const(np.float32(0.0), f"model.layers.{layer}.mlp.flag")
        out = g.op("MatMul", [cur, g.weight(width, width)], f"{scope}/mlp/up_proj/MatMul")
        return g.op("Add", [cur, g.op("Mul", [out, flag], f"{scope}/mlp/Mul")], f"{scope}/Add"), width
    if kind == "branches":
        total = g.op("ReduceSum", [cur], f"{scope}/ReduceSum", keepdims=0)
        cond = g.op("Greater", [total, g.const(np.float32(0.0))], f"{scope}/Greater")
        branches = []
        for side in ("then", "else"):
            out = g.name(side)
            body = oh.make_node("MatMul", [cur, g.weight(width, n)], [out], name=f"{scope}/mlp/{side}_proj/MatMul")
            branches.append(oh.make_graph([body], side, [], [oh.make_tensor_value_info(out, TensorProto.FLOAT, None)]))
        out = g.op("If", [cond], f"{scope}/If", then_branch=branches[0], else_branch=branches[1])
        return out, n
    if kind == "gemm_bias_row" and rank == 2:
        bias = g.const(rng.standard_normal((1, n)).astype(np.float32))
        return g.op("Gemm", [cur, g.weight(width, n), bias], f"{scope}/mlp/fc/Gemm"), n
    return cur, width  # batched / gemm_bias_row at another rank: no layer


def feeds(model: onnx.ModelProto, seed: int, size: int) -> dict[str, np.ndarray]:
    """Seeded inputs, every symbolic dim ``size`` (ids below the vocabulary)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    out = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else size for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == TensorProto.INT64:
            out[value.name] = rng.integers(0, VOCAB, size=dims).astype(np.int64)
        else:
            out[value.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def _session(model: onnx.ModelProto, library: str | None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    if library is not None:
        options.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def refused(exc: Exception, refusals: tuple[str, ...] = EXPECTED_REFUSALS) -> bool:
    """Whether ``exc`` is a one-line refusal naming one of ``refusals`` (substrings)."""
    from layerzero.errors import InvalidInputError

    return isinstance(exc, InvalidInputError) and any(r in str(exc) for r in refusals)


def _where(exc: Exception) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    last = tb[-1] if tb else None
    at = f" ({Path(last.filename).name}:{last.lineno})" if last is not None else ""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}{at}"


#: The option sets a graph ONNX Runtime's quantizer made (``ort_quantized``) is compiled with.
QUANTIZED_OPTIONS: tuple[dict, ...] = (
    {},
    {"activation_sparsity": 0.3, "max_deviation": _WIDE},
    {"weights": "int4", "linear_kernel": "native"},
)


def ort_quantized(model: onnx.ModelProto, seed: int) -> onnx.ModelProto | None:
    """``model`` through ONNX Runtime's own int4 quantizer (``matmul_nbits_quantizer``, block 32; symmetric or not
    and MatMulNBits or DequantizeLinear by ``seed``), without value_info as it writes it; None where the quantizer
    fails or writes an invalid model (its own faults: a weight two MatMuls share, say)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as nbits

    rng = np.random.default_rng(seed + 1_000_003)
    fmt = nbits.QuantFormat.QOperator if rng.random() < 0.5 else nbits.QuantFormat.QDQ
    config = nbits.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=bool(rng.random() < 0.5),
                                                accuracy_level=4, quant_format=fmt)  # fmt: skip
    try:
        quantizer = nbits.MatMulNBitsQuantizer(
            onnx.ModelProto.FromString(model.SerializeToString()), algo_config=config
        )
        quantizer.process()
        out = quantizer.model.model
        onnx.checker.check_model(out)
        _session(out, None).run(None, feeds(model, seed, 3))
    except Exception:
        return None
    return out


def check(seed: int, library: str | None, options: tuple[dict, ...] = OPTIONS, quantized: bool = True) -> list[str]:
    """The failures of case ``seed`` (``[]``: it passed); ``library``: liblayerzero_ort.so (None: the option sets
    that need it are skipped). ``quantized``: also the graph as ONNX Runtime's quantizer writes it
    (``ort_quantized``), compiled with ``QUANTIZED_OPTIONS``."""
    model = generate(seed)
    try:
        onnx.checker.check_model(model, full_check=True)
        _session(model, None).run(None, feeds(model, seed, 3))
    except Exception as exc:  # the generator's own fault: never expected
        return [f"seed {seed}: the generated graph is invalid: {_where(exc)}"]
    failures = _compiles(model, f"seed {seed}", seed, library, options)
    if quantized:
        q = ort_quantized(model, seed)
        if q is not None:
            failures += _compiles(q, f"seed {seed} (ONNX Runtime's int4)", seed, library, QUANTIZED_OPTIONS)
    return failures


def _compiles(
    model: onnx.ModelProto, case: str, seed: int, library: str | None, options: tuple[dict, ...]
) -> list[str]:
    import onnx_ir as ir

    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions

    failures = []
    for k, opts in enumerate(options):
        if library is None and opts.get("linear_kernel") == "native":
            continue
        label = f"{case}, options {k} {opts}"
        try:
            result = compile_model(model, CompileOptions(**opts))
        except Exception as exc:
            if not refused(exc):
                failures.append(f"{label}: {_where(exc)}")
            continue
        compiled = ir.to_proto(result.model)
        try:
            session = _session(compiled, library)
            for size in (1, 5):
                session.run([o.name for o in model.graph.output], feeds(model, seed + size, size))
        except Exception as exc:
            failures.append(f"{label}: the compiled model does not run: {_where(exc)}")
            continue
        try:
            compile_model(compiled, CompileOptions(**opts))
        except Exception as exc:
            if not refused(exc):
                failures.append(f"{label}: a second compile: {_where(exc)}")
    return failures


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """While inside, the compile's and ONNX Runtime's info logs and warnings are off (a case compiles ten times);
    the levels and filters come back on exit (a test process's later tests read the logs)."""
    loggers = [logging.getLogger(name) for name in ("", "layerzero", "onnx_ir", "onnxruntime")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--start", type=int, default=0)
    args = ap.parse_args(argv)
    with quiet():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    return run_seeds(check, args.start, args.cases, f"{len(OPTIONS)} option sets")


def run_seeds(check_case: Callable[[int, str | None], list[str]], start: int, cases: int, what: str) -> int:
    """A fuzzer's long run: ``check_case(seed, library)`` for ``cases`` seeds from ``start`` (``library``:
    liblayerzero_ort.so, None where it is not built), each failure printed as it comes; 1 when any failed."""
    from layerzero.plugins.ort_library import find_ort_library

    library = find_ort_library()
    if library is None:
        print("liblayerzero_ort.so is not built (layerzero plugins build): the native option sets are skipped")
    started = time.perf_counter()
    failed = 0
    for seed in range(start, start + cases):
        for line in check_case(seed, None if library is None else str(library)):
            failed += 1
            print(line, flush=True)
    print(f"{cases} cases x {what} in {time.perf_counter() - started:.0f} s: {failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
