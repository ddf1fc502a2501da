"""Static zeroing on real exports of both torch.onnx exporters (issue 8, items 1-2).

Tiny transformers configs with random weights are exported at test time and cached under
``~/.cache/layerzero/lattice-tests/<torch>-<transformers>/``. The TorchScript exporter
(``dynamo=False``) names almost no intermediate dim, so these prove that the lattice derives shapes
from operands, not from dim names:

- rotary families with ``inv_freq = 0`` (the rotation is the identity): Cos, Sin and rotate-half's
  Neg must be gone and the compiled model must equal the original on several sequence lengths;
- MLPs with a zero weight and a kept bias (GPT-2's ``Gemm`` Conv1D, GPT-NeoX's Linear): ``x @ 0 + b``
  is a row constant, so a zero up-projection leaves no MatMul/Gemm of that MLP, and GPT-2's zero
  ``c_proj`` leaves none either (the residual adds the bias row).
"""

from __future__ import annotations

import collections
import warnings
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch", reason="real-export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="real-export tests need transformers")

from layerzero.options import CompileOptions  # noqa: E402
from layerzero.passes._graph import scope_of  # noqa: E402
from layerzero.pipeline import run_static_passes  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

VOCAB = 64
CACHE = Path.home() / ".cache" / "layerzero" / "lattice-tests" / f"{torch.__version__}-{transformers.__version__}"
SHAPES = [(1, 1), (2, 5), (1, 16)]  # (batch, seq); traced at (2, 8)
COMMON = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": VOCAB,
    "max_position_embeddings": 32,
    "use_cache": False,
}
ROTARY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


