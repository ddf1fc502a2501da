"""CI run of the differential fuzzer: a few thousand seeded random graphs, compiled and compared with ORT.

``LAYERZERO_FUZZ_CASES`` sets the number of cases (default 3000), ``LAYERZERO_FUZZ_SECONDS`` the time budget
(default 170 s, on 2 processes); the long run is ``python -m tests.fuzz.run --cases 100000``. A failure is
minimised (delta debugging over nodes) and printed in ONNX text, for ``test_regressions.py``.
"""

from __future__ import annotations

import os

from tests.fuzz.generator import generate
from tests.fuzz.harness import Outcome
from tests.fuzz.minimize import minimize, to_text
from tests.fuzz.run import LABELS, fuzz


# Failures whose cause is owned by the lattice engineer (passes/_lattice.py, issue 14 causes 1, 4, 5), each with a
# strict xfail regression in test_regressions.py. NOTE: make this return False when the lattice fix is merged.
def lattice_open(seed: int, detail: str) -> bool:
    if "Integers to negative integer powers" in detail:  # cause 1
        return True
    model = generate(seed)
    consts = {t.name for t in model.graph.initializer}
    return any(
        n.op_type == "MatMulInteger"  # cause 4
        or (n.op_type == "Pad" and len(n.input) > 2 and n.input[2] and n.input[2] not in consts)  # cause 5
        for n in model.graph.node
    )


def test_fuzz_ci() -> None:
    cases = int(os.environ.get("LAYERZERO_FUZZ_CASES", "3000"))
    seconds = float(os.environ.get("LAYERZERO_FUZZ_SECONDS", "170"))
    counts, failures = fuzz(cases, start=0, jobs=2, deadline_s=seconds)
    summary = ", ".join(f"{LABELS[k]} {counts[k]}" for k in LABELS)
    print(summary)
    ran = sum(counts.values())
    # 2 cores to itself run ~3000 in the budget; a loaded machine fewer, but never a token few.
    assert ran >= min(cases, 300), f"only {ran} cases ran in {seconds:.0f} s: {summary}"
    assert counts["equal"] > 0.7 * ran, f"too few valid cases: {summary}"
    open_failures = [f for f in failures if not lattice_open(f[0], f[2])]
    if open_failures:
        seed, kind, detail = open_failures[0]
        small = minimize(generate(seed), Outcome(kind, detail), seed, budget=150)
        raise AssertionError(f"{summary}\nfirst failure, seed {seed}: {kind}: {detail}\nminimised:\n{to_text(small)}")
