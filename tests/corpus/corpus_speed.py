"""1-token latency of each MoE family's export against its compiled model, at a realistic size (issue 8 item 7).

Each MoE family of the corpus is scaled to ``speed_family``: hidden 512, 2 layers, 8 heads of 64 (4 KV heads),
vocab 1024, the family's default number of experts and top-k (``transformers``' default config) capped at 32
experts and top-8 (a default without experts, or a single one, gets 16 experts, top-2), expert MLPs of 1024
(families of ≤ 16 experts) or 256 (fine-grained families of more), dense and shared MLPs of 1024. The other
attention sizes of a family (MLA ranks, JetMoE's kv channels) stay the corpus's. Random weights, seeded.

The export (cached like the corpus's, by family hash) is compiled with the default options (verification on),
then both models run in onnxruntime with the same session options (CPU, 1 intra-op and 1 inter-op thread,
default graph optimisations; ``liblayerzero_ort.so`` registered for a compiled model that kept
``ai.layerzero::MoE`` for it, the ``native`` lowering) on a 1-token prompt: warm-up, then rounds that alternate
export and compiled runs (so a load change on the machine hits both), and the p50 of each. The speed-up is export
p50 / compiled p50: above 1 the compiled model is faster. Each result records the MoE lowering the compile chose
(``lowering``) and the machine's 1-minute load average before and after the timed rounds (``load``): the machine
is shared, and a ratio measured under a changing load is worth a rerun.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from corpus_export import cache_root, get_export, output_name
from corpus_families import FAMILIES, Family

__all__ = ["SpeedResult", "read_speed", "run_speed", "speed_family"]

HIDDEN = 512
LAYERS = 2
HEADS = 8
HEAD_DIM = 64
VOCAB = 1024
MAX_EXPERTS = 32
MAX_TOP_K = 8
WARMUP = 5
ROUNDS = 7
RUNS_PER_ROUND = 15

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk")


def _default_experts(family: Family) -> tuple[int, int, bool]:
    """(experts, top-k, has a separate expert MLP size) of the family's default transformers config."""
    import transformers

    config = getattr(transformers, family.config)()
    experts = max((getattr(config, k, None) or 0 for k in _EXPERT_KEYS), default=0)
    top_k = max((getattr(config, k, None) or 0 for k in _TOP_K_KEYS), default=0)
    if experts < 2 or top_k < 1:
        experts, top_k = 16, 2
    return experts, top_k, getattr(config, "moe_intermediate_size", None) is not None


def speed_family(family: Family) -> Family:
    """The family at the speed column's size (module docstring)."""
    default_experts, default_k, separate = _default_experts(family)
    experts = min(default_experts, MAX_EXPERTS)
    top_k = min(default_k, MAX_TOP_K, experts)
    expert_mlp = 1024 if default_experts <= 16 else 256
    kwargs = dict(family.kwargs)
    kwargs.update(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        head_dim=HEAD_DIM,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        intermediate_size=1024 if separate else expert_mlp,
        shared_expert_intermediate_size=1024,
        intermediate_size_mlp=1024,
    )
    kwargs["moe_intermediate_size"] = expert_mlp if separate else kwargs.get("moe_intermediate_size")
    for key in _EXPERT_KEYS:
        if key in kwargs:
            kwargs[key] = experts
    for key in _TOP_K_KEYS:
        if key in kwargs:
            kwargs[key] = top_k
    if family.name in ("deepseek_v2", "deepseek_v3"):
        kwargs.update(num_key_value_heads=HEADS, head_dim=8)  # MLA: the corpus's head dims, all heads
    if family.name == "jetmoe":
        kwargs.update(kv_channels=HEAD_DIM, num_key_value_heads=HEADS)
    return dataclasses.replace(family, name=f"{family.name}@speed", kwargs=kwargs)


@dataclasses.dataclass
class SpeedResult:
    family: str
    exporter: str
    config: str = ""  # experts / top-k / expert MLP size
    export_error: str | None = None
    compile_error: str | None = None
    moe_blocks: int | None = None
    export_ms: float | None = None  # p50 of one 1-token run
    compiled_ms: float | None = None
    speedup: float | None = None  # export_ms / compiled_ms
    max_abs: float | None = None  # compiled vs export at the timed prompt
    seconds: float = 0.0
    lowering: str | None = None  # the MoE lowering(s) of the compiled model ("if", "ort-moe", "native")
    load: str | None = None  # 1-minute load average before -> after the timed rounds

    @property
    def key(self) -> str:
        return f"{self.family}/{self.exporter}"


