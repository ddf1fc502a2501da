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

Generation stops after ``max_new_tokens``, when a stop token is produced (it is kept in ``ids``, as
transformers does) or at ``max_tokens`` tokens per sequence (the guard's ``max_tokens`` when the engine is a
``GuardedEngine``). A batch of prompts is left-padded under ``attention_mask`` with position ids counting
each row's real tokens, as transformers' batched ``generate``; each row stops on its own. In a batch, a step's
``skipped_paths`` and masks are the batch's (a path is skipped when no row's token ran it; ``batch_rows`` in each
report says how many rows shared them), a row's ``steps`` are the steps it took (a row that stopped early has
fewer) and its ``skipped_paths`` are the batch's over those steps; ``tokens_per_s`` is per row: the batch's
throughput is the sum over rows. A row padded by a number of columns that is not a multiple of 4 is not its solo
run bit for bit (ONNX Runtime's Softmax and MatMul over the padded axis sum it in another order: ~1e-6 on float32
logits, ~3e-2 on int4 / int8 ones, where greedy ids can differ); the continuous batcher keeps paddings aligned
(runtime/batcher.py ``PAD_ALIGN``), a batch of prompts given at once cannot.

The loop: an ``Engine`` running ONNX Runtime on the CPU is driven through one IO binding per request
(``_BoundSteps``): the presents stay ONNX Runtime values bound as the next step's past, the feeds are validated on
the first step only, and the ids, mask and positions of every step are views of buffers allocated once. A
``GuardedEngine``, another backend or device, and a single-pass model go through ``run`` each step
(``_PlainSteps``); both give the same tokens, skipped paths and masks.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from layerzero.contract import MASK_PREFIX
from layerzero.errors import InvalidInputError, LayerZeroError, UnsupportedModelError
from layerzero.runtime.cache_layout import CacheLayout, cache_layout
from layerzero.runtime.report import GenerateReport, Generation, StepReport, StepSkips

if TYPE_CHECKING:
    from layerzero.runtime.engine import Engine
    from layerzero.runtime.guard import GuardedEngine

__all__ = [
    "GENERATE_META_KEY",
    "CacheLayout",
    "GenerateReport",
    "Generation",
    "StepReport",
    "cache_layout",
    "choose_token",
    "export_metadata",
    "generate",
    "stop_tokens_of",
]

logger = logging.getLogger(__name__)

#: The model metadata entry ``layerzero export`` writes (JSON: eos_token_id, layers, ...).
GENERATE_META_KEY = "layerzero.generate"

# One step's logits, the paths it skipped and its masks by path (or, for both, a function that finds them: called
# after the last step, or at once when the masks are asked for).
_Step = tuple[np.ndarray, "list[str] | Callable[[], tuple[list[str], dict[str, np.ndarray]]]", dict[str, np.ndarray]]
# (session, binding, bind a numpy input, the outputs' device) as ``_BoundSteps._run`` calls them.
_BindingEnds = tuple[Any, Any, Any, Any]


class _Steps(Protocol):
    """Runs one forward pass of the decode loop: the step's ids, mask and positions in; its logits, skipped paths
    and masks out."""

    def __call__(self, feeds: dict[str, np.ndarray]) -> _Step: ...


class _PlainSteps:
    """Every step through ``run`` (``Engine.run`` or the guard's): the presents come back as numpy arrays and are
    fed as the next step's past. For a guard, a backend other than ONNX Runtime on the CPU, a single-pass model."""

    def __init__(self, run: Callable[..., Any], layout: CacheLayout | None, batch: int) -> None:
        self._run = run
        self._layout = layout
        self._past: dict[str, np.ndarray] = {}
        if layout is not None:
            self._past = layout.empty(batch)

    def __call__(self, feeds: dict[str, np.ndarray]) -> _Step:
        result = self._run({**feeds, **self._past}, masks=True)
        if self._layout is not None:
            self._past = {p: result.outputs[q] for p, q in self._layout.names}
        return result.outputs["logits"], result.report.skipped_paths, result.report.masks


