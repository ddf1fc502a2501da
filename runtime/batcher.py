"""Continuous batching: concurrent generations share decode steps.

    batcher = ContinuousBatcher(engine_or_guard, max_batch=8, max_queue=64)
    with batcher:                                    # one scheduler thread
        ticket = batcher.submit(GenerationRequest([1, 2, 3], max_new_tokens=16))
        generation = ticket.result()                 # the same Generation as runtime.generate returns

A request waits in a bounded queue (``QueueFull`` past ``max_queue``: the server answers 503) until the running
batch has room (``max_batch`` rows); it then runs its prefill alone (its prompt, an empty past: exactly what it
runs alone), and joins the batch at one of the next ``PAD_ALIGN`` decode steps (below). Every decode step runs
one token of every active row as one batch: the rows' caches are one tensor per layer, left-padded to the longest
past under ``attention_mask`` 0, position ids counting each row's own tokens, as transformers' batched
``generate``. A row leaves when it finishes (its stop token, ``max_new_tokens``, ``max_tokens``, its ``on_token``
callback answering True — a stop string —, or a cancel); columns no remaining row attends to are cut from the front
of the cache.

Each request keeps its own sampling options (temperature, top-k, top-p, a generator seeded by its ``seed``) and stop
condition; a greedy request gets the ids it gets alone (tests/generate/test_batcher.py), and every decode step's
logits of a row are bit for bit those of its solo step at the same kernel path, float32, int4 and int8 bundles alike
(tests/generate/test_batcher_exact.py; the kernel path below). That takes aligned padding: ONNX Runtime's CPU
Softmax and MatMul over the cache axis (the attention's softmax and its product with V) sum a row in another order
when it is shifted by masked leading columns, unless the shift is a multiple of ``PAD_ALIGN`` (4; measured: a shift
of 1-3 columns changes the logits by ~1e-6 in float32, ~3e-2 in int4 / int8, where MatMulNBits' accuracy level 4
rounds each activation block to int8 and a last-bit change flips codes; greedy ids then differ). So every row's
padding is kept a multiple of ``PAD_ALIGN``: a prefilled request joins the batch at the first step where its length
is congruent to the batch's width modulo ``PAD_ALIGN`` (it waits at most ``PAD_ALIGN - 1`` steps, its first token
already streamed), and a leaving row's cut drops a multiple of ``PAD_ALIGN`` columns. Whether MatMulNBits gives a
row the same bits alone (M = 1) as in a batch (M >= 2) depends on the CPU's kernel, not on the batcher: on x86-64
AVX-512 at accuracy level 4 it does (measured; at levels 0 / 1 not: 1e-5), on AVX2 (AMD EPYC, measured) it does not
at any level (~6e-6 on one matrix, ~2e-6 on the test model's int4 logits; rows at M = 2-8 equal each other), and
there a quantized request's greedy ids batched can differ from its solo ids at a near-tie. The test checks every
batched step bit for bit against the request alone at the batch's kernel path (two identical rows), and the ids
against solo generate where the installed runtime's two paths agree (a skip naming the difference where not). Making
them agree would take running every solo decode step as two rows (measured on AVX2: a [2048, 8192] int4 MatMulNBits
takes 0.78 ms at M = 2 against 0.61 at M = 1); it is not done.

The cache: the exported graph writes each present with its own ``Concat(past, new)``, so every step copies the
whole cache once inside ONNX Runtime (also when one request runs alone); the batcher adds a copy of the cache
only when a row joins (padding it in) or leaves (dropping its row), not per step (the presents ``run`` returns
are fed back as they are: measured, ``session.run`` of a 134 MB Concat takes no longer than the same run
through an IO binding, so no copy is made turning outputs into numpy arrays). The graph does not
allow growing in place: ONNX Runtime's Concat always writes a new buffer and may not be bound to an output that
aliases its input, and the interface (past in, present out) has no write position for a max-length buffer; that
takes a rewrite to ``com.microsoft.GroupQueryAttention`` (``past_present_share_buffer``), attention fusion's work.
What it costs (bench/kv_cache.py, bench/README.md): at 2,048 tokens of context the present Concats write 33.6 MB a
row per step at serve_batch's ``l3`` size and 134 MB at ``1b``: 3-7% of the step at 1 row, 8-12% at 8 rows
(measured on a loaded machine, 1b and l3); the export's ``repeat_kv`` Expand and key Transpose copy 4x and 2x that
again, and all cache-length work is 37-51% of the step at 1 row, 82-87% at 8 rows.
``step_seconds - run_seconds`` is the batcher's own work per step (feeds, sampling, callbacks, cuts): 6.7 ms of a
1.3 s step at serve_batch's ``1b`` size (0.5%).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from layerzero.errors import InvalidInputError, LayerZeroError, UnsupportedModelError
from layerzero.runtime.generate import (
    GenerateReport,
    Generation,
    StepReport,
    cache_layout,
    choose_token,
    export_metadata,
)

if TYPE_CHECKING:
    from layerzero.runtime.engine import Engine
    from layerzero.runtime.guard import GuardedEngine

__all__ = ["PAD_ALIGN", "ContinuousBatcher", "GenerationRequest", "QueueFull", "Ticket"]

#: Every row's left padding in the batch's cache is a multiple of this many columns (see the module doc: a row
#: joins when its length is congruent to the batch's width, a cut keeps the multiple). ONNX Runtime 1.32's CPU
#: Softmax and MatMul reducing over the cache axis give a row's own result bit for bit under leading masked
#: columns only when they are a multiple of 4 (measured on x86-64 AVX-512: pads 4, 8, ..., 32 exact at lengths 9
#: to 2,049, every other pad not; tests/generate/test_batcher_exact.py checks it on the installed runtime).
PAD_ALIGN = 4

logger = logging.getLogger(__name__)


class QueueFull(LayerZeroError):
    """The batcher's queue holds ``max_queue`` requests already (a server answers 503)."""


