"""Run a compiled bundle (or a plain .onnx file) with the LayerZero runtime.

Prints each output (shape, dtype, values, abbreviated) and the zeroing report. Inputs come from an
.npz file and/or NAME=VALUES items; a flat list given for an input of higher rank gets leading
dims of 1 (input_ids=1,2,3 feeds a [batch, seq] input as [1, 3]); values take the input's dtype
(x=0.5,1.5 feeds a float32 input; flag=1 a scalar bool one). A causal LM that `layerzero export` wrote runs
as the first step of a generation: attention_mask, position_ids and past_key_values.* not given are filled
(ones, 0..seq-1, an empty past), so input_ids=1,2,3 alone runs it. --save writes an .npz atomically; it never
replaces the bundle's files or its source model, nor (without --force) a file that is not such an .npz.

examples:
  layerzero run model.lz --input input_ids=1,2,3,4
  layerzero run model.lz --inputs feeds.npz --save out.npz --json
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from layerzero.cli._common import (
    add_device,
    add_force,
    add_no_activation_sparsity,
    apply_activation_flag,
    check_output_file,
    console,
    one_line_errors,
    parse_feeds,
    source_of,
    write_file_atomic,
)
from layerzero.errors import InvalidInputError
from layerzero.runtime import Engine
from layerzero.runtime.bundle import read_bundle


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("bundle", type=Path, help="a bundle written by `layerzero compile`, or an .onnx file")
    p.add_argument("--input", action="append", metavar="NAME=VALUES", help="an input, e.g. input_ids=1,2,3")
    p.add_argument("--inputs", type=Path, metavar="NPZ", help="inputs from an .npz file")
    p.add_argument("--save", type=Path, metavar="NPZ", help="write the outputs to an .npz file")
    add_force(p, "--save: replace a file that is not an outputs .npz")
    p.add_argument("--masks", action="store_true", help="include per-token skip masks in the report")
    add_device(p)
    add_no_activation_sparsity(p)
    p.add_argument("--json", action="store_true", help="print outputs and report as JSON")


def _fit_ranks(engine: Engine, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    specs = {s.name: s for s in engine.input_specs}
    for name, value in feeds.items():
        spec = specs.get(name)
        if spec is not None and spec.rank is not None and value.ndim == 1 and spec.rank > 1:
            feeds[name] = value.reshape((1,) * (spec.rank - 1) + value.shape)
        if spec is not None and spec.rank == 0 and value.shape == (1,):  # flag=1 feeds a scalar input
            feeds[name] = value = value.reshape(())
        value = feeds[name]
        if spec is None or spec.dtype is None or value.dtype == spec.dtype:
            continue
        # Text parses to int64 / float64: feed the model's own dtype (x=0.5,1.5 into a float32 input, 1,0 into
        # a bool one), but never narrow a float to an int silently.
        kinds = (value.dtype.kind, spec.dtype.kind)
        if kinds in (("i", "i"), ("u", "i"), ("i", "u"), ("f", "f"), ("i", "f"), ("i", "b")):
            if kinds == ("i", "b") and not np.isin(value, (0, 1)).all():
                raise InvalidInputError(f"--input {name}: a bool input takes 0 or 1")
            feeds[name] = value.astype(spec.dtype)
    return feeds


def _is_outputs_npz(names: list[str]) -> Callable[[Path], bool]:
    def check(path: Path) -> bool:
        # An .npz of exactly this model's outputs is what an earlier --save wrote; anything else is not ours.
        with np.load(path, allow_pickle=False) as data:
            return sorted(data.files) == sorted(names)

    return check


def save_outputs(path: Path, outputs: dict[str, np.ndarray], *, force: bool) -> None:
    """``--save``: the outputs as .npz, written atomically, never over a file that is not such an .npz."""
    check_output_file(path, "--save", kind="outputs .npz", force=force, is_ours=_is_outputs_npz(list(outputs)))
    buffer = io.BytesIO()
    np.savez(buffer, **outputs)
    write_file_atomic(path, buffer.getvalue(), "--save")


def run(args: argparse.Namespace) -> int:
    if args.save is not None:  # before running: a refused --save must not cost a run
        # source_of reads the bundle: a broken manifest (a JSON list, ...) is reported here, in one line.
        protect = [p for p in (args.inputs, args.bundle) if p is not None] + source_of(args.bundle)
        check_output_file(args.save, "--save", kind="outputs .npz", force=args.force, is_ours=lambda _p: True,
                          protect=protect, protect_dirs=[args.bundle])  # fmt: skip
    elif args.bundle.is_dir():
        read_bundle(args.bundle)  # a broken manifest (a JSON list, ...) is reported here, in one line
    engine = Engine.load(args.bundle, device=args.device)  # the backend its manifest names
    apply_activation_flag(engine, args)
    feeds = parse_feeds(args.inputs, args.input)
    if not feeds and engine.input_specs:
        names = ", ".join(s.describe() for s in engine.input_specs)
        raise InvalidInputError(f"no inputs given; the model expects {names} (use --input or --inputs)")
    # A causal LM export is run as its first generation step: the mask, positions and empty past not given are filled.
    feeds = engine.first_step_feeds(_fit_ranks(engine, feeds))
    start = time.perf_counter()
    result = engine.run(feeds, masks=args.masks)
    ms = (time.perf_counter() - start) * 1e3
    if args.save is not None:
        save_outputs(args.save, result.outputs, force=args.force)
    if args.json:
        doc = {
            "outputs": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype), "values": v.tolist()}
                for k, v in result.outputs.items()
            },
            "report": result.report.to_dict(),
            "latency_ms": ms,
        }
        console.print_json(json.dumps(doc))
        return 0
    with np.printoptions(precision=4, threshold=20, edgeitems=3, suppress=True):
        for name, value in result.outputs.items():
            console.print(f"{name} {value.dtype}{list(value.shape)}")
            console.print(str(value))
    console.print(f"report: {result.report.summary()}  ({ms:.2f} ms)")
    if result.report.skipped_paths:
        console.print("  skipped on this request: " + ", ".join(result.report.skipped_paths))
    if args.masks and result.report.masks:
        for path, mask in result.report.masks.items():
            console.print(f"  mask {path}: {np.asarray(mask).astype(int).tolist()}")
    return 0