class _BoundSteps:
    """ONNX Runtime on the CPU through one IO binding per request.

    The first step's feeds are validated as ``Engine.run`` does (a wrong dtype or dim is an ``InvalidInputError``);
    then each step binds its three small inputs and the previous step's presents, which stay ONNX Runtime values
    (no numpy array of the cache is made, no copy of it is fed back). The outputs are bound to the CPU and
    allocated by the session: an exported graph writes each present with a ``Concat(past, new)`` of its own. A
    bundle whose attention is liblayerzero_ort.so's op and whose graph reads the past's length from the mask
    (``CACHE_BUFFER_META_KEY``, ``--linear-kernel native``) gets one buffer of ``capacity`` rows per past / present
    pair instead, bound as both: each step writes only its new rows into it (no copy of the cache a step;
    ``LAYERZERO_KV_BUFFER=0`` turns it off). Only the logits (one row per position) and the masks become numpy
    arrays.
    """

    def __init__(self, engine: Engine, layout: CacheLayout, batch: int, capacity: int | None = None) -> None:
        backend = engine.backend
        self._engine = engine
        self._session = backend.session  # type: ignore[attr-defined]
        self._run_options = _step_run_options(getattr(backend, "_run_options", None))
        self._label = str(engine.model_path)
        self._layout = layout
        self._outputs = list(backend.output_names)
        self._binding = self._session.io_binding()
        self._empty_past = layout.empty(batch)
        self._first = True
        index = {name: i for i, name in enumerate(self._outputs)}
        self._presents = [(past, index[present]) for past, present in layout.names]
        presents = {i for _, i in self._presents}
        self._arrays = [(name, i) for i, name in enumerate(self._outputs) if i not in presents]
        direct = _direct_binding(self._session, self._binding)
        self._ends: _BindingEnds = (
            (direct[0], direct[1], direct[1].bind_input, direct[2])
            if direct is not None
            else (self._session, self._binding, self._binding.bind_cpu_input, "cpu")
        )
        self._bound: dict[str, np.ndarray] = {}  # the numpy inputs bound by address, alive until rebound
        self._skips = StepSkips(self._outputs, engine.dynamic_index, MASK_PREFIX)
        # The cache buffers (numpy arrays, and the ONNX Runtime values over their memory bound as past and present)
        self._buffers: dict[str, np.ndarray] = {}
        self._buffer_values: dict[str, Any] = {}
        if capacity is not None and _cache_buffers_allowed(self._session):
            import onnxruntime as ort

            for past, _ in layout.names:
                array = layout.zeros(past, batch, capacity)
                value = ort.OrtValue.ortvalue_from_numpy(array)
                self._buffers[past] = array
                self._buffer_values[past] = value._ortvalue if direct is not None else value
        # Each output's binding: its cache buffer, or None (allocated by the session on the CPU).
        buffers = {present: self._buffer_values.get(past) for past, present in layout.names}
        self._plan = [(name, buffers.get(name)) for name in self._outputs]
        # With buffers the outputs keep their shapes from one decode step to the next: bound once, the session writes
        # the same values again (each step's numpy arrays are copies); rebound when the step's token count changes.
        self._bound_tokens = -1
        # A bundle whose every mask is an activation group's (``StepSkips.activation_only``): a step needs none of
        # them unless its masks are asked for (``_activation_masks``, read before the next step). Converting its 64
        # masks and building a whole report each step cost ~0.65 ms of a 20-27 ms Llama-1B int4 step (ONNX Runtime's
        # profile: the loop around run 0.92 ms against the dense bundle's 0.26).
        self._activation_masks_at = (
            [(path, index[name]) for name, path in zip(self._skips.masks, self._skips.paths, strict=True)]
            if self._skips.activation_only
            else []
        )
        # What a step converts to numpy: the logits and the masks when StepSkips reads them, the logits alone for
        # activation masks, else every output.
        lean = (
            {"logits", *self._skips.masks}
            if self._skips.applies
            else ({"logits"} if self._skips.activation_only else None)
        )
        self._lean_arrays = [(n, i) for n, i in self._arrays if lean is None or n in lean]

    def __call__(self, feeds: dict[str, np.ndarray]) -> _Step:
        if self._first:
            arrays = self._engine.validate_feeds({**feeds, **self._empty_past})
            self._first = False
            if self._buffers:  # the buffers are the pasts from the start (0 rows in use: the mask says so)
                arrays = {k: v for k, v in arrays.items() if k not in self._buffers}
                for past, value in self._buffer_values.items():
                    self._ends[1].bind_ortvalue_input(past, value)
        else:
            arrays = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
        try:
            values = self._run(arrays)
        except Exception as e:
            from layerzero.ort_runner import first_line

            kind = InvalidInputError if type(e).__name__ == "InvalidArgument" else LayerZeroError
            raise kind(f"onnxruntime failed to run {self._label}: {first_line(e)}") from e
        if self._skips.activation_only:
            return values["logits"], self._activation_masks, {}
        # Where StepSkips applies, the masks side by side (one copy: the numpy arrays of bound outputs are views that
        # the next step overwrites) and what they skipped found after the loop: one numpy call a step instead of a
        # handful, on caches the step has just flushed (~0.07 ms a 2.5 ms int4 step here).
        side = self._skips.side(values)
        if side is not None:
            return values["logits"], lambda: self._skips.from_side(side), {}
        lean = self._skips(values)
        if lean is not None:
            return values["logits"], lean[0], lean[1]
        if len(values) < len(self._arrays):  # the outputs the lean path left in ONNX Runtime
            outputs = self._ends[1].get_outputs()
            values = {name: outputs[i].numpy() for name, i in self._arrays}
        report = self._engine.result_from(values, masks=True).report
        return values["logits"], report.skipped_paths, report.masks

    def _activation_masks(self) -> tuple[list[str], dict[str, np.ndarray]]:
        """The last step's skipped paths (none: activation masks skip no path) and its masks by path, as the
        report's ``masks``; valid until the next step overwrites the outputs (generate calls it at once when masks
        are asked for, else after the loop, for the paths alone)."""
        outputs = self._ends[1].get_outputs()
        return [], {path: outputs[i].numpy() for path, i in self._activation_masks_at}

    def _run(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step on the binding's ends (``_BindingEnds``): the C objects where ``_direct_binding`` finds them
        (the public wrapper's per-call Python checks skipped: ~0.2 ms of a ~5 ms int4 decode step, measured
        here), the public ``IOBinding`` otherwise."""
        session, binding, bind_input, device = self._ends
        bound = self._bound
        for name, value in arrays.items():
            bind_input(name, value)
            bound[name] = value  # ONNX Runtime reads the array's buffer: keep it alive while it is bound
        # The session allocates fresh outputs each run: the presents bound as this step's past stay valid. With cache
        # buffers each present is its past's buffer, bound once as both, and the other outputs stay bound while the
        # step's token count (their shapes) does not change.
        tokens = arrays["input_ids"].shape[-1] if "input_ids" in arrays else -2
        if not self._buffers or tokens != self._bound_tokens:
            binding.clear_binding_outputs()
            for name, buffer in self._plan:
                if buffer is not None:
                    binding.bind_ortvalue_output(name, buffer)
                else:
                    binding.bind_output(name, device)
            self._bound_tokens = tokens if self._buffers else -1
        session.run_with_iobinding(binding, self._run_options)
        values = binding.get_outputs()
        if not self._buffers:
            for past, i in self._presents:
                binding.bind_ortvalue_input(past, values[i])
                bound.pop(past, None)
        return {name: values[i].numpy() for name, i in self._lean_arrays}


def _direct_binding(session: Any, binding: Any) -> tuple[Any, Any, Any] | None:
    """``(C session, C binding, C CPU device)`` behind onnxruntime's Python ``IOBinding`` (its ``_sess``,
    ``_iobinding`` and ``OrtDevice._get_c_device()``), or None when this onnxruntime has not got them: then the
    public API runs the steps (the same calls, a few Python checks more)."""
    try:
        from onnxruntime import OrtDevice

        c_session, c_binding = session._sess, binding._iobinding
        device = OrtDevice.make("cpu", 0)._get_c_device()
        needed = [(c_session, "run_with_iobinding")] + [
            (c_binding, m)
            for m in ("bind_input", "bind_output", "bind_ortvalue_input", "bind_ortvalue_output",
                      "clear_binding_outputs", "get_outputs")
        ]  # fmt: skip
        return (c_session, c_binding, device) if all(callable(getattr(o, m, None)) for o, m in needed) else None
    except (AttributeError, ImportError, TypeError):
        return None


def _cache_buffers_allowed(session: Any) -> bool:
    """Whether the bundle lets each past be a cache buffer (``CACHE_BUFFER_META_KEY``) and ``LAYERZERO_KV_BUFFER``
    is not 0."""
    from layerzero.contract import CACHE_BUFFER_META_KEY

    if os.environ.get("LAYERZERO_KV_BUFFER", "1").strip() == "0":
        return False
    try:
        return session.get_modelmeta().custom_metadata_map.get(CACHE_BUFFER_META_KEY) == "1"
    except Exception:  # an onnxruntime without the model's metadata: the plain steps
        return False


def _step_run_options(base: Any) -> Any:
    """The decode steps' run options: the backend's (its log level), with ``gpu_graph_id`` set to -1 (no graph
    capture, which the CPU provider does not do anyway). ONNX Runtime's ``run_with_iobinding`` looks that entry up
    on every run, and a missing entry costs a raised and caught C++ exception: ~80 µs a step, measured here."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = getattr(base, "log_severity_level", 4) if base is not None else 4
    options.add_run_config_entry("gpu_graph_id", "-1")
    return options


