"""``SparsifyActivations`` and its calibration (issue 23): groups of a tiny Llama export, the reference form against
a masked torch forward of the same weights, thresholds 0 and scale 0 = dense, NaN kept, the native form's nodes (and
its outputs where ``ai.layerzero::SparseLinear`` is built), the calibration's allocation on seeded activations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from layerzero.activation_calibration import GroupSamples, greedy, max_error, uniform
from layerzero.contract import ACTIVATION_SCALE_INPUT, DYNAMIC_META_KEY, MASK_PREFIX
from layerzero.errors import InvalidInputError
from layerzero.passes import sparsify_activations
from layerzero.passes.shape_inference import InferShapes
from layerzero.passes.sparsify_activations import SPARSE_LINEAR_OP, SparsifyActivations, find_groups

LAYERS, HIDDEN, FFN, VOCAB = 2, 64, 128, 128
KINDS = {"self_attn.qkv": 3, "self_attn.o": 1, "mlp.gate_up": 2, "mlp.down": 1}
MODULES = {"q_proj": "self_attn.qkv", "k_proj": "self_attn.qkv", "v_proj": "self_attn.qkv", "o_proj": "self_attn.o",
           "gate_proj": "mlp.gate_up", "up_proj": "mlp.gate_up", "down_proj": "mlp.down"}  # fmt: skip


# ------------------------------------------------------------------------------------------------ small graph

SMALL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x) => (float[N, 3] y) <float[4, 3] w = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}> {
    h = Relu (x)
    y = MatMul (h, w)
}
"""


def _small(helpers, name: str = "/model/layers.0/mlp/down_proj/MatMul") -> ir.Model:
    model = helpers.parse(SMALL)
    next(n for n in model.graph if n.op_type == "MatMul").name = name  # the exporter's path-like node name
    InferShapes()(model)
    return model


def test_small_graph_masks_as_the_numpy_reference_nan_kept(helpers) -> None:
    model = _small(helpers)
    (group,) = find_groups(model)
    assert group.name == "model.layers.0.mlp.down" and group.channels == 4
    t = np.array([0.5, 0.0, 2.0, 0.25], np.float32)
    assert SparsifyActivations({group.name: t}, native=False)(model).modified
    helpers.check_model(model)
    x = np.array([[0.4, 0.0, 2.5, -0.3], [np.nan, 1.0, 1.9, 0.25], [3.0, 0.0, 0.0, 0.0]], np.float32)
    out = helpers.run_ort(model, {"x": x})
    h = np.maximum(x, 0)
    h = np.where(np.isnan(x), np.nan, h)  # Relu keeps NaN
    keep = ~(np.abs(h) <= t)
    w = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    want = np.where(keep, h, 0) @ w
    np.testing.assert_array_equal(out["y"], want)
    assert np.isnan(out["y"][1]).all()  # NaN is kept and propagates
    np.testing.assert_array_equal(out[MASK_PREFIX + group.name], keep.sum(-1))
    # scale 0: every nonzero entry kept, the dense result
    dense = helpers.run_ort(_small(helpers), {"x": x})["y"]
    sess = helpers.session(model)
    zero = dict(zip([o.name for o in sess.get_outputs()],
                    sess.run(None, {"x": x, ACTIVATION_SCALE_INPUT: np.array(0, np.float32)})))  # fmt: skip
    np.testing.assert_array_equal(zero["y"], dense)