@dataclasses.dataclass
class GenerationRequest:
    """One generation: its prompt, sampling options and stop condition.

    ``on_token(id)`` is called with each new id as it is chosen (streaming); returning True ends the request
    there (``stop_reason`` ``"stop"``: the caller's own condition, e.g. a stop string). ``on_done()`` is called
    once when it has finished or failed (a streaming caller's wake-up). Both run in the batcher's thread.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: Sequence[int] | None = None  # None: the export's eos ids
    max_tokens: int | None = None  # prompt + new tokens
    on_token: Callable[[int], bool | None] | None = None
    on_done: Callable[[], None] | None = None  # called once the request has finished (or failed)


class Ticket:
    """A submitted request: ``result()`` waits for its ``Generation`` (or raises its error); ``cancel()`` ends it
    at the next step (``stop_reason`` ``"cancelled"``)."""

    def __init__(self, request: GenerationRequest, prompt: list[int]) -> None:
        self.request = request
        self.prompt = prompt
        self.submitted = time.perf_counter()
        self._done = threading.Event()
        self._generation: Generation | None = None
        self._error: BaseException | None = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Generation:
        if not self._done.wait(timeout):
            raise TimeoutError("the generation did not finish in time")
        if self._error is not None:
            raise self._error
        assert self._generation is not None
        return self._generation

    def _finish(self, generation: Generation | None, error: BaseException | None = None) -> None:
        self._generation, self._error = generation, error
        self._done.set()
        if self.request.on_done is not None:
            try:
                self.request.on_done()
            except Exception:  # the caller's callback must not stop the batch
                logger.debug("on_done failed", exc_info=True)


@dataclasses.dataclass
class _Row:
    """An active request's state in the batch."""

    ticket: Ticket
    rng: np.random.Generator
    stops: set[int]
    new: list[int]
    steps: list[StepReport]
    started: float  # when its prefill began
    first_token_at: float
    stop_reason: str = ""
    skipped: set[str] | None = None  # dynamic paths no step of this request ran
    batch_rows: int = 1  # the most rows a step of this request ran with


@dataclasses.dataclass
class _Waiting:
    """A prefilled row waiting to join the batch: its cache ([1, heads, length, head_dim] per past input)."""

    row: _Row
    present: dict[str, np.ndarray]
    length: int


