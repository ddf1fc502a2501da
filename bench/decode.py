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
- qwen3_moe: hidden 1024, 8 layers, 16 heads / 4 kv heads, head_dim 64, 32 experts top-4 (renormalised,
  ``norm_topk_prob`` as the released models), moe intermediate 384, vocab 32000 (389 M parameters, 1.6 GB float32).
Both have the same 40 M parameters per layer (experts 37.7 M), so the two differ only in routing: 2 of 8
large experts against 4 of 32 small ones. They fit this 24 GB machine with the export (~7 GB peak) and
export in ~15 minutes on 2 shared cores.

Targets (issue 12), printed met / NOT met; the exit status is 1 when one is missed: for each family the best
LayerZero lowering decodes ≥ 1.5 × the export's tokens/s, and every variant's ids equal transformers'.

    python bench/decode.py                       # both families, 3 rounds
    python bench/decode.py --quick               # tiny sizes, 1 round (checks the path, not the speed)
    python bench/decode.py --genai-path /tmp/ortgenai --families mixtral

Quantized weights (``--weights int4`` / ``int8``, issue 22): the same family, prompt and new tokens, batch 1, at each
``--threads`` count (default 1 and 2), interleaved rounds (every column at every thread count once per round), the
median decode tokens/s, time to first token and median step. Columns:
- LZ fp32 native: the native-lowering bundle above (its ids must equal transformers');
- ORT int4 / int8: ONNX Runtime's own best form of the same export: the ``ort-moe`` bundle's com.microsoft.MoE
  nodes as com.microsoft.QMoE (block 32, symmetric codes written here, checked once against MoE on the weights the
  codes decode to) and its dense MatMuls through ``onnxruntime.quantization.matmul_nbits_quantizer`` (MatMulNBits,
  block 32, symmetric, accuracy_level 4); ONNX Runtime 1.32's CPU QMoE always renormalises the top-k weights, so a
  family that does not (Qwen3-MoE) gets its output times the top-k probabilities' sum (see ``_qmoe_nodes``);
- llama.cpp Q4_0 / Q8_0 and F32: llama-cpp-python built here from PyPI's source (``scripts/build_llamacpp.sh``), the
  GGUF written from the same Hugging Face folder by the converter that source ships, quantized with
  ``llama_model_quantize`` (``bench/_llamacpp.py``); F32 is the conversion's check (its logits must be the
  export's within 1e-3 relative L2);
- LZ int4 / int8: ``CompileOptions(weights="int4")`` with the native lowering; until that option exists the column
  says "not available" and the run is a miss (exit 1);
- read bound (not a tool: a ceiling): LZ int4 / int8's own weight bytes of one decode token (the MatMulNBits
  codes and scales, the routers, ``top_k`` experts' codes and scales per MoE layer, freshly drawn each token)
  streamed alone by the native kernels' read loop on the same threads in the same rounds (``_ReadBound``): the
  tokens/s no kernel reading those bytes can pass here, printed with LZ's share of it and whether 3 × ORT int4 (a
  target) lies above it.
Beside each: the quantization's deviation from the fp32 export on the prompt (one prefill: top-1 agreement of the
greedy id at every position, relative L2 of the logits) and how many of the greedy ids equal transformers' fp32 ones
from the start; LZ int4 / int8's greedy ids must equal those of its own quantized-dense reference
(``layerzero.compile.quantized_dense_reference``: the export with the same weight quantization, nothing skipped; run
once, not timed), a miss otherwise. Targets (issue 22), per thread count, not judged at ``--quick``: LZ int4 ≥ 1.0 ×
llama.cpp Q4_0, ≥ 3 × ORT int4 and ≥ 3 × LZ fp32 native; LZ int8 ≥ 1.0 × llama.cpp Q8_0. ``--no-spin`` makes ONNX
Runtime's idle workers sleep (every ORT column); ``--profile`` prints ONNX Runtime's per-op profile of the first
``--lowerings`` bundle's decode steps at each ``--threads`` count instead of the table (with ``--weights int4`` /
``int8``: LayerZero's quantized bundle's).

    python bench/decode.py --families qwen3_moe --weights int4 --rounds 3
    python bench/decode.py --families qwen3_moe --profile --lowerings native --no-spin
    python bench/decode.py --families qwen3_moe --profile --weights int4

