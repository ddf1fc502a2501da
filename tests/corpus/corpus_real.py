"""Real-size corpus exports (≥ 1 GB of external-data weights), and their compile in a child process.

    python tests/corpus/corpus_real.py export dense|moe OUT.onnx   # torch.onnx.export(dynamo=True), external data
    python tests/corpus/corpus_real.py compile MODEL.onnx OUT.lz   # compile_file, default options; prints JSON

Both run as child processes of the slow test (tests/corpus/test_real_size.py), so that the test process
stays small and the compile's peak RSS is its own (``resource.getrusage(RUSAGE_SELF)`` at exit, printed as
the last line of JSON).

- ``dense``: Llama, hidden 2048, 3 layers, intermediate 5632, vocab 32000: 273 M parameters, 1.09 GB;
- ``moe``: OLMoE-style, hidden 1024, 64 experts, top-8, expert intermediate 512, 2 layers, vocab 32000:
  1.10 GB (the experts 805 MB), experts through transformers' ``batched_mm`` implementation.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

REAL: dict[str, dict] = {
    "dense": {
        "config": "LlamaConfig",
        "kwargs": {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 3,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 256,
        },
    },
    "moe": {
        "config": "OlmoeConfig",
        "kwargs": {
            "hidden_size": 1024,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 256,
        },
    },
}
MIN_BYTES = 1 << 30


def export(kind: str, out: Path) -> None:
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = REAL[kind]
    config = getattr(transformers, spec["config"])(
        **spec["kwargs"], use_cache=False, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    ids = torch.randint(0, 32000, (2, 8))
    program = torch.onnx.export(
        model,
        (ids,),
        dynamo=True,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}},
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.onnx")
    program.save(str(tmp), external_data=True)
    data = tmp.with_name(tmp.name + ".data")
    # The external-data file is named after the model file: rename both, the model last (it marks done).
    import onnx

    proto = onnx.load(str(tmp), load_external_data=False)
    for init in proto.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                entry.value = out.name + ".data"
    data.rename(out.with_name(out.name + ".data"))
    onnx.save(proto, str(out))
    tmp.unlink()


def compile_(source: Path, out: Path) -> dict:
    from layerzero.compile import compile_file
    from layerzero.passes._dynamic import read_dynamic_paths

    start = time.perf_counter()
    result = compile_file(source, out, overwrite=True)
    v = result.verification
    return {
        "passed": bool(v is not None and v.passed),
        "needed_atol": None if v is None else v.needed_atol,
        "nodes": [result.before.nodes, result.after.nodes],
        "moe_blocks": len(read_dynamic_paths(result.model)),
        "seconds": round(time.perf_counter() - start, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main(argv: list[str]) -> int:
    verb = argv[0]
    if verb == "export":
        export(argv[1], Path(argv[2]))
        print(json.dumps({"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
        return 0
    if verb == "compile":
        print(json.dumps(compile_(Path(argv[1]), Path(argv[2]))))
        return 0
    raise SystemExit(f"unknown verb {verb!r}: export | compile")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
