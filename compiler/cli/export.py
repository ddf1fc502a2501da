"""Export a local Hugging Face causal LM (a save_pretrained folder) to ONNX, ready for compile and generate.

The model gets inputs input_ids, attention_mask, position_ids and past_key_values.N.key/value, and outputs
logits and present.N.key/value (a KV cache carried in and out); --no-cache exports one pass (logits only).
MoE models use the batched_mm experts implementation; the TorchScript exporter uses eager attention. The
tokenizer files and generation_config.json are copied beside the model. A model the exporter cannot take is
refused with the exporter's reason (exit 2). Nothing is written over a file export did not write (checked
before any work, exit 2): an existing OUTPUT is replaced only with --force and only when it is a model
layerzero export wrote (so is its OUTPUT.data); a different tokenizer or generation_config.json beside it is
never replaced (export into another directory).

examples:
  layerzero export ./tiny-llama -o llama.onnx
  layerzero export ./tiny-mixtral -o mixtral.onnx --exporter torchscript
  layerzero export ./tiny-llama -o llama1.onnx --no-cache
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from layerzero.cli._common import add_force, check_output_dir, console, one_line_errors, progress
from layerzero.errors import InvalidInputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("model_dir", type=Path, help="a folder written by save_pretrained (config.json, weights)")
    p.add_argument("-o", "--output", type=Path, required=True, help="the .onnx file to write")
    p.add_argument("--no-cache", action="store_true", help="one pass, logits only (no past/present tensors)")
    p.add_argument(
        "--exporter",
        choices=("dynamo", "torchscript"),
        default="dynamo",
        help="torch.onnx exporter (default dynamo; torchscript is faster to export and uses eager attention)",
    )
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    add_force(p, "replace OUTPUT if it is a model layerzero export wrote")
    p.add_argument("--gguf", type=Path, metavar="FILE",
                   help="export a GGUF file (llama.cpp's format; in MODEL_DIR or a path): transformers reads its "
                        "config and tokenizer and dequantizes its weights")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from layerzero.hf_export import export_hf

    if args.output.suffix != ".onnx":
        raise InvalidInputError(f"-o {args.output}: give a file name ending in .onnx")
    if args.output.is_dir():
        raise InvalidInputError(f"-o {args.output}: is a directory; give a file name")
    check_output_dir(args.output, "-o")
    start = time.perf_counter()
    with progress(f"exporting {args.model_dir}") as say:
        result = export_hf(args.model_dir, args.output, cache=not args.no_cache, exporter=args.exporter,
                           opset=args.opset, force=args.force, progress=say, gguf_file=args.gguf)  # fmt: skip
    seconds = time.perf_counter() - start
    kind = "cache-carrying" if result.cache else "single-pass"
    console.print(
        f"exported {result.model_type} ({result.layers} layers, {kind}, {result.exporter}) to {result.path} "
        f"in {seconds:.1f} s"
    )
    past = ", past_key_values.N.key/value" if result.cache else ""
    console.print(f"  inputs: {', '.join(result.input_names[:3])}{past}")
    console.print("  outputs: logits" + (", present.N.key/value" if result.cache else ""))
    if result.copied:
        console.print(f"  copied beside it: {', '.join(result.copied)}")
    return 0