Exports, bundles and transformers' reference ids are cached under ~/.cache/layerzero/decode/<family>-<key>/
(the key hashes the config, the sizes and the torch/transformers versions); a bundle is compiled again when the
LayerZero code changed since it was (``bench/_stamp.py``: a hash of the compiler's, runtime's and native library's
sources beside each bundle).
"""

from __future__ import annotations

import argparse
import bisect
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _stamp  # noqa: E402  # bench/_stamp.py: which cached bundles the current code compiled

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
            # As the released Qwen3-MoE models (transformers' default is False): llama.cpp's qwen3moe graph always
            # renormalises the top-k weights, so only this model is the same model in its columns.
            norm_topk_prob=True,
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
    """liblayerzero_ort.so in this bench's cache, built when missing or stale; None when there, else why not (the
    table says so, the rest runs)."""
    return _stamp.native_library(PLUGIN_DIR, say, "native lowering")


def bundle(prepared: dict[str, Any], lowering: str, say, verify: bool = True) -> tuple[Path, float | None]:
    """The bundle of one lowering (compiled when missing, or unverified where verification is asked) and the
    seconds its compile took when it ran now."""
    out = prepared["root"] / f"lz-{lowering}"
    manifest_file = out / "manifest.json"
    verified = manifest_file.is_file() and json.loads(manifest_file.read_text())["options"].get("verify", False)
    seconds = None
    if not _stamp.fresh(out) or (verify and not verified):
        say(f"{prepared['root'].name}: compiling with --moe-lowering {lowering}{'' if verify else ' --no-verify'}")
        options = CompileOptions(moe_lowering=lowering, verify=verify)
        start = time.perf_counter()
        compile_file(prepared["export"], out, options, overwrite=True)
        _stamp.stamp(out)
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
        feeds.update(layout.empty(1))
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


# ------------------------------------------------------------------------------------------ --weights int4 / int8

#: llama.cpp's file type of the same bits (its symmetric 32-blocks: 4-bit codes offset 8, or int8, one scale each).
LLAMACPP_KIND = {4: "Q4_0", 8: "Q8_0"}
#: Issue 22's done-when, per thread count: (numerator, denominator, at least) on decode tokens/s.
QUANT_TARGETS = {
    4: (("LZ int4", "llama.cpp Q4_0", 1.0), ("LZ int4", "ORT int4", 3.0), ("LZ int4", "LZ fp32 native", 3.0)),
    8: (("LZ int8", "llama.cpp Q8_0", 1.0),),
}
_SHAPE_ONLY = {"Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Cast"}


def _router_matmuls(graph: Any) -> list[str]:
    """The MatMul nodes that compute a ``com.microsoft.MoE``'s router logits (through shape-only ops): kept float,
    as llama.cpp keeps its ``ffn_gate_inp`` (the routing decides which experts run at all)."""
    producer = {o: n for n in graph.node for o in n.output}
    names = []
    for node in graph.node:
        if node.domain != "com.microsoft" or node.op_type != "MoE":
            continue
        value = node.input[1]
        while value in producer and producer[value].op_type in _SHAPE_ONLY:
            value = producer[value].input[0]
        if value in producer and producer[value].op_type in ("MatMul", "Gemm"):
            names.append(producer[value].name)
    return names


def _qmoe_weights(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """QMoE's layout of one expert stack ``w`` [E, out, in]: uint8 codes along ``in`` in 32-blocks (int4: two
    offset-8 nibbles a byte, low nibble first; int8: code + 128), float32 scales [E, out, in / 32] (QMoE's default
    zero points 8 / 128: symmetric); and the float weights those codes decode to."""
    from layerzero.plugins.quant import dequantize_blocks, quantize_blocks

    codes, scales = quantize_blocks(w, bits, 32, axis=-1)
    decoded = dequantize_blocks(codes, scales, bits, 32, axis=-1)
    if bits == 8:
        codes = codes.view(np.uint8) ^ np.uint8(0x80)
    return np.ascontiguousarray(codes), scales.astype(np.float32), decoded


def _qmoe_nodes(moe: Any, bits: int, weights: dict[str, np.ndarray]) -> tuple[list[Any], dict[str, Any], dict]:
    """``com.microsoft.MoE`` -> ``com.microsoft.QMoE`` (block 32, symmetric): the nodes that replace ``moe``, the
    quantized initializers, and the float weights their codes decode to (for the check).

    ONNX Runtime 1.32's CPU QMoE renormalises the top-k routing weights whatever ``normalize_routing_weights``
    says (measured: its output equals MoE's with normalisation on); a model that does not renormalise (Qwen3-MoE's
    ``norm_topk_prob=False``) gets QMoE's output times the sum of its top-k softmax probabilities (Softmax, TopK,
    ReduceSum, Mul), which is the un-normalised mixture exactly."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in moe.attribute}
    fc1, fc2 = moe.input[2], moe.input[4]
    quantized: dict[str, np.ndarray] = {}
    decoded: dict[str, np.ndarray] = {}
    for name in (fc1, fc2):
        codes, scales, decoded[name] = _qmoe_weights(weights[name], bits)
        quantized[f"{name}.q{bits}"], quantized[f"{name}.q{bits}.scales"] = codes, scales
    bias1 = moe.input[3] if len(moe.input) > 3 else ""
    bias2 = moe.input[5] if len(moe.input) > 5 else ""
    inputs = [moe.input[0], moe.input[1], f"{fc1}.q{bits}", f"{fc1}.q{bits}.scales", bias1,
              f"{fc2}.q{bits}", f"{fc2}.q{bits}.scales", bias2]  # fmt: skip
    renormalise = int(attrs.get("normalize_routing_weights", 0)) == 0
    out = moe.output[0]
    q_out = f"{out}.q{bits}.normalised" if renormalise else out
    nodes = [helper.make_node("QMoE", inputs, [q_out], name=f"{moe.name}.q{bits}", domain="com.microsoft",
                              **{**attrs, "expert_weight_bits": bits, "block_size": 32})]  # fmt: skip
    if renormalise:
        k = f"{out}.q{bits}.k"
        quantized[k] = np.array([int(attrs["k"])], dtype=np.int64)
        p, top = f"{out}.q{bits}.probs", f"{out}.q{bits}.top"
        total = f"{out}.q{bits}.top_sum"
        nodes += [
            helper.make_node("Softmax", [moe.input[1]], [p], axis=-1),
            helper.make_node("TopK", [p, k], [top, f"{top}.indices"], axis=-1),
            helper.make_node("ReduceSum", [top, f"{out}.q{bits}.axis"], [total], keepdims=1),
            helper.make_node("Mul", [q_out, total], [out]),
        ]
        quantized[f"{out}.q{bits}.axis"] = np.array([-1], dtype=np.int64)
    return nodes, quantized, decoded


