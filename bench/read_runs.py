"""The memory system's read rate for runs of bytes, some skipped: the access pattern of SparseLinear's kept rows.

A kept input channel of ``ai.layerzero::SparseLinear`` (issue 23) is one contiguous run of its column tile's row (q4:
1 KB for N = 2048, 4 KB for a full tile of 8192 columns); at sparsity s about that share of the runs is skipped at
random. This builds ``bench/read_runs.cpp`` (g++, AVX-512) and prints, per run length, skip share and thread count,
the GB/s of kept bytes one pass over a buffer beyond the last-level cache reads at best (``--repeats``), 16 runs
read side by side with the next 16 prefetched a line at a time, as the kernel does. A diagnostic, not a target: it
says which run lengths the kernel's layout can stream at the full read rate (bench/README.md, sparse_linear.py).

    python bench/read_runs.py                       # 512 MiB; runs 1, 2, 4, 8 KB; skip 0 and 0.5; 1 and 2 threads
    python bench/read_runs.py --runs 1024 4096 --skip 0.5 --threads 1

Exit 2 when g++ is missing, the CPU has no AVX-512 or the build fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("read_runs.cpp")


def build(out: Path) -> Path:
    """Compile read_runs.cpp into ``out``; the executable."""
    exe = out / "read_runs"
    cmd = ["g++", "-O2", "-std=c++17", "-mavx512f", "-mavx512bw", "-pthread", str(SOURCE), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed: {(proc.stderr.strip().splitlines() or ['?'])[0]}")
    return exe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=512, help="buffer size (beyond the last-level cache)")
    p.add_argument("--runs", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="run lengths, bytes")
    p.add_argument("--skip", type=float, nargs="+", default=[0.0, 0.5], help="share of the runs skipped")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if any(r < 64 or r % 64 for r in args.runs) or any(not 0 <= s < 1 for s in args.skip):
        print("--runs must be multiples of 64 bytes and --skip in [0, 1)", file=sys.stderr)
        return 2
    if shutil.which("g++") is None:
        print("g++ not found (apt-get install g++)", file=sys.stderr)
        return 2
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512bw" not in flags:
        print("this CPU has no AVX-512 (BW): read_runs.cpp is written for it", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        try:
            exe = build(Path(tmp))
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 2
        print(f"{args.mib} MiB, best of {args.repeats}; GB/s of kept bytes; load {os.getloadavg()[0]:.2f} at start")
        print("run bytes  skip  " + "  ".join(f"{t} thread(s)" for t in args.threads))
        for run in args.runs:
            for skip in args.skip:
                rates = []
                for t in args.threads:
                    cmd = [str(exe), str(args.mib), str(run), str(skip), str(t), "16", str(args.repeats)]
                    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    if proc.returncode != 0:
                        print(f"read_runs failed: {proc.stderr.strip()}", file=sys.stderr)
                        return 2
                    rates.append(float(proc.stdout))
                print(f"{run:9d}  {skip:4.2f}  " + "  ".join(f"{r:11.1f}" for r in rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
