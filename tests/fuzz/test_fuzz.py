"""CI run of the differential fuzzer: a few thousand seeded random graphs, compiled and compared with ORT.

``LAYERZERO_FUZZ_CASES`` sets the number of cases (default 2000), ``LAYERZERO_FUZZ_SECONDS`` the time budget
(default 170 s, on 2 processes); the long run is ``python -m tests.fuzz.run --cases 100000``. A failure is
minimised (delta debugging over nodes) and printed in ONNX text, for ``test_regressions.py``.
"""

from __future__ import annotations

import os

from tests.fuzz.generator import generate
from tests.fuzz.harness import Outcome
from tests.fuzz.minimize import minimize, to_text
from tests.fuzz.run import LABELS, fuzz

# Failures whose cause is owned by the lattice engineer (passes/_lattice.py, issue 14 cause 1): each has a strict
# xfail regression in test_regressions.py. NOTE: empty this tuple when the lattice fix is merged.
LATTICE_OPEN = ("Integers to negative integer powers",)


def test_fuzz_ci() -> None:
    cases = int(os.environ.get("LAYERZERO_FUZZ_CASES", "2000"))
    seconds = float(os.environ.get("LAYERZERO_FUZZ_SECONDS", "170"))
    counts, failures = fuzz(cases, start=0, jobs=2, deadline_s=seconds)
    summary = ", ".join(f"{LABELS[k]} {counts[k]}" for k in LABELS)
    print(summary)
    ran = sum(counts.values())
    assert ran >= min(cases, 1000), f"only {ran} cases ran in {seconds:.0f} s: {summary}"
    assert counts["equal"] > 0.7 * ran, f"too few valid cases: {summary}"
    open_failures = [f for f in failures if not any(s in f[2] for s in LATTICE_OPEN)]
    if open_failures:
        seed, kind, detail = open_failures[0]
        small = minimize(generate(seed), Outcome(kind, detail), seed, budget=150)
        raise AssertionError(f"{summary}\nfirst failure, seed {seed}: {kind}: {detail}\nminimised:\n{to_text(small)}")