def _moe_session(nodes: list[Any], arrays: dict[str, np.ndarray], x: str, logits: str, y: str, shape) -> Any:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    used = {i for n in nodes for i in n.input}
    hidden, experts = shape
    graph = helper.make_graph(
        nodes,
        "one_moe",
        [
            helper.make_tensor_value_info(x, TensorProto.FLOAT, ["T", hidden]),
            helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["T", experts]),
        ],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["T", hidden])],
        [numpy_helper.from_array(a, n) for n, a in arrays.items() if n in used],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _check_qmoe(moe: Any, bits: int, weights: dict[str, np.ndarray], say) -> str:
    """One layer's QMoE nodes against ``com.microsoft.MoE`` on the float weights their codes decode to (the
    conversion's check: int4 dequantizes exactly, measured 4e-7; int8's kernel computes with int8 activations,
    ~1e-2) and on the original weights (the quantization's own deviation), on 8 seeded tokens. Raises when the first
    is off: the layout, not the quantization, would be wrong."""
    nodes, quantized, decoded = _qmoe_nodes(moe, bits, weights)
    experts, _, hidden = weights[moe.input[2]].shape
    rng = np.random.default_rng(0)
    feeds = {moe.input[0]: rng.standard_normal((8, hidden)).astype(np.float32),
             moe.input[1]: rng.standard_normal((8, experts)).astype(np.float32)}  # fmt: skip
    names = (moe.input[0], moe.input[1], moe.output[0], (hidden, experts))

    def run(ns: list[Any], arrays: dict[str, np.ndarray]) -> np.ndarray:
        return _moe_session(ns, arrays, *names).run(None, feeds)[0]

    float_out = run([moe], weights)
    decoded_out = run([moe], {**weights, **decoded})
    q_out = run(nodes, {**weights, **quantized})
    conv = float(np.linalg.norm(q_out - decoded_out) / np.linalg.norm(decoded_out))
    quant = float(np.linalg.norm(q_out - float_out) / np.linalg.norm(float_out))
    if not conv < (1e-3 if bits == 4 else 3e-2):
        raise SystemExit(f"QMoE conversion check failed: relative L2 {conv:.2e} against MoE on the decoded weights")
    note = f"QMoE checked once against MoE: rel L2 {conv:.1e} on the decoded weights, {quant:.1e} on the float ones"
    say(note)
    return note


def ort_quantized(prepared: dict[str, Any], bits: int, say) -> tuple[Path, str]:
    """ONNX Runtime's own int4 / int8 form of the export: LayerZero's ``ort-moe`` lowering (com.microsoft.MoE) with
    every MoE as ``com.microsoft.QMoE`` (``_qmoe_nodes``) and the dense MatMuls through
    ``onnxruntime.quantization.matmul_nbits_quantizer`` (block 32, symmetric, accuracy_level 4; the routers kept
    float). Written once under the family's cache; returns the model and the QMoE check's note."""
    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    out = prepared["root"] / f"ort-int{bits}" / "model.onnx"
    note_file = out.with_name("check.txt")
    if out.is_file() and note_file.is_file() and _stamp.fresh(out.parent):
        return out, note_file.read_text()
    source, _ = bundle(prepared, "ort-moe", say, verify=False)
    say(f"{prepared['root'].name}: ONNX Runtime int{bits} form (QMoE + MatMulNBits) of the ort-moe bundle")
    model = onnx.load(str(source / "model.onnx"))
    graph = model.graph
    routers = _router_matmuls(graph)
    by_name = {t.name: t for t in graph.initializer}
    note = ""
    replaced: set[str] = set()
    nodes = []
    for node in graph.node:
        if node.domain != "com.microsoft" or node.op_type != "MoE":
            nodes.append(node)
            continue
        weights = {n: numpy_helper.to_array(by_name[n]) for n in (node.input[2], node.input[4])}
        if not note:  # the first layer's: the conversion checked once
            note = _check_qmoe(node, bits, weights, say)
        new, quantized, _ = _qmoe_nodes(node, bits, weights)
        graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in quantized.items())
        replaced.update(weights)
        nodes += new
    if not note:
        raise SystemExit(f"{source}: no com.microsoft.MoE node to quantize")
    del graph.node[:]
    graph.node.extend(nodes)
    still_used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name not in replaced or t.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4, nodes_to_exclude=routers
    )
    quantizer.process()
    model = quantizer.model.model
    dense = sum(1 for n in model.graph.node if n.op_type == "MatMulNBits")
    note += f"; {dense} MatMuls as MatMulNBits, {len(routers)} routers kept float"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(".model.onnx")
    onnx.save(model, str(tmp), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    tmp.replace(out)
    note_file.write_text(note)
    _stamp.stamp(out.parent)
    return out, note


def _lz_folder(bits: int, linear_kernel: str) -> str:
    return f"lz-native-int{bits}" + ("-qlinear" if linear_kernel == "native" else "")


def lz_quantized(
    prepared: dict[str, Any], bits: int, say, verify: bool, linear_kernel: str = "ort"
) -> tuple[Path | None, str]:
    """LayerZero's own int4 / int8 bundle (``CompileOptions(weights="int4")``, native lowering; ``linear_kernel``
    "native": the dense MatMuls as liblayerzero_ort.so's QLinear), or why not."""
    import dataclasses

    if "weights" not in {f.name for f in dataclasses.fields(CompileOptions)}:
        return None, "not available: CompileOptions has no weights option"
    out = prepared["root"] / _lz_folder(bits, linear_kernel)
    manifest_file = out / "manifest.json"
    if not _stamp.fresh(out) or (verify and not json.loads(manifest_file.read_text())["options"].get("verify")):
        say(f"{prepared['root'].name}: compiling --moe-lowering native --weights int{bits} "
            f"--linear-kernel {linear_kernel}")
        options = CompileOptions(moe_lowering="native", verify=verify, weights=f"int{bits}",  # type: ignore[call-arg]
                                 linear_kernel=linear_kernel)  # fmt: skip
        compile_file(prepared["export"], out, options, overwrite=True)
        if linear_kernel == "native" and not _stamp.op_count(out, "QLinear"):
            # the compile fell back to MatMulNBits (the library was not found): never timed, never cached as fresh
            return None, "compiled without QLinear (liblayerzero_ort.so not found by the compile)"
        _stamp.stamp(out)
    return out, "compiled with verification" if verify else "compiled --no-verify"


def lz_reference(prepared: dict[str, Any], bits: int, lz_path: Path, say, linear_kernel: str = "ort") -> Path:
    """LayerZero int4 / int8's own quantized-dense reference (``layerzero.compile.quantized_dense_reference``: the
    export with the compile's static zeroing and the same weight quantization, nothing skipped: what verification
    compares the bundle with), saved as a plain ``.onnx`` beside the bundle; remade when the bundle is newer."""
    import onnx_ir as ir

    from layerzero.compile import quantized_dense_reference

    out = prepared["root"] / f"{_lz_folder(bits, linear_kernel)}-reference" / "model.onnx"
    manifest = lz_path / "manifest.json"
    if out.is_file() and out.stat().st_mtime >= manifest.stat().st_mtime:
        return out
    say(f"{prepared['root'].name}: writing LZ int{bits}'s quantized-dense reference")
    options = CompileOptions(moe_lowering="native", weights=f"int{bits}", linear_kernel=linear_kernel)  # type: ignore[call-arg]
    model = quantized_dense_reference(ir.load(prepared["export"]), options, static_zeroing=True,
                                      compiled=ir.load(lz_path / "model.onnx"))  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, out, external_data=out.name + ".data", size_threshold_bytes=1 << 20)
    return out


