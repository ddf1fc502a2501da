"""Real exports: a tiny Hugging Face Llama through ``torch.onnx.export(dynamo=True)``, then LayerZero.

Three exports, one per module run (each takes seconds):

- rotary disabled (``inv_freq = 0``): cos = 1 and sin = 0, so Cos, Sin and every rotate-half
  (Slice, Slice, Neg, Concat) must fold away;
- decoder layers wrapped in a *consumed* flag (``x + flag * (layer(x) - x)`` and
  ``Where(flag > 0.5, layer(x), x)``) with some flags 0: those layers and their weights must go;
- a plain export with a *declared* flag (an unread ``model.layers.1.flag = 0`` initializer) added
  after export: layer 1 must be bypassed, found through the exporter's name-scope metadata.

Each compiled model is run with onnxruntime against the exported original and against PyTorch's
own hand-pruned model (the flagged layers deleted), on more than one sequence length.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch", reason="real-export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip(
    "transformers", reason="real-export tests need transformers (pip install -e '.[export]')"
)
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from layerzero.compile import compile_model  # noqa: E402
from layerzero.options import CompileOptions  # noqa: E402
from layerzero.passes._graph import scope_of  # noqa: E402
from tests.tiny_llama import export_logits, ort_logits, tiny_llama, token_feeds  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB = 128
LAYERS = 4
ATOL = 1e-5
SHAPES = [(1, 1), (1, 16), (2, 16)]  # (batch, seq); the exports are traced at (2, 8)


def _llama(seed: int = 0) -> torch.nn.Module:
    return tiny_llama(LAYERS, VOCAB, seed)


def _rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module with an ``inv_freq`` buffer (one shared module here; per layer in some versions)."""
    return [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]


