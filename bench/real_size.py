"""Real size on this machine (issue 22): an OLMoE-1B-7B-shaped MoE (random, seeded weights in bf16) through
``layerzero export`` (external data), ``layerzero compile --weights int4`` and ``layerzero generate``, each step a
child process whose wall time and peak RSS (``os.wait4``'s rusage of that child alone) are printed.

    python bench/real_size.py --layers 2 --work /tmp/rs2        # a mid-size model of the family (2 of 16 layers)
    python bench/real_size.py --work /tmp/rs16                  # the full 16-layer shape (bf16 ~13.8 GB)
    python bench/real_size.py --layers 2 --steps make,export    # only some steps (the others' files are reused)
    python bench/real_size.py --layers 2 --work /tmp/rs2 --steps compile --trace   # RSS at every compile stage

The compile needs liblayerzero_ort.so (the native MoE kernel runs the int4 experts; without it every expert would
lower to a float32 MatMul constant): the bench refuses to run the step without it (exit 2).

The model folder is written without ever holding the model: the module tree is built on the meta device (shapes
only), then every tensor is drawn in bf16 from its own seeded generator and written to safetensors shards of at
most ``--shard-gb`` (so the maker's peak is one shard). Norm weights are 1 + 0.1 N(0, 1) (random, so that a zero
detection has nothing to find), every other weight N(0, 0.02) (the config's initializer_range).

Exit status 1 when a step fails, or when the compile's peak RSS exceeds the bound: the int4 size (the compiled
bundle's bytes) + ``--rss-slack-gb`` (2 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

#: OLMoE-1B-7B's shape (allenai/OLMoE-1B-7B-0924's config: hidden 2048, 16 layers, 16 heads, 64 experts top-8,
#: expert MLP 1024, vocab 50304, untied embeddings).
OLMOE_7B = {
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "vocab_size": 50304,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "pad_token_id": 1,
    "bos_token_id": None,
    "eos_token_id": 50279,
}

STEPS = ("make", "export", "compile", "generate")


def make_model(folder: Path, layers: int, seed: int = 0, shard_gb: float = 1.0) -> dict:
    """Write an OLMoE-shaped model folder (config.json, safetensors shards, their index) in bf16, one tensor at a
    time (see the module docstring); returns its parameter count and bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.OlmoeConfig(**{**OLMOE_7B, "num_hidden_layers": layers})
    config.dtype = "bfloat16"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    del model
    folder.mkdir(parents=True, exist_ok=True)
    limit = int(shard_gb * 2**30)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = params = 0
    names = sorted(shapes)
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush(last: bool) -> None:
        nonlocal size
        if shards[-1]:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shards[-1], str(folder / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shards[-1]})
            shards[-1] = {}
            size = 0

    for k, name in enumerate(names):
        shape = shapes[name]
        gen = torch.Generator().manual_seed(seed * 100003 + k)
        if "norm" in name:
            t = (1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.bfloat16)).to(torch.bfloat16)
        else:
            t = torch.randn(shape, generator=gen, dtype=torch.bfloat16).mul_(config.initializer_range)
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > limit:
            flush(False)
        shards[-1][name] = t
        size += nbytes
        total += nbytes
        params += t.numel()
    flush(True)
    # Shard names carry the count, as save_pretrained writes them.
    final = {}
    for i, name in enumerate(files):
        new = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (folder / name).rename(folder / new)
        final[name] = new
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(str(folder))
    return {"params": params, "bytes": total, "shards": len(files)}


