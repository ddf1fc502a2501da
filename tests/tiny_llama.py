"""The tiny Hugging Face Llama of the real-export tests (tests/test_hf_llama.py, tests/passes/test_quantized_in.py,
tests/generate), its logits-only ``torch.onnx.export(dynamo=True)``, and the token feeds and ONNX Runtime logits
the tests compare.

Import it after ``pytest.importorskip("torch")`` / ``("transformers")``: it needs both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
import transformers


def tiny_llama_config(layers: int, vocab: int, **more: Any) -> transformers.LlamaConfig:
    """Hidden 64, FFN 128, 4 heads over 2 KV heads; ``more``: the test's own settings."""
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        **more,
    )


def tiny_llama(layers: int, vocab: int, seed: int = 0) -> transformers.LlamaForCausalLM:
    """Seeded random weights, logits only (``use_cache=False``, sdpa attention). The RMSNorm weights start at 1:
    all equal, so the exporter would share one initializer among them; they are perturbed apart."""
    torch.manual_seed(seed)
    config = tiny_llama_config(
        layers, vocab, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa"
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def export_logits(model: torch.nn.Module, path: Path, vocab: int) -> Path:
    """``model`` itself (not a wrapper, so that scopes read ``model.layers.3`` as in the checkpoint) exported with
    dynamic batch and sequence, traced at (2, 8): an example batch of 1 would be specialised to 1."""
    ids = torch.randint(0, vocab, (2, 8))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    program = torch.onnx.export(
        model,
        (ids,),
        dynamo=True,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes=({0: batch, 1: seq},),
        verbose=False,
    )
    program.save(str(path))
    return path


def token_feeds(vocab: int, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random ``input_ids`` [batch, seq] below ``vocab``."""
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, vocab, size=(batch, seq), dtype=np.int64)}


def prefill_feeds(vocab: int, layers: int, seq: int, seed: int = 3, head_dim: int = 16,
                  kv_heads: int = 2) -> dict[str, np.ndarray]:  # fmt: skip
    """A cached-decoder export's first call (tiny_llama_config's 4 / 2 heads of 16 by default): seeded ``input_ids``
    [1, seq] below ``vocab``, its mask and positions, and every layer's empty past key / value."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=(1, seq))
    feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((1, seq), np.int64),
             "position_ids": np.arange(seq, dtype=np.int64)[None]}  # fmt: skip
    for i in range(layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, kv_heads, 0, head_dim), np.float32)
    return feeds


def ort_logits(model: Path | onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The ``logits`` ONNX Runtime (CPU) computes for ``model`` (a file, a proto or an onnx-ir model)."""
    if isinstance(model, ir.Model):
        model = ir.to_proto(model)
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]


def greedy_llama_config(layers: int = 2, vocab: int = 128, **more: Any) -> transformers.LlamaConfig:
    """The generation tests' Llama (tests/generate): 256 positions, no BOS / EOS, and large random weights
    (``initializer_range=0.2``), so that the greedy tokens vary instead of repeating one."""
    return tiny_llama_config(
        layers,
        vocab,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        **more,
    )
