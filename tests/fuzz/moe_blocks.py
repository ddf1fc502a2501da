"""Fuzzing the MoE passes: random mixture-of-experts blocks through the skipping rewrite, every lowering,
``--weights``, ``--zeroing-threshold``, solidify and ``--activation-sparsity``, each compile verified.

The decoder fuzzer (``decoders.py --moe``) draws nine Hugging Face families, whose exports all take one block form
(``batched_mm``). These blocks are built directly (``layerzero.models.moe``) in every form the rewrite matches —
``batched_mm``, ``dense`` (routing matrix by ``ScatterElements`` into zeros of ``Shape(logits)`` or of the rows of
``x``, or by ``OneHot``; combined by ``Einsum`` or ``Mul`` / ``ReduceSum``; gate / up fused or not) and
``unrolled`` — with 2-8 experts, top 1 to all, softmax or sigmoid scores, normalized or not, SiLU / GELU / ReLU,
hidden and expert sizes that are and are not multiples of the quantization's block, 1-2 layers (residual or
chained), experts no token ever picks, a router that is sharp or flat, expert biases (dense and unrolled), and a
float projection before the first block (so activation sparsity has a dense group beside the experts). Every
fourth seed is instead a ``com.microsoft::QMoE`` node as ONNX Runtime GenAI writes it (``build_qmoe``): 4 / 8 bits,
blocks of 16-128 or one scale a row, accuracy level 0 / 4, zero points or not, float16 / float32 scales, biases,
GPT-OSS's clamped SwiGLU, routing weights normalised or not, the router in the graph or the logits an input; it
must be rewritten exactly where ``Case.rewritten`` says (passes/_moe/qmoe.py's contract) and equal QMoE's output.

A case (``check``) compiles a block with each option set of ``OPTIONS`` (and, where the block has experts no token
picks, one that solidifies them away) and passes when every compile succeeds or refuses in a line of
``EXPECTED_REFUSALS``; every block is rewritten (one dynamic path per layer); the compiled model runs in ONNX
Runtime (with ``liblayerzero_ort.so``) at 1 and 5 tokens and, for the option sets that keep the function
(``exact``), equals the original there; and a second compile of it succeeds or refuses in a known line.

    python -m tests.fuzz.moe_blocks --cases 200 [--start 0]    # the long run
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper as oh
from onnx import numpy_helper

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.fuzz.projections import _session, _where, quiet, refused, run_seeds  # noqa: E402

__all__ = ["EXPECTED_REFUSALS", "OPTIONS", "Case", "check", "exact", "generate", "main"]

_WIDE = 1e9  # deviations on purpose (a zeroing threshold, activation sparsity): reported, not refused
OPTIONS: tuple[dict, ...] = (
    {"moe_lowering": "if"},
    {"moe_lowering": "ort-moe"},
    {"moe_lowering": "native"},
    {"dynamic": False},
    {"weights": "int4"},
    {"weights": "int8"},
    {"weights": "int4", "moe_lowering": "ort-moe"},
    {"weights": "int8", "moe_lowering": "if"},
    {"weights": "int8", "moe_lowering": "ort-moe"},
    {"zeroing_threshold": 0.3, "max_deviation": _WIDE},
    {"zeroing_threshold": 0.3, "moe_lowering": "if", "max_deviation": _WIDE},
    {"activation_sparsity": 0.3, "max_deviation": _WIDE},
    {"activation_sparsity": 0.5, "moe_lowering": "if", "max_deviation": _WIDE},
    {"weights": "int4", "activation_sparsity": 0.3, "max_deviation": _WIDE},
)
#: The refusals a valid block may get (substrings): experts whose hidden or expert size the quantization's block
#: does not divide (quantized whole or not at all); activation sparsity with quantized experts and no dense
#: projection (quantized experts stay dense); a second compile of a model holding LayerZero's own records.
EXPECTED_REFUSALS = (
    "its experts cannot be quantized",
    "quantized experts keep the dense kernel",
    "which LayerZero reserves for the inputs and outputs it adds",
    "is where LayerZero records its dynamic paths",
)
#: And a QMoE case (no float projection): activation sparsity finds no float group where the node is left or
#: becomes quantized experts (never where it becomes float experts: ``Case.float_experts``).
_QMOE_REFUSAL = "so nothing to sparsify"
ATOL, RTOL = 1e-4, 1e-3


def exact(options: dict) -> bool:
    """Whether a compile with ``options`` computes the original function (float weights, nothing skipped that a
    token uses: solidify removes only experts no token picks): compared with the original at 1 and 5 tokens."""
    return not ({"weights", "zeroing_threshold", "activation_sparsity"} & options.keys())


@dataclasses.dataclass(frozen=True)
class Case:
    """A drawn block: the builder's config and what the fuzzer adds around it, or a QMoE node's ``build_qmoe``
    arguments (``qmoe``; ``config`` None)."""

    config: object  # layerzero.models.moe.MoEConfig, or None for a QMoE case
    biases: bool = False
    projection: bool = False  # a float [H, H] projection (its own layer scope) before the first block
    qmoe: dict = dataclasses.field(default_factory=dict)

    @property
    def paths(self) -> list[str]:
        """The blocks' paths (one dynamic path each once rewritten)."""
        return ["layers.0.moe"] if self.config is None else [self.config.path(i) for i in range(self.config.layers)]

    @property
    def float_experts(self) -> bool:
        """A QMoE case whose node becomes float experts whatever the options (4 bits below accuracy level 4, or one
        scale a row; normalised routing): a float group for activation sparsity, which must not then refuse."""
        q = self.qmoe
        return bool(q) and q["normalize"] and (q["block"] is None or (q["bits"] == 4 and q["accuracy"] < 4))

    def rewritten(self, options: dict, library: str | None) -> bool:
        """Whether a compile with ``options`` rewrites every block (passes/_moe/qmoe.py's contract for QMoE: float
        experts where QMoE keeps float activations; quantized experts where it quantizes them to int8 per block of
        32 as the native kernels do, the format converts exactly (K's of multiples of 32, the default zero point,
        float16 scales) and the lowering is the native kernel's; never with ``normalize_routing_weights=0``; else
        the node is left with a refusal)."""
        q = self.qmoe
        if self.config is not None:
            return True
        if not q["normalize"]:
            return False
        block, bits = q["block"], q["bits"]
        if block is None or (bits == 4 and q["accuracy"] < 4):
            return True
        native = library is not None and options.get("moe_lowering", "auto") in ("auto", "native")
        exact = block == 32 and q["hidden"] % 32 == 0 and q["ffn"] % 32 == 0
        return native and exact and not q["zero_points"] and q["scale_dtype"] is np.float16


