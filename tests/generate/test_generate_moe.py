"""MoE families through ``export -> compile -> generate``: the export corpus's Mixtral and Qwen3-MoE.

The models are the corpus family table's (``tests/corpus/corpus_families.py``: 2 layers, 4 experts, top-2,
random weights; here with ``initializer_range`` 0.2 so greedy decoding has no near-ties, and no EOS), saved and
exported with ``layerzero export`` (cache-carrying, dynamo) once per family and cached with the corpus's exports
(``corpus_export.get_generate_export``). The export must be rewritten into the skipping MoE form (``dynamic``
entries in the manifest), and the compiled bundle must still generate exactly transformers' greedy tokens,
with per-step skipped experts in the report.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))

from corpus_export import get_generate_export  # noqa: E402
from corpus_families import FAMILIES  # noqa: E402

import layerzero.runtime.generate as generate_module  # noqa: E402
from layerzero.cli import main  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPT, NEW, EXPERTS = [5, 17, 99, 3, 42, 7], 16, 4


def _family(name: str):
    family = FAMILIES[name]
    kwargs = {**family.kwargs, "initializer_range": 0.2, "eos_token_id": None, "bos_token_id": None}
    return dataclasses.replace(family, name=f"{name}_generate", kwargs=kwargs)


def _compiled(spec, tmp_path: Path, block: str = "mlp") -> tuple:
    """(the transformers model, its greedy ids for PROMPT, the compiled bundle's engine): exported (cached),
    compiled with the CLI, both MoE layers (``model.layers.N.<block>``) rewritten."""
    folder = get_generate_export(spec)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder / "hf"), local_files_only=True).eval()
    expected = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None
    )[0, len(PROMPT) :].tolist()
    bundle = tmp_path / "model.lz"
    assert main(["compile", str(folder / "model.onnx"), "-o", str(bundle)]) == 0
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert {d["path"] for d in manifest["dynamic"]} == {f"model.layers.{i}.{block}" for i in range(2)}
    return model, expected, Engine.load(bundle)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_export_compile_generate_matches_transformers(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _family(family)
    assert spec.kwargs["num_experts_per_tok"] == 2 and spec.kwargs["num_hidden_layers"] == 2
    model, expected, engine = _compiled(spec, tmp_path)
    assert model.config.num_local_experts == EXPERTS
    assert generate_module._bindable(engine)  # ONNX Runtime on the CPU: the IO-binding loop
    out = engine.generate(PROMPT, max_new_tokens=NEW, masks=True)
    assert out.ids == expected
    # The plain loop (run() per step, the presents fed back as numpy: the guard's) gives the same tokens, the
    # same skipped experts and the same masks at every step.
    monkeypatch.setattr(generate_module, "_bindable", lambda engine: False)
    plain = engine.generate(PROMPT, max_new_tokens=NEW, masks=True)
    assert plain.ids == expected
    assert [(s.skipped_paths, s.masks) for s in plain.report.steps] == [
        (s.skipped_paths, s.masks) for s in out.report.steps
    ]
    experts = {f"model.layers.{i}.mlp.experts.{e}" for i in range(2) for e in range(EXPERTS)}
    # A decode step runs one token through top-2 of 4 experts per layer: at least 2 per layer are skipped.
    for step in out.report.steps[1:]:
        assert set(step.skipped_paths) <= experts and len(step.skipped_paths) >= 4


def test_qwen3_moe_batch_cli_matches_transformers_batched_greedy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    spec = _family("qwen3_moe")
    folder = get_generate_export(spec)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder / "hf"), local_files_only=True).eval()
    prompts, pad = [PROMPT, [9, 8], [100, 1, 2, 3]], 0
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    expected = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=pad,
        eos_token_id=None,
    )[:, width:].tolist()  # fmt: skip
    bundle = tmp_path / "model.lz"
    assert main(["compile", str(folder / "model.onnx"), "-o", str(bundle)]) == 0
    capsys.readouterr()
    args = [f"--prompt-ids={','.join(map(str, p))}" for p in prompts]
    assert main(["generate", str(bundle), *args, "--max-new-tokens", str(NEW), "--pad-id", "0", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["ids"] for r in results] == expected
    # Each row alone gives its own tokens too: the batch's padding and shared expert skipping change nothing.
    engine = Engine.load(bundle)
    assert [engine.generate(p, max_new_tokens=NEW, stop_tokens=()).ids for p in prompts] == expected


def test_deepseek_v3_compressed_cache_exports_and_generates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLA's compressed cache (DeepSeek-V3: keys [batch, 1, past, kv_lora_rank], values [batch, 1, past,
    qk_rope_head_dim]) is not [batch, kv_heads, past, head_dim]: the export took its example past from the config
    and torch.onnx failed ("Sizes of tensors must match"). It now takes each tensor's shape from a forward's cache,
    and generate keeps one shape per past input."""
    model, expected, engine = _compiled(_family("deepseek_v3"), tmp_path)
    layout = generate_module.cache_layout(engine)
    config = model.config
    assert set(layout.shapes.values()) == {(1, config.kv_lora_rank), (1, config.qk_rope_head_dim)}
    assert engine.generate(PROMPT, max_new_tokens=NEW).ids == expected
    monkeypatch.setattr(generate_module, "_bindable", lambda engine: False)
    assert engine.generate(PROMPT, max_new_tokens=NEW).ids == expected


@pytest.mark.parametrize(("family", "block"), [("deepseek_v2", "mlp"), ("llama4", "feed_forward")])
def test_complex_rotary_families_export_and_generate(family: str, block: str, tmp_path: Path) -> None:
    """DeepSeek-V2's and Llama 4's RoPE is a complex product (``torch.polar``, ``view_as_complex``), which neither
    torch.onnx exporter has: ``layerzero export`` failed for both ("No decompositions registered for the
    complex-valued input"). The export now computes it in real arithmetic (hf_rotary.real_rotary), and the
    compiled model's greedy ids equal transformers' own (complex) ones."""
    _, expected, engine = _compiled(_family(family), tmp_path, block)
    assert engine.generate(PROMPT, max_new_tokens=NEW).ids == expected


def test_real_rotary_equals_the_complex_product_and_is_undone() -> None:
    """The real-valued rotary gives transformers' logits (to float rounding: the complex product rounds its own
    way), and the swap is undone on exit: the modeling module's ``apply_rotary_emb`` and the rotary modules'
    ``forward`` are transformers' again."""
    from layerzero.hf_rotary import real_rotary

    folder = get_generate_export(_family("deepseek_v2"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder / "hf"), local_files_only=True).eval()
    modeling = sys.modules[type(model).__module__]
    original = modeling.apply_rotary_emb
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        complex_logits = model(ids).logits
        with real_rotary(torch, model) as rewritten:
            assert rewritten and modeling.apply_rotary_emb is not original
            real_logits = model(ids).logits
        assert modeling.apply_rotary_emb is original
        assert torch.equal(model(ids).logits, complex_logits)
    torch.testing.assert_close(real_logits, complex_logits, rtol=1e-4, atol=1e-4)


def test_deepseek_v2_torchscript_export_and_llama4_torchscript_refusal(tmp_path: Path, capsys) -> None:
    """The TorchScript exporter takes DeepSeek-V2 through the real rotary too (its logits equal transformers');
    for Llama 4 it writes the chunked-attention mask as a ``CumSum`` of a bool tensor, which ONNX has no kernel
    for: ``layerzero export`` refuses in one line naming it (exit 2, nothing left behind) instead of writing a
    model ONNX Runtime cannot load."""
    import onnxruntime as ort

    folder = get_generate_export(_family("deepseek_v2"))
    out = tmp_path / "ds.onnx"
    assert main(["export", str(folder / "hf"), "-o", str(out), "--exporter", "torchscript"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder / "hf"), local_files_only=True).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = model(ids).logits.numpy()
    engine = Engine.load(out)
    got = engine.run(engine.first_step_feeds({"input_ids": ids.numpy()})).outputs["logits"]
    assert abs(got - expected).max() < 1e-4
    assert ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]) is not None

    folder = get_generate_export(_family("llama4"))
    out = tmp_path / "l4.onnx"
    capsys.readouterr()
    assert main(["export", str(folder / "hf"), "-o", str(out), "--exporter", "torchscript"]) == 2
    err = capsys.readouterr().err  # transformers' loading progress bar writes there too
    errors = [line for line in err.splitlines() if line.startswith("layerzero export: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "does not type-check" in errors[0] and "CumSum" in errors[0] and "--exporter dynamo" in errors[0]
    assert not out.exists() and not out.with_name("l4.onnx.data").exists()
