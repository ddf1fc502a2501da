"""From a Hugging Face folder to generated tokens: ``export`` -> ``flag`` -> ``compile`` -> ``generate``.

One tiny Llama (random weights, ``save_pretrained``, with a word-level tokenizer.json) is exported once per
module with the KV cache (dynamo exporter); the compiled bundle must generate exactly transformers' greedy
tokens, and a flag added with ``layerzero flag`` must take its layer out (the oracle: the same weights with
that MLP's output projection zeroed, which is what bypassing it computes).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from layerzero.cli import main  # noqa: E402
from layerzero.errors import InvalidInputError, UnsupportedModelError  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402
from layerzero.runtime.generate import choose_token  # noqa: E402
from tests.tiny_llama import greedy_llama_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB, LAYERS, NEW = 128, 2, 16
PROMPT = [5, 17, 99, 3, 42, 7]


def _config() -> transformers.LlamaConfig:
    return greedy_llama_config(LAYERS, VOCAB)


def _hf_greedy(model_dir: Path, prompt: list[int], new: int = NEW, zero_mlp: int | None = None) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    if zero_mlp is not None:
        with torch.no_grad():
            model.model.layers[zero_mlp].mlp.down_proj.weight.zero_()
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("generate")


@pytest.fixture(scope="module")
def llama_dir(tmp: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    path = tmp / "tiny-llama"
    model.save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(path / "tokenizer.json"))
    return path


# exported, bundle: tests/generate/conftest.py


def test_export_names_dims_and_tokenizer(exported: Path) -> None:
    graph = onnx.load(str(exported), load_external_data=False).graph
    kv = [f"{i}.{k}" for i in range(LAYERS) for k in ("key", "value")]
    assert [v.name for v in graph.input] == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{n}" for n in kv
    ]
    assert [v.name for v in graph.output] == ["logits"] + [f"present.{n}" for n in kv]
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}
    assert dims["input_ids"] == ["batch", "seq"]
    assert dims["past_key_values.0.key"] == ["batch", 2, "past", 16]
    assert (exported.parent / "tokenizer.json").is_file()


def test_compiled_generate_matches_transformers_greedy(llama_dir: Path, exported: Path, bundle: Path) -> None:
    expected = _hf_greedy(llama_dir, PROMPT)
    assert len(set(expected)) > 3, "the oracle should not be one repeated token"
    compiled = Engine.load(bundle).generate(PROMPT, max_new_tokens=NEW, stop_tokens=())
    assert compiled.ids == expected
    assert Engine.load(exported).generate(PROMPT, max_new_tokens=NEW).ids == expected
    report = compiled.report
    assert report.new_tokens == NEW and report.prompt_tokens == len(PROMPT) and report.cache
    assert [s.tokens for s in report.steps] == [len(PROMPT)] + [1] * (NEW - 1)
    assert report.tokens_per_s > 0 and report.time_to_first_token_s > 0 and report.decode_tokens_per_s
    assert report.total_layers == LAYERS


def test_bound_steps_direct_and_public_bindings_agree(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The decode loop drives onnxruntime's C binding directly when it has one (this onnxruntime does); the
    # public IOBinding path it falls back to must compute the same ids, logits and reports.
    from layerzero.runtime import generate as gen

    engine = Engine.load(bundle)
    found: list[object] = []
    real = gen._direct_binding
    monkeypatch.setattr(
        gen, "_direct_binding", lambda session, binding: found.append(real(session, binding)) or found[-1]
    )
    direct = engine.generate(PROMPT, max_new_tokens=NEW, stop_tokens=(), masks=True)
    assert len(found) == 1 and found[0] is not None, "the direct binding was not used"
    monkeypatch.setattr(gen, "_direct_binding", lambda session, binding: None)
    public = engine.generate(PROMPT, max_new_tokens=NEW, stop_tokens=(), masks=True)
    assert direct.ids == public.ids and len(direct.ids) == NEW
    assert [s.tokens for s in direct.report.steps] == [s.tokens for s in public.report.steps]
    assert [s.skipped_paths for s in direct.report.steps] == [s.skipped_paths for s in public.report.steps]
    assert [s.masks for s in direct.report.steps] == [s.masks for s in public.report.steps]


def test_generate_cli_json_ids_and_text(llama_dir: Path, bundle: Path, capsys: pytest.CaptureFixture) -> None:
    expected = _hf_greedy(llama_dir, PROMPT)
    capsys.readouterr()
    assert (
        main(["generate", str(bundle), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "16", "--json"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert doc["ids"] == expected and doc["report"]["new_tokens"] == NEW
    assert doc["text"] == " ".join(f"w{i}" for i in expected)  # the tokenizer beside the source model
    text = " ".join(f"w{i}" for i in PROMPT)
    assert main(["generate", str(bundle), "--prompt", text, "--max-new-tokens", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prompt_ids"] == PROMPT and doc["ids"] == expected
    # Streaming: the text comes out on stdout as it is generated, the report on stderr.
    assert main(["generate", str(bundle), "--prompt", text, "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == " ".join(f"w{i}" for i in expected[:4])
    assert "4 new tokens" in captured.err


def test_stop_tokens_and_sampling(llama_dir: Path, bundle: Path) -> None:
    engine = Engine.load(bundle)
    greedy = _hf_greedy(llama_dir, PROMPT)
    stop = greedy[3]
    first = greedy.index(stop)
    out = engine.generate(PROMPT, max_new_tokens=NEW, stop_tokens=[stop])
    assert out.ids == greedy[: first + 1] and out.report.stop_reason == "stop_token"
    streamed: list[int] = []
    a = engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3, on_token=streamed.append)
    b = engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3)
    c = engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=4)
    assert a.ids == b.ids == streamed and a.ids != c.ids
    assert engine.generate(PROMPT, max_new_tokens=8, temperature=5.0, top_k=1, seed=0).ids == greedy[:8]
    with pytest.raises(InvalidInputError, match="top_p"):
        engine.generate(PROMPT, top_p=0)
    with pytest.raises(InvalidInputError, match="empty"):
        engine.generate([])
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        engine.generate([1, VOCAB])


def test_choose_top_k_top_p() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(0)
    assert choose_token(logits, 0.0, 0, 1.0, rng) == 0
    assert {choose_token(logits, 1.0, 0, 0.5, rng) for _ in range(50)} == {0}  # 0.5 alone reaches p = 0.5
    assert {choose_token(logits, 1.0, 0, 0.8, rng) for _ in range(200)} == {0, 1}
    assert {choose_token(logits, 1.0, 3, 1.0, rng) for _ in range(300)} == {0, 1, 2}


def test_flag_removes_its_layer(llama_dir: Path, exported: Path, tmp: Path, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["flag", str(exported), "--list"]) == 0
    listed = capsys.readouterr().out
    assert "model.layers.1.mlp" in listed
    flagged, lz = tmp / "export" / "flagged.onnx", tmp / "flagged.lz"
    # A whole decoder layer also writes its present key/value: not a layer that can be bypassed here.
    assert main(["flag", str(exported), "model.layers.1", "-o", str(flagged)]) == 2
    assert "model.layers.1" in capsys.readouterr().err
    assert main(["flag", str(exported), "model.layers.9.mlp", "-o", str(flagged)]) == 2
    assert main(["flag", str(exported), "model.layers.1.mlp", "-o", str(flagged)]) == 0
    inits = {t.name: t for t in onnx.load(str(flagged)).graph.initializer}
    assert onnx.numpy_helper.to_array(inits["model.layers.1.mlp.flag"]).tolist() == [0.0]
    assert main(["compile", str(flagged), "-o", str(lz)]) == 0
    manifest = json.loads((lz / "manifest.json").read_text())
    removed = {r["scope"]: r for r in manifest["removed"]}
    assert removed["model.layers.1.mlp"]["kind"] == "declared-flag"
    assert removed["model.layers.1.mlp"]["params"] == 3 * 64 * 128  # gate, up and down projections
    assert manifest["stats"]["params_before"] - manifest["stats"]["params_after"] >= 3 * 64 * 128
    expected = _hf_greedy(llama_dir, PROMPT, zero_mlp=1)
    out = Engine.load(lz).generate(PROMPT, max_new_tokens=NEW)
    assert out.ids == expected and out.ids != _hf_greedy(llama_dir, PROMPT)
    # The metadata form works the same way.
    meta = tmp / "export" / "flagged_meta.onnx"
    assert main(["flag", str(exported), "model.layers.1.mlp", "--metadata", "-o", str(meta)]) == 0
    props = {p.key: p.value for p in onnx.load(str(meta), load_external_data=False).metadata_props}
    assert props["model.layers.1.mlp.flag"] == "0"


def test_torch_add_flag_consumed_form(tmp: Path) -> None:
    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions
    from layerzero.torch_flags import add_flag

    config = _config()
    config.use_cache = False
    config._attn_implementation = "eager"  # the TorchScript exporter cannot take SDPA's mask (aten::diff)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    oracle = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()  # its own config: it loses a layer
    oracle.load_state_dict(model.state_dict())
    oracle.model.layers = torch.nn.ModuleList([oracle.model.layers[0]])
    oracle.config.num_hidden_layers = 1
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        plain = model(ids).logits
        handle = add_flag(model.model.layers[1], 1)
        assert torch.equal(model(ids).logits, plain)  # Where selects: flag 1 changes nothing
        handle.remove()
        del model.model.layers[1].flag
        add_flag(model.model.layers[1], 0)
        assert not torch.allclose(plain, oracle(ids).logits, atol=1e-3)
        torch.testing.assert_close(model(ids).logits, oracle(ids).logits, rtol=0, atol=1e-5)
    path = tmp / "torch_flag.onnx"
    # No constant folding at export: TorchScript would fold the flag itself (its layer gone before LayerZero).
    # With the mask and positions given (as `layerzero export` does), no packed-sequence check (aten::diff) runs.
    args = (ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
    names = ["input_ids", "attention_mask", "position_ids"]
    torch.onnx.export(
        model,
        args,
        str(path),
        dynamo=False,
        input_names=names,
        output_names=["logits"],
        dynamic_axes={n: {1: "seq"} for n in names},
        do_constant_folding=False,
    )
    assert "model.layers.1.flag" in {t.name for t in onnx.load(str(path)).graph.initializer}
    result = compile_model(path, CompileOptions(atol=1e-5, rtol=0))
    layer_params = sum(p.numel() for p in model.model.layers[1].parameters())
    assert result.before.layers == ["model.layers.0", "model.layers.1"]
    assert result.after.layers == ["model.layers.0"]
    # The exporter shares the (all-ones) norm weights between layers: those stay for layer 0.
    assert layer_params - 2 * 64 <= result.before.params - result.after.params <= layer_params
    with pytest.raises(InvalidInputError, match="already has"):
        add_flag(model.model.layers[1])


def test_export_and_generate_refuse_with_reason(tmp: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp / "not-causal"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5"}))
    capsys.readouterr()
    assert main(["export", str(folder), "-o", str(tmp / "t5.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not-causal" in err
    assert main(["export", str(tmp / "missing"), "-o", str(tmp / "m.onnx")]) == 2
    plain = tmp / "plain.onnx"
    onnx.save(
        onnx.parser.parse_model(
            '<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) { y = Relu(x) }'
        ),
        str(plain),
    )
    with pytest.raises(UnsupportedModelError, match="input_ids"):
        Engine.load(plain).generate([1, 2])


def test_torchscript_export_flag_and_generate(llama_dir: Path, tmp: Path) -> None:
    """The TorchScript exporter (eager attention, no intermediate shapes): same tokens, flags found after
    shape inference."""
    exported, flagged, lz = tmp / "ts" / "model.onnx", tmp / "ts" / "flagged.onnx", tmp / "ts.lz"
    assert main(["export", str(llama_dir), "-o", str(exported), "--exporter", "torchscript"]) == 0
    assert Engine.load(exported).generate(PROMPT, max_new_tokens=NEW, stop_tokens=()).ids == _hf_greedy(
        llama_dir, PROMPT
    )
    assert main(["flag", str(exported), "model.layers.1.mlp", "-o", str(flagged)]) == 0
    assert main(["compile", str(flagged), "-o", str(lz)]) == 0
    out = Engine.load(lz).generate(PROMPT, max_new_tokens=NEW)
    assert out.ids == _hf_greedy(llama_dir, PROMPT, zero_mlp=1)


def test_large_export_keeps_its_weights_in_external_data(
    llama_dir: Path, exported: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above EXTERNAL_DATA_BYTES the weights move to ``<name>.data`` (mapped at load, not parsed and copied);
    the model computes exactly what the inline export does."""
    import onnxruntime as ort

    from layerzero import hf_export

    monkeypatch.setattr(hf_export, "EXTERNAL_DATA_BYTES", 0)
    out = tmp / "external" / "model.onnx"
    out.parent.mkdir()
    (out.parent / "model.onnx.data").write_bytes(b"stale")  # not the export's: refused, never appended to
    assert main(["export", str(llama_dir), "-o", str(out)]) == 2
    assert (out.parent / "model.onnx.data").read_bytes() == b"stale"
    (out.parent / "model.onnx.data").unlink()
    assert main(["export", str(llama_dir), "-o", str(out)]) == 0
    # Replaced with --force (its own export): the new weights are written, not appended to the old ones.
    size = (out.parent / "model.onnx.data").stat().st_size
    assert main(["export", str(llama_dir), "-o", str(out), "--force"]) == 0
    assert (out.parent / "model.onnx.data").stat().st_size == size
    graph = onnx.load(str(out), load_external_data=False).graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and {e.value for t in external for e in t.external_data if e.key == "location"} == {
        "model.onnx.data"
    }
    assert out.stat().st_size < (out.parent / "model.onnx.data").stat().st_size
    assert not (out.parent / ".model.onnx.tmp").exists()

    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (1, 5), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, 5), np.int64), "position_ids": np.arange(5)[None]}
    for i in range(LAYERS):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros((1, 2, 0, 16), np.float32)
    inline = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    moved = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    np.testing.assert_array_equal(moved, inline)
    assert Engine.load(_compile(out, tmp / "external.lz")).generate(
        PROMPT, max_new_tokens=NEW, stop_tokens=()
    ).ids == _hf_greedy(llama_dir, PROMPT)


def _compile(model: Path, out: Path) -> Path:
    assert main(["compile", str(model), "-o", str(out)]) == 0
    return out