def _draw_qmoe(seed: int) -> Case:
    rng = np.random.default_rng(seed)

    def pick(values):
        return values[int(rng.integers(len(values)))]

    experts = int(rng.integers(2, 9))
    hidden, ffn = pick((32, 64, 96, 128)), pick((32, 48, 64, 128))
    blocks = [b for b in (16, 32, 64, 128) if hidden % b == 0 and ffn % b == 0] + [None]
    kwargs = dict(experts=experts, hidden=hidden, ffn=ffn, top_k=int(rng.integers(1, min(3, experts) + 1)),
                  bits=pick((4, 8)), block=pick(blocks), accuracy=pick((0, 4)),
                  activation="swiglu", normalize=bool(rng.random() < 0.7),
                  biases=bool(rng.random() < 0.3), oai=bool(rng.random() < 0.2),
                  zero_points=bool(rng.random() < 0.25), scale_dtype=pick((np.float16, np.float16, np.float32)),
                  router=bool(rng.random() < 0.5), seed=seed)  # fmt: skip
    return Case(None, qmoe=kwargs)


def draw(seed: int) -> Case:
    """The case of ``seed`` (deterministic): a QMoE node for every fourth seed, else a ``build_moe`` block."""
    from layerzero.models.moe import MoEConfig

    if seed % 4 == 3:
        return _draw_qmoe(seed)
    rng = np.random.default_rng(seed)

    def pick(values):
        return values[int(rng.integers(len(values)))]

    experts = int(rng.integers(2, 9))
    form = pick(("batched_mm", "dense", "unrolled"))
    never = tuple(int(e) for e in rng.choice(experts, size=int(rng.integers(0, min(3, experts))), replace=False))
    top_k = int(rng.integers(1, min(3, experts - len(never)) + 1))
    layers = int(rng.integers(1, 3))
    config = MoEConfig(
        hidden=pick((32, 48, 64, 96)),
        ffn=pick((32, 40, 64, 128)),
        experts=experts,
        top_k=top_k,
        layers=layers,
        residual=bool(rng.random() < 0.5),
        normalize=bool(rng.random() < 0.6),
        scoring=pick(("softmax", "softmax", "sigmoid")),
        activation=pick(("silu", "silu", "gelu", "relu")),
        form=form,
        routing=pick(("scatter", "scatter-rows", "onehot")),
        combine=pick(("einsum", "sum")),
        fused_gate_up=bool(rng.random() < 0.4),
        never_routed=never,
        router_std=pick((0.3, 1.0, 4.0)),
        seed=seed,
        opset=pick((17, 18, 20)),
    )
    return Case(config, biases=form != "batched_mm" and bool(rng.random() < 0.3),
                projection=bool(rng.random() < 0.5))  # fmt: skip