def test_output_deviation_is_the_relative_change_from_dense_in_one_session(helpers) -> None:
    from layerzero.activation_calibration import output_deviation
    from layerzero.runtime.guard import relative_l2

    model = _small(helpers)
    x = np.array([[0.4, 0.1, 2.5, -0.3], [0.2, 1.0, 1.9, 0.25], [3.0, 0.05, 0.6, 0.7]], np.float32)
    evaluate = output_deviation(model, [{"x": x}, {"x": x[:1] * 2}])
    assert evaluate({}) == 0.0 and not any(n.op_type == "Where" for n in model.graph)  # the model is left alone
    w = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
    for t in (np.array([0.5, 0.0, 2.0, 0.25], np.float32), np.full(4, 0.3, np.float32)):
        worst = 0.0
        for xs in (x, x[:1] * 2):
            h = np.maximum(xs, 0)
            worst = max(worst, float(relative_l2(np.where(h <= t, 0, h) @ w, h @ w)))
        assert evaluate({"model.layers.0.mlp.down": t}) == pytest.approx(worst, rel=1e-5) and worst > 0
    with pytest.raises(InvalidInputError):
        evaluate({"model.layers.9.mlp.down": np.zeros(4, np.float32)})


def test_zero_thresholds_leave_the_graph_alone_and_a_second_run_changes_nothing(helpers) -> None:
    model = _small(helpers)
    before = helpers.to_proto(model).SerializeToString()
    assert not SparsifyActivations({"model.layers.0.mlp.down": np.zeros(4, np.float32)}, native=False)(model).modified
    assert not SparsifyActivations({}, native=True)(model).modified
    assert helpers.to_proto(model).SerializeToString() == before
    assert SparsifyActivations({"model.layers.0.mlp.down": np.float32(0.1)}, native=False)(model).modified
    count = helpers.count_nodes(model)
    InferShapes()(model)
    assert not SparsifyActivations({"model.layers.0.mlp.down": np.float32(0.1)}, native=False)(model).modified
    assert helpers.count_nodes(model) == count


@pytest.mark.parametrize(
    ("thresholds", "needle"),
    [
        ({"model.layers.0.mlp.up": 0.1}, "no projection group"),
        ({"model.layers.0.mlp.down": np.ones(3)}, "expected [] or [4]"),
        ({"model.layers.0.mlp.down": -1.0}, "finite and >= 0"),
        ({"model.layers.0.mlp.down": np.nan}, "finite and >= 0"),
    ],
)
def test_bad_thresholds_are_one_line_naming_the_group(helpers, thresholds, needle) -> None:
    model = _small(helpers)
    with pytest.raises(InvalidInputError) as info:
        SparsifyActivations(thresholds, native=False)(model)
    message = str(info.value)
    assert needle in message and "\n" not in message and "model.layers.0.mlp" in message


def test_outside_a_layer_no_group(helpers) -> None:
    assert find_groups(_small(helpers, "/lm_head/MatMul")) == []


