"""Decode tokens/s of MoE causal LMs: the dense export against LayerZero's compiled bundles, side by side.

For a Mixtral-style and a Qwen3-MoE-style model at realistic per-layer sizes (random weights, seeded, written
with ``save_pretrained``), at batch 1 with a 32-token prompt and 128 new tokens (greedy):

- export: ``layerzero export`` (torch.onnx dynamo, ``batched_mm`` experts, KV cache) run as is by the runtime;
- LZ if / LZ ort-moe / LZ native: ``layerzero compile`` of that export with ``--moe-lowering if`` / ``ort-moe`` /
  ``native`` (the native ONNX Runtime custom op is built into ~/.cache/layerzero/decode/plugins when cmake and
  a compiler are there, so other checkouts' ``auto`` lowering is untouched);
- ONNX Runtime GenAI: when ``onnxruntime_genai`` is importable (``--genai-path DIR`` adds a ``pip install
  --target DIR onnxruntime-genai``), its model builder is asked for the same folder; when it cannot build the
  family the table says why (its own message).

Every variant runs through ``Engine.generate`` (the same decode loop: ONNX Runtime through an IO binding, the
presents bound back as the next step's past); the rounds are interleaved (every variant once per round) so
the noise of a shared machine falls on all alike, and the table gives the median decode tokens/s (new tokens
after the first / their time), time to first token and the ratio to the export; beside them the median step time
(the median over a run's decode steps, then over rounds) and its ratio to the export's, which a burst of load
moves less, and the best round's decode tokens/s (the least disturbed run, as ``timeit`` advises) and its
ratio to the export's best. The target is judged on the median decode tokens/s. Every variant's ids must
equal transformers' greedy ``generate`` on the same weights.

Verification (``--verify``): ``once`` (default) compiles the native lowering (else the first) with LayerZero's
numerical verification (chunked at this size: the reference and the compiled model, a few layers at a time, on
two input sets) and the others with ``--no-verify``; ``all`` verifies every compile, ``none`` (``--no-verify``)
none. Every variant also gets a short check: its prefill logits on the bench prompt against the export's (max
abs difference, printed), beside the 128 greedy ids against transformers'. The export is kept with its weights
in an external-data file (``model.onnx.data``): a 1.5 GB single-file protobuf is parsed whole (three times)
each time verification loads the original, which made a verified compile take ~5 minutes instead of ~2.5.

Sizes (``--quick``: 2 layers, for a smoke run; no target):
- mixtral: hidden 1024, 8 layers, 16 heads / 4 kv heads, 8 experts top-2, intermediate 1536, vocab 32000
  (389 M parameters, 1.6 GB float32);
- qwen3_moe: hidden 1024, 8 layers, 16 heads / 4 kv heads, head_dim 64, 32 experts top-4, moe intermediate
  384, vocab 32000 (389 M parameters, 1.6 GB float32).
Both have the same 40 M parameters per layer (experts 37.7 M), so the two differ only in routing: 2 of 8
large experts against 4 of 32 small ones. They fit this 24 GB machine with the export (~7 GB peak) and
export in ~15 minutes on 2 shared cores.

Targets (issue 12), printed met / NOT met; the exit status is 1 when one is missed: for each family the best
LayerZero lowering decodes ≥ 1.5 × the export's tokens/s, and every variant's ids equal transformers'.

    python bench/decode.py                       # both families, 3 rounds
    python bench/decode.py --quick               # tiny sizes, 1 round (checks the path, not the speed)
    python bench/decode.py --genai-path /tmp/ortgenai --families mixtral

Exports, bundles and transformers' reference ids are cached under ~/.cache/layerzero/decode/<family>-<key>/
(the key hashes the config, the sizes and the torch/transformers versions).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layerzero" / "decode"
PLUGIN_DIR = CACHE / "plugins"
# Before layerzero looks for liblayerzero_ort.so: this bench's build, not the shared default directory.
os.environ.setdefault("LAYERZERO_PLUGIN_DIR", str(PLUGIN_DIR))

import numpy as np  # noqa: E402

from layerzero.compile import compile_file  # noqa: E402
from layerzero.options import CompileOptions  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402

TARGET = 1.5  # best LayerZero lowering / export, decode tokens/s
LOWERINGS = ("if", "ort-moe", "native")
logger = logging.getLogger("bench.decode")


def configs(quick: bool) -> dict[str, dict[str, Any]]:
    """The two families' transformers configs (see the module doc for why these sizes)."""
    layers = 2 if quick else 8
    hidden = 256 if quick else 1024
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=16 if not quick else 4,
        num_key_value_heads=4 if not quick else 2,
        vocab_size=32000 if not quick else 1024,
        max_position_embeddings=4096,
        initializer_range=0.05,  # random weights that still pick varied tokens
        eos_token_id=None,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return {
        "mixtral": dict(
            common, num_local_experts=8, num_experts_per_tok=2, intermediate_size=1536 if not quick else 512
        ),
        "qwen3_moe": dict(
            common,
            num_experts=32 if not quick else 8,
            num_experts_per_tok=4 if not quick else 2,
            moe_intermediate_size=384 if not quick else 128,
            intermediate_size=1024,
            decoder_sparse_step=1,
            head_dim=64,
        ),
    }


