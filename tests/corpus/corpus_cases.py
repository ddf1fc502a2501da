"""The corpus cases: family × exporter × variant, run through ``compile_model`` and measured.

Variants (the zero patterns users make), derived from one export by editing its tensors:

- ``base`` (MoE families): the export as is, outputs compared at 1 and 16 tokens, the skipping form counted;
- ``rotary_off``: ``inv_freq = 0`` (GPT-J: its ``[positions, sin | cos]`` table at frequency 0), the rotation is
  the identity: Cos / Sin / rotate-half must go;
- ``up0`` / ``gate0`` / ``down0``: that MLP projection's weight zero in every layer, its bias kept;
  ``up0_b0`` / ``down0_b0``: weight and bias zero (families with MLP biases): the MLP's MatMuls must go;
- ``neurons``: half the MLP's intermediate neurons pruned (rows of up / gate and their bias, columns of down);
- ``heads``: head 0 pruned in every layer (its query rows and bias, its columns of the output projection);
- ``flag``: a declared flag ``<last decoder layer scope>.flag = 0`` (README "Zero flags"): the layer is bypassed.
  Its oracle is transformers' model with that layer replaced by the identity (``torch_without_layer``), not
  the compiler's own bypass.

Outcome of a case (``run_case``): ``compile_error`` or the max deviation from the export (ORT, seeded
inputs), and ``fold``: ``full`` / ``partial`` / ``none`` (what the variant should remove went, some of it did,
nothing did) or ``n/a``; MoE cases also ``moe_blocks`` (blocks in the skipping form).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from corpus_export import EXPORTERS, Edit, Export, cache_root, get_export, output_name, torch_without_layer
from corpus_families import FAMILIES, HEAD_DIM, Family, Proj
from onnx import numpy_helper

__all__ = ["ATOL", "FOLD_RANK", "RTOL", "all_cases", "results_dir", "run_case", "variants_for"]

ATOL = 1e-5
RTOL = 1e-4
FOLD_RANK = {"n/a": 0, "none": 0, "partial": 1, "full": 2}
DENSE_SHAPES = ((1, 1), (2, 9))
MOE_SHAPES = ((1, 1), (1, 16))
MLP_OPS = ("MatMul", "Gemm", "Einsum")
ROTARY_OPS = ("Cos", "Sin", "Neg")
MOE_LAYERS = 2


def variants_for(family: Family) -> list[str]:
    # Dense families have no ``base`` case: every variant compiles the whole export and compares its outputs.
    out = ["base"] if family.moe else []
    if family.rotary:
        out.append("rotary_off")
    if not family.moe:
        out += ["up0"] + (["up0_b0"] if family.bias else [])
        out += ["gate0"] if family.gate else []
        out += ["down0"] + (["down0_b0"] if family.bias else [])
        out += ["neurons", "heads"]
    out.append("flag")
    return out


def all_cases() -> list[tuple[str, str, str]]:
    return [(f.name, e, v) for f in FAMILIES.values() for e in EXPORTERS for v in variants_for(f)]


def results_dir() -> Path:
    return cache_root() / "results"


# ------------------------------------------------------------------------------------------------ edits


def _zero_block(proj: Proj, axis: int, start: int, stop: int) -> callable:
    def fn(a: np.ndarray) -> np.ndarray:
        index = [slice(None)] * a.ndim
        index[axis if a.ndim > 1 else 0] = slice(start, stop)
        a[tuple(index)] = 0
        return a

    return fn


def _names(export: Export, proj: Proj, suffix: str) -> list[str]:
    return sorted(n for n in export.tensors if re.search(proj.pattern + r"\." + suffix + "$", n))


def _whole(export: Export, proj: Proj, suffix: str) -> list[Edit]:
    """Zero the projection (or its block of a fused weight) along the output axis."""
    stop = None if proj.size is None else proj.offset + proj.size
    return [(n, _block_out(proj, proj.offset, stop, suffix)) for n in _names(export, proj, suffix)]


def _block_out(proj: Proj, start: int, stop: int | None, suffix: str) -> callable:
    def fn(a: np.ndarray) -> np.ndarray:
        axis = 0 if suffix == "bias" else proj.out_axis
        index = [slice(None)] * a.ndim
        index[axis] = slice(start, stop)
        a[tuple(index)] = 0
        return a

    return fn


def _inv_freq_zero(a: np.ndarray) -> np.ndarray:
    return np.zeros_like(a)


def _table_at_zero_frequency(a: np.ndarray) -> np.ndarray:
    """GPT-J's ``[positions, sin | cos]``: sin(0) = 0, cos(0) = 1."""
    half = a.shape[-1] // 2
    out = np.zeros_like(a)
    out[..., half:] = 1
    return out


