"""Concurrent generations through `layerzero serve`'s generate endpoint: 8 clients against 1, side by side.

A dense Llama-style model larger than this machine's L3 (random weights, seeded, ``save_pretrained``;
``layerzero export`` with the KV cache, ``layerzero compile``) is served by the generate endpoint (the code
``layerzero serve`` runs: ``GenerateServer`` and its ``ContinuousBatcher``) on 127.0.0.1. Each client streams
``POST /v1/generate`` (greedy, a 32-token prompt of its own, 128 new tokens, no stop token) and records when
each token line arrives. Rounds alternate one client alone and N clients at once (``--clients``, 8), so the
noise of a shared machine falls on both alike.

Printed per round and as medians: the solo tokens/s, the aggregate tokens/s of N clients (all new tokens / the
wall time from the first request to the last token), their ratio, the p50 time to first token and the p50
inter-token latency over all clients, the mean batch the batcher ran (rows per decode step). Each client is a
process of its own (as real clients are: none shares the server's interpreter and GIL). Checked: every
client's ids equal its prompt's solo ids (greedy, from ``Engine.generate``).

Target (issue 24): aggregate ≥ 4 × one client alone on the dense model; the exit status is 1 when it is missed or
an id differs. ``--family mixtral|qwen3_moe`` (bench/decode.py's MoE sizes, 389 M parameters) prints the same
figures beside the bound physics allows: a batch reads the dense weights once and the union of its rows' routed
experts (about 3.6 of 8 experts for 8 rows of top-2 of 8, nearly all 32 for top-4 of 32).

Sizes: ``--size l3`` (default): hidden 1024, 8 layers, 16 heads / 4 kv heads, intermediate 4096, vocab 32000
(~210 M parameters, 0.84 GB float32: 3 × the L3); ``--size 1b``: hidden 2048, 16 layers, 32 / 8 heads,
intermediate 8192 (1.1 B parameters, 4.4 GB; built in ~5 minutes here); ``--quick``: 2 layers of
hidden 256, 32 new tokens (checks the path, not the speed). Exports are cached under
~/.cache/layerzero/serve_batch/<size>/. ``--weights int4|int8``: the same export compiled with ``layerzero compile
--weights`` (MatMulNBits: its decode step at 8 rows is not the fp32 GEMM's), cached as ``model-int4.lz`` beside
the fp32 bundle. ``--mixed-lengths``: client i's prompt has 32 + i tokens (every residue modulo the batcher's
``PAD_ALIGN``: rows join at different offsets, some wait up to ``PAD_ALIGN - 1`` steps to keep their left padding
aligned; the ids check then covers padded rows, which equal prompts do not).

    python bench/serve_batch.py                  # 8 clients vs 1, 3 rounds
    python bench/serve_batch.py --quick --weights int4 --mixed-lengths   # padded int4 rows' ids against solo
    python bench/serve_batch.py --size 1b --weights int4
    python bench/serve_batch.py --size 1b --ceiling   # only the decode step at 1 and 8 rows (no server, no clients)
    python bench/serve_batch.py --quick
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import time
from pathlib import Path

SIZES = {
    "quick": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=1024, vocab_size=4096),
    "l3": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=4096, vocab_size=32000),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=32000),
}  # fmt: skip


#: The MoE families (``--family``): bench/decode.py's sizes (hidden 1024, 8 layers, 389 M parameters each).
MOE = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=1536),
    "qwen3_moe": dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384, head_dim=64),
}
MOE_QUICK = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256),
    "qwen3_moe": dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64, head_dim=64),
}


def _hf_model(family: str, size: str):
    import transformers

    dense = SIZES[size] if family == "llama" else dict(SIZES["quick" if size == "quick" else "l3"])
    common = dict(max_position_embeddings=4096, initializer_range=0.05, eos_token_id=None, bos_token_id=None)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**dense, **common))
    moe = (MOE_QUICK if size == "quick" else MOE)[family]
    if family == "mixtral":
        dense.pop("intermediate_size")
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**dense, **moe, **common))
    else:
        dense.pop("intermediate_size")
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**dense, **moe, **common))
    model.set_experts_implementation("batched_mm")
    return model


def moe_bound(family: str, size: str, rows: int) -> float | None:
    """What physics allows N rows of a MoE decode step against one: every row reads the dense weights (attention,
    router, embeddings) and its routed experts; a batch reads the dense weights once and the union of its rows'
    experts (E · (1 − (1 − k/E)^N) expected for independent uniform routing). Returns N · bytes(1 row) /
    bytes(N rows); None for a dense model (the bound is N, less the arithmetic)."""
    if family == "llama":
        return None
    import torch

    torch.manual_seed(0)
    model = _hf_model(family, size)
    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    expert_params = sum(p.numel() for e in experts for p in e.parameters())
    total = sum(p.numel() for p in model.parameters())
    # Read by every step whatever the batch: all but the experts and the embedding table (one row gathered per
    # token; the lm_head is read whole).
    dense = total - expert_params - model.get_input_embeddings().weight.numel()
    e = (MOE_QUICK if size == "quick" else MOE)[family]
    n_experts = e.get("num_local_experts") or e["num_experts"]
    k = e["num_experts_per_tok"]
    per_expert = expert_params / n_experts
    union = n_experts * (1 - (1 - k / n_experts) ** rows)
    return rows * (dense + k * per_expert) / (dense + union * per_expert)


def _bundle(family: str, size: str, weights: str = "float") -> Path:
    """The cached bundle of the model (exported and compiled once); ``weights`` int4 / int8: the same export
    compiled with ``--weights`` (``model-int4.lz`` beside ``model.lz``, which it needs first)."""
    import torch

    from layerzero.cli import main as cli

    name = size if family == "llama" else f"{family}-{size}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layerzero" / "serve_batch" / name
    if weights != "float":
        quantized = cache / f"model-{weights}.lz"
        if not (quantized / "manifest.json").is_file():
            _bundle(family, size)  # the export it compiles (compile writes the bundle atomically: no half-made one)
            args = ["compile", str(cache / "onnx" / "model.onnx"), "-o", str(quantized), "--weights", weights]
            if cli(args) != 0:
                sys.exit(f"bench/serve_batch.py: `layerzero {' '.join(args)}` failed")
        return quantized
    bundle = cache / "model.lz"
    if (bundle / "manifest.json").is_file():
        return bundle
    import shutil

    shutil.rmtree(cache, ignore_errors=True)  # a half-made cache of an interrupted run
    cache.mkdir(parents=True)
    torch.manual_seed(0)
    _hf_model(family, size).eval().save_pretrained(cache / "hf")
    for args in (["export", str(cache / "hf"), "-o", str(cache / "onnx" / "model.onnx")],
                 ["compile", str(cache / "onnx" / "model.onnx"), "-o", str(bundle)]):  # fmt: skip
        if cli(args) != 0:
            sys.exit(f"bench/serve_batch.py: `layerzero {' '.join(args)}` failed")
    return bundle


def _client(port: int, prompt: list[int], new: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt_ids": prompt, "max_new_tokens": new, "stop_ids": [], "stream": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/generate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    times, ids, out = [], [], {}
    while True:
        line = resp.readline()
        if not line:
            break
        doc = json.loads(line)
        if "token" in doc:
            times.append(time.perf_counter())
            ids.append(doc["token"])
        elif "error" in doc:
            out["error"] = doc["error"]
    conn.close()
    out.update(start=start, times=times, ids=ids)
    return out


def _round(pool, port: int, prompts: list[list[int]], new: int) -> list[dict]:
    """Each prompt from a client process of its own (time.perf_counter is the machine's monotonic clock: the
    processes' stamps compare), so that no client shares the server's interpreter."""
    results = list(pool.map(_client, [port] * len(prompts), prompts, [new] * len(prompts)))
    for r in results:
        if "error" in r or len(r.get("ids", [])) != new:
            sys.exit(f"bench/serve_batch.py: a client failed: {r.get('error', 'short answer')}")
    return results


def step_bound(engine, rows: int, past: int = 64, runs: int = 10) -> tuple[float, float]:
    """The model's own ceiling on batching: the median time of one decode step (one token per row, ``past``
    cached) at 1 row and at ``rows``, run directly on the engine (no server, no batcher)."""
    import numpy as np

    from layerzero.runtime.generate import cache_layout

    layout = cache_layout(engine)
    times = []
    for batch in (1, rows):
        feeds = {"input_ids": np.ones((batch, 1), np.int64), "attention_mask": np.ones((batch, past + 1), np.int64),
                 "position_ids": np.full((batch, 1), past, np.int64)}  # fmt: skip
        for name, _ in layout.names:
            heads, dim = layout.shapes[name]
            feeds[name] = np.random.default_rng(0).random((batch, heads, past, dim), dtype=np.float32)
        engine.run(feeds)
        samples = []
        for _ in range(runs):
            start = time.perf_counter()
            engine.run(feeds)
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    return times[0], times[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("l3", "1b"), default="l3")
    parser.add_argument(
        "--family",
        choices=("llama", *MOE),
        default="llama",
        help="llama (dense, the target) or a MoE family (figures beside the union-of-experts bound)",
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument(
        "--weights",
        choices=("float", "int4", "int8"),
        default="float",
        help="the same export compiled with `layerzero compile --weights` (default float: fp32)",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mixed-lengths", action="store_true",
                        help="client i's prompt has 32 + i tokens (default: 32 each)")  # fmt: skip
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="only the model's own ceiling (a decode step at 1 and --clients rows on the engine, no "
        "server): minutes where a full run at --size 1b takes an hour on a loaded machine",
    )
    args = parser.parse_args()
    size, new = ("quick", 32) if args.quick else (args.size, args.new)

    import numpy as np

    from layerzero.runtime import Engine
    from layerzero.runtime.generate_server import GenerateServer, GenerateServerConfig

    bundle = _bundle(args.family, size, args.weights)
    bound = moe_bound(args.family, size, args.clients)
    engine = Engine.load(bundle)
    if args.ceiling:
        load = os.getloadavg()[0]
        one, many_rows = step_bound(engine, args.clients)
        print(f"the model's own ceiling ({size}, {args.weights}, load {load:.1f} -> {os.getloadavg()[0]:.1f}): a "
              f"decode step takes {one * 1e3:.1f} ms at 1 row, {many_rows * 1e3:.1f} ms at {args.clients} rows: "
              f"{args.clients * one / many_rows:.2f}x at most")  # fmt: skip
        return 0
    vocab = SIZES[size if args.family == "llama" or size == "quick" else "l3"]["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, 32 + (i if args.mixed_lengths else 0)).tolist() for i in range(args.clients)]
    solo_ids = [engine.generate(p, max_new_tokens=new, stop_tokens=()).ids for p in prompts]
    config = GenerateServerConfig(port=0, max_new_tokens_cap=max(new, 1), max_prompt_tokens=64 + args.clients,
                                  batch_rows=args.clients, max_queue=args.clients)  # fmt: skip
    rows = []
    wrong = 0
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(max_workers=len(prompts), mp_context=multiprocessing.get_context("spawn"))
    with pool, GenerateServer(engine, config) as server:
        _round(pool, server.port, prompts, 2)  # warm-up: every client process started
        for k in range(args.rounds):
            solo = _round(pool, server.port, prompts[k % len(prompts) : k % len(prompts) + 1], new)[0]
            solo_rate = new / (solo["times"][-1] - solo["start"])
            b = server.batcher
            steps0, rows0, run0, step0 = b.steps_run, b.rows_stepped, b.run_seconds, b.step_seconds
            many = _round(pool, server.port, prompts, new)
            steps = max(1, b.steps_run - steps0)
            mean_batch = (b.rows_stepped - rows0) / steps
            step_ms, run_ms = (b.step_seconds - step0) / steps * 1e3, (b.run_seconds - run0) / steps * 1e3
            wall = max(r["times"][-1] for r in many) - min(r["start"] for r in many)
            rate = len(prompts) * new / wall
            ttft = statistics.median(r["times"][0] - r["start"] for r in many)
            itl = statistics.median(b - a for r in many for a, b in zip(r["times"], r["times"][1:]))
            wrong += sum(r["ids"] != want for r, want in zip(many, solo_ids))
            wrong += solo["ids"] != solo_ids[k % len(prompts)]
            rows.append((solo_rate, rate, rate / solo_rate, ttft, itl, mean_batch, step_ms, run_ms))
            print(f"round {k + 1}: 1 client {solo_rate:7.1f} tok/s | {len(prompts)} clients {rate:7.1f} tok/s "
                  f"= {rate / solo_rate:4.2f}x | p50 TTFT {ttft * 1e3:7.1f} ms, p50 ITL {itl * 1e3:6.1f} ms, "
                  f"mean batch {mean_batch:.2f}; a decode step {step_ms:.1f} ms, {step_ms - run_ms:.2f} ms of it "
                  f"the batcher's own (feeds, sampling, callbacks, cuts)", flush=True)  # fmt: skip
    med = [statistics.median(col) for col in zip(*rows)]
    load = os.getloadavg()[0]
    print(f"median ({size}, {args.weights}, {args.clients} clients, {new} new tokens, load {load:.1f}): 1 client "
          f"{med[0]:.1f} tok/s, {args.clients} clients {med[1]:.1f} tok/s = {med[2]:.2f}x; p50 TTFT "
          f"{med[3] * 1e3:.1f} ms, p50 ITL {med[4] * 1e3:.1f} ms; the batcher's own work {med[6] - med[7]:.2f} ms "
          f"of a {med[6]:.1f} ms step ({(med[6] - med[7]) / med[6]:.1%})")  # fmt: skip
    if bound is not None:
        print(f"bound ({args.family}: a batch of {args.clients} reads the union of its rows' experts): "
              f"{bound:.2f}x; measured {med[2]:.2f}x = {med[2] / bound:.0%} of it")  # fmt: skip
    one, many_rows = step_bound(engine, args.clients)
    print(f"the model's own ceiling: a decode step takes {one * 1e3:.1f} ms at 1 row, {many_rows * 1e3:.1f} ms at "
          f"{args.clients} rows: {args.clients} x {one / many_rows:.2f} = {args.clients * one / many_rows:.2f}x at "
          f"most; measured {med[2]:.2f}x = {med[2] / (args.clients * one / many_rows):.0%} of it")  # fmt: skip
    ok_ids = wrong == 0
    print(f"ids of every client equal its solo run: {'met' if ok_ids else f'NOT met ({wrong} differ)'}")
    if args.quick or args.family != "llama":
        return 0 if ok_ids else 1  # the 4x target is the dense model's
    ok_rate = med[2] >= 4.0
    print(f"target aggregate >= 4.0x one client: {'met' if ok_rate else 'NOT met'} ({med[2]:.2f}x)")
    return 0 if ok_ids and ok_rate else 1


if __name__ == "__main__":
    sys.exit(main())
