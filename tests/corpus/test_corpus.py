"""The export corpus: every family × exporter × zero variant, compiled with the default options.

Each case (tests/corpus/corpus_cases.py) exports the family once per exporter (cached, see corpus_export.py),
derives the variant by editing the export's tensors, runs ``compile_model`` (verification on) and then

- asserts the compile neither crashed nor refused, unless the expectations table records that refusal (the
  case is then an expected failure with the recorded reason, reported to be fixed);
- asserts the compiled model's outputs equal the export's on seeded inputs (onnxruntime, atol 1e-5, rtol 1e-4;
  at 1 and 16 tokens for MoE families; for the declared flag, the compiler's own verification against the
  export with that layer bypassed);
- asserts at least the folding the expectations table (tests/corpus/expectations.json) records for the case:
  ``fold`` (``full`` ≥ ``partial`` ≥ ``none``) and, for MoE families, ``moe_blocks`` in the skipping form.

An outcome better than expected passes and is printed (and warned), so the table can be raised with
``python scripts/coverage_table.py --update``. Every case writes its result to the cache's ``results/``,
from which the script writes docs/coverage.md. A family an exporter cannot export skips with the exporter's
error. ``LAYERZERO_CORPUS_FAMILIES=llama,mixtral`` limits the run to those families.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

pytest.importorskip("torch", reason="the export corpus needs torch (pip install -e '.[export]')")
pytest.importorskip("transformers", reason="the export corpus needs transformers (pip install -e '.[export]')")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from corpus_cases import FOLD_RANK, all_cases, run_case, write_result  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

EXPECTATIONS: dict[str, dict] = json.loads((HERE / "expectations.json").read_text())["cases"]
# LAYERZERO_CORPUS_FAMILIES=llama,mixtral runs only those families (local work); CI runs every one.
_ONLY = {f for f in os.environ.get("LAYERZERO_CORPUS_FAMILIES", "").split(",") if f}
CASES = [c for c in all_cases() if not _ONLY or c[0] in _ONLY]


def test_expectations_cover_every_case() -> None:
    keys = {"/".join(c) for c in all_cases()}
    assert set(EXPECTATIONS) == keys, (
        f"expectations.json is out of date: missing {sorted(keys - set(EXPECTATIONS))[:5]}, "
        f"stale {sorted(set(EXPECTATIONS) - keys)[:5]}; run scripts/coverage_table.py --update"
    )


def _better(key: str, what: str) -> None:
    message = f"{key}: better than expected: {what} (raise tests/corpus/expectations.json)"
    print(message)
    warnings.warn(message, UserWarning, stacklevel=2)


@pytest.mark.parametrize(("family", "exporter", "variant"), CASES, ids=["/".join(c) for c in CASES])
def test_case(family: str, exporter: str, variant: str) -> None:
    result = run_case(family, exporter, variant)
    write_result(result)
    key = result.key
    expected = EXPECTATIONS.get(key, {})
    if result.export_error:
        pytest.skip(f"{exporter} cannot export {family} ({variant}): {result.export_error}")
    if expected.get("export_error"):
        _better(key, f"exports now (was: {expected['export_error']})")
    if result.compile_error:
        if expected.get("compile_error"):
            pytest.xfail(f"known refusal/crash, to be fixed: {result.compile_error}")
        pytest.fail(f"{key}: compile failed: {result.compile_error}")
    if expected.get("compile_error"):
        _better(key, f"compiles now (was: {expected['compile_error']})")
    if result.wrong_output:
        if expected.get("wrong_output"):
            pytest.xfail(f"known wrong output, max abs {result.max_abs}")
        pytest.fail(f"{key}: compiled output differs from the export: max abs {result.max_abs} ({result.detail})")

    want = expected.get("fold", "n/a")
    assert FOLD_RANK[result.fold] >= FOLD_RANK[want], f"{key}: fold {result.fold}, expected {want}: {result.detail}"
    if FOLD_RANK[result.fold] > FOLD_RANK[want]:
        _better(key, f"fold {result.fold} (expected {want}): {result.detail}")
    if expected.get("moe_blocks") is not None:
        assert result.moe_blocks >= expected["moe_blocks"], (
            f"{key}: {result.moe_blocks} MoE blocks in the skipping form, expected {expected['moe_blocks']}"
        )
        if result.moe_blocks > expected["moe_blocks"]:
            _better(key, f"{result.moe_blocks} MoE blocks in the skipping form (expected {expected['moe_blocks']})")
