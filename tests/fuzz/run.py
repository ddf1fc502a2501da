"""The differential fuzzer's long run: ``python -m tests.fuzz.run --cases 100000 [--start 0] [--jobs 2]``.

``--generator V`` picks the generator version (``tests/fuzz/generator.py``; default the latest): a seed reported
by a run of an older version replays with that version.

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

__all__ = ["CRASH_HOOK", "fuzz", "main", "run_case"]

# The seed whose process kills itself with SIGSEGV (a test of the runner's crash handling; unset in real runs).
CRASH_HOOK = "LAYERZERO_FUZZ_CRASH_SEED"

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
    "crash": "process died (segfault)",
}


def run_case(seed: int, version: int | None = None) -> tuple[int, str, str]:
    """(seed, kind, detail) of one seeded case (generator ``version``, default the latest)."""
    import logging

    logging.disable(logging.WARNING)
    if os.environ.get(CRASH_HOOK) == str(seed):  # tests/fuzz/test_fuzz.py: a case whose process dies
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)
    from tests.fuzz.generator import VERSION, generate
    from tests.fuzz.harness import check_model

    outcome = check_model(generate(seed, VERSION if version is None else version), seed)
    return seed, outcome.kind, outcome.detail


def _run_isolated(seeds: list[int], version: int | None = None) -> list[tuple[int, str, str]]:
    """Run ``seeds`` in fresh interpreters, one at a time, each announcing a seed before running it: a process
    that dies names the seed it died on (``crash``), and the rest continue in a new process."""
    import json
    import subprocess

    results: list[tuple[int, str, str]] = []
    left = list(seeds)
    script = (
        f"import json, sys; sys.path.insert(0, {str(_ROOT)!r}); from tests.fuzz.run import run_case\n"
        "version = json.loads(sys.argv[2])\n"
        "for seed in json.loads(sys.argv[1]):\n"
        "    print('start', seed, flush=True)\n"
        "    print('done', json.dumps(run_case(seed, version)), flush=True)\n"
    )
    while left:
        proc = subprocess.run(
            [sys.executable, "-c", script, json.dumps(left), json.dumps(version)],
            capture_output=True,
            text=True,
            timeout=3600,
        )
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("start "):
                started = int(line.split()[1])
            elif line.startswith("done "):
                seed, kind, detail = json.loads(line[5:])
                results.append((seed, kind, detail))
                left.remove(seed)
                started = None
        if proc.returncode == 0 and not left:
            break
        if started is None:  # died outside any case: count the first left seed so nothing is silent
            started = left[0]
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        if _original_kills_ort(started, version):
            # onnxruntime's own bug on the generated model (its graph optimiser dies loading it, e.g. seed
            # 45712): not a case about the compiler, counted as invalid like any model ORT refuses.
            results.append((started, "invalid", f"onnxruntime dies loading the generated model ({how})"))
        else:
            tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
            results.append((started, "crash", f"the case's process died ({how}) {tail}".strip()))
        left.remove(started)
    return results


def _original_kills_ort(seed: int, version: int | None = None) -> bool:
    """Whether creating the ORT session of the generated (uncompiled) model alone kills the process."""
    import subprocess

    code = (
        f"import sys; sys.path.insert(0, {str(_ROOT)!r})\n"
        "from tests.fuzz.generator import VERSION, generate\n"
        "from tests.fuzz.harness import _session\n"
        f"_session(generate({seed}, {version!r} or VERSION).SerializeToString())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    return proc.returncode < 0


def fuzz(
    cases: int, start: int = 0, jobs: int = 2, deadline_s: float | None = None, version: int | None = None
) -> tuple[collections.Counter, list[tuple[int, str, str]]]:
    """Run seeds ``start .. start+cases`` (stopping at ``deadline_s``) of generator ``version`` (default the
    latest); the counts and the failures.

    A case whose process dies (a segfault in onnxruntime on the original or the compiled model) does not hang
    or end the run: the batches in flight are rerun in fresh processes that announce each seed, the seed a
    process dies on is counted as ``crash`` and the rest as what they are. ``jobs`` 1 runs one worker process
    too (a ``--jobs 1`` run of seeds 114800-118899 in this process ended without printing its counts; rerun in
    a worker, 4,097 equal and none died); only ``jobs`` 0 runs the cases in this process."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    counts: collections.Counter = collections.Counter({k: 0 for k in LABELS})
    failures: list[tuple[int, str, str]] = []
    began = time.monotonic()
    seeds = list(range(start, start + cases))

    def record(result: tuple[int, str, str]) -> None:
        counts[result[1]] += 1
        if result[1] not in ("equal", "invalid"):
            failures.append(result)

    def late() -> bool:
        return deadline_s is not None and time.monotonic() - began > deadline_s

    if jobs <= 0:
        for seed in seeds:
            if late():
                break
            record(run_case(seed, version))
    else:
        batch = 8
        batches = [seeds[i : i + batch] for i in range(0, len(seeds), batch)]
        # spawn: each worker starts from the current environment (the crash hook below) with no forked ORT state.
        ctx = multiprocessing.get_context("spawn")
        pending = list(reversed(batches))
        while pending and not late():
            with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
                running = {}
                broken: list[list[int]] = []
                while (pending or running) and not late():
                    while pending and len(running) < 2 * jobs:
                        chunk = pending.pop()
                        running[pool.submit(_run_batch, chunk, version)] = chunk
                    done = next(iter(_wait_any(running)))
                    chunk = running.pop(done)
                    try:
                        for result in done.result():
                            record(result)
                    except BrokenProcessPool:
                        broken.append(chunk)
                        broken += list(running.values())  # the pool is gone: everything in flight reruns
                        running.clear()
                        break
            for chunk in broken:  # in fresh processes: the seed a process dies on is named and counted
                for result in _run_isolated(chunk, version):
                    record(result)
    failures.sort()
    return counts, failures


def _run_batch(seeds: list[int], version: int | None = None) -> list[tuple[int, str, str]]:
    os.nice(0)
    return [run_case(seed, version) for seed in seeds]


def _wait_any(futures: dict) -> set:
    from concurrent.futures import FIRST_COMPLETED, wait

    done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__)
    parser.add_argument("--cases", type=int, default=int(os.environ.get("LAYERZERO_FUZZ_CASES", "2000")))
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--generator", type=int, default=None, help="generator version (default: the latest)")
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="stop starting cases after this many seconds (counts what ran)"
    )
    parser.add_argument("--minimize", action="store_true", help="minimise one failure per distinct message")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.fuzz.generator import OPS_BY_VERSION, VERSION

    version = VERSION if args.generator is None else args.generator
    if version not in OPS_BY_VERSION:
        print(f"error: --generator {version} is not one of {sorted(OPS_BY_VERSION)}", file=sys.stderr)
        return 2
    began = time.monotonic()
    counts, failures = fuzz(args.cases, args.start, args.jobs, deadline_s=args.deadline_s, version=version)
    total = sum(counts.values())
    print(f"{total} cases (generator version {version}) in {time.monotonic() - began:.0f} s")
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

            small = minimize(generate(seed, version), Outcome(kind, detail), seed)
            print(f"--- seed {seed} minimised ({len(small.graph.node)} nodes):\n{to_text(small)}\n---")
    return 0 if counts["differ"] + counts["exception"] + counts["cannot_run"] + counts["crash"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