def _model(family: str, config: dict[str, Any]):
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**config)).eval()
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config)).eval()


def prepare(family: str, config: dict[str, Any], prompt: list[int], new: int, say) -> dict[str, Any]:
    """The cached folder, export, bundles and transformers' greedy ids of one family (built when missing)."""
    import torch
    import transformers

    key = hashlib.sha256(
        json.dumps([config, prompt, new, torch.__version__, transformers.__version__], sort_keys=True).encode()
    ).hexdigest()[:12]
    root = CACHE / f"{family}-{key}"
    hf, exported, expected_file = root / "hf", root / "export" / "model.onnx", root / "expected.json"
    root.mkdir(parents=True, exist_ok=True)
    if not (hf / "config.json").is_file() or not expected_file.is_file():
        say(f"{family}: building the random-weight model and transformers' greedy ids")
        model = _model(family, config)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(hf)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None
            )
        seconds = time.perf_counter() - start
        doc = {"ids": out[0, len(prompt) :].tolist(), "params": params, "torch_tokens_per_s": new / seconds}
        expected_file.write_text(json.dumps(doc))
        del model
    doc = json.loads(expected_file.read_text())
    if not exported.is_file():
        from layerzero.hf_export import export_hf

        say(f"{family}: exporting ({doc['params'] / 1e6:.0f} M parameters)")
        start = time.perf_counter()
        export_hf(hf, exported, cache=True, exporter="dynamo")
        doc["export_s"] = time.perf_counter() - start
        expected_file.write_text(json.dumps(doc))
    external_weights(exported, say)
    return {"root": root, "hf": hf, "export": exported, **doc}


def external_weights(path: Path, say) -> None:
    """Move the weights of a single-file export into ``model.onnx.data`` beside it (once; see the module doc)."""
    import onnx

    data = path.with_name(path.name + ".data")
    if data.is_file() or path.stat().st_size < 64 << 20:
        return
    say(f"{path}: moving the weights into {data.name} (memory-mapped by verification)")
    tmp = path.with_name(".external")
    tmp.mkdir(exist_ok=True)
    model = onnx.load(str(path))
    onnx.save(model, str(tmp / path.name), save_as_external_data=True, location=data.name, size_threshold=1024)
    del model
    (tmp / data.name).replace(data)  # the data first: a model.onnx naming it is then always complete
    (tmp / path.name).replace(path)
    tmp.rmdir()


def native_library(say) -> str | None:
    """Build liblayerzero_ort.so into this bench's cache when missing; None when built, else why not."""
    from layerzero.plugins import ort_library

    if ort_library.find_ort_library() is not None:
        return None
    say("building liblayerzero_ort.so (native lowering) into " + str(PLUGIN_DIR))
    try:
        ort_library.build_ort_library(PLUGIN_DIR, jobs=2, fetch_headers=False)
    except Exception as exc:  # a missing compiler / header set: the table says so, the rest runs
        return f"not built: {str(exc).splitlines()[0]}"
    return None


def bundle(prepared: dict[str, Any], lowering: str, say, verify: bool = True) -> tuple[Path, float | None]:
    """The bundle of one lowering (compiled when missing, or unverified where verification is asked) and the
    seconds its compile took when it ran now."""
    out = prepared["root"] / f"lz-{lowering}"
    manifest_file = out / "manifest.json"
    verified = manifest_file.is_file() and json.loads(manifest_file.read_text())["options"].get("verify", False)
    seconds = None
    if not manifest_file.is_file() or (verify and not verified):
        say(f"{prepared['root'].name}: compiling with --moe-lowering {lowering}{'' if verify else ' --no-verify'}")
        options = CompileOptions(moe_lowering=lowering, verify=verify)
        start = time.perf_counter()
        compile_file(prepared["export"], out, options, overwrite=True)
        seconds = time.perf_counter() - start
    manifest = json.loads(manifest_file.read_text())
    used = {d.get("detail", {}).get("lowering") for d in manifest.get("dynamic", [])}
    if used != {lowering}:
        raise SystemExit(f"{out}: --moe-lowering {lowering} gave lowerings {sorted(map(str, used))}")
    return out, seconds


