"""FuseDecoder: RMSNorm -> SimplifiedLayerNormalization, rotary -> com.microsoft.RotaryEmbedding, repeat_kv read
grouped (issue 22).

On the export corpus's tiny Llama, Qwen3 (q / k norms), Qwen3-MoE and Mixtral (``layerzero export``, cache-carrying,
as the decode loop runs them): node counts per fused kind, outputs equal to the unfused model's on seeded prefill and
decode-with-past inputs, greedy ids through ``Engine.generate`` equal with and without ``--no-fuse``, a second run
changes nothing; hand-written norms and rotaries that do not match are left with a refusal.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.loader import load_model
from layerzero.options import CompileOptions
from layerzero.passes.fuse_decoder import FuseDecoder
from layerzero.passes.shape_inference import InferShapes
from layerzero.pipeline import fuse_decoder

PROMPT, NEW = [5, 17, 99, 3, 42, 7], 10
# Per family: (norms, rotaries) of its 2-layer export: input + post-attention norms per layer and the final one,
# q / k norms for the Qwen3s; one rotary on q and one on k per layer.
FUSED = {"llama": (5, 4), "qwen3": (9, 4), "qwen3_moe": (9, 4), "mixtral": (5, 4)}
NORM_OPS = ("Pow", "ReduceMean", "Sqrt", "Reciprocal")
LAYERS = 2  # one key transpose through a 3-D view per layer; a repeat_kv of the key and of the value per layer


def _export(name: str) -> Path:
    pytest.importorskip("torch", reason="the exports need torch")
    pytest.importorskip("transformers", reason="the exports need transformers")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))
    from corpus_export import get_generate_export
    from corpus_families import FAMILIES

    family = FAMILIES[name]
    kwargs = {**family.kwargs, "initializer_range": 0.2, "eos_token_id": None, "bos_token_id": None}
    return get_generate_export(dataclasses.replace(family, name=f"{name}_generate", kwargs=kwargs)) / "model.onnx"


def _feeds(model: ir.Model, batch: int, seq: int, past: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.inputs:
        name = value.name or ""
        if name == "input_ids":
            feeds[name] = rng.integers(0, 100, (batch, seq)).astype(np.int64)
        elif name == "attention_mask":
            mask = np.ones((batch, past + seq), np.int64)
            mask[1:, :1] = 0  # a left-padded row, as the batcher feeds it
            feeds[name] = mask
        elif name == "position_ids":
            feeds[name] = np.broadcast_to(np.arange(past, past + seq), (batch, seq)).astype(np.int64).copy()
        elif name == "layerzero::threshold":  # a compiled bundle's run-time threshold: 0, every routed expert
            feeds[name] = np.array(0.0, np.float32)
        else:  # past_key_values.<i>.key / value: [batch, kv heads, past, head dim]
            shape = value.shape
            assert shape is not None
            feeds[name] = rng.standard_normal((batch, shape[1], past, shape[3])).astype(np.float32)
    return feeds


def _run(model: ir.Model, feeds: dict[str, np.ndarray], tmp: Path, tag: str) -> dict[str, np.ndarray]:
    path = tmp / f"{tag}.onnx"
    ir.save(model, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.mark.parametrize("family", sorted(FUSED))
def test_export_fused_counts_outputs_and_idempotence(family: str, tmp_path: Path) -> None:
    source = _export(family)
    original = ir.load(source)
    model = ir.load(source)
    InferShapes()(model)
    before = Counter(n.op_type for n in model.graph)
    step = FuseDecoder()
    assert step(model).modified
    after = Counter(n.op_type for n in model.graph)
    norms, rotaries = FUSED[family]
    assert step.fused == {"rmsnorm": norms, "rotary": rotaries, "transpose": LAYERS, "repeat_kv": 2 * LAYERS}
    assert step.refused == []
    assert after["Expand"] == before["Expand"] - 2 * LAYERS  # no cache is repeated any more
    assert after["SimplifiedLayerNormalization"] == norms and after["RotaryEmbedding"] == rotaries
    assert all(after[op] == before[op] - norms for op in NORM_OPS)
    assert after["Neg"] == before["Neg"] - rotaries
    # Constant nodes (axes, the ids' range) are initializers once ONNX Runtime loads the model: not counted.
    computed = {k: sum(n for op, n in c.items() if op != "Constant") for k, c in (("before", before), ("after", after))}
    assert computed["after"] <= computed["before"] - 5 * norms - 5 * rotaries
    for label, (batch, seq, past) in {"prefill": (2, 6, 0), "decode": (2, 1, 5)}.items():
        feeds = _feeds(original, batch, seq, past, seed=len(label))
        want = _run(original, feeds, tmp_path, f"original-{label}")
        got = _run(model, feeds, tmp_path, f"fused-{label}")
        assert list(got) == list(want)
        for name, ref in want.items():
            scale = max(float(np.abs(ref).max()), 1e-30)
            assert float(np.abs(got[name] - ref).max()) <= 1e-5 * scale, (label, name)
    again = FuseDecoder()
    assert not again(model).modified and set(again.fused.values()) == {0} and again.refused == []
    # A fused graph is a compile input again (a bundle's model.onnx): the loader takes ONNX Runtime's onnx-domain
    # kernel, external weights included.
    path = tmp_path / "fused" / "model.onnx"
    path.parent.mkdir()
    ir.save(model, path, external_data="model.onnx.data")
    assert Counter(n.op_type for n in load_model(path).graph) == after


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FUSED))
def test_generate_ids_equal_with_and_without_fusion(family: str, tmp_path: Path) -> None:
    from layerzero.compile import compile_file
    from layerzero.runtime import Engine

    source = _export(family)
    ids, removed = {}, {}
    for fuse in (True, False):
        out = tmp_path / f"fuse-{fuse}.lz"
        result = compile_file(source, out, CompileOptions(fuse=fuse))
        assert result.verification is not None and result.verification.passed
        removed[fuse] = [(r.scope, r.kind) for r in result.removed]  # the report sees no scope go with a fusion
        ops = Counter(n.op_type for n in result.model.graph)
        assert (ops["SimplifiedLayerNormalization"], ops["RotaryEmbedding"]) == (FUSED[family] if fuse else (0, 0))
        ids[fuse] = Engine.load(out).generate(PROMPT, max_new_tokens=NEW, stop_tokens=()).ids
    assert ids[True] == ids[False] and len(ids[True]) == NEW
    assert removed[True] == removed[False]


@pytest.mark.slow
def test_int4_fused_verifies_at_the_unfused_tolerance(tmp_path: Path) -> None:
    """The quantized-dense reference is fused as the compile fuses it: the same float graph under the same codes."""
    from layerzero.cli import main

    source = _export("qwen3_moe")
    needed = {}
    for flag in ([], ["--no-fuse"]):
        out = tmp_path / f"int4{''.join(flag)}.lz"
        assert main(["compile", str(source), "-o", str(out), "--weights", "int4", *flag]) == 0
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["verification"]["passed"]
        needed[bool(flag)] = manifest["verification"]["needed_atol"]
        ops = Counter(n.op_type for n in ir.load(out / "model.onnx").graph)
        assert ops["SimplifiedLayerNormalization"] == (0 if flag else FUSED["qwen3_moe"][0])
    assert needed[False] <= max(needed[True], 1e-6)


def test_cli_no_fuse_sets_the_option() -> None:
    from layerzero.cli import build_parser
    from layerzero.cli.compile import options_from

    parser = build_parser(["compile"])
    assert options_from(parser.parse_args(["compile", "m.onnx", "-o", "m.lz"])).fuse is True
    assert options_from(parser.parse_args(["compile", "m.onnx", "-o", "m.lz", "--no-fuse"])).fuse is False


def test_pipeline_runs_it_for_onnxruntime_on_the_cpu_only() -> None:
    model = _parse(_norm())
    assert fuse_decoder(model, CompileOptions(fuse=False)) is None
    assert fuse_decoder(model, CompileOptions(target="tensorrt")) is None
    assert fuse_decoder(model, CompileOptions(device="cuda")) is None  # its kernels are not tested yet
    assert Counter(n.op_type for n in model.graph)["ReduceMean"] == 1
    step = fuse_decoder(model, CompileOptions())
    assert step is not None and step.fused["rmsnorm"] == 1


# ------------------------------------------------------------------------------------------- hand-written


def _parse(text: str) -> ir.Model:
    model = ir.from_onnx_text(textwrap.dedent(text))
    InferShapes()(model)
    return model


def _norm(axis: int = -1, eps: bool = True, weight: str = "w") -> str:
    add = "s = Add(m, e)" if eps else "s = Identity(m)"
    return f"""
    <ir_version: 10, opset_import: ["" : 20]>
    g (float[2, 3, 8] x) => (float[2, 3, 8] y) <float[8] w = {{1, 2, 3, 4, 5, 6, 7, 8}}, float[1, 1, 8] w3 = {{1, 2, 3,
      4, 5, 6, 7, 8}}, float e = {{1e-6}}, float two = {{2.0}}, int64[1] ax = {{{axis}}}> {{
        p = Pow(x, two)
        m = ReduceMean<keepdims: int = 1>(p, ax)
        {add}
        r = Sqrt(s)
        i = Reciprocal(r)
        n = Mul(x, i)
        y = Mul(n, {weight})
    }}
    """


def _outputs(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    proto = ir.to_proto(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("weight", ["w", "w3"])
def test_norm_fused_with_its_weight_or_with_ones(weight: str) -> None:
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    model = _parse(_norm(weight=weight))
    want = _outputs(model, {"x": x})[0]
    step = FuseDecoder()
    assert step(model).modified and step.fused["rmsnorm"] == 1
    ops = Counter(n.op_type for n in model.graph)
    # A [1, 1, 8] weight is not the kernel's [D] scale: the norm is fused with ones and the Mul stays.
    assert ops == Counter({"SimplifiedLayerNormalization": 1, **({"Mul": 1} if weight == "w3" else {})})
    np.testing.assert_allclose(_outputs(model, {"x": x})[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (_norm(axis=1), "the mean reduces axes [1], not the last one"),
        (_norm(eps=False), "no epsilon Add after the mean"),
    ],
)
def test_norm_that_does_not_match_is_left_with_a_refusal(text: str, reason: str) -> None:
    model = _parse(text)
    before = Counter(n.op_type for n in model.graph)
    step = FuseDecoder()
    assert not step(model).modified
    assert Counter(n.op_type for n in model.graph) == before
    assert [(r.kind, r.reason) for r in step.refused] == [("rmsnorm", reason)]
    assert step.refused[0].node.startswith("ReduceMean")


def _rotary(halved: bool = True) -> str:
    angle = "f2 = Concat<axis: int = -1>(f, f)" if halved else "f2 = Concat<axis: int = -1>(f, g)"
    return f"""
    <ir_version: 10, opset_import: ["" : 20]>
    r (float[2, 4, 3, 8] x, float[2, 3, 4] f, float[2, 3, 4] g) => (float[2, 4, 3, 8] y)
      <int64[1] zero = {{0}}, int64[1] four = {{4}}, int64[1] big = {{9223372036854775807}}, int64[1] last = {{-1}},
       int64[1] one = {{1}}> {{
        {angle}
        c = Cos(f2)
        s = Sin(f2)
        cu = Unsqueeze(c, one)
        su = Unsqueeze(s, one)
        lo = Slice(x, zero, four, last)
        hi = Slice(x, four, big, last)
        nh = Neg(hi)
        rh = Concat<axis: int = -1>(nh, lo)
        a = Mul(x, cu)
        b = Mul(rh, su)
        y = Add(a, b)
    }}
    """


def test_rotary_fused_equals_rotate_half() -> None:
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in
             {"x": (2, 4, 3, 8), "f": (2, 3, 4), "g": (2, 3, 4)}.items()}  # fmt: skip
    model = _parse(_rotary())
    want = _outputs(model, feeds)[0]
    step = FuseDecoder()
    assert step(model).modified and step.fused["rotary"] == 1
    ops = Counter(n.op_type for n in model.graph)
    assert ops["RotaryEmbedding"] == 1 and ops["Neg"] == 0 and model.opset_imports["com.microsoft"] == 1
    np.testing.assert_allclose(_outputs(model, feeds)[0], want, rtol=1e-5, atol=1e-6)


def test_rotary_whose_table_halves_may_differ_is_refused() -> None:
    model = _parse(_rotary(halved=False))
    before = Counter(n.op_type for n in model.graph)
    step = FuseDecoder()
    assert not step(model).modified and Counter(n.op_type for n in model.graph) == before
    assert [r.kind for r in step.refused] == ["rotary"]
    assert "halves may differ" in step.refused[0].reason


def _view_transpose(back: str = "b0, b1, b3, b2") -> str:
    return f"""
    <ir_version: 10, opset_import: ["" : 20]>
    t (float[batch, 4, T, 8] k) => (float[batch, 4, 8, T] y) <int64[1] m1 = {{-1}}, int64[1] two = {{2}},
      int64[1] three = {{3}}, int64[1] four = {{4}}, int64[1] zero = {{0}}> {{
        s = Shape(k)
        b0 = Slice(s, zero, two)
        b1 = Slice(s, two, three)
        b2 = Slice(s, three, four)
        v = Concat<axis: int = 0>(m1, b1, b2)
        r = Reshape(k, v)
        tr = Transpose<perm: ints = [0, 2, 1]>(r)
        b3 = Concat<axis: int = 0>(b0)
        w = Concat<axis: int = 0>({back})
        y = Reshape(tr, w)
    }}
    """


def test_key_transpose_through_a_3d_view_becomes_one_transpose() -> None:
    text = _view_transpose().replace("b0, b1, b3, b2", "b0, b2, b1")  # [B, N] (b0 holds two dims), H, T
    model = _parse(text)
    k = np.random.default_rng(2).standard_normal((2, 4, 5, 8)).astype(np.float32)
    want = _outputs(model, {"k": k})[0]
    step = FuseDecoder()
    assert step(model).modified and step.fused["transpose"] == 1
    assert Counter(n.op_type for n in model.graph) == Counter({"Transpose": 1})
    np.testing.assert_array_equal(_outputs(model, {"k": k})[0], want)
    np.testing.assert_array_equal(want, k.transpose(0, 1, 3, 2))


def test_key_view_that_does_not_go_back_is_refused() -> None:
    text = _view_transpose().replace("b0, b1, b3, b2", "b0, b1, b2")  # [B, N, T, H]: a reshape, no transpose
    text = text.replace("float[batch, 4, 8, T] y", "float[batch, 4, T, 8] y")
    model = _parse(text)
    before = Counter(n.op_type for n in model.graph)
    step = FuseDecoder()
    assert not step(model).modified and Counter(n.op_type for n in model.graph) == before
    assert [r.kind for r in step.refused] == ["transpose"] and "not" in step.refused[0].reason


def _repeat_kv(extra: str = "") -> str:
    """A value cache [B, 2, S, 8] repeated to 6 heads and read by the attention's second MatMul (p [B, 6, T, S])."""
    more = ", float[batch, 6, S, 8] z" if extra else ""
    return f"""
    <ir_version: 10, opset_import: ["" : 20]>
    a (float[batch, 2, S, 8] v, float[batch, 6, T, S] p) => (float[batch, 6, T, 8] y{more})
      <int64[1] two = {{2}}, int64[1] one = {{1}}, int64[1] zero = {{0}}, int64[1] three = {{3}},
      int64[1] rep = {{3}}, int64[1] heads = {{6}}> {{
        s = Shape(v)
        b0 = Slice(s, zero, one)
        b1 = Slice(s, one, two)
        b2 = Slice(s, two, three)
        b3 = Shape<start: int = 3>(v)
        e = Concat<axis: int = 0>(b0, b1, rep, b2, b3)
        u = Unsqueeze(v, two)
        x = Expand(u, e)
        f = Concat<axis: int = 0>(b0, heads, b2, b3)
        r = Reshape(x, f)
        y = MatMul(p, r)
        {extra}
    }}
    """