def _rss_mb() -> tuple[int, int]:
    """This process's resident set and its peak so far (``VmRSS``, ``VmHWM``), in MB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(rest.split()[0]) // 1024
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def traced_compile(onnx_path: Path, bundle: Path) -> int:
    """``--trace``'s compile step (this process is its child): ``compile_file`` with ``--weights int4``, printing the
    resident set and its peak so far at every stage the compile reports (pass boundaries, verification's runs)."""
    from layerzero.compile import compile_file
    from layerzero.options import CompileOptions

    start = time.perf_counter()
    last = [""]

    def say(message: str, **_: object) -> None:
        stage = message.split(", chunk")[0]
        if stage != last[0]:
            rss, hwm = _rss_mb()
            print(json.dumps({"t": round(time.perf_counter() - start, 1), "rss_mb": rss, "peak_mb": hwm,
                              "stage": stage}), flush=True)  # fmt: skip
            last[0] = stage

    compile_file(onnx_path, bundle, CompileOptions(weights="int4"), progress=say, overwrite=True)
    say("done")
    return 0


def _run(label: str, argv: list[str], log: Path) -> dict:
    """Run one step as a child; its wall time and peak RSS (its own rusage, from ``os.wait4``)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    row = {"step": label, "rc": code, "seconds": round(seconds, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024)}
    print(json.dumps(row), flush=True)
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        print(f"{label} failed ({code}); {log}: " + " | ".join(tail), file=sys.stderr, flush=True)
    return row


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (OLMoE-1B-7B has 16)")
    parser.add_argument("--work", type=Path, required=True, help="folder for the model, its export and bundle")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=16, help="tokens generate makes")
    parser.add_argument("--rss-slack-gb", type=float, default=2.0, help="compile's bound: int4 size + this")
    parser.add_argument("--compile-args", default="", help="extra arguments for layerzero compile")
    parser.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)  # the child of the make step
    parser.add_argument("--trace", action="store_true",
                        help="compile in a child of this script that prints its RSS at every compile stage (in "
                             "compile.log); --compile-args is then ignored")  # fmt: skip
    parser.add_argument("--trace-only", action="store_true", help=argparse.SUPPRESS)  # the child of --trace
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        print(f"--steps: unknown step {bad[0]!r} (choose from {', '.join(STEPS)})", file=sys.stderr)
        return 2
    work = args.work
    hf, onnx_path, bundle = work / "hf", work / "model.onnx", work / "model.lz"
    if args.trace_only:
        return traced_compile(onnx_path, bundle)
    if args.make_only:
        print(json.dumps(make_model(hf, args.layers, args.seed)))
        return 0
    if "compile" in steps:
        from layerzero.plugins.ort_library import find_ort_library

        if find_ort_library() is None:
            # Without it the MoE blocks lower to per-expert If: every expert a float32 MatMul constant (the int4
            # experts are the native kernel's), the whole model in float32 before quantization.
            print("compile: liblayerzero_ort.so is not built (python -c 'from layerzero.plugins.ort_library import "
                  "build_ort_library; build_ort_library()', or LAYERZERO_PLUGIN_DIR): the real-size compile needs "
                  "the native MoE kernel", file=sys.stderr)  # fmt: skip
            return 2
    work.mkdir(parents=True, exist_ok=True)
    lz = [sys.executable, "-m", "layerzero"]
    rows = []
    print(f"# OLMoE shape, {args.layers} layers; load {os.getloadavg()[0]:.2f}", flush=True)
    for step in steps:
        if step == "make":
            cmd = [sys.executable, __file__, "--make-only", "--work", str(work), "--layers", str(args.layers),
                   "--seed", str(args.seed)]  # fmt: skip
        elif step == "export":
            cmd = [*lz, "export", str(hf), "-o", str(onnx_path), "--force"]
        elif step == "compile" and args.trace:
            cmd = [sys.executable, __file__, "--trace-only", "--work", str(work)]
        elif step == "compile":
            cmd = [*lz, "compile", str(onnx_path), "-o", str(bundle), "--weights", "int4", "--force",
                   *args.compile_args.split()]  # fmt: skip
        else:
            cmd = [*lz, "generate", str(bundle), "--prompt-ids", "1,2,3,4", "--max-new-tokens", str(args.tokens),
                   "--json"]  # fmt: skip
        row = _run(step, cmd, work / f"{step}.log")
        row["load"] = round(os.getloadavg()[0], 2)
        rows.append(row)
        if row["rc"] != 0:
            break
    sizes = {"hf": hf, "onnx": onnx_path.with_name(onnx_path.name + ".data"), "bundle": bundle}
    summary = {k: round(_size(p) / 2**20) for k, p in sizes.items() if p.exists()}
    print(json.dumps({"sizes_mb": summary}), flush=True)
    status = 0 if all(r["rc"] == 0 for r in rows) else 1
    compiled = next((r for r in rows if r["step"] == "compile" and r["rc"] == 0), None)
    if compiled is not None and "bundle" in summary:
        bound = summary["bundle"] + args.rss_slack_gb * 1024
        ok = compiled["peak_rss_mb"] <= bound
        print(f"compile peak RSS {compiled['peak_rss_mb']} MB; bound (int4 bundle {summary['bundle']} MB + "
              f"{args.rss_slack_gb:g} GB) {bound:.0f} MB: {'met' if ok else 'MISSED'}", flush=True)  # fmt: skip
        status = status or (0 if ok else 1)
    if args.json is not None:
        args.json.write_text(json.dumps({"layers": args.layers, "rows": rows, "sizes_mb": summary}, indent=1))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