def _bindable(engine: Engine) -> bool:
    """Whether the decode loop can drive ``engine`` through an IO binding: ONNX Runtime running on the CPU."""
    backend = engine.backend
    if getattr(backend, "name", None) != "onnxruntime" or not hasattr(backend, "session"):
        return False
    return list(backend.providers)[:1] == ["CPUExecutionProvider"]


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
    engine: Engine | GuardedEngine,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    on_token: Callable[[int], None] | None = None,
    on_step: Callable[[list[int | None]], None] | None = None,
    masks: bool = False,
    max_tokens: int | None = None,
    pad_token_id: int | None = None,
) -> Generation | list[Generation]:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (see the module doc).

    ``prompt_ids`` is one prompt (a list of ids: returns a ``Generation``) or a batch of prompts (a list of
    lists: returns one ``Generation`` per prompt, in order). A batch runs as one tensor: prompts are padded
    on the left with ``pad_token_id`` (default: the export's pad id, else its first eos id, else 0) under
    ``attention_mask`` 0, position ids count each row's real tokens (pads at 0), as transformers' batched
    ``generate`` does; each row stops on its own and a finished row is fed pads until every row is done.

    Args:
        engine: An ``Engine``, or a ``GuardedEngine`` (every step goes through the guard: its kill switch and
            sampling apply, and its ``max_tokens`` caps the request as ``max_tokens`` below).
        stop_tokens: Ids that end generation; None uses the eos ids recorded by ``layerzero export``;
            ``()`` never stops early.
        on_token: Called with each new id as soon as it is chosen (streaming; one prompt only).
        on_step: Called after each step with each row's new id, None for a row that had already finished
            (streaming a batch).
        masks: Keep each step's per-path masks in ``report.steps[i].masks``.
        max_tokens: At most this many tokens per sequence, prompt included: a longer prompt is an error,
            generation stops there (``stop_reason`` ``"max_tokens"``). None: the guard's, else no cap.

    Raises:
        InvalidInputError: an empty prompt, an id outside the vocabulary, a prompt over ``max_tokens``, or a bad
            sampling option.
        UnsupportedModelError: the model is not a causal LM export (inputs/outputs named as above).
    """
    from layerzero.runtime.guard import GuardedEngine

    guard = engine if isinstance(engine, GuardedEngine) else None
    base: Engine = guard.engine if guard is not None else engine
    single = not prompt_ids or not isinstance(prompt_ids[0], (Sequence, np.ndarray))
    prompts = [[int(i) for i in p] for p in ([prompt_ids] if single else prompt_ids)]
    if not prompts or any(not p for p in prompts):
        raise InvalidInputError("the prompt is empty: give at least one token id")
    if on_token is not None and len(prompts) > 1:
        raise InvalidInputError("on_token streams one prompt; a batch returns its ids at the end")
    if max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if temperature < 0 or not np.isfinite(temperature):
        raise InvalidInputError(f"temperature={temperature}: must be a finite number >= 0 (0 = greedy)")
    if top_k < 0:
        raise InvalidInputError(f"top_k={top_k}: must be >= 0 (0 = off)")
    if not 0 < top_p <= 1:
        raise InvalidInputError(f"top_p={top_p}: must be in (0, 1] (1 = off)")
    if max_tokens is None and guard is not None:
        max_tokens = guard.config.max_tokens
    if max_tokens is not None:
        longest = max(len(p) for p in prompts)
        if longest >= max_tokens:
            raise InvalidInputError(
                f"the prompt has {longest} tokens, the limit is max_tokens={max_tokens} tokens per sequence "
                f"(prompt and new tokens) for {base.model_path}: shorten the prompt"
            )
    layout = cache_layout(base)
    meta = export_metadata(base)
    vocab = meta.get("vocab_size")
    for prompt in prompts:
        if isinstance(vocab, int) and any(not 0 <= i < vocab for i in prompt):
            bad = next(i for i in prompt if not 0 <= i < vocab)
            raise InvalidInputError(
                f"prompt token id {bad} is outside the vocabulary [0, {vocab}) of {base.model_path}"
            )
    eos = meta.get("eos_token_id") or []
    stops = set((int(t) for t in eos) if stop_tokens is None else (int(t) for t in stop_tokens))
    if pad_token_id is None:
        pad = meta.get("pad_token_id")
        pad_token_id = int(pad) if isinstance(pad, int) else (int(eos[0]) if eos else 0)
    rng = np.random.default_rng(seed)
    run = guard.run if guard is not None else base.run

    batch, width = len(prompts), max(len(p) for p in prompts)
    # Left padding: every row's last prompt token is the last column, so one step's logits[:, -1] serve all.
    prompt_ids_2d = np.full((batch, width), pad_token_id, dtype=np.int64)
    prompt_mask = np.zeros((batch, width), dtype=np.int64)
    for r, prompt in enumerate(prompts):
        prompt_ids_2d[r, width - len(prompt) :] = prompt
        prompt_mask[r, width - len(prompt) :] = 1
    # As transformers: positions count the real tokens, pads sit at 0.
    prompt_positions = np.where(prompt_mask == 1, np.cumsum(prompt_mask, axis=1) - 1, 0)
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)

    template = base.report_template()
    steps: list[list[StepReport]] = [[] for _ in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    stop_reason = ["max_new_tokens"] * batch
    # Every token of the request in one buffer (prompt, then the columns fed after it: pads for finished rows),
    # and the mask beside it: a step feeds views of them, nothing is concatenated per token.
    all_ids = np.full((batch, width + max_new_tokens), pad_token_id, dtype=np.int64)
    all_ids[:, :width] = prompt_ids_2d
    all_mask = np.ones((batch, width + max_new_tokens), dtype=np.int64)
    all_mask[:, :width] = prompt_mask
    all_positions = np.zeros((batch, width + max_new_tokens), dtype=np.int64)
    all_positions[:, :width] = prompt_positions
    all_positions[:, width:] = lengths[:, None] + np.arange(max_new_tokens, dtype=np.int64)[None, :]
    stepper: _Steps = (
        _BoundSteps(base, layout, batch, capacity=width + max_new_tokens)
        if guard is None and layout is not None and _bindable(base)
        else _PlainSteps(run, layout, batch)
    )
    # Steps whose skipped paths are found after the loop (``_BoundSteps``: no numpy work between two steps for them).
    deferred: list[tuple[Callable[[], tuple[list[str], Any]], list[StepReport]]] = []
    start = time.perf_counter()
    first_token_at = start
    step = 0
    while step < max_new_tokens and not all(done):
        seen = width + step  # tokens the model has seen after this step's input
        # The prefill and a single-pass model (no cache) run the whole sequence; a cached step its last token.
        lo = 0 if layout is None or step == 0 else seen - 1
        run_ids = all_ids[:, lo:seen]
        feeds = {
            "input_ids": run_ids,
            "attention_mask": all_mask[:, :seen],
            "position_ids": all_positions[:, lo:seen],
        }
        step_start = time.perf_counter()
        logits, skipped, step_arrays = stepper(feeds)
        if logits.ndim != 3 or logits.shape[:2] != run_ids.shape:
            raise UnsupportedModelError(
                f"{base.model_path}: logits have shape {list(logits.shape)}, expected "
                f"[{batch}, {run_ids.shape[1]}, vocab]"
            )
        tokens = [choose_token(logits[r, -1], temperature, top_k, top_p, rng) for r in range(batch)]
        seconds = time.perf_counter() - step_start
        later = callable(skipped)
        if later and masks:  # the masks asked for: found now
            skipped, step_arrays = skipped()  # type: ignore[operator]
            later = False
        step_masks = {k: np.asarray(v).astype(int).tolist() for k, v in step_arrays.items()} if masks else {}
        if step == 0:
            first_token_at = time.perf_counter()
        was_done = list(done)
        reports: list[StepReport] = []
        for r, token in enumerate(tokens):
            if done[r]:
                continue  # a finished row is fed a pad, as transformers does; its token is not kept
            all_ids[r, seen] = token
            new[r].append(token)
            report = StepReport(
                tokens=int(run_ids.shape[1]),
                token_id=token,
                seconds=seconds,
                skipped_paths=[] if later else list(skipped),  # type: ignore[arg-type]
                masks=step_masks,
            )
            steps[r].append(report)
            reports.append(report)
            if on_token is not None:
                on_token(token)
            if token in stops:
                done[r], stop_reason[r] = True, "stop_token"
            elif max_tokens is not None and len(prompts[r]) + len(new[r]) >= max_tokens:
                done[r], stop_reason[r] = True, "max_tokens"
        if later:
            deferred.append((skipped, reports))  # type: ignore[arg-type]
        if on_step is not None:
            on_step([None if finished else token for finished, token in zip(was_done, tokens, strict=True)])
        step += 1
    end = time.perf_counter()
    for find, reports in deferred:
        paths, _ = find()
        for report in reports:
            report.skipped_paths = list(paths)
    total = end - start
    decode_time = end - first_token_at
    out = []
    for r, prompt in enumerate(prompts):
        n = len(new[r])
        generation_report = GenerateReport(
            prompt_tokens=len(prompt),
            new_tokens=n,
            stop_reason=stop_reason[r],
            time_to_first_token_s=first_token_at - start,
            total_s=total,
            tokens_per_s=n / total if total > 0 else 0.0,
            decode_tokens_per_s=(n - 1) / decode_time if n > 1 and decode_time > 0 else None,
            cache=layout is not None,
            total_layers=template.total_layers,
            zeroed_layers=template.zeroed_layers,
            zeroed_paths=list(template.zeroed_paths),
            zeroed_params_ratio=template.zeroed_params_ratio,
            # Skipped on every step this row took (a row that stopped early is not judged by later steps).
            skipped_paths=sorted(set.intersection(*(set(s.skipped_paths) for s in steps[r])) if steps[r] else ()),
            steps=steps[r],
            removed_scopes=list(template.removed_scopes),
            batch_rows=batch,
        )
        out.append(Generation(ids=new[r], prompt_ids=prompt, report=generation_report))
    return out[0] if single else out


def choose_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
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