def _session(data: bytes | str, native: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if native:  # the compiled model kept ai.layerzero::MoE for liblayerzero_ort.so (the native lowering)
        from layerzero.plugins.ort_library import ort_library_path, register

        register(options, [str(ort_library_path())])
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _feeds(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    feeds = {"input_ids": np.array([[17]], dtype=np.int64)}
    for extra in session.get_inputs():
        if extra.name not in feeds and not extra.shape:
            feeds[extra.name] = np.array(0, dtype=np.int64)
    return feeds


def _timed(session: ort.InferenceSession, out: str, feeds: dict[str, np.ndarray], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run([out], feeds)
        times.append(time.perf_counter() - start)
    return times


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_speed(family_name: str, exporter: str, rounds: int = ROUNDS) -> SpeedResult:
    """Export (cached), compile, and time the family at the speed size with one exporter (``rounds``
    interleaved rounds of ``RUNS_PER_ROUND`` runs each)."""
    import onnx_ir as ir

    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions
    from layerzero.passes._dynamic import read_dynamic_paths

    start = time.perf_counter()
    family = speed_family(FAMILIES[family_name])
    experts = next(family.kwargs[k] for k in _EXPERT_KEYS if k in family.kwargs)
    top_k = next(family.kwargs[k] for k in _TOP_K_KEYS if k in family.kwargs)
    separate = _default_experts(FAMILIES[family_name])[2]
    mlp = family.kwargs["moe_intermediate_size"] if separate else family.kwargs["intermediate_size"]
    result = SpeedResult(family_name, exporter, config=f"{experts} experts, top-{top_k}, expert MLP {mlp}")
    export = get_export(family.name, exporter, family=family)
    if export.error:
        result.export_error = export.error
        return result
    out = output_name(family)
    reference = _session(str(export.path))
    feeds = _feeds(reference)
    try:  # as the corpus does: an export that does not run at the timed prompt is the exporter's failure
        expected = reference.run([out], feeds)[0]
    except Exception as exc:  # e.g. a TorchScript trace that kept the example's expert sizes in a Split
        lines = [line for line in str(exc).splitlines() if line.strip()]
        first = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        result.export_error = f"the export does not run at input shape (1, 1): {first}"[:300]
        result.seconds = round(time.perf_counter() - start, 1)
        return result
    proto = export.load()
    try:
        compiled = compile_model(copy.deepcopy(proto), CompileOptions())
    except Exception as exc:  # a refusal or crash is this case's outcome
        lines = [line for line in str(exc).splitlines() if line.strip()]
        result.compile_error = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
        result.seconds = round(time.perf_counter() - start, 1)
        return result
    paths = read_dynamic_paths(compiled.model)
    result.moe_blocks = len(paths)
    result.lowering = ", ".join(sorted({str(p.detail.get("lowering")) for p in paths if p.detail.get("lowering")}))
    native = any(n.domain == "ai.layerzero" for n in compiled.model.graph)
    candidate = _session(ir.to_proto(compiled.model).SerializeToString(), native=native)
    got = candidate.run([out], _feeds(candidate))[0]
    result.max_abs = float(np.max(np.abs(expected - got)))
    _timed(reference, out, feeds, WARMUP)
    _timed(candidate, out, _feeds(candidate), WARMUP)
    export_times: list[float] = []
    compiled_times: list[float] = []
    load_before = _load()
    for _ in range(rounds):  # interleaved: a load change on the shared machine hits both
        export_times += _timed(reference, out, feeds, RUNS_PER_ROUND)
        compiled_times += _timed(candidate, out, _feeds(candidate), RUNS_PER_ROUND)
    result.load = f"{load_before} -> {_load()}"
    result.export_ms = round(float(np.median(export_times)) * 1e3, 3)
    result.compiled_ms = round(float(np.median(compiled_times)) * 1e3, 3)
    result.speedup = round(result.export_ms / result.compiled_ms, 2)
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def speed_dir() -> Path:
    return cache_root() / "results_speed"


def write_speed(result: SpeedResult) -> Path:
    folder = speed_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (result.key.replace("/", "__") + ".json")
    path.write_text(json.dumps(dataclasses.asdict(result), indent=1))
    return path


def read_speed() -> dict[str, dict]:
    folder = speed_dir()
    out = {}
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        data = json.loads(path.read_text())
        out[f"{data['family']}/{data['exporter']}"] = data
    return out