def prefill_logits(engine: Engine, prompt: list[int]) -> Any:
    """The logits of one forward pass over the prompt (empty past): the short numerical check of a variant."""
    from layerzero.runtime.generate import cache_layout

    layout = cache_layout(engine)
    n = len(prompt)
    feeds = {
        "input_ids": np.asarray([prompt], dtype=np.int64),
        "attention_mask": np.ones((1, n), dtype=np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None, :],
    }
    if layout is not None:
        heads, head_dim = layout.shape
        feeds.update({p: np.zeros((1, heads, 0, head_dim), dtype=layout.dtype) for p, _ in layout.names})
    return engine.run(feeds).outputs["logits"]


class GenAIRunner:
    """ONNX Runtime GenAI on the same folder: its builder's model, greedy, timed like the others."""

    def __init__(self, prepared: dict[str, Any], say) -> None:
        import onnxruntime_genai as og
        from onnxruntime_genai.models.builder import create_model, parse_extra_options

        self.og = og
        out = prepared["root"] / "genai"
        if not (out / "genai_config.json").is_file():
            say(f"{prepared['root'].name}: onnxruntime-genai {og.__version__} builder")
            where = ("", str(prepared["hf"]), str(out), "fp32", "cpu", str(prepared["root"] / "genai-cache"))
            create_model(*where, **parse_extra_options(*where, []))
        self.model = og.Model(str(out))

    def generate(self, prompt: list[int], new: int) -> tuple[list[int], float, float]:
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + new, min_length=len(prompt) + new)
        generator = og.Generator(self.model, params)
        start = time.perf_counter()
        generator.append_tokens(np.asarray([prompt], dtype=np.int32))
        ids: list[int] = []
        first = start
        while not generator.is_done() and len(ids) < new:
            generator.generate_next_token()
            ids.append(int(generator.get_next_tokens()[0]))
            if len(ids) == 1:
                first = time.perf_counter()
        end = time.perf_counter()
        return ids, first - start, (len(ids) - 1) / (end - first) if len(ids) > 1 else 0.0