class FlaggedLayer(torch.nn.Module):
    """A decoder layer switched by a consumed flag buffer (exported as ``<layer scope>.flag``)."""

    def __init__(self, layer: torch.nn.Module, flag: float, form: str) -> None:
        super().__init__()
        self.layer = layer
        self.form = form
        self.register_buffer("flag", torch.tensor([flag], dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = self.layer(hidden_states, *args, **kwargs)
        if self.form == "mul":
            return hidden_states + self.flag * (out - hidden_states)  # x + flag * (f(x) - x)
        return torch.where(self.flag > 0.5, out, hidden_states)  # Where(flag > 0.5, f(x), x)


def _export(model: torch.nn.Module, path: Path) -> Path:
    return export_logits(model, path, VOCAB)


def _feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    return token_feeds(VOCAB, batch, seq, seed)


def _torch_logits(model: torch.nn.Module, feeds: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(feeds["input_ids"]), use_cache=False).logits.numpy()


def _prune(model: torch.nn.Module, omit: set[int]) -> torch.nn.Module:
    """The hand-pruned oracle: the same weights with layers ``omit`` deleted."""
    kept = [layer for i, layer in enumerate(model.model.layers) if i not in omit]
    model.model.layers = torch.nn.ModuleList(kept)
    model.config.num_hidden_layers = len(kept)
    return model


def _in_scope(scope: str, prefix: str) -> bool:
    return scope == prefix or scope.startswith(prefix + ".")


def _nodes_in(model: ir.Model, prefix: str) -> list[ir.Node]:
    return [n for n in model.graph.all_nodes() if _in_scope(scope_of(n), prefix)]


def _params(model: ir.Model) -> int:
    return sum(v.const_value.size for v in model.graph.initializers.values() if v.const_value is not None)


def _tensors(model: ir.Model) -> set[str]:
    return {n for n, v in model.graph.initializers.items() if v.const_value is not None and v.const_value.size > 1}


def _size(model: ir.Model, names: set[str]) -> int:
    return sum(model.graph.initializers[n].const_value.size for n in names)


def _rotate_half(model: ir.Model) -> list[ir.Node]:
    """The nodes of every rotate-half: Concat(Neg(Slice(x)), Slice(x)) with both slices of one x."""
    found: list[ir.Node] = []
    for concat in model.graph.all_nodes():
        if concat.op_type != "Concat" or len(concat.inputs) != 2:
            continue
        neg, second = (v.producer() if v is not None else None for v in concat.inputs)
        if neg is None or second is None or neg.op_type != "Neg" or second.op_type != "Slice":
            continue
        first = neg.inputs[0].producer()
        if first is None or first.op_type != "Slice" or first.inputs[0] is not second.inputs[0]:
            continue
        found += [concat, neg, first, second]
    return found


def _assert_close(actual: np.ndarray, expected: np.ndarray, atol: float = ATOL) -> None:
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)


@dataclasses.dataclass
class Export:
    path: Path
    torch_model: torch.nn.Module  # the exported module, as exported
    oracle: torch.nn.Module | None = None  # the flagged layers deleted
    omitted: tuple[int, ...] = ()
    omitted_params: int = 0


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_llama")


@pytest.fixture(scope="module")
def rotary_off(tmp: Path) -> Export:
    model = _llama()
    modules = _rotary_modules(model)
    assert modules, "no rotary module with an inv_freq buffer in this transformers version"
    for module in modules:
        module.inv_freq.zero_()
        if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
            module.original_inv_freq.zero_()
    return Export(_export(model, tmp / "rotary_off.onnx"), model)


@pytest.fixture(scope="module")
def flagged(tmp: Path) -> Export:
    omitted = {1: "mul", 3: "where"}
    model = _llama(seed=1)
    oracle = _llama(seed=1)
    layers = model.model.layers
    for i in range(LAYERS):
        layers[i] = FlaggedLayer(layers[i], 0.0 if i in omitted else 1.0, omitted.get(i, "mul" if i % 2 else "where"))
    omitted_params = sum(p.numel() for i in omitted for p in oracle.model.layers[i].parameters())
    path = _export(model, tmp / "flagged.onnx")
    return Export(path, model, _prune(oracle, set(omitted)), tuple(omitted), omitted_params)


@pytest.fixture(scope="module")
def plain(tmp: Path) -> Export:
    model = _llama(seed=2)
    return Export(_export(model, tmp / "plain.onnx"), model)


# --------------------------------------------------------------------------------------------- rotary


def test_export_keeps_names_and_dynamic_dims(rotary_off: Export) -> None:
    model = ir.load(rotary_off.path)
    assert [v.name for v in model.graph.inputs] == ["input_ids"]
    assert [str(d) for d in model.graph.inputs[0].shape] == ["batch", "seq"]
    scopes = {scope_of(n) for n in model.graph.all_nodes()}
    assert {f"model.layers.{i}" for i in range(LAYERS)} <= scopes
    assert "model.rotary_emb" in scopes
    # The exporter's name scopes end with the fx node's own name, which is not a scope.
    assert all(not s.startswith(("linear", "add", "mul")) for s in scopes)


def test_rotary_disabled_folds_cos_sin_and_rotate_half(rotary_off: Export) -> None:
    original = ir.load(rotary_off.path)
    before_ops = _histogram(original)
    before_rotate = _rotate_half(original)
    assert before_ops["Cos"] == before_ops["Sin"] == 1
    assert before_ops["Neg"] == 2 * LAYERS  # rotate_half of q and of k in every layer
    assert len(before_rotate) == 4 * 2 * LAYERS

    result = compile_model(rotary_off.path, CompileOptions(atol=ATOL, rtol=0, fuse=False))  # the zeroing alone
    after_ops = _histogram(result.model)
    assert after_ops["Cos"] == after_ops["Sin"] == after_ops["Neg"] == 0
    assert _rotate_half(result.model) == []
    rotate_slices = sum(1 for n in before_rotate if n.op_type == "Slice")
    assert after_ops["Slice"] == before_ops["Slice"] - rotate_slices
    assert after_ops["Concat"] <= before_ops["Concat"] - 2 * LAYERS
    assert result.verification is not None and result.verification.passed
    assert "model.rotary_emb" in [r.scope for r in result.removed]
    # Of the tensors (more than one number), only inv_freq goes: no weight is lost on the way.
    assert _tensors(original) - _tensors(result.model) == {"model.rotary_emb.inv_freq"}

    for batch, seq in SHAPES:
        feeds = _feeds(batch, seq)
        compiled = ort_logits(result.model, feeds)
        _assert_close(compiled, ort_logits(rotary_off.path, feeds))
        _assert_close(compiled, _torch_logits(rotary_off.torch_model, feeds), atol=1e-4)


def _histogram(model: ir.Model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.all_nodes():
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return _Zero(counts)


class _Zero(dict):
    def __missing__(self, key: str) -> int:
        return 0


# --------------------------------------------------------------------------------------------- consumed


def test_consumed_layer_flags_remove_layers(flagged: Export) -> None:
    original = ir.load(flagged.path)
    flags = sorted(n for n in original.graph.initializers if n.endswith(".flag"))
    assert flags, f"the exporter dropped the flag buffers: {sorted(original.graph.initializers)}"
    for i in flagged.omitted:
        assert _nodes_in(original, f"model.layers.{i}")

    result = compile_model(flagged.path, CompileOptions(atol=ATOL, rtol=0))

    for i in range(LAYERS):
        left = _nodes_in(result.model, f"model.layers.{i}")
        if i in flagged.omitted:
            assert left == [], f"layer {i} is flagged 0 but keeps {[n.name for n in left]}"
        else:
            assert left, f"layer {i} is flagged 1 but was removed"
    removed = {r.scope: r for r in result.removed}
    for i in flagged.omitted:
        assert f"model.layers.{i}" in removed
    # Of the tensors (more than one number), exactly the omitted layers' weights go.
    assert _size(original, _tensors(original) - _tensors(result.model)) == flagged.omitted_params
    assert result.before.params - result.after.params < flagged.omitted_params + 32  # + flags, scalar constants
    assert result.verification is not None and result.verification.passed

    for batch, seq in SHAPES:
        feeds = _feeds(batch, seq)
        compiled = ort_logits(result.model, feeds)
        _assert_close(compiled, ort_logits(flagged.path, feeds))
        _assert_close(compiled, _torch_logits(flagged.oracle, feeds), atol=1e-4)


# --------------------------------------------------------------------------------------------- declared


@pytest.mark.parametrize("layer", [1, 0])
def test_declared_flag_on_export_bypasses_layer(plain: Export, tmp: Path, layer: int) -> None:
    """Layer 0 is the hard case: the exporter's CSE puts what all layers share (the rotary tables
    unsqueezed for the heads, the float attention mask, shape vectors) into layer 0's scope, so
    values other than the hidden state leave it. Those do not read the hidden state and stay."""
    scope = f"model.layers.{layer}"
    proto = onnx.load(str(plain.path))
    assert scope in {scope_of(n) for n in ir.from_proto(proto).graph.all_nodes()}
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1, np.float32), f"{scope}.flag"))
    path = tmp / f"declared_{layer}.onnx"
    onnx.save(proto, str(path))
    original = ir.load(path)
    oracle = _prune(_llama(seed=2), {layer})
    layer_params = sum(p.numel() for p in plain.torch_model.model.layers[layer].parameters())

    result = compile_model(path, CompileOptions(atol=ATOL, rtol=0))

    assert [b.scope for b in result.pipeline.bypassed] == [scope]
    assert [(r.scope, r.kind) for r in result.removed] == [(scope, "declared-flag")]
    left = _nodes_in(result.model, scope)
    if layer == 0:  # only the shared side values are left: no projection, norm or attention
        assert {n.op_type for n in left} <= {"Concat", "Unsqueeze", "Where", "Shape", "Slice", "Squeeze", "Cast"}
        assert not any(_in_scope(scope_of(n), f"{scope}.{sub}") for n in left for sub in ("mlp", "input_layernorm"))
    else:
        assert left == []
    for i in set(range(LAYERS)) - {layer}:
        assert any(n.op_type == "MatMul" for n in _nodes_in(result.model, f"model.layers.{i}"))
    assert _size(original, _tensors(original) - _tensors(result.model)) == layer_params
    assert result.before.params - result.after.params < layer_params + 32  # + the flag, scalar constants
    v = result.verification
    assert v is not None and v.passed
    assert v.impact is not None and max(o.max_abs for o in v.impact) > 1e-3  # the layer did something

    for batch, seq in SHAPES:
        feeds = _feeds(batch, seq)
        _assert_close(ort_logits(result.model, feeds), _torch_logits(oracle, feeds), atol=1e-4)
