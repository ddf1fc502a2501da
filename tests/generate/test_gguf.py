"""``layerzero export DIR --gguf FILE``: a GGUF file (llama.cpp's format) written by the ``gguf`` package for a tiny
Llama — Q8_0 weights, the q/k rows permuted as llama.cpp's converter writes them — exported through transformers'
GGUF loader (it dequantizes); the export's logits and greedy ids equal transformers' on the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package (pip install -e '.[export]')")
pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")

from layerzero.cli import main  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 96, 64, 2, 4, 2, 128
PROMPT = [5, 17, 33, 2, 9]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The q/k row order llama.cpp's converter writes (transformers' loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                      max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False)  # fmt: skip
    state = {k: v.detach().numpy() for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"w{i}" for i in range(VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([1] * VOCAB)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def tensor(name: str, array: np.ndarray, quantized: bool = True) -> None:
        array = np.ascontiguousarray(array.astype(np.float32))
        if quantized:
            w.add_tensor(name, gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, array)

    tensor("token_embd.weight", state["model.embed_tokens.weight"])
    tensor("output_norm.weight", state["model.norm.weight"], quantized=False)
    tensor("output.weight", state["lm_head.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"], quantized=False)
        tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"], quantized=False)
        tensor(f"blk.{i}.attn_q.weight", _permute(state[p + "self_attn.q_proj.weight"], HEADS))
        tensor(f"blk.{i}.attn_k.weight", _permute(state[p + "self_attn.k_proj.weight"], KV_HEADS))
        tensor(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        tensor(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            tensor(f"blk.{i}.{ours}.weight", state[p + f"mlp.{theirs}.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    _write_gguf(folder / "tiny.Q8_0.gguf")
    return folder


@pytest.fixture(scope="module")
def exported(gguf_dir: Path) -> Path:
    out = gguf_dir / "export" / "model.onnx"
    assert main(["export", str(gguf_dir), "--gguf", "tiny.Q8_0.gguf", "-o", str(out)]) == 0
    return out


def _hf(gguf_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file="tiny.Q8_0.gguf").eval()


def test_export_of_a_gguf_file_equals_transformers_on_it(gguf_dir: Path, exported: Path) -> None:
    model = _hf(gguf_dir)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits.numpy()
    engine = Engine.load(exported)
    got = engine.run(engine.first_step_feeds({"input_ids": np.array([PROMPT])})).outputs["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        hf_ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()  # fmt: skip
    assert engine.generate(PROMPT, max_new_tokens=12, stop_tokens=()).ids == hf_ids
    assert len(set(hf_ids)) > 2


def test_gguf_quantization_is_what_transformers_dequantizes(gguf_dir: Path) -> None:
    # The file really holds Q8_0 blocks (the export path reads quantized weights, not a float copy).
    reader = gguf.GGUFReader(str(gguf_dir / "tiny.Q8_0.gguf"))
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert kinds["output_norm.weight"] == gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("case", ["missing", "not gguf"])
def test_a_bad_gguf_argument_is_one_line_exit_2(gguf_dir: Path, tmp_path: Path, case: str, capsys) -> None:
    if case == "not gguf":
        (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
        name = str(tmp_path / "fake.gguf")
    else:
        name = "absent.gguf"
    assert main(["export", str(gguf_dir), "--gguf", name, "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and ("no such file" in err or "not a GGUF file" in err), err
    assert not (tmp_path / "m.onnx").exists()
