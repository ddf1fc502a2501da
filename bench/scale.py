"""Scale: peak memory and time of ``layerzero compile`` on a model of about 1 GB in external data.

The model is a residual chain of MatMul layers, ``x = x + flag * Relu(x @ W_i)`` on ``x [batch, H]``,
with some layers zero: consumed flags of 0, all-zero weights, and one declared flag (an unread
``layers.i.flag = 0`` initializer). Weights are written chunk by chunk straight into the external-data
file, so the generator never holds more than one chunk.

``layerzero compile`` runs in a subprocess, once with ``--no-verify`` and once verified; the peak RSS
of that process (``wait4``'s ``ru_maxrss``) and its wall time are compared with the target
``0.5 × model size + 300 MB``. ``--stages`` adds, per row, the peak RSS of each compile stage (load,
static passes, verification, writing the bundle), sampled in the compiling process.

    python bench/scale.py                   # about 1 GB
    python bench/scale.py --size-gb 0.25    # quicker
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

MB = 1 << 20
_ALIGN = 4096  # page-aligned offsets: ORT may memory-map them
_CHUNK_ROWS = 256


def _layer_kinds(layers: int) -> dict[int, str]:
    """Which layers are zero, and how: about a third of them, spread over the chain."""
    kinds = {i: "live" for i in range(layers)}
    zero = ["consumed-flag", "zero-weight", "declared-flag", "consumed-flag", "zero-weight"]
    for j, i in enumerate(range(2, layers, 3)):
        kinds[i] = zero[j % len(zero)]
    return kinds


def _write_weight(f, name: str, hidden: int, rng: np.random.Generator | None, base: str) -> TensorProto:
    """Append a [hidden, hidden] float32 weight (zeros when ``rng`` is None) to ``f``, chunk by chunk."""
    offset = f.seek(0, os.SEEK_END)
    pad = -offset % _ALIGN
    f.write(b"\0" * pad)
    offset += pad
    for start in range(0, hidden, _CHUNK_ROWS):
        rows = min(_CHUNK_ROWS, hidden - start)
        if rng is None:
            chunk = np.zeros((rows, hidden), np.float32)
        else:
            chunk = rng.standard_normal((rows, hidden), dtype=np.float32)
            chunk *= np.float32(0.5 / math.sqrt(hidden))
        chunk.tofile(f)
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[hidden, hidden])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", base), ("offset", str(offset)), ("length", str(4 * hidden * hidden))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def generate(path: Path, size_bytes: int, layers: int, seed: int = 0) -> tuple[int, dict[int, str]]:
    """Write the model to ``path`` (+ ``path.data``); return (hidden size, layer kinds)."""
    hidden = max(64, int(math.sqrt(size_bytes / (4 * layers))) // 64 * 64)
    kinds = _layer_kinds(layers)
    data = path.with_name(path.name + ".data")
    nodes, inits = [], []
    x = "x"
    with open(data, "wb") as f:
        for i in range(layers):
            rng = np.random.default_rng([seed, i])
            w = f"layers.{i}.weight"
            inits.append(_write_weight(f, w, hidden, None if kinds[i] == "zero-weight" else rng, data.name))
            p = f"/layers.{i}"
            nodes.append(helper.make_node("MatMul", [x, w], [f"{p}/MatMul_output_0"], name=f"{p}/MatMul"))
            nodes.append(helper.make_node("Relu", [f"{p}/MatMul_output_0"], [f"{p}/Relu_output_0"], name=f"{p}/Relu"))
            update = f"{p}/Relu_output_0"
            # Consumed flags: 0 on the flagged layers, 1 on every other live layer (that one must stay).
            if kinds[i] == "consumed-flag" or (kinds[i] == "live" and i % 2 == 0):
                flag = f"layers.{i}.flag"
                value = 0.0 if kinds[i] == "consumed-flag" else 1.0
                inits.append(helper.make_tensor(flag, TensorProto.FLOAT, [1], [value]))
                nodes.append(helper.make_node("Mul", [flag, update], [f"{p}/Mul_output_0"], name=f"{p}/Mul"))
                update = f"{p}/Mul_output_0"
            elif kinds[i] == "declared-flag":
                inits.append(helper.make_tensor(f"layers.{i}.flag", TensorProto.FLOAT, [1], [0.0]))
            out = "y" if i == layers - 1 else f"{p}/Add_output_0"
            nodes.append(helper.make_node("Add", [x, update], [out], name=f"{p}/Add"))
            x = out
    graph = helper.make_graph(
        nodes,
        "scale_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save_model(model, str(path))  # the tensors already point at the data file
    return hidden, kinds


_STAGES = r"""
import os, sys, threading, time
from pathlib import Path
from layerzero.compile import compile_file
from layerzero.options import CompileOptions

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