def variant_edits(family: Family, export: Export, variant: str) -> list[Edit]:
    """The edits (torch tensor name, new value) that make the variant; [] for base and flag."""
    if variant == "rotary_off":
        names = [n for n in export.tensors if n.endswith("inv_freq")]
        if family.rotary_table:
            return [(n, _table_at_zero_frequency) for n in export.tensors if n.endswith(family.rotary_table)]
        return [(n, _inv_freq_zero) for n in names]
    if variant in ("up0", "gate0", "down0", "up0_b0", "down0_b0"):
        proj = {"up": family.up, "gate": family.gate, "down": family.down}[variant[:-1].split("0")[0]]
        edits = _whole(export, proj, "weight")
        if variant.endswith("_b0"):
            edits += _whole(export, proj, "bias")
        return edits
    if variant == "neurons":  # the first half of the intermediate neurons
        half = family.intermediate // 2
        edits: list[Edit] = []
        for proj in (p for p in (family.up, family.gate) if p is not None):
            for suffix in ("weight", "bias"):
                block = _block_out(proj, proj.offset, proj.offset + half, suffix)
                edits += [(n, block) for n in _names(export, proj, suffix)]
        down = family.down
        edits += [(n, _zero_block(down, down.in_axis, 0, half)) for n in _names(export, down, "weight")]
        return edits
    if variant == "heads":  # head 0: its query rows (+ bias) and its input columns of the output projection
        edits = []
        q = family.query
        for suffix in ("weight", "bias"):
            edits += [(n, _block_out(q, 0, HEAD_DIM, suffix)) for n in _names(export, q, suffix)]
        o = family.out
        edits += [(n, _zero_block(o, o.in_axis, 0, HEAD_DIM)) for n in _names(export, o, "weight")]
        return edits
    return []


def _apply_edits(proto: onnx.ModelProto, export: Export, edits: list[Edit], torch_values: dict) -> onnx.ModelProto:
    """Write the edited values into the export's initializers / Constant nodes (all of them, by the map)."""
    proto = copy.deepcopy(proto)
    inits = {i.name: i for i in proto.graph.initializer}
    consts = {n.output[0]: n for n in proto.graph.node if n.op_type == "Constant"}
    current: dict[str, np.ndarray] = {}
    for name, fn in edits:  # edits of one tensor (a fused weight's blocks) apply one after the other
        current[name] = fn(current.get(name, torch_values[name]).copy())
    for name, value in current.items():
        for m in export.tensors[name]:
            new = value.T if m["transposed"] else value
            if m["where"] == "initializer":
                old = inits[m["name"]]
                old.CopyFrom(numpy_helper.from_array(new.reshape(tuple(old.dims)).astype(new.dtype), m["name"]))
            else:
                attr = next(a for a in consts[m["name"]].attribute if a.name == "value")
                attr.t.CopyFrom(numpy_helper.from_array(new.reshape(tuple(attr.t.dims)), m["name"]))
    return proto


