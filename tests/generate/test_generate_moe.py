"""MoE families through ``export -> compile -> generate``: tiny Mixtral and Qwen3-MoE (random weights).

The cache-carrying dynamo export must be rewritten into the skipping MoE form (``dynamic`` entries in the
manifest), and the compiled bundle must still generate exactly transformers' greedy tokens, with per-step
skipped experts in the report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from layerzero.cli import main  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPT, NEW, EXPERTS = [5, 17, 99, 3, 42, 7], 16, 4
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
)


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=EXPERTS, num_experts_per_tok=2, **COMMON)
        return transformers.MixtralForCausalLM(config).eval()
    config = transformers.Qwen3MoeConfig(
        num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, head_dim=16,
        **COMMON,
    )
    return transformers.Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_export_compile_generate_matches_transformers(family: str, tmp_path: Path) -> None:
    model = _model(family)
    folder = tmp_path / family
    model.save_pretrained(folder)
    expected = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None
    )[0, len(PROMPT) :].tolist()
    onnx_path, bundle = tmp_path / "model.onnx", tmp_path / "model.lz"
    assert main(["export", str(folder), "-o", str(onnx_path)]) == 0
    assert main(["compile", str(onnx_path), "-o", str(bundle)]) == 0
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert {d["path"] for d in manifest["dynamic"]} == {"model.layers.0.mlp", "model.layers.1.mlp"}
    out = Engine.load(bundle).generate(PROMPT, max_new_tokens=NEW, masks=True)
    assert out.ids == expected
    experts = {f"model.layers.{i}.mlp.experts.{e}" for i in range(2) for e in range(EXPERTS)}
    # A decode step runs one token through top-2 of 4 experts per layer: at least 2 per layer are skipped.
    for step in out.report.steps[1:]:
        assert set(step.skipped_paths) <= experts and len(step.skipped_paths) >= 4
