"""The differential fuzzer's long run: ``python -m tests.fuzz.run --cases 100000 [--start 0] [--jobs 2]``.

Prints the counts (equal / differ / compiler exception / compiled model cannot run / invalid generated) and,
with ``--minimize``, each distinct failure minimised, in ONNX text, ready to paste into
``tests/fuzz/test_regressions.py``.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import time
from pathlib import Path

__all__ = ["fuzz", "main", "run_case"]

# Runnable as ``python -m tests.fuzz.run`` from the repository root and from anywhere else.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

LABELS = {
    "equal": "equal",
    "differ": "differ",
    "exception": "compiler exception",
    "cannot_run": "compiled model cannot run",
    "invalid": "invalid generated",
}


def run_case(seed: int) -> tuple[int, str, str]:
    """(seed, kind, detail) of one seeded case."""
    import logging

    logging.disable(logging.WARNING)
    from tests.fuzz.generator import generate
    from tests.fuzz.harness import check_model

    outcome = check_model(generate(seed), seed)
    return seed, outcome.kind, outcome.detail


def fuzz(
    cases: int, start: int = 0, jobs: int = 1, deadline_s: float | None = None
) -> tuple[collections.Counter, list[tuple[int, str, str]]]:
    """Run seeds ``start .. start+cases`` (stopping at ``deadline_s``); the counts and the failures."""
    counts: collections.Counter = collections.Counter({k: 0 for k in LABELS})
    failures: list[tuple[int, str, str]] = []
    began = time.monotonic()
    seeds = range(start, start + cases)

    def record(result: tuple[int, str, str]) -> None:
        counts[result[1]] += 1
        if result[1] not in ("equal", "invalid"):
            failures.append(result)

    if jobs <= 1:
        for seed in seeds:
            if deadline_s is not None and time.monotonic() - began > deadline_s:
                break
            record(run_case(seed))
    else:
        ctx = multiprocessing.get_context("forkserver" if sys.platform != "win32" else "spawn")
        with ctx.Pool(jobs, initializer=os.nice, initargs=(0,)) as pool:
            for result in pool.imap_unordered(run_case, seeds, chunksize=8):
                record(result)
                if deadline_s is not None and time.monotonic() - began > deadline_s:
                    pool.terminate()
                    break
    failures.sort()
    return counts, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__)
    parser.add_argument("--cases", type=int, default=int(os.environ.get("LAYERZERO_FUZZ_CASES", "2000")))
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--minimize", action="store_true", help="minimise one failure per distinct message")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    began = time.monotonic()
    counts, failures = fuzz(args.cases, args.start, args.jobs)
    total = sum(counts.values())
    print(f"{total} cases in {time.monotonic() - began:.0f} s")
    for kind, label in LABELS.items():
        print(f"  {label:28s} {counts[kind]}")
    seen: set[str] = set()
    for seed, kind, detail in failures:
        print(f"seed {seed}: {kind}: {detail}")
        key = f"{kind}:{detail[:60] if kind == 'exception' else detail.split(' ')[0]}"
        if args.minimize and key not in seen:
            seen.add(key)
            from tests.fuzz.generator import generate
            from tests.fuzz.harness import Outcome
            from tests.fuzz.minimize import minimize, to_text

            small = minimize(generate(seed), Outcome(kind, detail), seed)
            print(f"--- seed {seed} minimised ({len(small.graph.node)} nodes):\n{to_text(small)}\n---")
    return 0 if counts["differ"] + counts["exception"] + counts["cannot_run"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