def genai_for(prepared: dict[str, Any], family: str, say) -> tuple[GenAIRunner | None, str]:
    """A runner, or why there is none (not importable, or its builder's own refusal)."""
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        return None, (
            f"onnxruntime_genai not importable ({exc}): pip install --target DIR onnxruntime-genai; --genai-path DIR"
        )
    architecture = (json.loads((prepared["hf"] / "config.json").read_text()).get("architectures") or ["?"])[0]
    try:  # the builder's dispatch on config.architectures[0]: ask it before it reads weights or a tokenizer
        import inspect

        from onnxruntime_genai.models import builder

        if f'"{architecture}"' not in inspect.getsource(builder.create_model):
            return None, f"onnxruntime-genai {og.__version__}'s model builder does not support {architecture}"
    except (ImportError, OSError, TypeError):
        pass  # no source to read: let the builder say it
    try:
        return GenAIRunner(prepared, say), f"onnxruntime-genai {og.__version__}"
    except NotImplementedError as exc:
        return None, f"onnxruntime-genai {og.__version__}'s builder refuses {architecture}: {exc}"
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"onnxruntime-genai {og.__version__} failed on {family}: {type(exc).__name__}: {first}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="mixtral,qwen3_moe")
    p.add_argument("--lowerings", default=",".join(LOWERINGS))
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 3, --quick 1)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the path, not the speed (no target)")
    p.add_argument("--genai-path", type=Path, default=None, help="a pip --target folder holding onnxruntime_genai")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--verify",
        choices=("once", "all", "none"),
        default="once",
        help="LayerZero's numerical verification: the first lowering's compile (default), every compile, none "
        "(each variant's prefill logits and its 128 greedy ids are checked in any case)",
    )
    p.add_argument("--no-verify", action="store_true", help="the same as --verify none")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.genai_path is not None:
        sys.path.append(str(args.genai_path))  # appended: the venv's onnxruntime stays first
    rounds = args.rounds or (1 if args.quick else 3)
    verify_mode = "none" if args.no_verify else args.verify

    def say(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()
    all_configs = configs(args.quick)
    families = [f for f in args.families.split(",") if f]
    lowerings = [x for x in args.lowerings.split(",") if x]
    native_why = native_library(say) if "native" in lowerings else None
    if native_why:
        lowerings.remove("native")
    results: list[dict[str, Any]] = []
    misses: list[str] = []
    for family in families:
        config = all_configs[family]
        # Its own seeded stream per family: the prompt (and so the cache key) does not depend on which ran before.
        prompt = np.random.default_rng(0).integers(0, config["vocab_size"], size=args.prompt).tolist()
        prepared = prepare(family, config, prompt, args.new, say)
        variants: dict[str, Any] = {"export": Engine.load(prepared["export"])}
        verify_notes: list[str] = []
        verified_once = "native" if "native" in lowerings else lowerings[0] if lowerings else None
        for lowering in lowerings:
            verify = verify_mode == "all" or (verify_mode == "once" and lowering == verified_once)
            path, seconds = bundle(prepared, lowering, say, verify=verify)
            if verify:
                took = f" in {seconds:.0f} s" if seconds is not None else " (cached)"
                verify_notes.append(f"{lowering} compiled with verification{took}")
            variants[f"LZ {lowering}"] = Engine.load(path)
        reference_logits = prefill_logits(variants["export"], prompt)
        logits_error = {
            name: float(np.abs(prefill_logits(engine, prompt) - reference_logits).max())
            for name, engine in variants.items()
        }
        genai, genai_note = genai_for(prepared, family, say)
        # Per round: decode tokens/s (new tokens after the first / their time), time to first token, and the
        # median step time: a burst of load on the shared machine moves the mean, much less the median.
        timings: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
        ids: dict[str, list[int]] = {}
        if genai is not None:
            timings["ORT GenAI"] = []
        for engine in variants.values():  # warm-up: sessions, allocators, page cache
            engine.generate(prompt[:4], max_new_tokens=2, stop_tokens=())
        for r in range(rounds):
            say(f"{family}: round {r + 1}/{rounds}")
            for name, engine in variants.items():
                out = engine.generate(prompt, max_new_tokens=args.new, stop_tokens=())
                ids.setdefault(name, out.ids)
                step = statistics.median(s.seconds for s in out.report.steps[1:]) if args.new > 1 else 0.0
                timings[name].append((out.report.decode_tokens_per_s or 0.0, out.report.time_to_first_token_s, step))
            if genai is not None:
                got, ttft, tps = genai.generate(prompt, args.new)
                ids.setdefault("ORT GenAI", got)
                timings["ORT GenAI"].append((tps, ttft, float("nan")))
        export_tps = statistics.median(t for t, _, _ in timings["export"])
        export_step = statistics.median(m for _, _, m in timings["export"])
        export_best = max(t for t, _, _ in timings["export"])
        print(
            f"\n{family}: {prepared['params'] / 1e6:.0f} M parameters, prompt {args.prompt}, {args.new} new tokens, "
            f"batch 1, {rounds} interleaved round(s); "
            f"{'; '.join(verify_notes) or 'bundles compiled --no-verify'}; transformers (torch eager) "
            f"{prepared['torch_tokens_per_s']:.1f} tok/s end to end"
        )
        print(
            f"  {'variant':<12} {'decode tok/s':>12} {'vs export':>10} {'first token':>12} "
            f"{'median step':>12} {'vs export':>10} {'best round':>11} {'vs export':>10} {'prefill |Δ|':>12}  "
            "ids == transformers"
        )
        best = 0.0
        for name, values in timings.items():
            tps = statistics.median(t for t, _, _ in values)
            ttft = statistics.median(t for _, t, _ in values)
            step = statistics.median(m for _, _, m in values)
            step_ratio = export_step / step if step > 0 else float("nan")
            best_round = max(t for t, _, _ in values)
            best_ratio = best_round / export_best if export_best else 0.0
            same = ids[name] == prepared["ids"]
            ratio = tps / export_tps if export_tps else 0.0
            if name.startswith("LZ "):
                best = max(best, ratio)
            error = logits_error.get(name)
            shown = f"{error:>12.2e}" if error is not None else f"{'-':>12}"
            print(
                f"  {name:<12} {tps:>12.1f} {ratio:>9.2f}× {ttft * 1e3:>9.0f} ms {step * 1e3:>9.1f} ms "
                f"{step_ratio:>9.2f}× {best_round:>11.1f} {best_ratio:>9.2f}× {shown}  {'yes' if same else 'NO'}"
            )
            results.append(dict(family=family, variant=name, decode_tokens_per_s=tps, vs_export=ratio,
                                time_to_first_token_s=ttft, median_step_s=step, vs_export_median_step=step_ratio,
                                ids_equal=same, rounds=[t for t, _, _ in values],
                                prefill_logits_max_abs=error))  # fmt: skip
            if not same:
                misses.append(f"{family} {name}: ids differ from transformers' greedy")
        if genai is None:
            print(f"  ORT GenAI    not run: {genai_note}")
        if native_why:
            print(f"  LZ native    {native_why}")
        if not args.quick:
            met = best >= TARGET
            verdict = "met" if met else "NOT met"
            print(f"  target: best LayerZero lowering ≥ {TARGET}× the export: {best:.2f}× {verdict}")
            if not met:
                misses.append(f"{family}: best LayerZero lowering {best:.2f}× < {TARGET}×")
        del variants
    load_after = os.getloadavg()
    print(
        f"\nmachine: {os.cpu_count()} cores, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
        "(shared: other processes run on the same cores)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "load": [load_before, load_after]}, indent=1))
    for miss in misses:
        print(f"MISSED: {miss}")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