stage, peaks, done = ["start"], {}, False
def sample():
    while not done:
        peaks[stage[0]] = max(peaks.get(stage[0], 0), rss())
        time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True); t.start()
def say(msg):
    peaks[stage[0]] = max(peaks.get(stage[0], 0), rss())
    stage[0] = msg.split(",")[0]
compile_file(sys.argv[1], sys.argv[2], CompileOptions(verify=sys.argv[3] == "1"), progress=say)
say("end"); done = True; t.join()
for name, peak in [(n, p) for n, p in peaks.items() if n != "end"]:
    print(f"STAGE {name}: {peak / 2**20:.0f} MB")
"""


def _run(cmd: list[str]) -> tuple[int, float, float, str]:
    """Run ``cmd``; return (exit code, peak RSS in bytes of that process tree, wall seconds, output)."""
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        log.seek(0)
        output = log.read().decode(errors="replace")
    return proc.returncode, usage.ru_maxrss * 1024, wall, output  # ru_maxrss is in KiB on Linux


def _disk_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.name.startswith(path.name))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0, help="model size in GiB (default 1)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--no-verified-row", action="store_true", help="only the --no-verify row")
    p.add_argument("--stages", action="store_true", help="also print the peak RSS of each compile stage")
    p.add_argument("--keep", type=Path, help="write the model here and keep it (default: a temp dir, removed)")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="lz-scale-"))
    try:
        model_dir = args.keep or tmp
        model_dir.mkdir(parents=True, exist_ok=True)
        model = model_dir / "chain.onnx"
        start = time.perf_counter()
        hidden, kinds = generate(model, int(args.size_gb * (1 << 30)), args.layers)
        size = _disk_size(model)
        zero = sorted(i for i, k in kinds.items() if k != "live")
        print(
            f"model: {args.layers} layers of [{hidden}, {hidden}] float32, {size / MB:,.0f} MB "
            f"(generated in {time.perf_counter() - start:.1f} s); zero layers {zero}",
            file=sys.stderr,
        )
        rows = [("--no-verify", False)] + ([] if args.no_verified_row else [("verified", True)])
        target = 0.5 * size + 300 * MB
        table = [
            f"{'run':<12} {'model size':>11} {'peak RSS':>10} {'target':>10} {'met':>4} {'time s':>7}  exit",
        ]
        stage_lines: list[str] = []
        missed = False
        for label, verify in rows:
            out = tmp / f"out-{label.strip('-')}.lz"
            cli = shutil.which("layerzero")
            cmd = [cli] if cli else [sys.executable, "-m", "layerzero.cli"]
            cmd += ["compile", str(model), "-o", str(out)]
            if not verify:
                cmd.append("--no-verify")
            print(f"running layerzero {' '.join(cmd[-4:])}", file=sys.stderr)
            code, peak, wall, output = _run(cmd)
            missed |= code != 0 or peak > target
            table.append(
                f"{label:<12} {size / MB:>8,.0f} MB {peak / MB:>7,.0f} MB {target / MB:>7,.0f} MB "
                f"{'yes' if peak <= target else 'NO':>4} {wall:>7.1f}  {code}"
            )
            if code != 0:
                stage_lines.append(f"{label} failed:\n{output[-2000:]}")
            elif out.exists():
                stage_lines.append(f"{label}: bundle {_disk_size(out / 'model.onnx') / MB:,.0f} MB")
            shutil.rmtree(out, ignore_errors=True)
            if args.stages:
                code, _, _, output = _run([sys.executable, "-c", _STAGES, str(model), str(out), "1" if verify else "0"])
                stages = [line.removeprefix("STAGE ") for line in output.splitlines() if line.startswith("STAGE")]
                stage_lines.append(f"{label} stages (peak RSS): " + "; ".join(stages) if code == 0 else output[-2000:])
                shutil.rmtree(out, ignore_errors=True)
        print("\n".join(table))
        print(f"target: peak RSS ≤ 0.5 × model size + 300 MB = {target / MB:,.0f} MB")
        for line in stage_lines:
            print(line)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if missed:
        print("a target was missed (or a compile failed): exit 1", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
