"""Token generation on an ``Engine``: KV cache, decode loop, sampling, stop tokens, streaming, a report.

    engine = Engine.load("model.lz")
    out = engine.generate([1, 2, 3], max_new_tokens=16)                    # greedy
    out = engine.generate(ids, temperature=0.8, top_k=50, top_p=0.9, seed=0, on_token=print)
    out.ids, out.report.tokens_per_s, out.report.steps[0].skipped_paths

The model is what ``layerzero export`` writes (and ``layerzero compile`` keeps): inputs ``input_ids``,
``attention_mask``, ``position_ids`` and, for a cache-carrying export, ``past_key_values.N.key/value``
[batch, kv_heads, past, head_dim]; outputs ``logits`` and ``present.N.key/value``. The first step (prefill)
runs the whole prompt with an empty past; each next step runs one token and feeds the presents back as the
past. A single-pass export (no past inputs) is driven by running the whole sequence at every step (correct,
quadratic; export with the cache for speed).

Sampling: ``temperature == 0`` is greedy (argmax; ties go to the lowest id, as torch's argmax). Otherwise
logits / temperature, then top-k (keep the k largest), then top-p (keep the smallest set of most probable
tokens whose probability reaches p; at least one), then a draw from ``numpy.random.default_rng(seed)``.

Generation stops after ``max_new_tokens`` or when a stop token is produced (it is kept in ``ids``, as
transformers does). Batch 1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from layerzero.errors import InvalidInputError, UnsupportedModelError

if TYPE_CHECKING:
    from layerzero.runtime.engine import Engine

__all__ = [
    "GENERATE_META_KEY",
    "GenerateReport",
    "Generation",
    "StepReport",
    "export_metadata",
    "generate",
    "stop_tokens_of",
]

logger = logging.getLogger(__name__)

#: The model metadata entry ``layerzero export`` writes (JSON: eos_token_id, layers, ...).
GENERATE_META_KEY = "layerzero.generate"

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


@dataclasses.dataclass
class StepReport:
    """One forward pass: the tokens it ran (the prompt on the first step, then one), what it skipped."""

    tokens: int
    token_id: int  # the token it produced
    seconds: float
    skipped_paths: list[str]
    masks: dict[str, list] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerateReport:
    """One request. ``tokens_per_s`` is new tokens / total time; ``decode_tokens_per_s`` leaves the prefill out.

    The static part (``total_layers``, ``zeroed_layers``, ``zeroed_paths``, ``zeroed_params_ratio``) comes
    from the bundle's manifest; ``skipped_paths`` are the dynamic paths no step of this request ran.
    """

    prompt_tokens: int
    new_tokens: int
    stop_reason: str  # "stop_token" | "max_new_tokens"
    time_to_first_token_s: float
    total_s: float
    tokens_per_s: float
    decode_tokens_per_s: float | None
    cache: bool
    total_layers: int
    zeroed_layers: int
    zeroed_paths: list[str]
    zeroed_params_ratio: float
    skipped_paths: list[str]
    steps: list[StepReport]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        decode = f", decode {self.decode_tokens_per_s:.1f} tok/s" if self.decode_tokens_per_s else ""
        return (
            f"{self.new_tokens} new tokens ({self.stop_reason}) in {self.total_s * 1e3:.1f} ms: "
            f"{self.tokens_per_s:.1f} tok/s{decode}, first token {self.time_to_first_token_s * 1e3:.1f} ms; "
            f"{self.zeroed_layers}/{self.total_layers} layers zeroed, "
            f"{self.zeroed_params_ratio:.1%} of parameters removed, "
            f"{len(self.skipped_paths)} paths skipped on every step"
        )


@dataclasses.dataclass
class Generation:
    """The generated ids (new tokens only), the prompt, and the report."""

    ids: list[int]
    prompt_ids: list[int]
    report: GenerateReport


@dataclasses.dataclass(frozen=True)
class _CacheLayout:
    names: list[tuple[str, str]]  # (past input, present output) per tensor, in layer order
    dtype: np.dtype
    shape: tuple[int, int]  # (kv_heads, head_dim)


def _cache_layout(engine: Engine) -> _CacheLayout | None:
    specs = {s.name: s for s in engine.input_specs}
    for name in ("input_ids", "attention_mask", "position_ids"):
        if name not in specs:
            raise UnsupportedModelError(
                f"{engine.model_path}: no {name!r} input; generate needs a model written by `layerzero export` "
                f"(its inputs are {', '.join(specs)})"
            )
    if "logits" not in engine.output_names:
        raise UnsupportedModelError(f"{engine.model_path}: no 'logits' output (outputs: {engine.output_names})")
    past = sorted(
        ((int(m[1]), m[2], n) for n in specs if (m := _PAST.match(n))), key=lambda t: (t[0], t[1] != "key")
    )
    if not past:
        return None
    names, outputs = [], set(engine.output_names)
    for layer, kind, name in past:
        present = f"present.{layer}.{kind}"
        if present not in outputs:
            raise UnsupportedModelError(f"{engine.model_path}: input {name!r} has no {present!r} output")
        names.append((name, present))
    spec = specs[past[0][2]]
    shape = spec.shape or ()
    if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
        raise UnsupportedModelError(
            f"{engine.model_path}: {spec.name!r} should be [batch, kv_heads, past, head_dim] with static heads "
            f"and head_dim, it is {spec.describe()}"
        )
    return _CacheLayout(names, spec.dtype, (shape[1], shape[3]))


def export_metadata(engine: Engine) -> dict[str, Any]:
    """What ``layerzero export`` recorded in the model's metadata (eos ids, vocab size, ...); {} when none."""
    import onnx

    model = onnx.load(str(engine.model_path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == GENERATE_META_KEY:
            try:
                meta = json.loads(prop.value)
            except ValueError:
                meta = None
            if isinstance(meta, dict):
                return meta
            logger.warning("%s: malformed %s metadata", engine.model_path, GENERATE_META_KEY)
    return {}


def stop_tokens_of(engine: Engine) -> list[int]:
    """The eos ids ``layerzero export`` recorded in the model's metadata (empty when none)."""
    ids = export_metadata(engine).get("eos_token_id") or []
    return [int(i) for i in ids] if isinstance(ids, list) else []


def generate(
    engine: Engine,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    on_token: Callable[[int], None] | None = None,
    masks: bool = False,
) -> Generation:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (see the module doc).

    Args:
        stop_tokens: Ids that end generation; None uses the eos ids recorded by ``layerzero export``;
            ``()`` never stops early.
        on_token: Called with each new id as soon as it is chosen (streaming).
        masks: Keep each step's per-path masks in ``report.steps[i].masks``.

    Raises:
        InvalidInputError: an empty prompt, an id outside the vocabulary, or a bad sampling option.
        UnsupportedModelError: the model is not a causal LM export (inputs/outputs named as above).
    """
    prompt = [int(i) for i in prompt_ids]
    if not prompt:
        raise InvalidInputError("the prompt is empty: give at least one token id")
    if max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if temperature < 0 or not np.isfinite(temperature):
        raise InvalidInputError(f"temperature={temperature}: must be a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise InvalidInputError(f"top_k={top_k}: must be >= 0 (0 = off)")
    if not 0 < top_p <= 1:
        raise InvalidInputError(f"top_p={top_p}: must be in (0, 1] (1 = off)")
    layout = _cache_layout(engine)
    meta = export_metadata(engine)
    vocab = meta.get("vocab_size")
    if isinstance(vocab, int) and any(not 0 <= i < vocab for i in prompt):
        bad = next(i for i in prompt if not 0 <= i < vocab)
        raise InvalidInputError(f"prompt token id {bad} is outside the vocabulary [0, {vocab}) of {engine.model_path}")
    eos = meta.get("eos_token_id") or []
    stops = set((int(t) for t in eos) if stop_tokens is None else (int(t) for t in stop_tokens))
    rng = np.random.default_rng(seed)

    template = engine.report_template()
    steps: list[StepReport] = []
    always_skipped: set[str] | None = None  # dynamic paths no step ran
    new: list[int] = []
    past: dict[str, np.ndarray] = {}
    if layout is not None:
        heads, head_dim = layout.shape
        past = {p: np.zeros((1, heads, 0, head_dim), dtype=layout.dtype) for p, _ in layout.names}
    stop_reason = "max_new_tokens"
    start = time.perf_counter()
    first_token_at = start
    while len(new) < max_new_tokens:
        sequence = prompt + new
        if layout is None:  # single pass: the whole sequence every step
            run_ids, offset = sequence, 0
        else:
            run_ids, offset = (prompt if not new else new[-1:]), len(sequence) - (len(prompt) if not new else 1)
        feeds: dict[str, np.ndarray] = {
            "input_ids": np.asarray([run_ids], dtype=np.int64),
            "attention_mask": np.ones((1, offset + len(run_ids)), dtype=np.int64),
            "position_ids": np.arange(offset, offset + len(run_ids), dtype=np.int64)[None, :],
            **past,
        }
        step_start = time.perf_counter()
        result = engine.run(feeds, masks=True)
        logits = result.outputs["logits"]
        if logits.ndim != 3 or logits.shape[:2] != (1, len(run_ids)):
            raise UnsupportedModelError(
                f"{engine.model_path}: logits have shape {list(logits.shape)}, expected [1, {len(run_ids)}, vocab]"
            )
        token = _choose(logits[0, -1], temperature, top_k, top_p, rng)
        seconds = time.perf_counter() - step_start
        if layout is not None:
            past = {p: result.outputs[q] for p, q in layout.names}
        report = result.report
        skipped = set(report.skipped_paths)
        always_skipped = skipped if always_skipped is None else always_skipped & skipped
        steps.append(
            StepReport(
                tokens=len(run_ids),
                token_id=token,
                seconds=seconds,
                skipped_paths=list(report.skipped_paths),
                masks={k: np.asarray(v).astype(int).tolist() for k, v in report.masks.items()} if masks else {},
            )
        )
        if not new:
            first_token_at = time.perf_counter()
        new.append(token)
        if on_token is not None:
            on_token(token)
        if token in stops:
            stop_reason = "stop_token"
            break
    end = time.perf_counter()
    total = end - start
    decode_time = end - first_token_at
    generation_report = GenerateReport(
        prompt_tokens=len(prompt),
        new_tokens=len(new),
        stop_reason=stop_reason,
        time_to_first_token_s=first_token_at - start,
        total_s=total,
        tokens_per_s=len(new) / total if total > 0 else 0.0,
        decode_tokens_per_s=(len(new) - 1) / decode_time if len(new) > 1 and decode_time > 0 else None,
        cache=layout is not None,
        total_layers=template.total_layers,
        zeroed_layers=template.zeroed_layers,
        zeroed_paths=list(template.zeroed_paths),
        zeroed_params_ratio=template.zeroed_params_ratio,
        skipped_paths=sorted(always_skipped or ()),
        steps=steps,
    )
    return Generation(ids=new, prompt_ids=prompt, report=generation_report)


def _choose(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """Greedy or sampled next token from one position's logits (see the module doc)."""
    if temperature == 0:
        return int(np.argmax(logits))
    scores = logits.astype(np.float64) / temperature
    if 0 < top_k < scores.size:
        kth = np.partition(scores, -top_k)[-top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep a token while the probability before it is below top_p: the smallest set reaching top_p.
        keep = order[np.concatenate(([True], cumulative[:-1] < top_p))]
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    return int(rng.choice(probs.size, p=probs))