class ContinuousBatcher:
    """Runs generation requests on one engine, batching their decode steps (see the module doc)."""

    def __init__(self, engine: Engine | GuardedEngine, *, max_batch: int = 8, max_queue: int = 64) -> None:
        from layerzero.runtime.guard import GuardedEngine

        if max_batch < 1 or max_queue < 0:
            raise InvalidInputError(f"max_batch={max_batch}, max_queue={max_queue}: need max_batch >= 1, queue >= 0")
        self._guard = engine if isinstance(engine, GuardedEngine) else None
        self.engine: Engine = self._guard.engine if self._guard is not None else engine
        self._run = self._guard.run if self._guard is not None else self.engine.run
        layout = cache_layout(self.engine)
        if layout is None:
            raise UnsupportedModelError(
                f"{self.engine.model_path}: continuous batching needs a KV-cache export (`layerzero export` "
                "without --no-cache)"
            )
        self._layout = layout
        meta = export_metadata(self.engine)
        vocab = meta.get("vocab_size")
        self.vocab_size = vocab if isinstance(vocab, int) else None
        self.eos = [int(t) for t in meta.get("eos_token_id") or []]
        self.max_batch, self.max_queue = max_batch, max_queue
        self._pending: collections.deque[Ticket] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._joining = 0  # requests taken from the queue whose prefill runs now
        self._thread: threading.Thread | None = None
        # The batch: one cache tensor per past input [B, heads, L, head_dim], the mask [B, L] of each row's
        # real columns, and per row its next input id and position.
        self._rows: list[_Row] = []
        self._waiting: list[_Waiting] = []  # prefilled rows waiting for their turn to join (``_admit``)
        self._cache: dict[str, np.ndarray] = {}
        self._mask = np.zeros((0, 0), dtype=np.int64)
        self._next_ids = np.zeros((0,), dtype=np.int64)
        self._positions = np.zeros((0,), dtype=np.int64)
        self.steps_run = 0  # decode steps (each one for every active row)
        self.rows_stepped = 0  # rows over those steps: rows_stepped / steps_run is the mean batch
        # Seconds over those steps: in the model's run, and in the whole step (its feeds, the run, sampling and
        # the callbacks of every row, a leaving row's cut): step_seconds - run_seconds is the batcher's own work.
        self.run_seconds = 0.0
        self.step_seconds = 0.0

    # ------------------------------------------------------------------------------------------ public side

    def __enter__(self) -> ContinuousBatcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="layerzero-batcher", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the running rows' current step, fail what is queued or running, and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def active(self) -> int:
        """Generations running: in the batch, waiting to join it (``_admit``), or in their prefill."""
        return len(self._rows) + len(self._waiting) + self._joining

    @property
    def queued(self) -> int:
        return len(self._pending)

    def submit(self, request: GenerationRequest) -> Ticket:
        """Check ``request`` (an ``InvalidInputError`` for a bad one, before any model work) and queue it."""
        prompt = self._check(request)
        ticket = Ticket(request, prompt)
        with self._cond:
            if self._stopping or self._thread is None:
                raise LayerZeroError("the batcher is not running")
            # Queued requests that get a row at the next step, besides the queue proper.
            free = max(0, self.max_batch - self.active)
            if len(self._pending) >= self.max_queue + free:
                raise QueueFull(f"{len(self._pending)} generations are queued already (the limit): retry later")
            self._pending.append(ticket)
            self._cond.notify_all()
        return ticket

    def _check(self, r: GenerationRequest) -> list[int]:
        prompt = [int(i) for i in r.prompt_ids]
        if not prompt:
            raise InvalidInputError("the prompt is empty: give at least one token id")
        if self.vocab_size is not None and any(not 0 <= i < self.vocab_size for i in prompt):
            bad = next(i for i in prompt if not 0 <= i < self.vocab_size)
            raise InvalidInputError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if r.max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens={r.max_new_tokens}: must be >= 1")
        if not (r.temperature >= 0 and np.isfinite(r.temperature)):
            raise InvalidInputError(f"temperature={r.temperature}: must be a finite number >= 0 (0 = greedy)")
        if r.top_k < 0:
            raise InvalidInputError(f"top_k={r.top_k}: must be >= 0 (0 = off)")
        if not 0 < r.top_p <= 1:
            raise InvalidInputError(f"top_p={r.top_p}: must be in (0, 1] (1 = off)")
        cap = r.max_tokens if r.max_tokens is not None else (self._guard.config.max_tokens if self._guard else None)
        if cap is not None and len(prompt) >= cap:
            raise InvalidInputError(f"the prompt has {len(prompt)} tokens, the limit is max_tokens={cap} tokens "
                                    "per sequence (prompt and new tokens): shorten the prompt")  # fmt: skip
        return prompt

    # -------------------------------------------------------------------------------------- scheduler side

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._rows:
                    self._cond.wait()
                if self._stopping:
                    break
                joining = []
                while self._pending and self.active + len(joining) < self.max_batch:
                    joining.append(self._pending.popleft())
                self._joining = len(joining)
            for ticket in joining:
                self._prefill(ticket)
                with self._cond:
                    self._joining -= 1
            self._admit()
            if self._rows:
                self._decode()
                self._admit()
        error = LayerZeroError("the batcher stopped")
        for row in self._rows + [w.row for w in self._waiting]:
            row.ticket._finish(None, error)
        for ticket in self._pending:
            ticket._finish(None, error)
        self._rows, self._pending = [], collections.deque()

    def _feeds(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, cache: dict[str, np.ndarray]) -> dict:
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **cache}

    def _prefill(self, ticket: Ticket) -> None:
        """The request's prompt alone with an empty past (what it runs alone); then it joins the batch."""
        r = ticket.request
        empty = self._layout.empty(1)
        n = len(ticket.prompt)
        started = time.perf_counter()
        try:
            ids = np.asarray([ticket.prompt], dtype=np.int64)
            result = self._run(self._feeds(ids, np.ones((1, n), np.int64), np.arange(n, dtype=np.int64)[None],
                                           empty), masks=True)  # fmt: skip
        except Exception as e:
            ticket._finish(None, e)
            return
        stops = set(self.eos if r.stop_tokens is None else (int(t) for t in r.stop_tokens))
        row = _Row(ticket, np.random.default_rng(r.seed), stops, [], [], started, 0.0)
        present = {p: result.outputs[q] for p, q in self._layout.names}
        self._emit(row, result.outputs["logits"][0, -1], n, time.perf_counter() - started, result.report)
        row.first_token_at = time.perf_counter()
        if row.stop_reason:
            self._finish(row)
            return
        self._waiting.append(_Waiting(row, present, n))

    def _admit(self) -> None:
        """Join the waiting rows whose cache length is congruent to the batch's width modulo ``PAD_ALIGN``; a
        cancelled one finishes here. A row waits at most ``PAD_ALIGN - 1`` steps: the width grows by one column
        a step. An empty batch starts with the largest class of waiting rows congruent to each other (the first
        of them joins the empty batch, the others are congruent to it)."""
        if not self._rows and self._waiting:
            classes = collections.Counter(w.length % PAD_ALIGN for w in self._waiting)
            # max() keeps the first of equals: a tie goes to the class of the earliest arrival.
            first = max(self._waiting, key=lambda w: classes[w.length % PAD_ALIGN]).length % PAD_ALIGN
            self._waiting.sort(key=lambda w: w.length % PAD_ALIGN != first)  # stable: arrival order kept
        still = []
        for w in self._waiting:
            if w.row.ticket.cancelled:
                w.row.stop_reason = "cancelled"
                self._finish(w.row)
            elif not self._rows or (self._mask.shape[1] - w.length) % PAD_ALIGN == 0:
                self._join(w.row, w.present, w.length)
            else:
                still.append(w)
        self._waiting = still

    def _join(self, row: _Row, present: dict[str, np.ndarray], length: int) -> None:
        """Add a row whose cache is ``present`` ([1, heads, length, head_dim]) to the batch, left-padding the
        shorter of the two to a common length (by a multiple of ``PAD_ALIGN`` columns: ``_admit``)."""
        width = self._mask.shape[1]
        common = max(width, length)
        assert not self._rows or (common - width) % PAD_ALIGN == 0 == (common - length) % PAD_ALIGN
        if self._rows:
            pad_batch = common - width
            pad_row = common - length
            mask_row = np.concatenate([np.zeros((1, pad_row), np.int64), np.ones((1, length), np.int64)], axis=1)
            mask = np.concatenate([np.pad(self._mask, ((0, 0), (pad_batch, 0))), mask_row], axis=0)
            cache = {}
            for name, old in self._cache.items():
                new = present[name]
                if pad_batch:
                    old = np.pad(old, ((0, 0), (0, 0), (pad_batch, 0), (0, 0)))
                if pad_row:
                    new = np.pad(new, ((0, 0), (0, 0), (pad_row, 0), (0, 0)))
                cache[name] = np.concatenate([old, new], axis=0)
        else:
            mask = np.ones((1, length), np.int64)
            cache = {name: np.ascontiguousarray(v) for name, v in present.items()}
        self._cache, self._mask = cache, mask
        self._rows.append(row)
        self._next_ids = np.append(self._next_ids, row.new[-1])
        self._positions = np.append(self._positions, length)

    def _decode(self) -> None:
        """One token of every active row, as one batch."""
        began = time.perf_counter()
        batch = len(self._rows)
        mask = np.concatenate([self._mask, np.ones((batch, 1), np.int64)], axis=1)
        start = time.perf_counter()
        try:
            result = self._run(self._feeds(self._next_ids[:, None].copy(), mask, self._positions[:, None].copy(),
                                           self._cache), masks=True)  # fmt: skip
        except Exception as e:
            for row in self._rows:
                row.ticket._finish(None, e)
            self._reset()
            return
        seconds = time.perf_counter() - start
        self.steps_run += 1
        self.rows_stepped += batch
        self._cache = {p: result.outputs[q] for p, q in self._layout.names}
        self._mask = mask
        logits = result.outputs["logits"]
        keep = []
        for i, row in enumerate(self._rows):
            row.batch_rows = max(row.batch_rows, batch)
            self._emit(row, logits[i, -1], 1, seconds, result.report)
            if row.stop_reason:
                self._finish(row)
            else:
                keep.append(i)
                self._next_ids[i] = row.new[-1]
                self._positions[i] += 1
        if len(keep) < batch:
            self._drop([i for i in range(batch) if i not in keep])
        self.run_seconds += seconds
        self.step_seconds += time.perf_counter() - began

    def _emit(self, row: _Row, logits: np.ndarray, tokens: int, seconds: float, report: Any) -> None:
        r = row.ticket.request
        token = choose_token(logits, r.temperature, r.top_k, r.top_p, row.rng)
        row.new.append(token)
        row.steps.append(StepReport(tokens=tokens, token_id=token, seconds=seconds,
                                    skipped_paths=list(report.skipped_paths)))  # fmt: skip
        skipped = set(report.skipped_paths)
        row.skipped = skipped if row.skipped is None else row.skipped & skipped
        stop_now = False
        if r.on_token is not None:
            try:
                stop_now = r.on_token(token) is True
            except Exception:  # a streaming client that went away: end its request, not the batch
                logger.debug("on_token failed; the request ends", exc_info=True)
                row.ticket.cancel()
        cap = r.max_tokens if r.max_tokens is not None else (self._guard.config.max_tokens if self._guard else None)
        if token in row.stops:
            row.stop_reason = "stop_token"
        elif stop_now:
            row.stop_reason = "stop"
        elif row.ticket.cancelled:
            row.stop_reason = "cancelled"
        elif len(row.new) >= r.max_new_tokens:
            row.stop_reason = "max_new_tokens"
        elif cap is not None and len(row.ticket.prompt) + len(row.new) >= cap:
            row.stop_reason = "max_tokens"

    def _drop(self, gone: list[int]) -> None:
        """Remove finished rows, then the leading cache columns no remaining row attends to."""
        keep = [i for i in range(len(self._rows)) if i not in set(gone)]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._reset()
            return
        index = np.asarray(keep)
        mask = self._mask[index]
        # The first column some row attends to, rounded down to a multiple of PAD_ALIGN: every row's padding
        # stays a multiple of it.
        cut = int(np.argmax(mask.any(axis=0))) // PAD_ALIGN * PAD_ALIGN
        self._mask = np.ascontiguousarray(mask[:, cut:])
        self._cache = {n: np.ascontiguousarray(v[index][:, :, cut:]) for n, v in self._cache.items()}
        self._next_ids = self._next_ids[index]
        self._positions = self._positions[index]

    def _reset(self) -> None:
        self._rows, self._cache = [], {}
        self._mask = np.zeros((0, 0), dtype=np.int64)
        self._next_ids = np.zeros((0,), dtype=np.int64)
        self._positions = np.zeros((0,), dtype=np.int64)

    def _finish(self, row: _Row) -> None:
        end = time.perf_counter()
        template = self.engine.report_template()
        n = len(row.new)
        total = end - row.ticket.submitted
        decode = end - row.first_token_at
        report = GenerateReport(
            prompt_tokens=len(row.ticket.prompt),
            new_tokens=n,
            stop_reason=row.stop_reason,
            time_to_first_token_s=row.first_token_at - row.ticket.submitted,
            total_s=total,
            tokens_per_s=n / total if total > 0 else 0.0,
            decode_tokens_per_s=(n - 1) / decode if n > 1 and decode > 0 else None,
            cache=True,
            total_layers=template.total_layers,
            zeroed_layers=template.zeroed_layers,
            zeroed_paths=list(template.zeroed_paths),
            zeroed_params_ratio=template.zeroed_params_ratio,
            skipped_paths=sorted(row.skipped or ()),
            steps=row.steps,
            removed_scopes=list(template.removed_scopes),
            batch_rows=row.batch_rows,
        )
        row.ticket._finish(Generation(ids=row.new, prompt_ids=row.ticket.prompt, report=report))