def _deviation(logits: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement of the greedy ids over the prompt's positions, relative L2) of prefill logits [n, V]."""
    logits, reference = np.asarray(logits, np.float64).reshape(reference.shape), np.asarray(reference, np.float64)
    top1 = float(np.mean(np.argmax(logits, axis=-1) == np.argmax(reference, axis=-1)))
    return top1, float(np.linalg.norm(logits - reference) / np.linalg.norm(reference))


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class _EngineColumn:
    """A LayerZero / ONNX Runtime column at one thread count, through ``Engine.generate``."""

    def __init__(self, path: Path, threads: int, spin: bool | None = None) -> None:
        self.engine = Engine.load(path, intra_op_num_threads=threads, allow_spinning=spin)

    def generate(self, prompt: list[int], new: int) -> dict[str, Any]:
        out = self.engine.generate(prompt, max_new_tokens=new, stop_tokens=())
        step = statistics.median(s.seconds for s in out.report.steps[1:]) if new > 1 else 0.0
        return {"ids": out.ids, "ttft": out.report.time_to_first_token_s,
                "tps": out.report.decode_tokens_per_s or 0.0, "step": step}  # fmt: skip

    def prefill(self, prompt: list[int]) -> np.ndarray:
        return prefill_logits(self.engine, prompt)[0]


class _ReadBound:
    """The least a decode step of a quantized bundle must read, streamed with nothing else done: the weights every
    token reads (the MatMulNBits / QLinear codes, scales and zero points: projections and lm_head; the routers' float
    MatMuls) and, per MoE layer, ``top_k`` experts' codes and scales (a fresh seeded draw of experts each token, so
    the whole model's experts rotate through the caches as decode's routing does). Embeddings, norms, rotary caches
    and the KV cache are left out, so the bytes are a lower bound and the tokens/s an upper one. Streamed by
    liblayerzero_ort.so's ``LayerZeroOrtStreamRead`` (the native kernels' read pattern without their arithmetic;
    the buffers backed by huge pages as the kernels back theirs) on ``threads`` threads, each a share of every
    token's regions (ctypes releases the GIL). ``generate`` streams ``new`` tokens' regions and returns the same
    dict as the engine columns (no ids)."""

    def __init__(self, bundle: Path, threads: int, seed: int = 0) -> None:
        import ctypes

        import onnx_ir as ir

        from layerzero.plugins import ort_library

        lib = ctypes.CDLL(str(ort_library.find_ort_library()))
        self._read = lib.LayerZeroOrtStreamRead
        self._read.restype = ctypes.c_float
        advise = lib.LayerZeroOrtAdviseHugePages
        advise.restype = ctypes.c_size_t
        self._ctypes = ctypes
        model = ir.load(bundle / "model.onnx")
        keep: list[np.ndarray] = []  # the arrays stay alive as long as their pointers are used

        def array(value: Any) -> np.ndarray | None:
            if value is None or value.const_value is None:
                return None
            a = np.ascontiguousarray(value.const_value.numpy())
            advise(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(a.nbytes))
            keep.append(a)
            return a

        dense: list[np.ndarray] = []
        self.layers: list[tuple[int, list[np.ndarray]]] = []  # (top_k, [codes / scales stacked over experts])
        for node in model.graph:
            if node.op_type in ("MatMulNBits", "QLinear") or (node.op_type in ("MatMul", "Gemm") and node.domain == ""):
                dense += [a for a in map(array, node.inputs[1:]) if a is not None]
            elif node.op_type == "MoE" and node.domain == "ai.layerzero":
                stacked = [a for i in (2, 3, 4, 10, 11, 12) if i < len(node.inputs)
                           for a in [array(node.inputs[i])] if a is not None]  # fmt: skip
                self.layers.append((node.attributes["top_k"].as_int(), stacked))
        self.dense_bytes = sum(a.nbytes for a in dense)
        self.expert_bytes = sum(k * sum(a[0].nbytes for a in stacked) for k, stacked in self.layers)
        self.bytes = self.dense_bytes + self.expert_bytes
        self._dense, self._keep = dense, keep
        self.threads = threads
        self._rng = np.random.default_rng(seed)

    def _token_regions(self) -> list[np.ndarray]:
        regions = list(self._dense)
        for k, stacked in self.layers:
            for e in self._rng.choice(len(stacked[0]), size=k, replace=False):
                regions += [a[e] for a in stacked]
        return regions

    def _args(self, regions: list[np.ndarray]) -> tuple[Any, Any, Any]:
        c, n = self._ctypes, len(regions)
        return (c.c_void_p * n)(*[r.ctypes.data for r in regions]), (c.c_int64 * n)(*[r.nbytes for r in regions]), n

    def _step(self) -> float:
        """One token's regions streamed: the time from the first thread's start to the last one's end (the
        threads made and the arguments built before, outside the time)."""
        import threading

        regions = [r.reshape(-1).view(np.uint8) for r in self._token_regions()]
        shares: list[list[np.ndarray]] = [[] for _ in range(self.threads)]
        for r in regions:  # every region cut in equal shares: each thread streams 1 / threads of every matrix
            for i, part in enumerate(np.array_split(r, self.threads)):
                shares[i].append(part)
        args = [self._args(share) for share in shares]
        if self.threads == 1:
            t0 = time.perf_counter()
            self._read(*args[0])
            return time.perf_counter() - t0
        barrier = threading.Barrier(self.threads)
        spans: list[tuple[float, float]] = []

        def work(a: tuple[Any, Any, Any]) -> None:
            barrier.wait()
            t0 = time.perf_counter()
            self._read(*a)
            spans.append((t0, time.perf_counter()))

        workers = [threading.Thread(target=work, args=(a,)) for a in args]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return max(e for _, e in spans) - min(b for b, _ in spans)

    def generate(self, prompt: list[int], new: int) -> dict[str, Any]:
        steps = [self._step() for _ in range(max(new - 1, 1))]
        step = statistics.median(steps)
        return {"ids": [], "ttft": 0.0, "tps": len(steps) / sum(steps), "step": step}


def quantized_main(args: argparse.Namespace, rounds: int, verify_mode: str, say) -> int:
    """``--weights int4 / int8``: the columns of the module doc's quantized table, interleaved rounds, medians."""
    import _llamacpp  # bench/_llamacpp.py, beside this script

    bits = 4 if args.weights == "int4" else 8
    kind = LLAMACPP_KIND[bits]
    threads = [int(t) for t in args.threads.split(",") if t]
    load_before = os.getloadavg()
    all_configs = configs(args.quick)
    families = [f for f in args.families.split(",") if f]
    native_why = native_library(say)
    llama_why = _llamacpp.missing()
    results: list[dict[str, Any]] = []
    misses: list[str] = []
    for family in families:
        config = all_configs[family]
        prompt = np.random.default_rng(0).integers(0, config["vocab_size"], size=args.prompt).tolist()
        prepared = prepare(family, config, prompt, args.new, say)
        notes: list[str] = []
        unavailable: dict[str, str] = {}
        paths: dict[str, Path] = {}
        if native_why:
            unavailable["LZ fp32 native"] = native_why
        else:
            paths["LZ fp32 native"], _ = bundle(prepared, "native", say, verify=verify_mode == "all")
        paths[f"ORT int{bits}"], note = ort_quantized(prepared, bits, say)
        notes.append(f"ORT int{bits}: {note}")
        lk = args.linear_kernel
        lz_path, lz_note = lz_quantized(prepared, bits, say, verify=verify_mode != "none", linear_kernel=lk) if not (
            native_why) else (None, native_why)  # fmt: skip
        mnb = f"LZ int{bits} MatMulNBits"  # --linear-kernel native: the same compile with ONNX Runtime's MatMulNBits
        if lz_path is None:
            unavailable[f"LZ int{bits}"] = lz_note
        else:
            paths[f"LZ int{bits}"] = lz_path
            notes.append(f"LZ int{bits}: {lz_note}, dense MatMuls as "
                         + ("liblayerzero_ort.so's QLinear" if lk == "native" else "MatMulNBits"))  # fmt: skip
            if lk == "native":
                paths[mnb], _ = lz_quantized(prepared, bits, say, verify=False, linear_kernel="ort")
                notes.append(f"{mnb}: the same compile with --linear-kernel ort (--no-verify)")
        ggufs: dict[str, Path] = {}
        if llama_why:
            unavailable[f"llama.cpp {kind}"] = unavailable["llama.cpp F32"] = llama_why
        else:
            gguf_dir = prepared["root"] / "gguf"
            ggufs["llama.cpp F32"] = gguf_dir / "model-f32.gguf"
            _llamacpp.convert(prepared["hf"], ggufs["llama.cpp F32"], CACHE / "llamacpp", say)
            ggufs[f"llama.cpp {kind}"] = gguf_dir / f"model-{kind.lower()}.gguf"
            _llamacpp.quantize(ggufs["llama.cpp F32"], ggufs[f"llama.cpp {kind}"], kind, say)
            notes.append(f"llama.cpp {_llamacpp.version()} (llama-cpp-python built here), GGUF from its converter")
        # The deviation of every column from the fp32 export, on the prompt (one prefill, 2 threads).
        export = Engine.load(prepared["export"])
        reference = prefill_logits(export, prompt)[0]
        del export
        deviation: dict[str, tuple[float, float]] = {}
        columns: dict[tuple[str, int], Any] = {}
        order = ["LZ fp32 native", f"ORT int{bits}", f"llama.cpp {kind}", "llama.cpp F32", mnb, f"LZ int{bits}"]
        for name in order:
            if name in paths:
                for t in threads:
                    columns[(name, t)] = _EngineColumn(paths[name], t, False if args.no_spin else None)
                deviation[name] = _deviation(columns[(name, threads[-1])].prefill(prompt), reference)
            elif name in ggufs:
                n_ctx = args.prompt + args.new + 8
                kv_f32 = name == "llama.cpp F32"  # the conversion's check: no f16 cache rounding (_llamacpp)
                for t in threads:
                    columns[(name, t)] = _llamacpp.LlamaCppRunner(ggufs[name], t, n_ctx, args.prompt, kv_f32)
                logits = _llamacpp.prefill_logits(ggufs[name], prompt, kv_f32=kv_f32)
                deviation[name] = _deviation(logits, reference)
        reference_ids: list[int] | None = None
        if f"LZ int{bits}" in paths:  # its greedy ids against its own quantized-dense reference (not timed)
            ref = _EngineColumn(lz_reference(prepared, bits, paths[f"LZ int{bits}"], say, lk), threads[-1])
            reference_ids = ref.generate(prompt, args.new)["ids"]
            del ref
        if f"LZ int{bits}" in paths:  # what LZ int's bytes allow at all, streamed in the same rounds
            for t in threads:
                columns[("read bound", t)] = _ReadBound(paths[f"LZ int{bits}"], t)
        for column in columns.values():  # warm-up: sessions, allocators, page cache
            column.generate(prompt[:4], 2)
        timings: dict[tuple[str, int], list[dict[str, Any]]] = {key: [] for key in columns}
        for r in range(rounds):
            say(f"{family} --weights {args.weights}: round {r + 1}/{rounds} (load {os.getloadavg()[0]:.1f})")
            for key, column in columns.items():
                timings[key].append(column.generate(prompt, args.new))
        print(
            f"\n{family} --weights {args.weights}: {prepared['params'] / 1e6:.0f} M parameters, prompt {args.prompt}, "
            f"{args.new} new tokens, batch 1, threads {','.join(map(str, threads))}, {rounds} interleaved round(s)"
        )
        for note in notes:
            print(f"  {note}")
        print(
            f"  {'column':<16} {'threads':>7} {'decode tok/s':>12} {'first token':>12} {'median step':>12} "
            f"{'top-1 vs fp32':>13} {'rel L2 vs fp32':>14}  ids == fp32 (leading, of {args.new})"
        )
        tps: dict[tuple[str, int], float] = {}
        for name in order:
            if name == mnb and name not in paths:
                continue
            if name in unavailable:
                print(f"  {name:<16} {'-':>7} {unavailable[name]}")
                continue
            for t in threads:
                values = timings[(name, t)]
                tps[(name, t)] = statistics.median(v["tps"] for v in values)
                ttft = statistics.median(v["ttft"] for v in values)
                step = statistics.median(v["step"] for v in values)
                top1, rel = deviation[name]
                same = _common_prefix(values[0]["ids"], prepared["ids"])
                print(
                    f"  {name:<16} {t:>7} {tps[(name, t)]:>12.1f} {ttft * 1e3:>9.0f} ms {step * 1e3:>9.2f} ms "
                    f"{top1:>13.3f} {rel:>14.2e}  {same}"
                )
                results.append(dict(family=family, column=name, threads=t, decode_tokens_per_s=tps[(name, t)],
                                    time_to_first_token_s=ttft, median_step_s=step, top1_vs_fp32=top1,
                                    rel_l2_vs_fp32=rel, ids_equal_fp32_leading=same,
                                    rounds=[v["tps"] for v in values]))  # fmt: skip
            if name == "LZ fp32 native" and timings[(name, threads[0])][0]["ids"] != prepared["ids"]:
                misses.append(f"{family} LZ fp32 native: ids differ from transformers' greedy")
            if name == f"LZ int{bits}" and reference_ids is not None:
                for t in threads:
                    ids = timings[(name, t)][0]["ids"]
                    same = _common_prefix(ids, reference_ids)
                    print(f"  {name:<16} {t:>7} ids == its quantized-dense reference: {same} of {len(reference_ids)}")
                    if ids != reference_ids:
                        misses.append(f"{family} {name} at {t} thread(s): greedy ids differ from its quantized-dense "
                                      f"reference from position {same}")  # fmt: skip
        if "llama.cpp F32" in deviation and deviation["llama.cpp F32"][1] > 1e-3:
            misses.append(
                f"{family} llama.cpp F32: relative L2 {deviation['llama.cpp F32'][1]:.1e} from the export's logits: "
                "the GGUF is not the same model"
            )
        bound = {t: statistics.median(v["tps"] for v in timings[("read bound", t)])
                 for t in threads if ("read bound", t) in timings}  # fmt: skip
        if bound:
            rb = columns[("read bound", threads[0])]
            print(f"  read bound: LZ int{bits}'s weights a token read at least {rb.bytes / 1e6:.1f} MB (dense, lm_head "
                  f"and routers {rb.dense_bytes / 1e6:.1f} MB, routed experts {rb.expert_bytes / 1e6:.1f} MB), "
                  "streamed alone in the same rounds:")  # fmt: skip
            for t, b in bound.items():
                lz = tps.get((f"LZ int{bits}", t), 0.0)
                ort_x3 = 3 * tps.get((f"ORT int{bits}", t), 0.0)
                print(f"    {t} thread(s): {b:.1f} tok/s at most ({rb.bytes * b / 1e9:.1f} GB/s); LZ int{bits} at "
                      f"{lz / b:.2f} of it; 3 x ORT int{bits} = {ort_x3:.1f} tok/s is "
                      f"{'above the bound: no kernel reading these bytes reaches it' if ort_x3 > b else 'below it'}"
                      + ("; LZ is faster than the stream: at this size the loop's per-region calls, not the bytes, "
                         "set the stream's time, and it bounds nothing" if lz > b else ""))  # fmt: skip
                results.append(dict(family=family, column="read bound", threads=t, decode_tokens_per_s=b,
                                    bytes_per_token=rb.bytes, rounds=[v["tps"] for v in timings[("read bound", t)]]))
        for t in threads:
            for num, den, want in QUANT_TARGETS[bits]:
                a, b = tps.get((num, t)), tps.get((den, t))
                if a is None or b is None:
                    why = unavailable.get(num) or unavailable.get(den) or "not measured"
                    print(f"  target {num} / {den} >= {want} at {t} thread(s): not measured ({why})")
                    # LayerZero's own column missing is a miss at any size; another tool's only where judged.
                    if num in unavailable or not args.quick:
                        misses.append(f"{family} {num} / {den} at {t} thread(s): not measured ({why})")
                    continue
                ratio = a / b if b else 0.0
                judged = not args.quick
                verdict = ("met" if ratio >= want else "NOT met") if judged else "no target at --quick"
                print(f"  target {num} / {den} >= {want} at {t} thread(s): {ratio:.2f} {verdict}")
                if judged and ratio < want:
                    misses.append(f"{family} {num} / {den} at {t} thread(s): {ratio:.2f} < {want}")
            if (mnb, t) in tps and (f"LZ int{bits}", t) in tps:
                print(f"  LZ int{bits} / {mnb} at {t} thread(s): {tps[(f'LZ int{bits}', t)] / tps[(mnb, t)]:.2f}")
            fp32 = tps.get(("LZ fp32 native", t))
            for name in (f"ORT int{bits}", f"llama.cpp {kind}", "llama.cpp F32"):
                if fp32 and (name, t) in tps:
                    print(f"  {name} / LZ fp32 native at {t} thread(s): {tps[(name, t)] / fp32:.2f}")
        del columns
    return _finish(args, results, misses, load_before)


def _finish(args, results: list, misses: list[str], load_before: tuple[float, float, float]) -> int:
    """The load line, the JSON (``--json``), the misses; exit status 1 on a missed target."""
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


def _op_groups(model_path: Path) -> dict[str, str]:
    """Node name -> its row in the thread-scaling table: the op type, with the MatMuls split into lm_head (the one
    whose constant weight's last dim is the vocabulary), dense (the other constant-weight MatMuls: q, k, v, o) and
    attention (the score and context MatMuls, no constant); a Gemm is a router."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    logits = next((o.type.tensor_type.shape.dim[-1].dim_value for o in model.graph.output if o.name == "logits"), 0)
    groups = {}
    for node in model.graph.node:
        group = node.op_type
        if node.op_type in ("MatMul", "MatMulNBits"):
            weight = dims.get(node.input[1]) if len(node.input) > 1 else None
            if weight is None:
                group = f"{node.op_type} attention"
            elif logits and logits in weight:
                group = f"{node.op_type} lm_head"
            else:
                group = f"{node.op_type} dense"
        elif node.op_type == "Gemm":
            group = "Gemm router"
        groups[node.name] = group
    return groups


def profile_threads(prepared: dict[str, Any], lowering: str, threads: list[int], prompt: list[int], new: int,
                    say, spin: bool | None = None, path: Path | None = None) -> dict[int, dict[str, Any]]:  # fmt: skip
    """ONNX Runtime's own profile of one bundle's decode steps at each thread count: per op group, the summed
    kernel time per decode step (the prefill run left out), the session's time per step (``model_run``) and the
    Python loop's time around it (the step's wall time in the report minus ``model_run``). ``path``: that bundle
    (``--weights int4``: LayerZero's int4 bundle) instead of the ``lowering``'s float one."""
    if path is None:
        path, _ = bundle(prepared, lowering, say, verify=False)
    names = _op_groups(path / "model.onnx")
    out: dict[int, dict[str, Any]] = {}
    for t in threads:
        prefix = prepared["root"] / f"profile-{lowering}-t{t}"
        engine = Engine.load(path, intra_op_num_threads=t, allow_spinning=spin, enable_profiling=True,
                             profile_file_prefix=str(prefix))  # fmt: skip
        engine.generate(prompt[:4], max_new_tokens=2, stop_tokens=())  # warm-up (its runs are dropped below)
        warm_runs = 2
        gen = engine.generate(prompt, max_new_tokens=new, stop_tokens=())
        events = json.loads(Path(engine.backend.end_profiling()).read_text())  # type: ignore[attr-defined]
        runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                      key=lambda e: e["ts"])[warm_runs + 1 :]  # fmt: skip  # warm-up and the prefill out
        windows = [(e["ts"], e["ts"] + e["dur"]) for e in runs]
        groups: dict[str, float] = {}
        starts = [w[0] for w in windows]
        for e in events:
            if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
                continue
            i = bisect.bisect_right(starts, e["ts"]) - 1
            if i < 0 or e["ts"] > windows[i][1]:
                continue
            node = e["name"].removesuffix("_kernel_time")
            key = names.get(node) or e.get("args", {}).get("op_name", "?")
            groups[key] = groups.get(key, 0.0) + e["dur"]
        steps = len(windows)
        # Means (not medians) here: the op groups are sums over the steps, and these rows account for them.
        step_wall = statistics.mean(s.seconds for s in gen.report.steps[1:]) * 1e6
        run_us = statistics.mean(e["dur"] for e in runs)
        out[t] = {"groups": {k: v / steps for k, v in groups.items()}, "model_run_us": run_us,
                  "step_us": step_wall, "steps": steps, "tokens_per_s": gen.report.decode_tokens_per_s}  # fmt: skip
        del engine
    return out


def print_profile(family: str, lowering: str, prof: dict[int, dict[str, Any]]) -> None:
    threads = sorted(prof)
    a, b = threads[0], threads[-1]
    print(f"\n{family} LZ {lowering}: ONNX Runtime profile, mean µs per decode step (kernel time summed per op group), "
          f"{a} vs {b} thread(s)")  # fmt: skip
    print(f"  {'op group':<22} " + " ".join(f"{f'{t} thr':>10}" for t in threads) + f" {'speedup':>8} {'share':>6}")
    total_a = sum(prof[a]["groups"].values())
    for key in sorted(prof[a]["groups"], key=lambda k: -prof[a]["groups"][k]):
        values = [prof[t]["groups"].get(key, 0.0) for t in threads]
        speedup = values[0] / values[-1] if values[-1] else float("nan")
        print(f"  {key:<22} " + " ".join(f"{v:>10.1f}" for v in values) +
              f" {speedup:>7.2f}× {values[0] / total_a:>6.1%}")  # fmt: skip
    for label, field in (("kernels (sum)", None), ("model_run", "model_run_us"), ("step (wall)", "step_us")):
        values = [sum(prof[t]["groups"].values()) if field is None else prof[t][field] for t in threads]
        print(f"  {label:<22} " + " ".join(f"{v:>10.1f}" for v in values) + f" {values[0] / values[-1]:>7.2f}×")
    for t in threads:
        p = prof[t]
        print(f"  {t} thread(s): {p['tokens_per_s']:.1f} tok/s decode; the loop around run: "
              f"{p['step_us'] - p['model_run_us']:.0f} µs a step; run minus its kernels: "
              f"{p['model_run_us'] - sum(p['groups'].values()):.0f} µs ({p['steps']} steps)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="mixtral,qwen3_moe")
    p.add_argument("--lowerings", default=",".join(LOWERINGS))
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per variant (default 3, --quick 1)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", "--new-tokens", dest="new", type=int, default=128)
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
    p.add_argument(
        "--weights",
        choices=("fp32", "int4", "int8"),
        default="fp32",
        help="fp32 (default): the export against LayerZero's lowerings; int4 / int8: the quantized columns "
        "(LayerZero fp32 native, ONNX Runtime's MatMulNBits + QMoE, llama.cpp Q4_0 / Q8_0 and F32, LayerZero "
        "int4 / int8) at 1 and 2 threads (see the module doc)",
    )
    p.add_argument(
        "--linear-kernel", choices=("ort", "native"), default="ort",
        help="--weights: LZ int's dense MatMuls as MatMulNBits (ort) or liblayerzero_ort.so's QLinear (native; then "
        "the MatMulNBits compile is a column beside it)",
    )  # fmt: skip
    p.add_argument("--threads", default="1,2", help="thread counts of --weights int4/int8 and --profile (default 1,2)")
    p.add_argument(
        "--no-spin",
        action="store_true",
        help="--weights / --profile: ONNX Runtime's idle workers sleep instead of spinning (allow_spinning=False)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="instead of the table: ONNX Runtime's per-op profile of the first --lowerings bundle's decode steps at "
        "each --threads count (which ops gain from a second thread, and the loop around run)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.genai_path is not None:
        sys.path.append(str(args.genai_path))  # appended: the venv's onnxruntime stays first
    rounds = args.rounds or (1 if args.quick else 3)
    verify_mode = "none" if args.no_verify else args.verify

    def say(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    if args.profile:
        threads = [int(t) for t in args.threads.split(",") if t]
        lowering = next(x for x in args.lowerings.split(",") if x)
        if lowering == "native" and native_library(say):
            raise SystemExit("--profile native: liblayerzero_ort.so is not built")
        for family in [f for f in args.families.split(",") if f]:
            config = configs(args.quick)[family]
            prompt = np.random.default_rng(0).integers(0, config["vocab_size"], size=args.prompt).tolist()
            prepared = prepare(family, config, prompt, args.new, say)
            load = os.getloadavg()[0]
            spin = False if args.no_spin else None
            path = None
            if args.weights != "fp32":  # LayerZero's quantized bundle (native lowering)
                bits = 4 if args.weights == "int4" else 8
                path, why = lz_quantized(prepared, bits, say, verify=False, linear_kernel=args.linear_kernel)
                if path is None:
                    raise SystemExit(f"--profile --weights {args.weights}: {why}")
                lowering = f"native {args.weights}"
            prof = profile_threads(prepared, lowering, threads, prompt, args.new, say, spin, path=path)
            print_profile(family, lowering, prof)
            print(f"  load average {load:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")
        return 0
    if args.weights != "fp32":
        return quantized_main(args, rounds, verify_mode, say)
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
    return _finish(args, results, misses, load_before)


if __name__ == "__main__":
    raise SystemExit(main())
