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
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.runtime._http import listen_http
from layerzero.runtime.generate_request import (
    GENERATE_PATH,
    GenerateServerConfig,
    Refused,
    one_line,
    parse_request,
)

__all__ = ["GENERATE_PATH", "GenerateServer", "GenerateServerConfig", "parse_request", "serve_generate"]

logger = logging.getLogger(__name__)

class GenerateServer:
    """The generate endpoint of one engine (``Engine`` or ``GuardedEngine``); see the module doc."""

    def __init__(self, engine: Any, config: GenerateServerConfig | None = None, metrics: Any = None) -> None:
        """``metrics``: a ``ServingMetrics`` (its registry gets the generate metrics: one /metrics), a
        ``GenerateMetrics``, or None (a registry of this endpoint's own; none without prometheus_client)."""
        from layerzero.runtime.generate import cache_layout, export_metadata
        from layerzero.runtime.guard import GuardedEngine

        self.engine = engine
        self.config = config or GenerateServerConfig()
        base = engine.engine if isinstance(engine, GuardedEngine) else engine
        cache_layout(base)  # UnsupportedModelError now, not on the first request, for a model that cannot generate
        vocab = export_metadata(base).get("vocab_size")
        self.vocab: int | None = vocab if isinstance(vocab, int) else None
        self._slots = threading.BoundedSemaphore(self.config.max_concurrent)
        from layerzero.runtime.batcher import ContinuousBatcher
        from layerzero.runtime.openai_api import OpenAIRoutes
        from layerzero.runtime.text import TextCodec

        # Single-prompt generations (/v1/generate and the OpenAI endpoints) share decode steps.
        self.batcher = ContinuousBatcher(engine, max_batch=self.config.batch_rows, max_queue=self.config.max_queue)
        try:
            codec = TextCodec.for_engine(base)
        except InvalidInputError as exc:  # an unreadable tokenizer: ids still served, text endpoints refuse
            logger.warning("no text endpoints: %s", exc)
            codec = None
        self.openai = OpenAIRoutes(self.batcher, codec, self.config.model_name,
                                   max_new_tokens=self.config.max_new_tokens_cap,
                                   max_prompt_tokens=self.config.max_prompt_tokens,
                                   observe=self.observe_generation)  # fmt: skip
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
        self.batcher.start()
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
        self.batcher.stop()

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

    def observe_generation(self, tokens: int, times: list[float]) -> None:
        """The generate metrics of one finished generation: ``times`` = [its start, each token's time]."""
        if self.metrics is not None:
            first = times[1] - times[0] if len(times) > 1 else None
            self.metrics.observe_generation(tokens, first, [b - a for a, b in itertools.pairwise(times[1:])])

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
        if self.path.split("?", 1)[0] == "/v1/models":
            self._send(200, self.server_.openai.get("/v1/models"), "application/json")
        elif self.path == "/healthz":
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
        if self.path in ("/v1/completions", "/v1/chat/completions"):
            self._openai()
            return
        if self.path != GENERATE_PATH:
            self._error(404, f"POST {self.path[:100]}: not found; POST {GENERATE_PATH}", count=False)
            return
        server.count("requests")
        if server.metrics is not None:
            server.metrics.observe_request()
        try:
            request = parse_request(self._body(), server.config, server.vocab)
        except Refused as exc:
            self._error(exc.status, str(exc))
            return
        if not isinstance(request["prompt_ids"][0], list):  # one prompt: the continuous batch
            self._generate_batched(request)
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
                self._chunk({"error": one_line(str(exc))})
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
                self._chunk({"error": one_line(message)})
                self._end_chunks()
            else:
                self._error(500, message)
            return
        outs = out if isinstance(out, list) else [out]
        tokens = sum(len(o.ids) for o in outs)
        server.count("generated_tokens", tokens)
        server.observe_generation(tokens, times)
        results = [{"ids": o.ids, "prompt_ids": o.prompt_ids, "report": o.report.to_dict()} for o in outs]
        final = {"results": results} if batch else results[0]
        if stream:
            self._chunk(final)
            self._end_chunks()
        else:
            self._send(200, (json.dumps(final) + "\n").encode(), "application/json")

    def _generate_batched(self, request: dict[str, Any]) -> None:
        """One prompt on the server's ContinuousBatcher: its decode steps shared with the other generations."""
        from layerzero.runtime.batcher import GenerationRequest, QueueFull

        server = self.server_
        stream = request.pop("stream")
        tokens: queue.Queue[int | None] = queue.Queue()  # the batcher's thread puts, this request's thread sends
        times = [time.perf_counter()]
        started = False

        def on_token(token: int) -> None:
            times.append(time.perf_counter())
            tokens.put(token)

        request.pop("pad_token_id", None)  # one prompt: nothing to pad
        job = GenerationRequest(request.pop("prompt_ids"), **request, on_token=on_token,
                                on_done=lambda: tokens.put(None))  # fmt: skip
        try:
            ticket = server.batcher.submit(job)
        except QueueFull as exc:
            server.count("busy")
            self._error(503, str(exc), retry_after=1)
            return
        except InvalidInputError as exc:
            self._error(400, str(exc))
            return
        while stream:  # a thread that sleeps until a token comes (no polling: the batcher's thread needs the GIL)
            token = tokens.get()
            if token is None:  # on_done: every token is in the queue before it
                break
            if not started:
                self._start_chunks()
                started = True
            self._chunk({"token": token})
            if self.close_connection:  # the client went away
                ticket.cancel()
                break
        try:
            out = ticket.result(timeout=None)
        except Exception as exc:
            status = 400 if isinstance(exc, InvalidInputError) else 500
            if status == 500:
                logger.error("generate failed: %s", exc)
                server.count("errors_5xx")
            message = one_line(str(exc) if status == 400 else f"generation failed: {type(exc).__name__}: {exc}")
            if started:
                self._chunk({"error": message})
                self._end_chunks()
            else:
                self._error(status, message)
            return
        server.count("generated_tokens", len(out.ids))
        server.observe_generation(len(out.ids), times)
        final = {"ids": out.ids, "prompt_ids": out.prompt_ids, "report": out.report.to_dict()}
        if stream:
            if not started:
                self._start_chunks()
            self._chunk(final)
            self._end_chunks()
        else:
            self._send(200, (json.dumps(final) + "\n").encode(), "application/json")

    def _start_chunks(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

    def _openai(self) -> None:
        """POST /v1/completions and /v1/chat/completions (runtime/openai_api.py)."""
        from layerzero.runtime.openai_api import ApiError

        server = self.server_
        server.count("requests")
        if server.metrics is not None:
            server.metrics.observe_request()
        streaming = False

        def start_stream() -> None:
            nonlocal streaming
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            streaming = True

        def send(data: bytes) -> bool:
            try:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                return True
            except OSError:
                self.close_connection = True
                return False

        try:
            try:
                body = self._body()
            except Refused as exc:
                raise ApiError(exc.status, str(exc)) from None
            answer = server.openai.post(self.path, body, start_stream, send)
        except ApiError as exc:
            self._count_error(exc.status)
            if 400 <= exc.status < 500:
                server.count("errors_4xx")
            elif exc.status >= 500:
                server.count("errors_5xx")
            if exc.status in (408, 411, 413):
                self.close_connection = True
            self._send(exc.status, exc.body(), "application/json",
                       {"Retry-After": "1"} if exc.status == 503 else None)  # fmt: skip
            return
        if streaming:
            self._end_chunks()
        else:
            self._send(200, answer, "application/json")

    # ------------------------------------------------------------------------------------------- wiring

    def _body(self) -> bytes:
        limit = self.server_.config.max_request_bytes
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise Refused(411, "chunked request bodies are not accepted; send a Content-Length")
        text = (self.headers.get("Content-Length") or "").strip()
        if not text:
            raise Refused(411, "a Content-Length header is required")
        if not text.isdigit() or len(text) > 15:
            raise Refused(400, f"Content-Length {text[:20]!r} is not a non-negative integer")
        length = int(text)
        if length > limit:
            raise Refused(413, f"the body is {length} bytes; at most {limit} are accepted")
        deadline = time.monotonic() + self.server_.config.client_timeout_s  # for the whole body, not per read
        chunks, left = [], length
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Refused(408, "the request body was not received in time")
            self.connection.settimeout(remaining)
            try:
                chunk = self.rfile.read1(min(left, 1 << 16))
            except OSError:
                raise Refused(408, "the request body was not received in time") from None
            if not chunk:
                raise Refused(400, f"the body ended after {length - left} of {length} bytes")
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
        self._send(status, (json.dumps({"error": one_line(message)}) + "\n").encode(), "application/json", headers)

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
