"""The generate endpoint: token generation over plain HTTP, streamed as JSON lines.

    server = GenerateServer(guard_or_engine, GenerateServerConfig(port=8003))
    with server:                       # a thread per connection, 127.0.0.1 only
        server.wait()

    curl -N localhost:8003/v1/generate -d '{"prompt_ids": [1, 2, 3], "max_new_tokens": 16}'
    {"token": 907}
    {"token": 12}
    ...
    {"ids": [907, 12, ...], "prompt_ids": [1, 2, 3], "report": {"tokens_per_s": ..., "stop_reason": ...}}

``POST /v1/generate`` takes a JSON object: ``prompt_ids`` (required, a non-empty list of token ids), and
optionally ``max_new_tokens`` (default 32), ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``seed``,
``stop_ids`` (default: the eos ids the export recorded), ``stream`` (default true). A streamed answer is
``application/x-ndjson``, chunked: one ``{"token": id}`` line per token as soon as it is chosen, then one
line with the ids and the request's report (tokens/s, time to first token, skipped paths). With
``"stream": false`` the answer is that last object alone. An error after the stream started (the model
failed mid-way) is a last line ``{"error": "..."}``.

A batch: ``prompts`` (a list of non-empty id lists) instead of ``prompt_ids``, and optionally ``pad_token_id``
(default: the export's pad id, else its eos). The prompts run as one left-padded batch (the tokens of
transformers' batched greedy ``generate``), each stopping on its own. Streamed, one ``{"tokens": [...]}`` line
per step (each prompt's new id, ``null`` for a prompt that has finished), then ``{"results": [{"ids",
"prompt_ids", "report"}, ...]}`` in the prompts' order; with ``"stream": false`` that last object alone.

    curl -N localhost:8003/v1/generate -d '{"prompts": [[1, 2, 3], [7, 8]], "max_new_tokens": 16}'

Bounded and validated before any model work, each refusal a 4xx with one JSON line ``{"error": "..."}``:
body at most ``max_request_bytes`` (413), a Content-Length (411), valid JSON object with known keys (400),
``prompt_ids`` non-empty integers inside the vocabulary, at most ``max_prompt_tokens`` (400; the same for each of
``prompts``, at most ``max_batch`` of them, and not both keys),
``max_new_tokens`` in 1..``max_new_tokens_cap`` (400), the sampling options in range (400), at most
``max_concurrent`` generations at once (503, ``Retry-After: 1``), a body sent within ``client_timeout_s``
(408). The engine may be a ``GuardedEngine``: its kill switch, sampling and ``max_tokens`` apply to every
step (``layerzero.runtime.generate``). ``GET /healthz`` answers ``ok``; ``GET /v1/generate/status`` gives the
counters and limits; ``GET /metrics`` the Prometheus metrics (``layerzero.runtime.metrics.GenerateMetrics``:
requests, tokens, time to first token, inter-token latency, errors by status; each counted once per request,
not per step). Under ``layerzero serve`` they are in the server's registry too (``metrics=server.metrics``), so
one scrape of the control port's /metrics has them.

Why a plain HTTP endpoint beside Triton and not a decoupled Triton model: generation is a loop over the
model with a KV cache held between steps, which the Python runtime already runs; a stream of JSON lines is
readable with ``curl -N`` and any HTTP client, and it needs no second copy of the model in Triton.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.runtime._http import listen_http

__all__ = ["GENERATE_PATH", "GenerateServer", "GenerateServerConfig", "parse_request", "serve_generate"]

logger = logging.getLogger(__name__)

GENERATE_PATH = "/v1/generate"
_KEYS = frozenset(
    {
        "prompt_ids",
        "prompts",
        "pad_token_id",
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "stop_ids",
        "stream",
    }
)


@dataclasses.dataclass(frozen=True)
class GenerateServerConfig:
    """Where to listen and the request bounds (see the module doc)."""

    host: str = "127.0.0.1"
    port: int = 8003  # 0 picks a free port
    max_request_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    max_new_tokens_cap: int = 1024
    max_concurrent: int = 4
    client_timeout_s: float = 30.0
    max_batch: int = 16  # prompts per request

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompt_tokens", "max_new_tokens_cap", "max_concurrent", "max_batch"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"generate endpoint {name} must be >= 1, got {getattr(self, name)}")
        if not self.client_timeout_s > 0:
            raise InvalidInputError(f"generate endpoint client_timeout_s must be > 0, got {self.client_timeout_s}")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _one_line(message: str, limit: int = 400) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _int(doc: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int | None) -> int | None:
    value = doc.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused(400, f"{key} must be an integer, got {json.dumps(value)[:40]}")
    if value < lo or (hi is not None and value > hi):
        raise _Refused(400, f"{key}={value}: must be in [{lo}, {hi if hi is not None else 'inf'}]")
    return value


def _float(doc: Mapping[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Refused(400, f"{key} must be a finite number, got {json.dumps(value)[:40]}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise _Refused(400, f"{key}={value}: must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    return float(value)


def _ids(doc: Mapping[str, Any], key: str, vocab: int | None, limit: int) -> list[int] | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise _Refused(400, f"{key} must be a list of token ids, got {type(value).__name__}")
    if len(value) > limit:
        raise _Refused(400, f"{key} has {len(value)} tokens; at most {limit} are accepted")
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int):
            raise _Refused(400, f"{key} must hold integers, got {json.dumps(i)[:40]}")
        if i < 0 or (vocab is not None and i >= vocab):
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise _Refused(400, f"{key}: token id {i} is outside the vocabulary {bound}")
    return value


def parse_request(body: bytes, config: GenerateServerConfig, vocab: int | None) -> dict[str, Any]:
    """The validated options of one request (``generate``'s keyword arguments plus ``prompt_ids``, ``stream``).

    Raises ``_Refused`` (status, one line) for anything the module doc lists as a 4xx.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Refused(400, f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _Refused(400, f"the body must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise _Refused(400, f"unknown key(s) {unknown}; known: {sorted(_KEYS)}")
    if "prompts" in doc:
        if "prompt_ids" in doc:
            raise _Refused(400, "give prompt_ids (one prompt) or prompts (a batch), not both")
        batch = doc["prompts"]
        if not isinstance(batch, list) or not batch:
            raise _Refused(400, "prompts must be a non-empty list of token id lists")
        if len(batch) > config.max_batch:
            raise _Refused(400, f"prompts has {len(batch)} prompts; at most {config.max_batch} are accepted")
        prompt: list[int] | list[list[int]] = []
        for i, item in enumerate(batch):
            ids = _ids({f"prompts[{i}]": item}, f"prompts[{i}]", vocab, config.max_prompt_tokens)
            if not ids:
                raise _Refused(400, f"prompts[{i}] must be a non-empty list of token ids")
            prompt.append(ids)  # type: ignore[arg-type]
    else:
        prompt = _ids(doc, "prompt_ids", vocab, config.max_prompt_tokens) or []
        if not prompt:
            raise _Refused(400, "prompt_ids is required: a non-empty list of token ids (or prompts, a batch)")
    stream = doc.get("stream", True)
    if not isinstance(stream, bool):
        raise _Refused(400, f"stream must be true or false, got {json.dumps(stream)[:40]}")
    return {
        "prompt_ids": prompt,
        "max_new_tokens": _int(doc, "max_new_tokens", 32, 1, config.max_new_tokens_cap),
        "temperature": _float(doc, "temperature", 0.0, 0.0, 1e6),
        "top_k": _int(doc, "top_k", 0, 0, None),
        "top_p": _float(doc, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "seed": _int(doc, "seed", None, 0, 2**63 - 1) if doc.get("seed") is not None else None,
        "stop_tokens": _ids(doc, "stop_ids", vocab, 1024),
        "pad_token_id": _int(doc, "pad_token_id", None, 0, vocab - 1 if vocab is not None else None),
        "stream": stream,
    }


class GenerateServer:
    """The generate endpoint of one engine (``Engine`` or ``GuardedEngine``); see the module doc."""

    def __init__(self, engine: Any, config: GenerateServerConfig | None = None, metrics: Any = None) -> None:
        """``metrics``: a ``ServingMetrics`` (its registry gets the generate metrics: one /metrics), a
        ``GenerateMetrics``, or None (a registry of this endpoint's own; none without prometheus_client)."""
        from layerzero.runtime.generate import _cache_layout, export_metadata
        from layerzero.runtime.guard import GuardedEngine

        self.engine = engine
        self.config = config or GenerateServerConfig()
        base = engine.engine if isinstance(engine, GuardedEngine) else engine
        _cache_layout(base)  # UnsupportedModelError now, not on the first request, for a model that cannot generate
        vocab = export_metadata(base).get("vocab_size")
        self.vocab: int | None = vocab if isinstance(vocab, int) else None
        self._slots = threading.BoundedSemaphore(self.config.max_concurrent)
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "generated_tokens": 0, "errors_4xx": 0, "errors_5xx": 0, "busy": 0}
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.metrics = _generate_metrics(metrics)

    # ---------------------------------------------------------------------------------------- lifecycle

    def start(self) -> GenerateServer:
        cfg = self.config
        handler = type("Handler", (_GenerateHandler,), {"server_": self, "timeout": cfg.client_timeout_s})
        self._httpd, self._thread = listen_http(cfg.host, cfg.port, handler, "layerzero-generate", "generate")
        self._thread.start()
        logger.info("generate endpoint on %s", self.url)
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> GenerateServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1] if self._httpd is not None else self.config.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}{GENERATE_PATH}"

    def status(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self.counters)
        return {"counters": counters, "limits": dataclasses.asdict(self.config), "vocab_size": self.vocab}

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n


def _generate_metrics(metrics: Any) -> Any:
    if metrics is not None:
        return metrics.generate() if hasattr(metrics, "generate") else metrics
    try:
        from layerzero.runtime.metrics import GenerateMetrics
    except ImportError:  # prometheus_client (the serve extra) is not installed: no /metrics here
        return None
    return GenerateMetrics()


@contextlib.contextmanager
def serve_generate(engine: Any, metrics: Any = None, **config: Any) -> Iterator[GenerateServer | None]:
    """The generate endpoint for ``layerzero serve``: started when the model can generate (a ``layerzero
    export`` model, compiled or not), else None with the reason logged, so serving goes on without it.
    ``metrics``: the server's ``ServingMetrics`` (see ``GenerateServer``)."""
    try:
        server = GenerateServer(engine, GenerateServerConfig(**config), metrics)
    except UnsupportedModelError as exc:
        logger.info("no generate endpoint: %s", exc)
        yield None
        return
    with server:
        yield server


class _GenerateHandler(BaseHTTPRequestHandler):
    server_: GenerateServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("generate %s - " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        elif self.path == f"{GENERATE_PATH}/status":
            self._send(200, (json.dumps(self.server_.status()) + "\n").encode(), "application/json")
        elif self.path == "/metrics" and self.server_.metrics is not None:
            from layerzero.runtime.metrics import CONTENT_TYPE

            self._send(200, self.server_.metrics.render(), CONTENT_TYPE)
        else:
            self._error(404, f"GET {self.path[:100]}: not found; POST {GENERATE_PATH}, GET /healthz", count=False)

    def do_POST(self) -> None:
        server = self.server_
        if self.path != GENERATE_PATH:
            self._error(404, f"POST {self.path[:100]}: not found; POST {GENERATE_PATH}", count=False)
            return
        server.count("requests")
        if server.metrics is not None:
            server.metrics.observe_request()
        try:
            request = parse_request(self._body(), server.config, server.vocab)
        except _Refused as exc:
            self._error(exc.status, str(exc))
            return
        if not server._slots.acquire(blocking=False):
            server.count("busy")
            self._error(503, f"{server.config.max_concurrent} generations are running; retry", retry_after=1)
            return
        try:
            self._generate(request)
        finally:
            server._slots.release()

    def do_PUT(self) -> None:
        self._error(405, f"{self.command} is not supported; POST {GENERATE_PATH}", count=False)

    do_DELETE = do_PATCH = do_PUT

    # --------------------------------------------------------------------------------------------- work

    def _generate(self, request: dict[str, Any]) -> None:
        from layerzero.runtime.generate import generate

        server = self.server_
        stream = request.pop("stream")
        prompt = request.pop("prompt_ids")
        batch = bool(prompt) and isinstance(prompt[0], list)
        started = False

        def send(doc: dict[str, Any]) -> None:
            nonlocal started
            if not started:  # headers only once the first token exists: a refusal before it is still a 4xx
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                started = True
            self._chunk(doc)

        # Each step's time (a token, or a batch's tokens), for the time to first token and inter-token latency.
        times = [time.perf_counter()]

        def on_token(token: int) -> None:
            times.append(time.perf_counter())
            if stream:
                send({"token": token})

        def on_step(tokens: list[int | None]) -> None:
            times.append(time.perf_counter())
            if stream:
                send({"tokens": tokens})

        callbacks = {"on_step": on_step} if batch else {"on_token": on_token}
        try:
            out = generate(server.engine, prompt, **callbacks, **request)
        except InvalidInputError as exc:  # e.g. the guard's max_tokens: the request's fault
            if started:
                self._count_error(400)
                self._chunk({"error": _one_line(str(exc))})
                self._end_chunks()
            else:
                self._error(400, str(exc))
            return
        except Exception as exc:  # the model failed: one line, no traceback to the client
            logger.exception("generate failed")
            message = f"generation failed: {type(exc).__name__}: {exc}"
            if started:
                server.count("errors_5xx")
                self._count_error(500)
                self._chunk({"error": _one_line(message)})
                self._end_chunks()
            else:
                self._error(500, message)
            return
        outs = out if isinstance(out, list) else [out]
        tokens = sum(len(o.ids) for o in outs)
        server.count("generated_tokens", tokens)
        if server.metrics is not None:
            first = times[1] - times[0] if len(times) > 1 else None
            server.metrics.observe_generation(tokens, first, [b - a for a, b in itertools.pairwise(times[1:])])
        results = [{"ids": o.ids, "prompt_ids": o.prompt_ids, "report": o.report.to_dict()} for o in outs]
        final = {"results": results} if batch else results[0]
        if stream:
            self._chunk(final)
            self._end_chunks()
        else:
            self._send(200, (json.dumps(final) + "\n").encode(), "application/json")

    # ------------------------------------------------------------------------------------------- wiring

    def _body(self) -> bytes:
        limit = self.server_.config.max_request_bytes
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise _Refused(411, "chunked request bodies are not accepted; send a Content-Length")
        text = (self.headers.get("Content-Length") or "").strip()
        if not text:
            raise _Refused(411, "a Content-Length header is required")
        if not text.isdigit() or len(text) > 15:
            raise _Refused(400, f"Content-Length {text[:20]!r} is not a non-negative integer")
        length = int(text)
        if length > limit:
            raise _Refused(413, f"the body is {length} bytes; at most {limit} are accepted")
        deadline = time.monotonic() + self.server_.config.client_timeout_s  # for the whole body, not per read
        chunks, left = [], length
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Refused(408, "the request body was not received in time")
            self.connection.settimeout(remaining)
            try:
                chunk = self.rfile.read1(min(left, 1 << 16))
            except OSError:
                raise _Refused(408, "the request body was not received in time") from None
            if not chunk:
                raise _Refused(400, f"the body ended after {length - left} of {length} bytes")
            chunks.append(chunk)
            left -= len(chunk)
        self.connection.settimeout(None)  # generation may take longer than a body may
        return b"".join(chunks)

    def _count_error(self, status: int) -> None:
        if self.server_.metrics is not None:
            self.server_.metrics.observe_error(status)

    def _error(self, status: int, message: str, retry_after: int | None = None, count: bool = True) -> None:
        """Answer ``status`` with one JSON line; ``count``: a generation request refused or failed (not a GET
        of an unknown path)."""
        if 400 <= status < 500:
            self.server_.count("errors_4xx")
        elif status >= 500 and status != 503:
            self.server_.count("errors_5xx")
        if count:
            self._count_error(status)
        if status in (408, 411, 413) or status >= 500:
            self.close_connection = True  # the unread rest of a body must not be parsed as a request
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        self._send(status, (json.dumps({"error": _one_line(message)}) + "\n").encode(), "application/json", headers)

    def _send(self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def _chunk(self, doc: Mapping[str, Any]) -> None:
        data = (json.dumps(doc) + "\n").encode()
        try:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True  # the client went away; generation ends with this request

    def _end_chunks(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True
