"""The example transformer: valid ONNX, equal to its numpy reference, zero flags equal to their oracles."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from layerzero.models import (
    TransformerConfig,
    build_transformer,
    example_feeds,
    parameter_count,
    reference_forward,
)

CONSUMED = TransformerConfig(flag_form="consumed")

CONFIGS = {
    "declared-initializer": TransformerConfig(zero_blocks=(1,), zero_rotary=(2,), zero_norms=(3,)),
    "declared-metadata": TransformerConfig(declared_in="metadata", zero_blocks=(0,), zero_rotary=(1,)),
    "consumed": TransformerConfig(flag_form="consumed", zero_blocks=(1,), zero_rotary=(2,), zero_norms=(3,)),
    "zero-weights": TransformerConfig(zero_weight_blocks=(2,)),
    "omit": TransformerConfig(omit_blocks=(1,), omit_rotary=(0, 2), omit_norms=(3,)),
    "no-flags": TransformerConfig(flags=False),
    "no-inv-freq": TransformerConfig(disable_rotary_inv_freq=True),
}


@functools.cache
def _model(config: TransformerConfig) -> onnx.ModelProto:
    return build_transformer(config)


@functools.cache
def _session(config: TransformerConfig) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # declared flags are unused initializers: ORT warns about each
    return ort.InferenceSession(_model(config).SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(config: TransformerConfig, batch: int = 2, seq: int = 7) -> np.ndarray:
    return _session(config).run(["logits"], example_feeds(config, batch=batch, seq=seq))[0]


def _scope(node_name: str) -> str:
    return node_name.rsplit("/", 1)[0].lstrip("/").replace("/", ".")


def _in_scope(node: onnx.NodeProto, scope: str) -> bool:
    return _scope(node.name) == scope or _scope(node.name).startswith(scope + ".")


def _boundary(model: onnx.ModelProto, scope: str) -> tuple[set[str], set[str]]:
    """(values the scope reads from outside, initializers excluded; values of the scope read outside)."""
    initializers = {t.name for t in model.graph.initializer}
    inside = [n for n in model.graph.node if _in_scope(n, scope)]
    outside = [n for n in model.graph.node if not _in_scope(n, scope)]
    produced = {o for n in inside for o in n.output}
    inputs = {i for n in inside for i in n.input if i not in produced and i not in initializers}
    read_outside = {i for n in outside for i in n.input} | {o.name for o in model.graph.output}
    return inputs, produced & read_outside


@pytest.mark.parametrize("name", list(CONFIGS))
def test_check_model(name: str) -> None:
    model = _model(CONFIGS[name])
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims] == ["batch", "seq"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ort_matches_reference(name: str) -> None:
    config = CONFIGS[name]
    feeds = example_feeds(config, batch=2, seq=7)
    np.testing.assert_allclose(_run(config), reference_forward(config, feeds["input_ids"]), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("zeroed", "oracle"),
    [
        ({"zero_blocks": (1,)}, {"omit_blocks": (1,)}),
        ({"zero_rotary": (1,)}, {"omit_rotary": (1,)}),
        ({"zero_norms": (2,)}, {"omit_norms": (2,)}),
    ],
)
def test_consumed_zero_flag_equals_oracle(zeroed: dict, oracle: dict) -> None:
    out = _run(TransformerConfig(flag_form="consumed", **zeroed))
    np.testing.assert_allclose(out, _run(TransformerConfig(**oracle)), atol=1e-5, rtol=0)
    # The layer matters, so the equality above is not vacuous.
    assert np.abs(out - _run(CONSUMED)).max() > 1e-3


def test_declared_zero_flag_changes_nothing_in_the_graph() -> None:
    declared = CONFIGS["declared-initializer"]
    np.testing.assert_array_equal(_run(declared), _run(TransformerConfig()))


def test_zero_weight_block_equals_omitted_block() -> None:
    out = _run(TransformerConfig(zero_weight_blocks=(2,)))
    np.testing.assert_allclose(out, _run(TransformerConfig(omit_blocks=(2,))), atol=1e-5, rtol=0)
    assert np.abs(out - _run(TransformerConfig())).max() > 1e-3


def test_zero_inv_freq_equals_no_rotary() -> None:
    everywhere = tuple(range(4))
    out = _run(TransformerConfig(disable_rotary_inv_freq=True))
    np.testing.assert_allclose(out, _run(TransformerConfig(omit_rotary=everywhere)), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 16)])
def test_dynamic_shapes(batch: int, seq: int) -> None:
    config = CONFIGS["consumed"]
    feeds = example_feeds(config, batch=batch, seq=seq, seed=seq)
    out = _session(config).run(["logits"], feeds)[0]
    assert out.shape == (batch, seq, config.vocab_size)
    np.testing.assert_allclose(out, reference_forward(config, feeds["input_ids"]), atol=1e-4, rtol=0)


def test_node_names_and_scopes() -> None:
    model = _model(CONFIGS["consumed"])
    names = [n.name for n in model.graph.node]
    assert len(names) == len(set(names))
    assert all(name.startswith("/") for name in names)
    scopes = {_scope(name) for name in names}
    for i in range(4):
        assert {f"layers.{i}", f"layers.{i}.attention.rotary_emb", f"layers.{i}.input_layernorm"} <= scopes
    assert {
        "embed_tokens",
        "rotary_emb",
        "causal_mask",
        "norm",
        "lm_head",
        "layers.3.mlp.gate_proj",
    } <= scopes
    assert all("/" not in t.name for t in model.graph.initializer)


@pytest.mark.parametrize("name", ["declared-initializer", "consumed"])
def test_layer_scopes_have_one_data_input_and_one_output(name: str) -> None:
    model = onnx.shape_inference.infer_shapes(_model(CONFIGS[name]), strict_mode=True)
    types = {v.name: v.type for v in model.graph.value_info}
    side = {"/rotary_emb/Cos_output_0", "/rotary_emb/Sin_output_0", "/causal_mask/Where_output_0"}
    for i in range(4):
        for scope, n_side in (
            (f"layers.{i}", 3),
            (f"layers.{i}.attention.rotary_emb", 2),
            (f"layers.{i}.input_layernorm", 0),
        ):
            inputs, outputs = _boundary(model, scope)
            assert len(outputs) == 1, scope
            data = inputs - side
            assert len(data) == 1 and len(inputs & side) == n_side, (scope, inputs)
            assert types[data.pop()] == types[outputs.pop()], scope


def test_flags_declared_and_consumed() -> None:
    flag_names = {
        f"layers.{i}.{suffix}"
        for i in range(4)
        for suffix in ("flag", "attention.rotary_emb.flag", "input_layernorm.flag")
    }

    declared = _model(CONFIGS["declared-initializer"])
    flags = {t.name: onnx.numpy_helper.to_array(t) for t in declared.graph.initializer if t.name.endswith(".flag")}
    assert set(flags) == flag_names
    assert flags["layers.1.flag"].tolist() == [0.0] and flags["layers.0.flag"].tolist() == [1.0]
    assert flags["layers.2.attention.rotary_emb.flag"].tolist() == [0.0]
    assert flags["layers.3.input_layernorm.flag"].tolist() == [0.0]
    assert not flag_names & {i for n in declared.graph.node for i in n.input}

    metadata = _model(CONFIGS["declared-metadata"])
    props = {p.key: p.value for p in metadata.metadata_props}
    assert set(props) == flag_names
    assert props["layers.0.flag"] == "0" and props["layers.1.attention.rotary_emb.flag"] == "0"
    assert props["layers.1.flag"] == "1"
    assert not any(t.name.endswith(".flag") for t in metadata.graph.initializer)

    consumed = _model(CONFIGS["consumed"])
    assert flag_names <= {i for n in consumed.graph.node for i in n.input}

    omitted = _model(CONFIGS["omit"])
    assert not any(t.name.startswith("layers.1.") for t in omitted.graph.initializer)
    assert "layers.0.attention.rotary_emb.flag" not in {t.name for t in omitted.graph.initializer}


def test_omitting_a_block_keeps_the_other_weights() -> None:
    full = {t.name: t for t in _model(TransformerConfig()).graph.initializer}
    pruned = {t.name: t for t in _model(TransformerConfig(omit_blocks=(1,))).graph.initializer}
    assert set(pruned) == {name for name in full if not name.startswith("layers.1.")}
    assert all(pruned[name] == full[name] for name in pruned)


def test_parameter_count() -> None:
    c = TransformerConfig()
    per_block = 4 * c.hidden**2 + 3 * c.hidden * c.ffn + 2 * c.hidden + 3  # + 3 one-element flags
    outside = 2 * c.vocab_size * c.hidden + c.hidden + c.head_dim // 2
    assert parameter_count(_model(c)) == outside + c.num_layers * per_block
    assert parameter_count(_model(TransformerConfig(omit_blocks=(1,)))) == outside + 3 * per_block


@pytest.mark.parametrize(
    "kwargs",
    [
        {"flag_form": "implicit"},
        {"declared_in": "attribute"},
        {"zero_blocks": (4,)},
        {"zero_blocks": (1,), "omit_blocks": (1,)},
        {"zero_rotary": (1,), "omit_rotary": (1,)},
        {"flags": False, "zero_norms": (0,)},
    ],
)
def test_invalid_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        TransformerConfig(**kwargs)