def generate(seed: int) -> tuple[Case, onnx.ModelProto]:
    """The case of ``seed`` and its ONNX model (``hidden [T, H]`` → ``y [T, H]``)."""
    from layerzero.models.moe import build_moe, build_qmoe, with_expert_biases

    case = draw(seed)
    if case.config is None:
        return case, build_qmoe(**case.qmoe)
    proto = build_moe(case.config)
    if case.biases:
        proto = with_expert_biases(proto, seed + 7, std=0.3)
    if case.projection:
        proto = _with_projection(proto, seed)
    return case, proto


def _with_projection(proto: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """A float projection ``/layers.0/self_attn/o_proj/MatMul`` (``[H, H]``, a dense group for activation
    sparsity) between the input and the first block."""
    rng = np.random.default_rng(seed + 11)
    x = proto.graph.input[0].name
    hidden = proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    projected = "/layers.0/self_attn/o_proj/MatMul_output_0"
    for node in proto.graph.node:
        node.input[:] = [projected if name == x else name for name in node.input]
    weight = (rng.standard_normal((hidden, hidden)) * hidden**-0.5).astype(np.float32)
    proto.graph.initializer.append(numpy_helper.from_array(weight, "layers.0.self_attn.o_proj.weight"))
    name = "/layers.0/self_attn/o_proj/MatMul"
    matmul = oh.make_node("MatMul", [x, "layers.0.self_attn.o_proj.weight"], [projected], name=name)
    proto.graph.node.insert(0, matmul)
    return proto


def feeds(case: Case, tokens: int, seed: int) -> dict[str, np.ndarray]:
    from layerzero.models.moe import moe_feeds

    if case.config is not None:
        return moe_feeds(case.config, tokens, seed)
    rng = np.random.default_rng(seed)
    out = {"x": rng.standard_normal((tokens, case.qmoe["hidden"]), dtype=np.float32)}
    if not case.qmoe["router"]:
        out["logits"] = rng.standard_normal((tokens, case.qmoe["experts"]), dtype=np.float32)
    return out


def option_sets(case: Case) -> list[dict]:
    """``OPTIONS``, and where the block has experts no token picks, solidify them (the function is unchanged)."""
    sets = list(OPTIONS)
    if case.config is not None and case.config.never_routed:
        subpaths = tuple(f"{case.config.path(layer)}.experts.{e}" for layer in range(case.config.layers)
                         for e in sorted(set(case.config.never_routed)))  # fmt: skip
        sets.append({"solidify": subpaths})
    return sets


def check(seed: int, library: str | None, options: tuple[dict, ...] | None = None) -> list[str]:
    """The failures of case ``seed`` (``[]``: it passed); ``library``: liblayerzero_ort.so (None: the option sets
    that need it — the native lowering, and int4 / int8 with the default lowering, which picks it — are skipped)."""
    import onnx_ir as ir

    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions
    from layerzero.passes._dynamic import read_dynamic_paths

    case, model = generate(seed)
    label = f"seed {seed} ({_describe(case)})"
    try:
        onnx.checker.check_model(model, full_check=True)
        reference = _session(model, None)
        expected = {t: reference.run(["y"], feeds(case, t, seed + t))[0] for t in (1, 5)}
    except Exception as exc:  # the generator's own fault: never expected
        return [f"{label}: the generated block is invalid: {_where(exc)}"]
    failures = []
    sets = option_sets(case) if options is None else list(options)
    for k, opts in enumerate(sets):
        if library is None and (opts.get("moe_lowering") == "native" or
                                ("weights" in opts and opts.get("moe_lowering", "auto") == "auto")):  # fmt: skip
            continue
        where = f"{label}, options {k} {opts}"
        try:
            result = compile_model(model, CompileOptions(**opts))
        except Exception as exc:
            qmoe_refusal = case.config is None and not case.float_experts and _QMOE_REFUSAL in str(exc)
            if not refused(exc, EXPECTED_REFUSALS) and not qmoe_refusal:
                failures.append(f"{where}: {_where(exc)}")
            continue
        compiled = ir.to_proto(result.model)
        if opts.get("dynamic", True):
            paths = case.paths if case.rewritten(opts, library) else []
            found = [entry.path for entry in read_dynamic_paths(result.model) if entry.path in paths]
            if found != paths:
                failures.append(f"{where}: blocks rewritten {found}, expected {paths}")
                continue
        try:
            session = _session(compiled, library)
            for tokens, want in expected.items():
                got = session.run(["y"], feeds(case, tokens, seed + tokens))[0]
                if not np.isfinite(got).all():
                    raise AssertionError(f"non-finite output at {tokens} tokens")
                if exact(opts) and not np.allclose(got, want, atol=ATOL, rtol=RTOL):
                    worst = float(np.abs(got - want).max())
                    raise AssertionError(f"differs from the original at {tokens} tokens (max abs {worst:.3g})")
        except Exception as exc:
            failures.append(f"{where}: the compiled model: {_where(exc)}")
            continue
        try:
            compile_model(compiled, CompileOptions(**opts))
        except Exception as exc:
            if not refused(exc, EXPECTED_REFUSALS):
                failures.append(f"{where}: a second compile: {_where(exc)}")
    return failures


def _describe(case: Case) -> str:
    if case.config is None:
        q = case.qmoe
        flags = [k for k in ("biases", "oai", "zero_points", "router") if q[k]]
        flags += ["unnormalized"] * (not q["normalize"]) + [np.dtype(q["scale_dtype"]).name, q["activation"]]
        shape = f"E{q['experts']} k{q['top_k']} H{q['hidden']} F{q['ffn']}"
        return f"QMoE {shape} q{q['bits']} block {q['block']} accuracy {q['accuracy']} {' '.join(flags)}"
    c = case.config
    parts = [c.form, f"E{c.experts} k{c.top_k} H{c.hidden} F{c.ffn} L{c.layers}", c.scoring, c.activation]
    if c.form != "batched_mm":
        parts.append(c.routing + ("" if c.form == "unrolled" else f"/{c.combine}"))
        parts += ["fused"] * c.fused_gate_up
    parts += ["biases"] * case.biases + ["projection"] * case.projection
    parts += [f"never {list(c.never_routed)}"] * bool(c.never_routed)
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--start", type=int, default=0)
    args = ap.parse_args(argv)
    with quiet():
        return run_seeds(check, args.start, args.cases, f"{len(OPTIONS)}+ option sets")


if __name__ == "__main__":
    sys.exit(main())
