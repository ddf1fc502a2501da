"""Fuzzing the decoder path end to end: random small Hugging Face decoder configs, exported with a KV cache by
``layerzero export``, compiled with the options users combine, and generated from.

A case (``check``): a family of ``FAMILIES`` and a config drawn from ``seed`` (heads 2-6 over 1 to all KV heads,
head dims 8-32, a hidden size that is or is not heads × head dim, intermediate 64-160, 1-2 layers, tied or separate
embeddings, the dynamo or the TorchScript exporter), random weights (norm weights perturbed apart), saved with
``save_pretrained``; then ``layerzero export`` and each option set of ``VARIANTS`` through ``layerzero compile``
(verification on). It passes when every compile succeeds, the float bundle's greedy ids equal transformers' own
``generate`` on the same weights, and every bundle's ids are the same with the native attention's cache buffers and
without (``LAYERZERO_KV_BUFFER``).

    python -m tests.fuzz.decoders --cases 24 [--start 0]    # the long run (about 40 s a case on 2 cores)
    python -m tests.fuzz.decoders --moe --cases 10          # MoE configs (MOE_FAMILIES)
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

__all__ = ["FAMILIES", "MOE_FAMILIES", "MOE_VARIANTS", "VARIANTS", "check", "config_for", "main"]

MOE_FAMILIES = ("MixtralConfig", "Qwen3MoeConfig", "OlmoeConfig", "Qwen2MoeConfig", "PhimoeConfig", "GraniteMoeConfig",
                "DeepseekV3Config", "DeepseekV2Config", "Llama4TextConfig")  # fmt: skip
FAMILIES = ("LlamaConfig", "Qwen2Config", "MistralConfig", "Qwen3Config", "Phi3Config", "GemmaConfig", "Olmo2Config",
            "GraniteConfig")  # fmt: skip
_WIDE = ["--max-deviation", "1e9"]  # activation sparsity's deviation is on purpose
VARIANTS: tuple[tuple[str, ...], ...] = (
    (),
    ("--weights", "int4"),
    ("--weights", "int4", "--linear-kernel", "native"),
    ("--weights", "int8", "--linear-kernel", "native"),
    ("--activation-sparsity", "0.3", *_WIDE),
    ("--weights", "int4", "--linear-kernel", "native", "--activation-sparsity", "0.3", *_WIDE),
)
#: With ``--moe`` also: the other lowerings of the MoE blocks and int8 through MatMulNBits.
MOE_VARIANTS: tuple[tuple[str, ...], ...] = (
    *VARIANTS,
    ("--weights", "int8"),
    ("--moe-lowering", "if"),
    ("--weights", "int4", "--moe-lowering", "ort-moe"),
)
#: The refusal a MoE config may get by design: experts whose hidden or expert size the block does not divide are
#: quantized whole or not at all (passes/quantize_weights.py).
MOE_REFUSAL = "its experts cannot be quantized"
PROMPT, NEW = 6, 8


def config_for(seed: int, moe: bool = False) -> tuple[str, dict, str]:
    """(config class name, its keyword arguments, exporter) for ``seed``; ``moe``: a family of ``MOE_FAMILIES``
    instead, with 4-8 experts, top 1-3 and its expert sizes (shared experts for Qwen2-MoE) drawn too."""
    rng = random.Random(seed)
    family = rng.choice(FAMILIES)
    heads = rng.choice([2, 3, 4, 6])
    kv = rng.choice([h for h in (1, 2, 3, heads) if heads % h == 0])
    head_dim = rng.choice([8, 16, 32])
    kwargs = {
        "hidden_size": rng.choice([heads * head_dim, 64, 96]),
        "intermediate_size": rng.choice([64, 96, 128, 160]),
        "num_hidden_layers": rng.choice([1, 2]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": rng.choice([128, 200, 256]),
        "max_position_embeddings": 128,
        "tie_word_embeddings": rng.random() < 0.5,
        "head_dim": head_dim,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family == "Phi3Config":  # no head_dim option: hidden / heads
        kwargs.pop("head_dim")
    exporter = rng.choice(["dynamo", "torchscript"])
    if moe:
        family = rng.choice(MOE_FAMILIES)
        experts, top = rng.choice([4, 6, 8]), rng.choice([1, 2, 3])
        kwargs.setdefault("head_dim", head_dim)
        if family in ("MixtralConfig", "PhimoeConfig", "GraniteMoeConfig"):  # expert size: intermediate_size
            kwargs.update(num_local_experts=experts, num_experts_per_tok=top)
        elif family == "Llama4TextConfig":  # top-1 (its router's only form), chunked attention, RoPE per layer
            kwargs.update(num_local_experts=experts, num_experts_per_tok=1, interleave_moe_layer_step=1,
                          intermediate_size_mlp=rng.choice([64, 128]), use_qk_norm=rng.random() < 0.5,
                          attention_chunk_size=rng.choice([4, 64]),
                          no_rope_layers=[rng.choice([0, 1]) for _ in range(kwargs["num_hidden_layers"])])  # fmt: skip
            exporter = "dynamo"  # TorchScript writes its chunked mask as a CumSum of bools: export refuses it
        else:
            kwargs.update(num_experts=experts, num_experts_per_tok=top, moe_intermediate_size=rng.choice([32, 64, 96]))
        if family == "Qwen2MoeConfig":
            kwargs.update(shared_expert_intermediate_size=rng.choice([32, 64]), decoder_sparse_step=1)
        if family == "OlmoeConfig":  # no head_dim option
            kwargs.pop("head_dim")
        if family in ("DeepseekV3Config", "DeepseekV2Config"):  # MLA (V2: complex RoPE); shared experts or not
            rope = rng.choice([8, 16])
            kwargs.update(n_routed_experts=experts, n_shared_experts=rng.choice([0, 1]), first_k_dense_replace=0,
                          n_group=1, topk_group=1, kv_lora_rank=rng.choice([16, 32]),
                          q_lora_rank=rng.choice([None, 16]), qk_rope_head_dim=rope,
                          qk_nope_head_dim=rng.choice([8, 16]), v_head_dim=rng.choice([8, 16]), head_dim=rope,
                          num_key_value_heads=heads)  # fmt: skip
    return family, kwargs, exporter


def _layerzero(args: list[str]) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "layerzero", *args], capture_output=True, text=True, check=False)
    text = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return done.returncode, text[-1][:300] if text else ""


def check(seed: int, variants: tuple[tuple[str, ...], ...] = VARIANTS, moe: bool = False) -> list[str]:
    """The failures of case ``seed`` (``[]``: it passed); ``moe``: a MoE config (``config_for``)."""
    import torch
    import transformers

    from layerzero.runtime import Engine

    family, kwargs, exporter = config_for(seed, moe)
    label = f"seed {seed} {family} {exporter} {kwargs}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, family)(**kwargs)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:  # all ones at init: the exporter would share one initializer among them
                    param.add_(0.1 * torch.randn_like(param))
        model.save_pretrained(folder / "hf")
        rng = random.Random(seed + 1)
        prompt = [rng.randrange(3, kwargs["vocab_size"]) for _ in range(PROMPT)]
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                  pad_token_id=0)[0, PROMPT:].tolist()  # fmt: skip
        rc, err = _layerzero(["export", str(folder / "hf"), "-o", str(folder / "m.onnx"), "--exporter", exporter])
        if rc != 0:
            return [f"{label}: export exit {rc}: {err}"]
        failures = []
        for k, variant in enumerate(variants):
            bundle = folder / f"b{k}.lz"
            rc, err = _layerzero(["compile", str(folder / "m.onnx"), "-o", str(bundle), *variant])
            if rc != 0:
                if not (moe and rc == 2 and MOE_REFUSAL in err):
                    failures.append(f"{label} {' '.join(variant) or 'float'}: compile exit {rc}: {err}")
                continue
            engine = Engine.load(bundle)
            got = {}
            for buffers in ("1", "0"):
                os.environ["LAYERZERO_KV_BUFFER"] = buffers
                try:
                    got[buffers] = engine.generate(prompt, max_new_tokens=NEW, stop_tokens=()).ids
                finally:
                    os.environ.pop("LAYERZERO_KV_BUFFER", None)
            if not variant and got["1"] != want:
                failures.append(f"{label}: float ids {got['1']} != transformers' {want}")
            if got["1"] != got["0"]:
                failures.append(f"{label} {' '.join(variant)}: ids with cache buffers {got['1']} != without {got['0']}")
        return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--moe", action="store_true", help="MoE configs (MOE_FAMILIES) and MOE_VARIANTS")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    failed = 0
    variants = MOE_VARIANTS if args.moe else VARIANTS
    for seed in range(args.start, args.start + args.cases):
        lines = check(seed, variants, moe=args.moe)
        failed += len(lines)
        for line in lines:
            print(line, flush=True)
        print(f"seed {seed}: {'ok' if not lines else 'FAILED'}", flush=True)
    print(f"{args.cases} cases x {len(variants)} compiles in {time.perf_counter() - started:.0f} s: {failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