def test_repeat_kv_is_read_grouped_with_the_same_products() -> None:
    model = _parse(_repeat_kv())
    rng = np.random.default_rng(4)
    feeds = {"v": rng.standard_normal((2, 2, 5, 8)).astype(np.float32),
             "p": rng.standard_normal((2, 6, 3, 5)).astype(np.float32)}  # fmt: skip
    want = _outputs(model, feeds)[0]
    step = FuseDecoder()
    assert step(model).modified and step.fused["repeat_kv"] == 1 and step.refused == []
    ops = Counter(n.op_type for n in model.graph)
    assert ops["Expand"] == 0 and ops["Unsqueeze"] == 0 and ops["MatMul"] == 1
    got = _outputs(model, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # head h reads kv head h // 3 (repeat_kv's order)
    ref = np.einsum("bhts,bhsd->bhtd", feeds["p"], np.repeat(feeds["v"], 3, axis=1))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_repeat_kv_read_outside_the_attention_is_refused() -> None:
    model = _parse(_repeat_kv(extra="z = Identity(r)"))
    before = Counter(n.op_type for n in model.graph)
    step = FuseDecoder()
    assert not step(model).modified and Counter(n.op_type for n in model.graph) == before
    assert [r.kind for r in step.refused] == ["repeat_kv"] and "read outside" in step.refused[0].reason
