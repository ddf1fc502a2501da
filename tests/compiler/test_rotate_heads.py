"""``RotateHeads`` (passes/rotate_heads.py) and ``--activation-rotation heads``' check
(compiler/activation_rotation.py) on a tiny Llama exported with its KV cache by both exporters: the rotation is exact
(logits within rounding, the cache outputs bitwise untouched), o_proj's input is the rotated one, and a rotation
that is not the graph's layout is caught and undone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")

from tests.tiny_llama import prefill_feeds  # noqa: E402

LAYERS, HIDDEN, VOCAB, HEADS, KV = 2, 64, 128, 4, 2
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(scope="module", params=["dynamo", "torchscript"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from layerzero.cli import main

    tmp = tmp_path_factory.mktemp(f"rotate_{request.param}")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "llama")
    out = tmp / "m.onnx"
    assert main(["export", str(tmp / "llama"), "-o", str(out), "--exporter", request.param]) == 0
    return out


def _feeds(seed: int = 5) -> dict[str, np.ndarray]:
    return prefill_feeds(VOCAB, LAYERS, 7, seed, head_dim=HEAD_DIM)


def _run(model: ir.Model, feeds: dict[str, np.ndarray], extra: list[ir.Value] = ()) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    for v in extra:
        model.graph.outputs.append(v)
    try:
        session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    finally:
        for v in extra:
            model.graph.outputs.remove(v)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _loaded(path: Path) -> ir.Model:
    from layerzero.passes.shape_inference import InferShapes

    model = ir.load(path)
    InferShapes()(model)
    return model


def _random_rotations(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"model.layers.{i}.self_attn": np.stack(
            [np.linalg.qr(rng.standard_normal((HEAD_DIM, HEAD_DIM)))[0] for _ in range(HEADS)]
        )
        for i in range(LAYERS)
    }


def test_the_head_layout_is_read_off_both_exports(exported: Path) -> None:
    from layerzero.passes.rotate_heads import find_head_pairs

    pairs, refused = find_head_pairs(_loaded(exported))
    assert refused == []
    assert [p.layer for p in pairs] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert all((p.kv_heads, p.heads, p.head_dim) == (KV, HEADS, HEAD_DIM) for p in pairs)


def test_the_rotation_is_exact_and_leaves_the_cache_alone(exported: Path) -> None:
    from layerzero.passes.rotate_heads import RotateHeads, find_head_pairs, read_rotations, rotated_inputs

    feeds = _feeds()
    original = _loaded(exported)
    pairs, _ = find_head_pairs(original)
    o_inputs = [p.o.inputs[0] for p in pairs]
    want = _run(original, feeds, o_inputs)
    model = _loaded(exported)
    rotations = _random_rotations()
    step = RotateHeads(rotations)
    assert step(model).modified and step.rotated == list(rotations)
    pairs, _ = find_head_pairs(model)
    got = _run(model, feeds, [p.o.inputs[0] for p in pairs])
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=2e-5)
    assert np.abs(got["logits"] - want["logits"]).max() > 0  # it did change the arithmetic
    for name in want:  # the cache keeps its basis: the first layer's bitwise, the later ones within rounding
        if name.startswith("present.0."):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        elif name.startswith("present."):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    for pair, before in zip(pairs, o_inputs, strict=True):
        x = want[before.name].reshape(-1, HIDDEN)
        y = got[pair.o.inputs[0].name].reshape(-1, HIDDEN)
        np.testing.assert_allclose(y, rotated_inputs(pair, x, rotations[pair.layer]), rtol=1e-5, atol=1e-5)
    back = read_rotations(model)
    assert sorted(back) == sorted(rotations)
    for layer, r in rotations.items():
        np.testing.assert_allclose(back[layer], r, atol=1e-7)


def test_head_rotations_are_orthogonal_and_sorted_by_energy() -> None:
    from layerzero.passes.rotate_heads import HeadPair, head_rotations, rotated_inputs

    pair = HeadPair("l", None, None, KV, HEADS, HEAD_DIM)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, HIDDEN)) * np.linspace(0.1, 3.0, HIDDEN)
    x = x @ np.linalg.qr(rng.standard_normal((HIDDEN, HIDDEN)))[0]
    r = head_rotations(pair, x)
    assert r.shape == (HEADS, HEAD_DIM, HEAD_DIM)
    for ri in r:
        np.testing.assert_allclose(ri.T @ ri, np.eye(HEAD_DIM), atol=1e-10)
    energy = np.square(rotated_inputs(pair, x, r).astype(np.float64)).sum(0).reshape(HEADS, HEAD_DIM)
    assert np.all(np.diff(energy, axis=1) <= 1e-6 * energy.max())  # largest first within each head


def test_a_rotation_that_is_not_the_graphs_layout_is_undone(exported: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile path checks the rotated model's group inputs against the rotation's: a pass that rotated the
    output weight's rows by another head's R (a layout it misread) is caught, the model gets its weights back."""
    from layerzero import activation_rotation
    from layerzero.activation_calibration import collect_activations
    from layerzero.passes import rotate_heads as module
    from layerzero.passes.sparsify_activations import find_groups

    feeds = _feeds()
    model = _loaded(exported)
    want = _run(model, feeds)
    before = {n: v.const_value.numpy().copy() for n, v in model.graph.initializers.items() if v.const_value}
    groups = find_groups(model)
    activations = collect_activations(model, groups, [feeds])

    def collect(gs):
        return collect_activations(model, gs, [feeds])

    class Misread(module.RotateHeads):  # each head's rows rotated by the next head's R
        def __init__(self, rotations):
            super().__init__({k: np.roll(v, 1, axis=0) for k, v in rotations.items()})

    real = activation_rotation.RotateHeads
    monkeypatch.setattr(activation_rotation, "RotateHeads", Misread)
    _, _, record = activation_rotation.rotate_heads(model, groups, activations, collect)
    assert record["layers"] == 0 and record["refused"][-1]["kind"] == "rotation", record
    assert "from the rotation's" in record["refused"][-1]["reason"]
    got = _run(model, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)  # its own weights, bitwise
    assert sorted(model.graph.initializers) == sorted(before)
    assert not any("head_rotation" in (n.name or "") for n in model.graph)
    # The same call with the real pass rotates every layer and passes its own check.
    monkeypatch.setattr(activation_rotation, "RotateHeads", real)
    groups = find_groups(model)
    _, after, record = activation_rotation.rotate_heads(model, groups, activations, collect)
    assert record["layers"] == LAYERS and record["check"] < activation_rotation.TOLERANCE, record
    assert after.keys() == activations.keys()  # collected again on the rotated model
    np.testing.assert_allclose(_run(model, feeds)["logits"], want["logits"], rtol=1e-5, atol=2e-5)


def test_a_rotated_model_that_does_not_run_is_undone(exported: Path) -> None:
    """Where the rotated model fails in ONNX Runtime (a layout misread into a shape it refuses), the compile keeps
    the model's own weights and records why, instead of failing the compile."""
    from layerzero import activation_rotation
    from layerzero.activation_calibration import collect_activations
    from layerzero.passes.sparsify_activations import find_groups

    feeds = _feeds()
    model = _loaded(exported)
    want = _run(model, feeds)
    names = sorted(model.graph.initializers)
    groups = find_groups(model)
    activations = collect_activations(model, groups, [feeds])

    def collect(gs):
        assert any("head_rotation" in (n.name or "") for n in model.graph)  # called on the rotated model
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Reshape refused\nmore lines")

    back, same, record = activation_rotation.rotate_heads(model, groups, activations, collect)
    assert record["layers"] == 0 and record["refused"][-1]["kind"] == "rotation", record
    reason = record["refused"][-1]["reason"]
    assert "does not run ([ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Reshape refused)" in reason
    assert same is not activations and same.keys() == activations.keys() and [g.name for g in back] == [
        g.name for g in groups
    ]
    assert sorted(model.graph.initializers) == names
    got = _run(model, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
