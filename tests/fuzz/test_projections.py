"""CI run of the weight-pass fuzzer (``projections.py``): seeded projection graphs through ``--weights``,
``--linear-kernel native`` and ``--activation-sparsity``, every compile verified.

``LAYERZERO_PROJECTION_CASES`` sets the number of cases (default 24: about 2 s of CPU each, ten compiles and a
second compile each); the long run is ``python -m tests.fuzz.projections --cases 300``."""

from __future__ import annotations

import logging
import os

from tests.fuzz.projections import KINDS, OPTIONS, check, generate, quiet


def test_projection_graphs_compile_verify_and_run(library: str) -> None:
    cases = int(os.environ.get("LAYERZERO_PROJECTION_CASES", "24"))
    failures = [line for seed in range(cases) for line in check(seed, library)]
    assert not failures, "\n".join(failures[:10])


def test_the_generator_covers_its_kinds_and_is_deterministic() -> None:
    names = " ".join(n.name for seed in range(60) for n in generate(seed).graph.node)
    assert generate(7).SerializeToString() == generate(7).SerializeToString()
    for needle in ("gate_proj", "q_proj", "Gemm", "Cast", "Transpose", "embed/Gather", "DequantizeLinear",
                   "layers.7", "/mlp/Mul", "/If"):  # fmt: skip
        assert needle in names, needle
    assert len(KINDS) == 17 and len(OPTIONS) == 10


def test_a_case_that_breaks_is_reported_with_its_seed_and_options(library: str, monkeypatch) -> None:
    """The checker is able to fail: a compile that raises an unexpected error is a failure naming seed and options."""
    import layerzero.compile as compile_module

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(compile_module, "compile_model", broken)
    failures = check(0, library, OPTIONS[:1], quantized=False)
    assert failures == ["seed 0, options 0 {'weights': 'int4'}: RuntimeError: boom (test_projections.py:"
                        f"{broken.__code__.co_firstlineno + 1})"]  # fmt: skip


def test_quiet_gives_the_log_levels_back() -> None:
    before = logging.getLogger("layerzero").level, logging.getLogger().level
    with quiet():
        assert logging.getLogger("layerzero").level == logging.ERROR
    assert (logging.getLogger("layerzero").level, logging.getLogger().level) == before
