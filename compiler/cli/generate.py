"""Generate tokens with a bundle compiled from a `layerzero export` model: KV cache, greedy or sampled.

The prompt is token ids (--prompt-ids 1,2,3) or text (--prompt "...", through the tokenizers package and the
tokenizer.json found beside the bundle, beside its source model, or given with --tokenizer). New tokens stream
to stdout as they come (text when there is a tokenizer, else ids); then a report: tokens/s, time to first token,
layers zeroed, paths skipped. --json prints one JSON object instead: "ids", "text" (with a tokenizer), "report".
The report is compact by default: "step_count" and "skipped_steps" (for each dynamic path, how many steps
skipped it); --steps adds "steps", every step's tokens, time and skipped paths (large: about 1 MB for 128
tokens of a 32-expert model), and --masks each step's masks too (it implies --steps).

Several prompts (--prompt or --prompt-ids repeated, or a file with one prompt per line: --prompt-file for text,
--prompt-ids-file for ids) run as one batch: left-padded (--pad-id, default the export's pad id, else its eos),
the same tokens as transformers' batched greedy generate; each prompt stops on its own. A batch prints one line
per prompt at the end (its text, else its ids) and one report per prompt; --json prints one JSON object,
{"results": [{"prompt_ids", "ids", "text", "report"}, ...]}, in the prompts' order. A row's report counts
the steps that row took (one that stopped early has fewer), but what a step skipped is the batch's: a path
no row's token ran ("batch_rows" in the report says how many rows shared each step).
Generation stops at --max-new-tokens, at --max-tokens (prompt included; a longer prompt is an error) or at a
stop token (--stop-ids, default the eos ids recorded at export).
--no-activation-sparsity runs a bundle compiled with --activation-sparsity dense (its activation scale 0): the
same tokens as the dense compile, for an A/B of the sparsity's effect on the text.
--temperature 0 (the default) is greedy; above 0 it samples, with --top-k, --top-p and --seed.

examples:
  layerzero generate model.lz --prompt-ids 1,2,3 --max-new-tokens 16
  layerzero generate model.lz --prompt-ids 1,2,3 --threads 2
  layerzero generate model.lz --prompt "Once upon a time" --temperature 0.8 --top-p 0.9 --seed 0
  layerzero generate model.lz --prompt-ids 1,2,3 --json --steps
  layerzero generate model.lz --prompt-ids 1,2,3 --json --masks
  layerzero generate model.lz --prompt-ids 1,2,3 --prompt-ids 7,8 --max-new-tokens 16
  layerzero generate model.lz --prompt-file prompts.txt --json
  layerzero generate sparse.lz --prompt-ids 1,2,3 --no-activation-sparsity
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from layerzero.cli._common import (
    add_no_activation_sparsity,
    add_threads,
    apply_activation_flag,
    integer,
    number,
    one_line_errors,
    stderr,
    thread_options,
)
from layerzero.errors import InvalidInputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("bundle", type=Path, help="a compiled bundle (or an exported .onnx, run uncompiled)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (needs tokenizer.json); repeat for a batch")
    prompt.add_argument(
        "--prompt-ids", action="append", help="prompt token ids, comma separated (e.g. 1,2,3); repeat for a batch"
    )
    prompt.add_argument("--prompt-file", type=Path, help="a text file, one prompt per line (a batch)")
    prompt.add_argument("--prompt-ids-file", type=Path, help="a file of comma-separated ids, one prompt per line")
    p.add_argument("--max-new-tokens", type=integer(1, 1_000_000), default=32, help="at most this many new tokens")
    p.add_argument(
        "--max-tokens", type=integer(2, 10_000_000), default=None, help="at most this many tokens, prompt included"
    )
    p.add_argument("--temperature", type=number(0), default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=integer(0), default=0, help="sample among the k most likely (0 = off)")
    p.add_argument("--top-p", type=number(0, 1, lo_open=True), default=1.0, help="nucleus sampling (1 = off)")
    p.add_argument("--seed", type=integer(0, 2**63 - 1), default=None, help="random seed for sampling")
    p.add_argument("--stop-ids", default=None, help="token ids that end generation (default: the model's eos)")
    p.add_argument("--pad-id", type=integer(0), default=None, help="left-padding id of a batch (default: the export's)")
    p.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json (or a folder holding one)")
    p.add_argument(
        "--steps",
        action="store_true",
        help="every step in the report: its tokens, time and skipped paths (default: per-path counts only)",
    )
    p.add_argument(
        "--masks", action="store_true", help="per-token masks of every dynamic path in the report (implies --steps)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object: ids, text, report")
    p.add_argument("--backend", default="onnxruntime", help="runtime backend (default onnxruntime)")
    add_threads(p)
    add_no_activation_sparsity(p)


def _ids(text: str, option: str, *, allow_none: bool = False) -> list[int]:
    """Comma-separated ids; an empty item (``1,,2``, ``1,2,``) is an error, never skipped. ``allow_none``: an
    empty (or all-blank) ``text`` is the empty list (``--stop-ids ""``: no stop token)."""
    items = text.replace(" ", "").split(",")
    if allow_none and items == [""]:
        return []
    if "" in items:
        position = items.index("") + 1
        raise InvalidInputError(
            f"{option} {text!r}: item {position} of {len(items)} is empty; expected comma-separated integers "
            "(e.g. 1,2,3)"
        )
    try:
        ids = [int(t) for t in items]
    except ValueError:
        raise InvalidInputError(f"{option} {text!r}: expected comma-separated integers (e.g. 1,2,3)") from None
    if any(i < 0 for i in ids):
        raise InvalidInputError(f"{option} {text!r}: token ids are >= 0")
    return ids


def run(args: argparse.Namespace) -> int:
    from layerzero.runtime import Engine

    engine = Engine.load(args.bundle, backend=args.backend, **thread_options(args, args.backend))
    apply_activation_flag(engine, args)
    from layerzero.runtime.text import TextCodec

    # The same tokenizer path as the server's OpenAI endpoints (runtime/text.py).
    tokenizer = TextCodec.for_engine(engine, args.tokenizer)
    prompts = _prompts(args, tokenizer)
    stops = None if args.stop_ids is None else _ids(args.stop_ids, "--stop-ids", allow_none=True)
    if len(prompts) > 1:
        return _run_batch(args, engine, prompts, stops, tokenizer)
    prompt = prompts[0]

    stream = not args.json
    generated: list[int] = []
    printed = ""

    def on_token(token: int) -> None:
        nonlocal printed
        generated.append(token)
        if not stream:
            return
        if tokenizer is None:
            sys.stdout.write(("" if len(generated) == 1 else ",") + str(token))
        else:  # decode the whole tail: a token may complete a multi-byte character
            text = tokenizer.decode(generated)
            sys.stdout.write(text[len(printed) :] if text.startswith(printed) else text)
            printed = text
        sys.stdout.flush()

    out = engine.generate(prompt, on_token=on_token, **_generate_options(args, stops))
    text = tokenizer.decode(out.ids) if tokenizer is not None else None
    if args.json:
        doc: dict[str, Any] = {"prompt_ids": out.prompt_ids, "ids": out.ids}
        if text is not None:
            doc["text"] = text
        doc["report"] = out.report.to_dict(steps=_per_step(args))
        sys.stdout.write(json.dumps(doc) + os.linesep)
        return 0
    sys.stdout.write(os.linesep)
    _print_report("report", out.report, args)
    return 0


def _per_step(args: argparse.Namespace) -> bool:
    return bool(args.steps or args.masks)


def _print_report(label: str, report: Any, args: argparse.Namespace) -> None:
    stderr.print(f"{label}: {report.summary()}")
    if report.skipped_paths:
        stderr.print("  skipped on every step: " + ", ".join(report.skipped_paths))
    if _per_step(args):
        for i, step in enumerate(report.steps):
            stderr.print(f"  step {i} ({step.tokens} tokens) -> {step.token_id}: skipped {step.skipped_paths}")


def _lines(path: Path, option: str) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{option} {path}: cannot read it ({exc})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise InvalidInputError(f"{option} {path}: no prompt in it (one prompt per non-empty line)")
    return lines


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """The prompts as id lists, in order: from --prompt / --prompt-file text, or --prompt-ids / --prompt-ids-file."""
    texts = args.prompt if args.prompt is not None else None
    if args.prompt_file is not None:
        texts = _lines(args.prompt_file, "--prompt-file")
    if texts is not None:
        if tokenizer is None:
            option = "--prompt" if args.prompt is not None else "--prompt-file"
            raise InvalidInputError(
                f"{option} needs a tokenizer.json (none beside {args.bundle} or its source model); "
                "give --tokenizer PATH or --prompt-ids"
            )
        prompts = [tokenizer.encode(text) for text in texts]
        empty = [i for i, ids in enumerate(prompts) if not ids]
        if empty:
            raise InvalidInputError(f"prompt {empty[0] + 1} ({texts[empty[0]]!r}) encodes to no token")
        return prompts
    if args.prompt_ids_file is not None:
        return [
            _ids(line, f"--prompt-ids-file {args.prompt_ids_file}")
            for line in _lines(args.prompt_ids_file, "--prompt-ids-file")
        ]
    return [_ids(text, "--prompt-ids") for text in args.prompt_ids]


def _generate_options(args: argparse.Namespace, stops: list[int] | None) -> dict[str, Any]:
    """The ``Engine.generate`` keywords the options give, one prompt or a batch alike."""
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop_tokens": stops,
        "masks": args.masks,
        "max_tokens": args.max_tokens,
    }

def _run_batch(
    args: argparse.Namespace, engine: Any, prompts: list[list[int]], stops: list[int] | None, tokenizer: Any
) -> int:
    """Several prompts as one left-padded batch: one line per prompt, then the reports (or one JSON object)."""
    outs = engine.generate(prompts, pad_token_id=args.pad_id, **_generate_options(args, stops))
    if args.json:
        results = []
        for out in outs:
            doc: dict[str, Any] = {"prompt_ids": out.prompt_ids, "ids": out.ids}
            if tokenizer is not None:
                doc["text"] = tokenizer.decode(out.ids)
            doc["report"] = out.report.to_dict(steps=_per_step(args))
            results.append(doc)
        sys.stdout.write(json.dumps({"results": results}) + os.linesep)
        return 0
    for out in outs:
        line = tokenizer.decode(out.ids) if tokenizer is not None else ",".join(map(str, out.ids))
        sys.stdout.write(line.replace(os.linesep, " ") + os.linesep)
    for i, out in enumerate(outs):
        _print_report(f"report {i + 1}/{len(outs)}", out.report, args)
    stderr.print(f"batch of {len(outs)}: {sum(len(o.ids) for o in outs) / outs[0].report.total_s:.1f} tok/s in all")
    return 0