def _torch_values(export: Export, proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The torch-layout values of the mapped tensors, read back from the export (no torch model needed)."""
    inits = {i.name: i for i in proto.graph.initializer}
    consts = {n.output[0]: n for n in proto.graph.node if n.op_type == "Constant"}
    out = {}
    for name, matches in export.tensors.items():
        if not matches:
            continue
        m = matches[0]
        if m["where"] == "initializer":
            arr = numpy_helper.to_array(inits[m["name"]])
        else:
            arr = numpy_helper.to_array(next(a for a in consts[m["name"]].attribute if a.name == "value").t)
        arr = np.array(arr)
        out[name] = arr.T if m["transposed"] else arr
    return out


def _layer_scopes(model: ir.Model) -> list[str]:
    from layerzero.passes._graph import scope_of

    scopes = {scope_of(n) for n in model.graph.all_nodes()}
    layers = set()
    for s in scopes:
        m = re.match(r"^(.*?(?:^|\.)(?:layers|h|layer)\.\d+)(?:\.|$)", s)
        if m:
            layers.add(m.group(1))
    return sorted(layers, key=lambda s: (len(s), s))


# ------------------------------------------------------------------------------------------------ run


@dataclasses.dataclass
class CaseResult:
    family: str
    exporter: str
    variant: str
    export_error: str | None = None
    exported_separately: str | None = None  # why the variant has its own export (the exporter folded a tensor)
    compile_error: str | None = None
    max_abs: float | None = None
    max_ref: float | None = None
    wrong_output: bool = False
    fold: str = "n/a"
    detail: str = ""
    moe_blocks: int | None = None
    seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.family}/{self.exporter}/{self.variant}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _histogram(model: ir.Model) -> Counter:
    return Counter(n.op_type for n in model.graph.all_nodes())


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    if any(n.domain == "ai.layerzero" for n in proto.graph.node):
        # The compile kept ai.layerzero::MoE for liblayerzero_ort.so (`auto` picks the native lowering where the
        # library is built): a plain session needs it registered, as Engine.load does from the manifest.
        from layerzero.plugins.ort_library import ort_library_path, register

        register(options, [str(ort_library_path())])
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(
    family: Family, session: ort.InferenceSession, shape: tuple[int, int], seed: int
) -> dict[str, np.ndarray]:
    """Token ids; a scalar the TorchScript exporter made an input (``logits_to_keep``) gets 0 (keep all)."""
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(3, family.kwargs.get("vocab_size", 256), size=shape, dtype=np.int64)}
    for extra in session.get_inputs():
        if extra.name not in feeds and not extra.shape:
            feeds[extra.name] = np.array(0, dtype=np.int64)
    return feeds


def _mlp_matmuls(proto: onnx.ModelProto, mlp_names: set[str]) -> int:
    """MatMul / Gemm nodes reading an MLP weight (directly or through one Transpose / Cast / Reshape)."""
    via = {}
    for node in proto.graph.node:
        if node.op_type in ("Transpose", "Cast", "Reshape") and node.input and node.input[0] in mlp_names:
            via[node.output[0]] = node.input[0]
    return sum(
        1
        for node in proto.graph.node
        if node.op_type in MLP_OPS and any(i in mlp_names or i in via for i in node.input)
    )


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def run_case(family_name: str, exporter: str, variant: str) -> CaseResult:
    """Export (cached), derive the variant, compile with the default options, compare, measure what folded."""
    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions
    from layerzero.passes._dynamic import read_dynamic_paths

    start = time.perf_counter()
    family = FAMILIES[family_name]
    result = CaseResult(family_name, exporter, variant)
    export = get_export(family_name, exporter)
    if export.error:
        result.export_error = export.error
        return result
    proto = export.load()
    edits = variant_edits(family, export, variant)
    if variant not in ("base", "flag") and not edits:
        result.export_error = f"variant {variant}: no tensor of it found in the family (spec error)"
        return result
    folded = sorted({name for name, _ in edits if not export.tensors.get(name)})
    if folded:
        # The exporter did not keep the tensor: the variant gets its own export, edited in torch.
        from corpus_export import edited_torch_model  # noqa: F401  (used by get_export)

        result.exported_separately = f"not kept as a tensor by the exporter: {folded[0]}"
        export = get_export(family_name, exporter, variant=variant, edits=edits)
        if export.error:
            result.export_error = export.error
            return result
        proto = export.load()
    else:
        proto = _apply_edits(proto, export, edits, _torch_values(export, proto))

    flag_scope = None
    if variant == "flag":
        scopes = _layer_scopes(ir.from_proto(proto))
        if not scopes:
            result.compile_error = "no decoder-layer scope found in the export"
            return result
        flag_scope = scopes[-1]
        proto.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), f"{flag_scope}.flag"))
        result.detail = f"flag on {flag_scope}"

    mlp_names: set[str] = set()
    for name, _ in edits:
        if variant in ("up0", "gate0", "down0", "up0_b0", "down0_b0"):
            mlp_names |= {m["name"] for m in export.tensors.get(name, [])}
    for proj in (family.up, family.gate, family.down):
        if proj is not None and variant.startswith(("up0", "gate0", "down0")):
            for n in _names(export, proj, "weight"):
                mlp_names |= {m["name"] for m in export.tensors.get(n, [])}
    before_mlp = _mlp_matmuls(proto, mlp_names)
    zeroed = 0
    if variant in ("neurons", "heads"):
        values = _torch_values(export, export.load())
        edited = {n: values[n].copy() for n, _ in edits}
        for n, fn in edits:
            edited[n] = fn(edited[n])
        zeroed = sum(int(np.count_nonzero(values[n]) - np.count_nonzero(edited[n])) for n in edited)

    before = _histogram(ir.from_proto(proto))
    out = output_name(family)
    reference = _session(proto)
    expected_outputs = []
    for i, shape in enumerate(MOE_SHAPES if family.moe else DENSE_SHAPES):
        feeds = _feeds(family, reference, shape, seed=i)
        try:
            expected_outputs.append((feeds, reference.run([out], feeds)[0]))
        except Exception as exc:  # e.g. a TorchScript trace that kept the example's sizes in a Split
            result.export_error = f"the export does not run at input shape {shape}: {_first_line(exc)}"
            return result
    try:
        compiled = compile_model(copy.deepcopy(proto), CompileOptions())
    except Exception as exc:  # a crash or a refusal is an outcome; the test decides against the expectations
        result.compile_error = _first_line(exc)
        result.seconds = round(time.perf_counter() - start, 2)
        return result
    after = _histogram(compiled.model)
    compiled_proto = ir.to_proto(compiled.model)

    if flag_scope is not None:
        # The export still computes the flagged layer: the oracle is transformers' model without it
        # (``torch_without_layer``), not the compiler's bypass. The compiler's own verification (against
        # the export bypassed by the same pass) must also have passed.
        v = compiled.verification
        result.fold = "full" if flag_scope in [b.scope for b in compiled.pipeline.bypassed] else "none"
        result.detail += f"; bypassed {[b.scope for b in compiled.pipeline.bypassed]}"
        if v is None or not v.passed:
            result.wrong_output = True
        without = torch_without_layer(family, exporter, flag_scope)
        candidate = _session(compiled_proto)
        worst, ref_max = 0.0, 0.0
        for feeds, _ in expected_outputs:
            actual, expected = candidate.run([out], feeds)[0], without(feeds["input_ids"])
            if actual.ndim == expected.ndim - 1:  # TorchScript's logits_to_keep input, fed 0: position 0
                expected = expected[:, 0]
            worst = max(worst, float(np.max(np.abs(actual - expected))))
            ref_max = max(ref_max, float(np.max(np.abs(expected))))
            if not np.allclose(actual, expected, rtol=RTOL, atol=ATOL):
                result.wrong_output = True
        result.max_abs, result.max_ref = worst, ref_max
        result.seconds = round(time.perf_counter() - start, 2)
        return result
    candidate = _session(compiled_proto)
    worst, ref_max = 0.0, 0.0
    for feeds, expected in expected_outputs:
        actual = candidate.run([out], feeds)[0]
        worst = max(worst, float(np.max(np.abs(actual - expected))))
        ref_max = max(ref_max, float(np.max(np.abs(expected))))
        if not np.allclose(actual, expected, rtol=RTOL, atol=ATOL):
            result.wrong_output = True
    result.max_abs, result.max_ref = worst, ref_max

    if family.moe:
        result.moe_blocks = len(read_dynamic_paths(compiled.model))
    if variant == "base":
        result.fold = "n/a"
        if family.moe:
            result.fold = "full" if result.moe_blocks >= MOE_LAYERS else "partial" if result.moe_blocks else "none"
            result.detail = f"{result.moe_blocks} of {MOE_LAYERS} MoE blocks in the skipping form; If: {after['If']}"
    elif variant == "rotary_off":
        b, a = sum(before[o] for o in ROTARY_OPS), sum(after[o] for o in ROTARY_OPS)
        result.fold = "full" if a == 0 else "partial" if a < b else "none"
        result.detail = f"Cos+Sin+Neg {b} -> {a}"
    elif variant.startswith(("up0", "gate0", "down0")):
        b, a = sum(before[o] for o in MLP_OPS), sum(after[o] for o in MLP_OPS)
        gone = b - a
        result.fold = "full" if gone >= before_mlp > 0 else "partial" if gone > 0 else "none"
        result.detail = f"MatMul/Gemm {b} -> {a}; MLP MatMuls {before_mlp}"
    elif variant in ("neurons", "heads"):
        removed = compiled.before.params - compiled.after.params
        result.fold = "full" if removed >= zeroed else "partial" if removed >= zeroed // 10 > 0 else "none"
        result.detail = f"zeroed {zeroed} weights; parameters removed {removed}"
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def write_result(result: CaseResult) -> Path:
    folder = results_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (result.key.replace("/", "__") + ".json")
    path.write_text(json.dumps(result.to_dict(), indent=1))
    return path


def read_results() -> dict[str, dict]:
    folder = results_dir()
    out = {}
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        data = json.loads(path.read_text())
        out[f"{data['family']}/{data['exporter']}/{data['variant']}"] = data
    return out
