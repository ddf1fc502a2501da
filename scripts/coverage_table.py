"""Write docs/coverage.md, the export corpus's coverage table: family × exporter → what folds.

    python scripts/coverage_table.py            # from the last run's results (the corpus tests write them)
    python scripts/coverage_table.py --run      # run the corpus here first (every case, or --family NAME ...)
    python scripts/coverage_table.py --update   # also rewrite tests/corpus/expectations.json from the results
    python scripts/coverage_table.py --update --variant flag   # ... only the entries of that variant
    python scripts/coverage_table.py --speed    # measure the MoE speed column first (every MoE family, or --family)
    python scripts/coverage_table.py --speed --exporter torchscript --family jetmoe --rounds 21   # rerun one row

The results are the JSON files the corpus tests (tests/corpus/test_corpus.py) write to the corpus cache
(``$LAYERZERO_CORPUS_CACHE`` or ``~/.cache/layerzero/corpus``, one folder per torch / transformers version),
``results/``. ``--update`` records each case's outcome as its expectation: the tests then assert at least that.

``--speed`` measures the MoE families' 1-token speed-up (``tests/corpus/corpus_speed.py``: hidden 512, 2 layers,
the family's default experts and top-k capped at 32 / 8, onnxruntime on 1 thread, interleaved rounds, p50) and
writes it to ``results_speed/`` in the cache; the table's speed column reads it. Not part of the tests (CI time):
a run of every MoE family and both exporters takes about 15 minutes on 2 cores, exports cached.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "corpus"))

from corpus_cases import all_cases, read_results, run_case, variants_for, write_result  # noqa: E402
from corpus_export import EXPORTERS  # noqa: E402
from corpus_families import FAMILIES  # noqa: E402
from corpus_speed import read_speed, run_speed, write_speed  # noqa: E402

EXPECTATIONS = ROOT / "tests" / "corpus" / "expectations.json"
TABLE = ROOT / "docs" / "coverage.md"
COLUMNS = [
    ("rotary_off", "rotary identity"),
    ("up0", "zero up"),
    ("up0_b0", "zero up + bias"),
    ("gate0", "zero gate"),
    ("down0", "zero down"),
    ("down0_b0", "zero down + bias"),
    ("neurons", "pruned neurons"),
    ("heads", "pruned heads"),
    ("flag", "declared flag"),
]
MARK = {"full": "✓", "partial": "◐", "none": "✗"}


def _cell(r: dict | None) -> str:
    if r is None:
        return "·"
    if r.get("export_error"):
        return "export ✗"
    if r.get("compile_error"):
        error = r["compile_error"]
        if "UnsupportedModelError" in error:
            return "refused"
        return "verify ✗" if "VerificationError" in error else "crash"
    if r.get("wrong_output"):
        return "WRONG"
    return MARK.get(r["fold"], "–")


def _moe_cell(r: dict | None) -> str:
    if r is None or r.get("export_error") or r.get("compile_error") or r.get("moe_blocks") is None:
        return _cell(r) if r is not None and (r.get("export_error") or r.get("compile_error")) else "·"
    return f"yes ({r['moe_blocks']}/2)" if r["moe_blocks"] >= 2 else f"partly ({r['moe_blocks']}/2)" if r[
        "moe_blocks"
    ] else "no"


def _export_error(results: dict[str, dict], family: str, exporter: str) -> str | None:
    """The exporter's error on the family's one export (a variant exported on its own does not count)."""
    for key, r in results.items():
        if key.startswith(f"{family}/{exporter}/") and r.get("export_error") and not r.get("exported_separately"):
            return r["export_error"]
    return None


def _speed_cell(r: dict | None) -> str:
    if r is None:
        return "·"
    if r.get("export_error"):
        return "export ✗"
    if r.get("compile_error"):
        return "refused" if "UnsupportedModelError" in r["compile_error"] else "crash"
    mark = " **slower**" if r["compiled_ms"] > r["export_ms"] else ""
    return f"{r['speedup']:.2f}×{mark}"


SPEED_TARGET = 1.15  # issue 8: every MoE family faster than its export at 1 token, with margin

# Why a row is where it is, where the number alone misleads (measured; printed under the speed table).
SPEED_NOTES = {
    "jetmoe/dynamo": (
        "jetmoe / dynamo is the closest row because its export already skips: JetMoE's MLP and its mixture of "
        "attention heads sort the token slots by expert and run one `Gemm` per expert on its slice of rows (empty "
        "at 1 token for the experts not chosen), so both models read the same expert weights. What the compile "
        "saves is the export's ≈ 87 small routing nodes per MLP block: with liblayerzero_ort.so built (`auto` "
        "picks `native`, one op per block) 1.35× here and 1.54× / 1.57× in two reruns at load 2; without the "
        "library (`auto` picks `if`) 1.01× in two runs of 21 rounds (load 2.9 and 8.8), and a model with each MLP "
        "block cut down to its two routed experts' products measured 1.07-1.08×: without the native op, no MLP "
        "lowering beats the export by more than noise. The attention's routed projections stay as exported."
    ),
}


def _speed_notes(speed: dict[str, dict]) -> list[str]:
    if not speed:
        return ["No recorded run (`python scripts/coverage_table.py --speed`)."]
    out = [
        "1-token latency, export vs compiled model, at hidden 512 (`tests/corpus/corpus_speed.py`: 2 layers, 8 heads",
        "of 64, vocab 1024, the family's default experts and top-k capped at 32 experts / top-8, expert MLPs of",
        "1024 for families of ≤ 16 experts and 256 for finer-grained ones, random weights); onnxruntime CPU, 1",
        "thread, default optimisations, the same session options for both; interleaved rounds, p50. Speed-up =",
        "export p50 / compiled p50. Measured on a 2-core machine shared with other jobs: take ±10 % as noise.",
        "Lowering: the MoE lowering the compile chose (`auto`); load: the machine's 1-minute load average before",
        "→ after the timed rounds (· where not recorded).",
        "These rows ran with liblayerzero_ort.so built (`layerzero plugins build --only ort`), so `auto` picks",
        "`native` for every family but PhiMoE (its sparsemixer routing runs in the `if` form). Without the",
        "library `auto` chooses `if` or `ort-moe` by its cost model; measured that way earlier the same day (load",
        "3-8): 1.17-2.83× (qwen2_moe 1.17 / 1.23, gpt_oss 1.18 / 1.22 with `ort-moe`) and jetmoe 1.01× (note below).",
        "",
        "| family | exporter | config | export p50 ms | compiled p50 ms | speed-up | MoE blocks | max abs diff "
        "| lowering | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in sorted(speed.items()):
        family, exporter = key.split("/")
        if r.get("export_error") or r.get("compile_error"):
            reason = r.get("export_error") or r.get("compile_error")
            out.append(
                f"| {family} | {exporter} | {r.get('config', '')} | – | – | {_speed_cell(r)} | – | `{reason}` | – | – |"
            )
            continue
        load = (r.get("load") or "·").replace("->", "→")
        out.append(
            f"| {family} | {exporter} | {r['config']} | {r['export_ms']:.2f} | {r['compiled_ms']:.2f} | "
            f"{_speed_cell(r)} | {r['moe_blocks']}/2 | {r['max_abs']:.1e} | {r.get('lowering') or '·'} | {load} |"
        )
    slower = [
        k for k, r in speed.items() if r.get("compiled_ms") is not None and r["compiled_ms"] > r["export_ms"]
    ]
    below = [k for k, r in speed.items() if r.get("speedup") is not None and r["speedup"] < SPEED_TARGET]
    unmeasured = [
        f"{f.name}/{e}" for f in FAMILIES.values() if f.moe for e in EXPORTERS if f"{f.name}/{e}" not in speed
    ]
    out += [
        "",
        "Compiled p50 above the export's at 1 token: "
        + (
            ", ".join(f"{k} ({speed[k]['compiled_ms']:.2f} vs {speed[k]['export_ms']:.2f} ms)" for k in sorted(slower))
            if slower
            else "none"
        )
        + ". Below the 1.15× target: "
        + (", ".join(f"{k} ({speed[k]['speedup']:.2f}×)" for k in sorted(below)) if below else "none")
        + ". Not measured: "
        + (", ".join(unmeasured) if unmeasured else "none")
        + ".",
    ]
    notes = [f"- {text}" for key, text in SPEED_NOTES.items() if key in speed]
    return out + (["", *notes] if notes else [])


def write_table(results: dict[str, dict], speed: dict[str, dict] | None = None) -> str:
    speed = speed or {}
    import torch
    import transformers

    lines = [
        "# Export corpus: what folds, per model family and exporter",
        "",
        "Generated by `python scripts/coverage_table.py` from the corpus tests (`tests/corpus/`): tiny random-weight",
        "configs of each family (hidden 64, 2 layers, vocab 256; MoE: 4 experts, top-2), exported by both",
        "`torch.onnx` exporters (`dynamo=True`; the TorchScript path `dynamo=False`, eager attention, opset 17),",
        "each zero variant derived from the export by editing its tensors, compiled with the default options",
        f"(verification on). torch {torch.__version__}, transformers {transformers.__version__}.",
        "",
        "✓ all of it folds (rotary: no Cos / Sin / Neg left; zero projection: every MLP MatMul gone; pruned",
        "neurons / heads: the zeroed parameters removed, heads by narrowing the query and output projections while the",
        "head's attention core still runs; flag: the layer bypassed), ◐ part of it, ✗ nothing;",
        "– not applicable; `refused` / `crash` / `verify ✗` (the compiler's own verification caught a mismatch): the",
        "compile failed (reason below); `export ✗`: the exporter failed (reason below); `·`: no recorded run.",
        "Outputs equal the export's (onnxruntime, atol 1e-5, rtol 1e-4) in every case that compiled, unless marked",
        "WRONG; a declared flag's outputs equal transformers' model run with that layer replaced by the identity.",
        "MoE skipping form: MoE blocks rewritten into `ai.layerzero::MoE` (lowered to per-expert `If`), of 2.",
        "1-token speed-up: export p50 / compiled p50 at hidden 512 (section \"MoE speed at 1 token\" below;",
        "`--speed`), **slower** where the compiled model is slower than the export.",
        "",
    ]
    header = ["family", "exporter", *(title for _, title in COLUMNS), "MoE skipping form", "1-token speed-up"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    notes: list[str] = []
    for family in FAMILIES.values():
        variants = set(variants_for(family))
        for exporter in EXPORTERS:
            row = [family.name, exporter]
            for variant, _ in COLUMNS:
                row.append(_cell(results.get(f"{family.name}/{exporter}/{variant}")) if variant in variants else "–")
            base = results.get(f"{family.name}/{exporter}/base")
            row.append(_moe_cell(base) if family.moe else "–")
            row.append(_speed_cell(speed.get(f"{family.name}/{exporter}")) if family.moe else "–")
            export_error = _export_error(results, family.name, exporter)
            if export_error:
                row[2:] = ["export ✗"] * (len(row) - 2)
                notes.append(f"- **{family.name} / {exporter}**: export fails: `{export_error}`")
            lines.append("| " + " | ".join(row) + " |")
            for variant in variants_for(family):
                r = results.get(f"{family.name}/{exporter}/{variant}")
                if r is None or export_error:
                    continue
                if r.get("export_error"):
                    notes.append(f"- {family.name} / {exporter} / {variant}: export of the variant fails: "
                                 f"`{r['export_error']}`")
                elif r.get("compile_error"):
                    notes.append(f"- {family.name} / {exporter} / {variant}: `{r['compile_error']}`")
                elif r.get("wrong_output"):
                    notes.append(f"- {family.name} / {exporter} / {variant}: WRONG output, max abs {r['max_abs']}")
                if r.get("exported_separately"):
                    notes.append(f"- {family.name} / {exporter} / {variant}: exported on its own "
                                 f"({r['exported_separately']})")
    lines += ["", "## Refusals, crashes and export failures", "", *(notes or ["None."]), ""]
    lines += ["## MoE speed at 1 token", "", *_speed_notes(speed), ""]
    lines += [
        "## Families",
        "",
        "Dense: " + ", ".join(f"{f.name} (`{f.config}`)" for f in FAMILIES.values() if not f.moe) + ".",
        "MoE (experts through transformers' `batched_mm` implementation): "
        + ", ".join(f"{f.name} (`{f.config}`)" for f in FAMILIES.values() if f.moe)
        + ". Not in the corpus: multimodal, hybrid (Mamba / linear attention) and encoder-decoder families.",
        "",
        "The real-size cases (≥ 1 GB of external data: a Llama and an OLMoE-style MoE, 64 experts, top-8, hidden",
        "1024) are `tests/corpus/test_real_size.py` (`-m slow`), which prints each compile's peak RSS.",
        "",
    ]
    lines += ["## Counts", "", *_counts(results), ""]
    return "\n".join(lines)


def _counts(results: dict[str, dict]) -> list[str]:
    dense = [f for f in FAMILIES.values() if not f.moe]
    moe = [f for f in FAMILIES.values() if f.moe]
    out = [f"- families: {len(FAMILIES)} ({len(dense)} dense, {len(moe)} MoE); cases: {len(all_cases())}, "
           f"with results: {len(results)}"]
    for exporter in EXPORTERS:
        seen = {k.split("/")[0] for k in results if k.split("/")[1] == exporter}
        exported = [f for f in seen if not _export_error(results, f, exporter)]
        rs = [r for k, r in results.items() if k.split("/")[1] == exporter and not r.get("export_error")]
        folds = {m: sum(1 for r in rs if not r.get("compile_error") and r["fold"] == m) for m in MARK}
        refused = sum(1 for r in rs if r.get("compile_error") and "UnsupportedModelError" in r["compile_error"])
        crashed = sum(1 for r in rs if r.get("compile_error") and "UnsupportedModelError" not in r["compile_error"])
        wrong = sum(1 for r in rs if r.get("wrong_output"))
        bases = [results.get(f"{f.name}/{exporter}/base") or {} for f in moe]
        moe_yes = sum(1 for r in bases if (r.get("moe_blocks") or 0) >= 2)
        out.append(
            f"- {exporter}: exported {len(exported)} of {len(seen)} families tried; cases compiled "
            f"{len(rs) - refused - crashed} of {len(rs)}: full {folds['full']}, partial {folds['partial']}, "
            f"none {folds['none']}; refused {refused}; crashed {crashed}; wrong outputs {wrong}; "
            f"MoE skipping form in {moe_yes} of {len(moe)} MoE families"
        )
    return out


def update_expectations(results: dict[str, dict], variant: str | None = None) -> None:
    """Record each case's outcome as its expectation (only ``variant``'s cases when given; the rest stay)."""
    old = json.loads(EXPECTATIONS.read_text())["cases"] if EXPECTATIONS.exists() else {}
    cases = {}
    for key in ("/".join(c) for c in all_cases()):
        r = results.get(key)
        if variant is not None and key.split("/")[2] != variant and key in old:
            entry = old[key]
        elif r is None:
            entry = old.get(key) or {"fold": "n/a", "pending": "no recorded run yet: compile and outputs only"}
        elif r.get("export_error"):
            entry = {"export_error": r["export_error"]}
        elif r.get("compile_error"):
            entry = {"compile_error": r["compile_error"]}
        else:
            entry = {"fold": r["fold"]}
            if r.get("wrong_output"):
                entry["wrong_output"] = True
            if r.get("moe_blocks") is not None:
                entry["moe_blocks"] = r["moe_blocks"]
        cases[key] = entry
    doc = {
        "about": "Today's outcome per family/exporter/variant; tests/corpus/test_corpus.py asserts at least this. "
        "Rewritten by scripts/coverage_table.py --update.",
        "cases": cases,
    }
    EXPECTATIONS.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    print(f"wrote {EXPECTATIONS} ({len(cases)} cases)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run the corpus cases first")
    parser.add_argument("--family", action="append", help="with --run: only this family (repeatable)")
    parser.add_argument("--update", action="store_true", help="rewrite tests/corpus/expectations.json")
    parser.add_argument("--variant", help="with --update: only this variant's entries (e.g. flag)")
    parser.add_argument("--speed", action="store_true", help="measure the MoE 1-token speed column first")
    parser.add_argument("--exporter", action="append", help="with --speed: only this exporter (repeatable)")
    parser.add_argument("--rounds", type=int, default=None, help="with --speed: interleaved rounds (default 7)")
    parser.add_argument("-o", "--output", type=Path, default=TABLE)
    args = parser.parse_args(argv)
    if args.run:
        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        start = time.perf_counter()
        for family, exporter, variant in all_cases():
            if args.family and family not in args.family:
                continue
            r = run_case(family, exporter, variant)
            write_result(r)
            status = r.export_error or r.compile_error or ("WRONG" if r.wrong_output else r.fold)
            print(f"{time.perf_counter() - start:7.1f}s {r.key}: {status} {r.detail}", flush=True)
    if args.speed:
        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
        start = time.perf_counter()
        for family in (f for f in FAMILIES.values() if f.moe):
            if args.family and family.name not in args.family:
                continue
            for exporter in EXPORTERS:
                if args.exporter and exporter not in args.exporter:
                    continue
                r = run_speed(family.name, exporter, **({"rounds": args.rounds} if args.rounds else {}))
                write_speed(r)
                status = r.export_error or r.compile_error or (
                    f"export {r.export_ms} ms, compiled {r.compiled_ms} ms: {r.speedup}x ({r.moe_blocks} blocks, "
                    f"{r.lowering}, load {r.load})"
                )
                print(f"{time.perf_counter() - start:7.1f}s {r.key} [{r.config}]: {status}", flush=True)
    results = read_results()
    args.output.write_text(write_table(results, read_speed()))
    print(f"wrote {args.output} ({len(results)} results)")
    if args.update:
        update_expectations(results, args.variant)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
