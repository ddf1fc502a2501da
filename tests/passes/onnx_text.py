"""Pieces of the ONNX text models the pass tests write (``onnx.parser``): the header, and seeded weights."""

from __future__ import annotations

import numpy as np

HEADER = '<ir_version: 10, opset_import: ["" : 18]>'


def floats(n: int, seed: int) -> str:
    """``n`` seeded values uniform in [-1, 1), comma-separated with 4 decimals (a tensor literal's body)."""
    values = np.random.default_rng(seed).uniform(-1.0, 1.0, size=n)
    return ", ".join(f"{v:.4f}" for v in values)


#: y = Neg(Relu(x)): the zero-flag tests' oracle (tests/passes/test_zero_flags*.py), their flagged block between
#: the two removed.
WITHOUT_BLOCK = (
    HEADER
    + """
    g (float[N, 4] x) => (float[N, 4] y) {
        h = Relu(x)
        y = Neg(h)
    }
    """
)