class _Logits(torch.nn.Module):
    """input_ids, attention_mask -> logits (an explicit mask keeps TorchScript off unsupported ops)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


# family -> (config class, model class, config, the MLP's module path, {variant: parameters zeroed})
MLPS = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 32, "n_layer": 1, "n_head": 2, "vocab_size": VOCAB, "n_positions": 32, "use_cache": False},
        "transformer.h.0.mlp",
        {"zero-up": ["c_fc.weight"], "zero-down": ["c_proj.weight"]},
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {**COMMON, "num_key_value_heads": 2},
        "gpt_neox.layers.0.mlp",
        {"zero-up": ["dense_h_to_4h.weight"]},
    ),
}


def _build(family: str, variant: str = "zero-inv-freq") -> torch.nn.Module:
    if family in MLPS:
        return _build_mlp(family, variant)
    if family == "gptj":
        return _build_gptj()
    config_cls, model_cls = ROTARY[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON)
    config._attn_implementation = "eager"
    if family == "phi3":
        config.pad_token_id = 0
    model = getattr(transformers, model_cls)(config).eval()
    for module in model.modules():
        for name in ("inv_freq", "original_inv_freq"):
            buffer = getattr(module, name, None)
            if isinstance(buffer, torch.Tensor):
                buffer.zero_()
    return model


def _build_gptj() -> torch.nn.Module:
    """GPT-J with its cached ``[positions, sin | cos]`` table as zero frequencies make it: sin 0, cos 1."""
    torch.manual_seed(0)
    config = transformers.GPTJConfig(
        n_embd=32, n_layer=1, n_head=2, rotary_dim=8, vocab_size=VOCAB, n_positions=32, use_cache=False
    )
    config._attn_implementation = "eager"
    model = transformers.GPTJForCausalLM(config).eval()
    tables = [
        m.embed_positions for m in model.modules() if isinstance(getattr(m, "embed_positions", None), torch.Tensor)
    ]
    assert tables, "GPT-J keeps no embed_positions table in this transformers version"
    for table in tables:
        half = table.shape[-1] // 2
        table[..., :half] = 0.0
        table[..., half:] = 1.0
    return model


def _build_mlp(family: str, variant: str) -> torch.nn.Module:
    config_cls, model_cls, kwargs, mlp_path, variants = MLPS[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    mlp = model.get_submodule(mlp_path)
    with torch.no_grad():
        for name in variants[variant]:
            mlp.get_parameter(name).zero_()
            bias = mlp.get_parameter(name.replace("weight", "bias"))
            bias.normal_()  # the bias is kept (and not zero): x @ 0 + b is b over every token
    return model


def _export(family: str, dynamo: bool, variant: str = "zero-inv-freq") -> Path:
    path = CACHE / f"{family}-{variant}-{'dynamo' if dynamo else 'torchscript'}.onnx"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(0, VOCAB, (2, 8))
    args = (ids, torch.ones_like(ids))
    names = ["input_ids", "attention_mask"]
    tmp = path.with_suffix(".tmp.onnx")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            batch, seq = torch.export.Dim("batch", max=8), torch.export.Dim("seq", max=32)
            shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
            program = torch.onnx.export(
                _Logits(_build(family, variant)), args, input_names=names, dynamic_shapes=shapes, dynamo=True
            )
            program.save(str(tmp))
        else:
            axes = {n: {0: "batch", 1: "seq"} for n in names}
            torch.onnx.export(
                _Logits(_build(family, variant)),
                args,
                str(tmp),
                input_names=names,
                output_names=["logits"],
                dynamic_axes=axes,
                opset_version=17,
                dynamo=False,
            )
    tmp.rename(path)  # a half-written export is never taken from the cache
    return path


def _run(model: ir.Model | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = str(model) if isinstance(model, Path) else ir.to_proto(model).SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * 100 + seq)
    return {
        "input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
    }


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("family", sorted(ROTARY))
def test_zero_inv_freq_removes_the_rotation(family, dynamo):
    if dynamo:
        pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    path = _export(family, dynamo)
    model = ir.load(str(path))
    before = collections.Counter(n.op_type for n in model.graph.all_nodes())
    assert before["Cos"] >= 1 and before["Sin"] >= 1, before  # the export really rotates
    result = run_static_passes(model, CompileOptions())
    assert result.converged
    after = collections.Counter(n.op_type for n in model.graph.all_nodes())
    assert after["Cos"] == 0 and after["Sin"] == 0 and after["Neg"] == 0, after
    assert sum(after.values()) < sum(before.values())
    for batch, seq in SHAPES:
        feeds = _feeds(batch, seq)
        (expected,) = _run(path, feeds)
        (got,) = _run(model, feeds)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"{family} {batch}x{seq}")
    # A second run finds nothing left to do.
    again = run_static_passes(model, CompileOptions())
    assert again.iterations == 1 and not any(again.modified_by.values()), again.modified_by


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_gptj_cached_table_with_zero_frequencies_removes_the_rotation(dynamo):
    # The table is constant per half once the frequencies are zero; the halves appear after Gather + Split.
    if dynamo:
        pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    path = _export("gptj", dynamo, "zero-table")
    model = ir.load(str(path))
    before = collections.Counter(n.op_type for n in model.graph.all_nodes())
    assert before["Neg"] >= 1, before  # rotate-every-two is there to remove
    assert run_static_passes(model, CompileOptions()).converged
    after = collections.Counter(n.op_type for n in model.graph.all_nodes())
    assert after["Neg"] == 0 and after["Split"] == 0, after
    for batch, seq in SHAPES:
        feeds = _feeds(batch, seq)
        np.testing.assert_allclose(_run(model, feeds)[0], _run(path, feeds)[0], rtol=1e-5, atol=1e-5)


def _contractions_in(model: ir.Model, scope: str) -> int:
    return sum(
        1
        for node in model.graph.all_nodes()
        if node.op_type in ("MatMul", "Gemm") and f".{scope}." in f".{scope_of(node)}."
    )


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize(("family", "variant"), [("gpt2", "zero-up"), ("gpt2", "zero-down"), ("gpt_neox", "zero-up")])
def test_zero_weight_with_bias_leaves_no_contraction_of_the_mlp(family, variant, dynamo):
    if dynamo:
        pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
    path = _export(family, dynamo, variant)
    model = ir.load(str(path))
    scope = MLPS[family][3]
    assert _contractions_in(model, scope) == 2, "the export has the MLP's two contractions where we look"
    before = collections.Counter(n.op_type for n in model.graph.all_nodes())
    result = run_static_passes(model, CompileOptions())
    assert result.converged
    after = collections.Counter(n.op_type for n in model.graph.all_nodes())
    assert _contractions_in(model, scope) == 0, after
    contractions = before["MatMul"] + before["Gemm"] - after["MatMul"] - after["Gemm"]
    assert contractions == 2, (before, after)  # only the MLP's: attention and the head stay
    for batch, seq in SHAPES:
        feeds = _feeds(batch, seq)
        (expected,) = _run(path, feeds)
        (got,) = _run(model, feeds)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"{family} {batch}x{seq}")
    again = run_static_passes(model, CompileOptions())
    assert again.iterations == 1 and not any(again.modified_by.values()), again.modified_by