def test_an_empty_weight_is_no_group(helpers) -> None:
    """A module of size 0 (DeepSeek-V3 with n_shared_experts=0: a [0, H] down projection) has no row to skip; as a
    group its calibration reshaped an empty x to [-1, 0] and the compile failed (the decoder fuzzer, seed 40)."""
    model = helpers.parse("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[N, 0] x) => (float[N, 3] y) <float[0, 3] w = {}> {
        y = MatMul (x, w)
    }
    """)
    next(n for n in model.graph if n.op_type == "MatMul").name = "/model/layers.0/mlp/shared_experts/down_proj/MatMul"
    InferShapes()(model)
    assert find_groups(model) == []


# ------------------------------------------------------------------------------------------------ tiny Llama

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")

from tests.tiny_llama import prefill_feeds  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    from layerzero.cli import main

    tmp = tmp_path_factory.mktemp("sparse_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp / "llama")
    assert main(["export", str(tmp / "llama"), "-o", str(tmp / "m.onnx")]) == 0
    return hf, tmp / "m.onnx"


def _load(path: Path) -> ir.Model:
    model = ir.load(path)
    InferShapes()(model)
    return model


def _feeds(seq: int = 7) -> dict[str, np.ndarray]:
    return prefill_feeds(VOCAB, LAYERS, seq, 3, head_dim=HIDDEN // 4)


def _thresholds(model: ir.Model, quantile: float = 0.4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    # per-channel thresholds around the typical magnitude of the inputs (random weights, init range 0.2)
    return {g.name: (rng.uniform(0.2, 1.6, g.channels) * quantile).astype(np.float32) for g in find_groups(model)}


def _run(helpers, model: ir.Model, feeds, extra=None) -> dict[str, np.ndarray]:
    sess = helpers.session(model)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {**feeds, **(extra or {})})))


def test_groups_of_a_llama_export(llama) -> None:
    _, path = llama
    groups = find_groups(_load(path))
    assert [g.name for g in groups] == [f"model.layers.{i}.{k}" for i in range(LAYERS) for k in KINDS]
    assert [len(g.projections) for g in groups] == [n for _ in range(LAYERS) for n in KINDS.values()]
    assert [g.channels for g in groups] == [HIDDEN, HIDDEN, HIDDEN, FFN] * LAYERS
    assert groups[0].scopes == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]


def test_reference_form_equals_a_masked_torch_forward(helpers, llama) -> None:
    hf, path = llama
    model = _load(path)
    thresholds = _thresholds(model)
    assert SparsifyActivations(thresholds, native=False)(model).modified
    helpers.check_model(model)
    feeds = _feeds()
    out = _run(helpers, model, feeds)
    kept: dict[str, torch.Tensor] = {}

    def hook(group: str):
        def pre(_module, args):
            x = args[0]
            keep = ~(x.abs() <= torch.from_numpy(thresholds[group]))
            kept[group] = keep.sum(-1)
            return (torch.where(keep, x, torch.zeros_like(x)),)

        return pre

    def group_of(name: str) -> str:
        return f"model.layers.{name.split('.')[2]}.{MODULES[name.rsplit('.', 1)[-1]]}"

    handles = [module.register_forward_pre_hook(hook(group_of(name)))
               for name, module in hf.named_modules() if name.rsplit(".", 1)[-1] in MODULES]  # fmt: skip
    try:
        with torch.no_grad():
            want = hf(torch.from_numpy(feeds["input_ids"])).logits.numpy()
    finally:
        for h in handles:
            h.remove()
    np.testing.assert_allclose(out["logits"], want, rtol=1e-4, atol=1e-4)
    masks = {k[len(MASK_PREFIX) :]: v for k, v in out.items() if k.startswith(MASK_PREFIX)}
    assert set(masks) == set(thresholds)
    for group, count in masks.items():
        np.testing.assert_array_equal(count, kept[group].numpy())
    dropped = [1 - masks[g].mean() / c for g, c in ((g.name, g.channels) for g in find_groups(_load(path)))]
    assert 0.1 < float(np.mean(dropped)) < 0.9  # the thresholds really drop entries
    paths = json.loads(model.metadata_props[DYNAMIC_META_KEY])
    assert {p["path"] for p in paths} == set(thresholds) and {p["kind"] for p in paths} == {"activation"}
    # scale 0 = the dense model; thresholds 0 = the graph unchanged
    dense = _run(helpers, _load(path), feeds)["logits"]
    off = {ACTIVATION_SCALE_INPUT: np.array(0, np.float32)}
    np.testing.assert_array_equal(_run(helpers, model, feeds, off)["logits"], dense)
    unchanged = _load(path)
    before = helpers.count_nodes(unchanged)
    zeros = {g: np.zeros_like(t) for g, t in thresholds.items()}
    assert not SparsifyActivations(zeros, native=False)(unchanged).modified
    assert helpers.count_nodes(unchanged) == before


def test_native_form_node_layout(helpers, llama) -> None:
    _, path = llama
    model = _load(path)
    thresholds = _thresholds(model)
    assert SparsifyActivations(thresholds, native=True)(model).modified
    ops = helpers.op_counts(model)
    # one node per group: q/k/v and gate/up fused (their weights side by side, a Split after), o and down alone
    assert ops[SPARSE_LINEAR_OP] == len(KINDS) * LAYERS
    assert ops["Split"] == sum(n > 1 for n in KINDS.values()) * LAYERS
    assert ops["MatMul"] == 2 * LAYERS + 1  # attention's two and lm_head
    assert model.opset_imports["ai.layerzero"] == 1
    groups = {g.name: g for g in find_groups(_load(path))}
    for node in model.graph:
        if node.op_type != SPARSE_LINEAR_OP:
            continue
        assert node.domain == "ai.layerzero" and len(node.inputs) == 4 and len(node.outputs) == 2
        x, w, t, scale = node.inputs
        assert node.attributes["weight_format"].value == "f" and node.attributes["block_size"].value == 32
        path_attr = node.attributes["path"].value
        fused = node.attributes.get("projections")
        group = groups[path_attr] if fused is not None else next(g for g in groups.values() if path_attr in g.scopes)
        assert (list(fused.value) if fused is not None else [path_attr]) == group.scopes
        assert x.name == group.x.name and scale.name == ACTIVATION_SCALE_INPUT
        np.testing.assert_array_equal(t.const_value.numpy(), thresholds[group.name])
        np.testing.assert_array_equal(w.const_value.numpy(), np.concatenate(group.weights, axis=1))
        if fused is not None:  # the Split gives each projection its columns
            (split,) = [use.node for use in node.outputs[0].uses()]
            sizes = ir.convenience.get_const_tensor(split.inputs[1]).numpy().tolist()
            assert split.op_type == "Split" and sizes == [a.shape[1] for a in group.weights]
    onnx.checker.check_model(ir.to_proto(model))
    from layerzero.plugins import ort_library
    from tests.plugins.native_build import build_ort_test_library

    # a bundle of this model lists the library that implements the op (plugins/ort_library.py)
    ops = {(n.domain, n.op_type) for n in model.graph}
    assert ort_library.libraries_for_ops(ops) == [ort_library.ORT_LIBRARY]
    # numerics: the kernel (skips, or fails under LAYERZERO_REQUIRE_NATIVE=1, where the library cannot be built)
    library = build_ort_test_library()
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    reference = _load(path)
    SparsifyActivations(thresholds, native=False)(reference)
    feeds = _feeds()
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    want = _run(helpers, reference, feeds)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    for name in want:
        if name.startswith(MASK_PREFIX):
            np.testing.assert_array_equal(got[name], want[name])
    # the fused nodes are bitwise the separate ones (a column's arithmetic does not depend on its neighbours)
    separate = _load(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sparsify_activations, "_fusable", lambda group: False)
        SparsifyActivations(thresholds, native=True)(separate)
    assert helpers.op_counts(separate)[SPARSE_LINEAR_OP] == sum(KINDS.values()) * LAYERS
    sess = ort.InferenceSession(ir.to_proto(separate).SerializeToString(), options, providers=["CPUExecutionProvider"])
    alone = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    for name in got:
        np.testing.assert_array_equal(got[name], alone[name], err_msg=name)


def test_native_form_when_a_projection_feeds_the_next_group_and_is_a_graph_output(helpers) -> None:
    """Layer 0's projection output is a graph output and the input of layer 1's q / k group: the native rewrite of
    layer 0 replaces that value, and layer 1's SparseLinear must read the new one (it read a value no node produced,
    found by a fuzzer of projection graphs: ONNX Runtime refused to load the compiled model)."""
    rng = np.random.default_rng(3)
    w0, wq, wk = (rng.standard_normal(s).astype(np.float32) for s in [(32, 64), (64, 32), (64, 32)])

    def build() -> ir.Model:
        h = onnx.helper
        nodes = [
            h.make_node("MatMul", ["x", "w0"], ["h"], name="/model/layers.0/mlp/up_proj/MatMul"),
            h.make_node("MatMul", ["h", "wq"], ["q"], name="/model/layers.1/self_attn/q_proj/MatMul"),
            h.make_node("MatMul", ["h", "wk"], ["k"], name="/model/layers.1/self_attn/k_proj/MatMul"),
            h.make_node("Concat", ["q", "k"], ["qk"], name="/model/layers.1/self_attn/Concat", axis=-1),
        ]
        f = onnx.TensorProto.FLOAT
        graph = h.make_graph(
            nodes, "g", [h.make_tensor_value_info("x", f, ["N", 32])],
            [h.make_tensor_value_info("h", f, ["N", 64]), h.make_tensor_value_info("qk", f, ["N", 64])],
            [onnx.numpy_helper.from_array(w, n) for n, w in [("w0", w0), ("wq", wq), ("wk", wk)]],
        )  # fmt: skip
        model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8))
        InferShapes()(model)
        return model

    model = build()
    groups = find_groups(model)
    assert [g.name for g in groups] == ["model.layers.0.mlp.up", "model.layers.1.self_attn.qk"]
    thresholds = {g.name: np.full(g.channels, 0.5, np.float32) for g in groups}
    assert SparsifyActivations(thresholds, native=True)(model).modified
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    produced = {o for n in model.graph for o in n.outputs} | set(model.graph.inputs)
    produced |= set(model.graph.initializers.values())
    for node in model.graph:
        for value in node.inputs:
            assert value is None or value in produced, f"{node.name} reads {value.name}, which nothing produces"
    assert [o.name for o in model.graph.outputs][:2] == ["h", "qk"]
    from tests.plugins.native_build import build_ort_test_library

    library = build_ort_test_library()
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, 32)).astype(np.float32)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    reference = build()
    SparsifyActivations(thresholds, native=False)(reference)
    want = helpers.run_ort(reference, {"x": x})
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


# ------------------------------------------------------------------------------------------------ calibration


def _seeded_groups() -> list[GroupSamples]:
    rng = np.random.default_rng(7)
    out = []
    for i, (k, n, spread) in enumerate([(32, 96, 1.0), (32, 32, 3.0), (32, 128, 0.5), (64, 32, 2.0)]):
        x = rng.laplace(size=(600, k)) * rng.uniform(0.2, spread, size=k)
        out.append(GroupSamples(f"model.layers.0.g{i}", x.astype(np.float32), rng.normal(size=(k, n))))
    return out


@pytest.mark.parametrize("target", [0.25, 0.4, 0.5])
def test_greedy_reaches_the_sparsity_asked_with_a_monotone_curve(target: float) -> None:
    groups = _seeded_groups()
    alloc = greedy(groups, target, "wina")
    assert abs(alloc.sparsity - target) <= 0.01  # realized on the samples
    errors = [e for _, e in alloc.curve]
    assert errors == sorted(errors) and abs(alloc.curve[-1][0] - target) < 1e-9
    for g in groups:
        assert np.all(np.diff(g.error("wina")) >= 0)
    flat = uniform(groups, target, "wina")
    assert abs(flat.sparsity - target) <= 0.01
    assert abs(uniform(groups, target + 0.02, "magnitude").sparsity - target - 0.02) <= 0.01  # between two levels


def test_greedy_realized_within_one_percent_on_many_groups() -> None:
    rng = np.random.default_rng(11)
    groups = [GroupSamples(f"model.layers.{i}.mlp.down", (rng.laplace(size=(400, 16)) * rng.uniform(0.1, 2, 16))
                           .astype(np.float32), rng.normal(size=(16, 24))) for i in range(24)]  # fmt: skip
    for target in (0.3, 0.45):
        assert abs(greedy(groups, target, "magnitude").sparsity - target) <= 0.01


def test_max_error_picks_the_largest_sparsity_within_the_bound() -> None:
    groups = _seeded_groups()

    def evaluate(thresholds) -> float:  # a deviation growing with the parameters dropped
        return sum(g.params * g.realized(thresholds.get(g.name, 0)) for g in groups) / sum(g.params for g in groups)

    alloc = max_error(groups, 0.33, evaluate)
    assert alloc.method == "max_error" and evaluate(alloc.thresholds) <= 0.33
    assert alloc.sparsity >= 0.25
    with pytest.raises(InvalidInputError):
        greedy(groups, 1.5)


def test_collected_activations_are_the_projection_inputs(llama) -> None:
    from layerzero.activation_calibration import collect_activations, group_samples

    hf, path = llama
    model = _load(path)
    groups = find_groups(model)
    feeds = _feeds(9)
    got = collect_activations(model, groups, [feeds, feeds], max_tokens=12)
    seen: dict[str, np.ndarray] = {}
    def keep(name: str):
        def pre(_module, args) -> None:
            seen[name] = args[0].numpy()

        return pre

    handles = [module.register_forward_pre_hook(keep(name))
               for name, module in hf.named_modules() if name.endswith(("q_proj", "down_proj"))]  # fmt: skip
    try:
        with torch.no_grad():
            hf(torch.from_numpy(feeds["input_ids"]))
    finally:
        for h in handles:
            h.remove()
    assert set(got) == {g.name for g in groups} and all(v.shape == (12, g.channels) for g, v in
                                                       zip(groups, got.values()))  # fmt: skip
    for i in range(LAYERS):
        for module, group in (("self_attn.q_proj", "self_attn.qkv"), ("mlp.down_proj", "mlp.down")):
            want = seen[f"model.layers.{i}.{module}"].reshape(-1, got[f"model.layers.{i}.{group}"].shape[1])
            np.testing.assert_allclose(got[f"model.layers.{i}.{group}"][:9], want, rtol=1e-4, atol=1e-5)
    samples = group_samples(groups, got)
    assert [s.weight.shape for s in samples[:2]] == [(HIDDEN, HIDDEN + 2 * HIDDEN // 2), (HIDDEN, HIDDEN)]


def test_probed_sensitivity_scales_each_group_to_the_deviation_measured() -> None:
    from layerzero.activation_calibration import probe_sensitivity

    groups = _seeded_groups()
    deviation = {g.name: 0.1 * (i + 1) for i, g in enumerate(groups)}
    probed = probe_sensitivity(groups, lambda t: deviation[next(iter(t))], 0.5, "wina")
    for g in groups:
        assert probed[g.name] == pytest.approx(deviation[g.name] / g.error("wina")[10])


def test_probes_at_several_levels_give_the_greedy_the_measured_curve() -> None:
    from layerzero.activation_calibration import probe_sensitivity

    groups = _seeded_groups()

    def deviation(thresholds) -> float:  # per group, twice the group's own error up to 50 %, ten times beyond
        ((name, t),) = thresholds.items()
        g = next(g for g in groups if g.name == name)
        i = next(i for i, s in enumerate(g.levels) if np.array_equal(g.thresholds_at(float(s)), t))
        return float(g.error("wina")[i]) * (2.0 if g.levels[i] <= 0.5 else 10.0)

    probed = probe_sensitivity(groups, deviation, (0.3, 0.5, 0.7), "wina")
    for g in groups:
        ratio = probed[g.name]
        assert ratio.shape == g.levels.shape
        np.testing.assert_allclose(ratio[g.levels <= 0.5], 2.0)
        np.testing.assert_allclose(ratio[g.levels >= 0.7], 10.0)
        assert 2.0 < ratio[12] < 10.0  # 0.6: between the two probes
    # Every group equally sensitive at every level: the greedy's allocation is the unweighted one, only its curve
    # in the measured unit; the group it takes furthest, made steep 10 % below that, is held there.
    plain = greedy(groups, 0.4, "wina")
    same = greedy(groups, 0.4, "wina", {g.name: np.full(g.levels.shape, 3.0) for g in groups})
    assert same.levels == plain.levels and same.curve[-1][1] == pytest.approx(3 * plain.curve[-1][1])
    top = max(groups, key=lambda g: plain.levels[g.name])
    cap = round(plain.levels[top.name] - 0.1, 4)  # below where the unweighted greedy takes it
    steep = dict(probed, **{top.name: np.where(top.levels <= cap + 1e-9, 1.0, 1e6)})
    held = greedy(groups, 0.4, "wina", steep)
    assert held.levels[top.name] <= cap + 1e-9 and abs(held.sparsity - 0.4) <= 0.01
    with pytest.raises(InvalidInputError):
        probe_sensitivity(groups, deviation, (0.0, 0.5))
