"""OpenAI-compatible endpoints on the generate port: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8003/v1", api_key="unused")
    client.chat.completions.create(model="model", messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
    for chunk in client.completions.create(model="model", prompt="Once", stream=True):
        print(chunk.choices[0].text, end="")

The served model's id is the bundle's folder name (``GET /v1/models``); a request naming another model is a 404
(``model_not_found``). Text goes through the bundle's tokenizer (``runtime/text.py``, the same path as
``layerzero generate --prompt``); chat messages through its chat template. Requests run on the server's
``ContinuousBatcher``: concurrent requests share decode steps, and past ``max_queue`` waiting ones a request is
a 503 with ``Retry-After``.

Parameters: ``max_tokens`` (``max_completion_tokens`` for chat; default 16 for completions as OpenAI's, the
server's cap for chat), ``temperature`` (0 greedy, ≤ 2), ``top_p``, ``seed``, ``stop`` (a string or up to 4),
``n`` (1 only), ``stream`` and ``stream_options.include_usage``, ``user`` (ignored). Other parameters OpenAI
defines that change the output (penalties, logprobs, tools, ...) are refused when set to anything but their
default, and unknown ones are refused: a 400 naming the parameter, never silently ignored. Answers carry
``usage`` (prompt, completion and total tokens); ``finish_reason`` is ``"stop"`` (an end token or a stop string:
the text ends before it) or ``"length"``. ``stream: true`` answers as OpenAI does: server-sent events, one
``data: {chunk}`` per piece of text, a last chunk with the ``finish_reason``, optionally one with the usage, then
``data: [DONE]``. Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a 4xx.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from layerzero.errors import InvalidInputError, LayerZeroError
from layerzero.runtime.batcher import ContinuousBatcher, GenerationRequest, QueueFull
from layerzero.runtime.text import TextCodec

__all__ = ["OPENAI_PATHS", "ApiError", "OpenAIRoutes"]

OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")

_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user"}
# Parameters OpenAI defines that change the output: accepted at their default only.
_DEFAULTS: dict[str, tuple[object, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logprobs": (False, None),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "best_of": (1, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
}
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An OpenAI-shaped refusal: HTTP status, message, error type, the parameter at fault, a code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> bytes:
        doc = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return (json.dumps(doc) + "\n").encode()


def _number(doc: Mapping[str, Any], key: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    value = doc.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{key} must be a number, got {json.dumps(value)[:40]}", param=key)
    if value < lo or value > hi or (open_lo and value == lo):
        raise ApiError(400, f"{key}={value} is out of range {'(' if open_lo else '['}{lo:g}, {hi:g}]", param=key)
    return float(value)


def _integer(doc: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer, got {json.dumps(value)[:40]}", param=key)
    if not lo <= value <= hi:
        raise ApiError(400, f"{key}={value} is out of range [{lo}, {hi}]", param=key)
    return value


class _StopText:
    """The text of a generation as it grows: what may be sent so far, and whether a stop string was reached.

    A piece is held back while it could still become a stop string, or ends in an incomplete UTF-8 sequence
    (the tokenizer's replacement character)."""

    def __init__(self, codec: TextCodec, stops: list[str]) -> None:
        self.codec, self.stops = codec, stops
        self.ids: list[int] = []
        self.text = ""  # the full decoded text, cut at a stop string once one is found
        self.sent = 0  # characters of text sent
        self.stopped = False
        self._lock = threading.Lock()  # add() runs in the batcher's thread, ready() in the request's

    def add(self, token: int) -> bool:
        """Add a token; True when a stop string now ends the generation."""
        with self._lock:
            if self.stopped:
                return True
            self.ids.append(token)
            text = self.codec.decode(self.ids)
            for stop in self.stops:
                at = text.find(stop, max(0, self.sent - len(stop)))
                if at >= 0:
                    text, self.stopped = text[:at], True
            self.text = text
            return self.stopped

    def ready(self, final: bool) -> str:
        """The next piece that may be sent (everything left when ``final``)."""
        with self._lock:
            return self._ready(final)

    def _ready(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            if self.text.endswith("\ufffd"):
                end -= 1
            for stop in self.stops:  # a tail that is the start of a stop string waits
                for n in range(min(len(stop) - 1, end - self.sent), 0, -1):
                    if self.text[end - n : end] == stop[:n]:
                        end -= n
                        break
        piece = self.text[self.sent : max(end, self.sent)]
        self.sent += len(piece)
        return piece


class OpenAIRoutes:
    """The endpoints' logic; the generate server's handler calls ``get`` / ``post`` for their paths."""

    def __init__(self, batcher: ContinuousBatcher, codec: TextCodec | None, model: str, *, max_new_tokens: int,
                 max_prompt_tokens: int, wait_s: float = 600.0,
                 observe: Callable[[int, list[float]], None] | None = None) -> None:  # fmt: skip
        self.batcher, self.codec, self.model = batcher, codec, model
        self.observe = observe  # (tokens, [start, each token's time]) of each finished generation: metrics
        self.max_new_tokens, self.max_prompt_tokens, self.wait_s = max_new_tokens, max_prompt_tokens, wait_s
        self.created = int(time.time())

    def get(self, path: str) -> bytes:
        if path == "/v1/models":
            doc = {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                               "owned_by": "layerzero"}]}  # fmt: skip
            return (json.dumps(doc) + "\n").encode()
        raise ApiError(404, f"GET {path[:100]}: not found", code="not_found")

    # ------------------------------------------------------------------------------------------- requests

    def _parse(self, path: str, body: bytes) -> tuple[dict[str, Any], GenerationRequest, list[str], bool]:
        if self.codec is None:
            raise ApiError(400, "this model has no tokenizer.json (beside the bundle or its source model): the "
                                "OpenAI endpoints need text; POST /v1/generate takes token ids")  # fmt: skip
        try:
            doc = json.loads(body)
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(doc).__name__}")
        chat = path == "/v1/chat/completions"
        allowed = _COMMON | set(_DEFAULTS) | ({"messages", "max_completion_tokens"} if chat else {"prompt"})
        for key in doc:
            if key not in allowed:
                raise ApiError(400, f"unknown parameter {key[:60]!r}", param=key[:60], code="unknown_parameter")
        for key, defaults in _DEFAULTS.items():
            if key in doc and doc[key] not in defaults:
                raise ApiError(400, f"{key}={json.dumps(doc[key])[:60]} is not supported (only its default)",
                               param=key, code="unsupported_parameter")  # fmt: skip
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "model is required: a string (GET /v1/models lists it)", param="model")
        if model != self.model:
            raise ApiError(404, f"the model {model[:80]!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")  # fmt: skip
        if doc.get("n") not in (None, 1):
            raise ApiError(400, f"n={json.dumps(doc['n'])[:20]}: only n = 1 is served", param="n")
        stream = doc.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise ApiError(400, "stream must be true or false", param="stream")
        options = doc.get("stream_options")
        if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                    or not isinstance(options.get("include_usage", False), bool)):  # fmt: skip
            raise ApiError(400, 'stream_options must be {"include_usage": true|false}', param="stream_options")
        usage_chunk = bool(stream and options and options.get("include_usage"))
        stop = doc.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise ApiError(400, "stop must be a non-empty string or a list of at most 4 of them", param="stop")
        prompt_ids = self._chat_ids(doc.get("messages")) if chat else self._prompt_ids(doc.get("prompt"))
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ApiError(400, f"the prompt is {len(prompt_ids)} tokens; at most {self.max_prompt_tokens} are "
                                "accepted", param="messages" if chat else "prompt",
                           code="context_length_exceeded")  # fmt: skip
        key = "max_completion_tokens" if chat and doc.get("max_completion_tokens") is not None else "max_tokens"
        max_new = _integer(doc, key, 1, self.max_new_tokens)
        if max_new is None:
            max_new = self.max_new_tokens if chat else min(16, self.max_new_tokens)
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new,
            temperature=_number(doc, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(doc, "top_p", 1.0, 0.0, 1.0, open_lo=True),
            seed=_integer(doc, "seed", -(2**63), 2**64 - 1),
        )
        if request.seed is not None and request.seed < 0:
            request.seed = request.seed % 2**64  # numpy seeds are non-negative
        return {"chat": chat, "stream": bool(stream), "usage_chunk": usage_chunk}, request, stops, bool(stream)

    def _prompt_ids(self, prompt: object) -> list[int]:
        assert self.codec is not None
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list: n prompts in one request are not served
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in prompt):  # fmt: skip
            ids = list(prompt)
        else:
            raise ApiError(400, "prompt must be a string (or one list of token ids); several prompts in one "
                                "request are not served", param="prompt")  # fmt: skip
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    def _chat_ids(self, messages: object) -> list[int]:
        assert self.codec is not None
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES:
                raise ApiError(400, f"messages[{i}] must be an object with a role in {', '.join(_CHAT_ROLES)}",
                               param=f"messages[{i}]")  # fmt: skip
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):  # fmt: skip
                    raise ApiError(400, f"messages[{i}].content: only text parts are served",
                                   param=f"messages[{i}].content")  # fmt: skip
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
            clean.append({"role": m["role"], "content": content})
        try:
            ids = self.codec.chat_ids(clean)
        except InvalidInputError as e:
            raise ApiError(400, str(e), param="messages") from None
        if not ids:
            raise ApiError(400, "the chat template rendered an empty prompt", param="messages")
        return ids

    # ------------------------------------------------------------------------------------------ answering

    def post(self, path: str, body: bytes, start_stream: Callable[[], None], send: Callable[[bytes], bool]) -> bytes:
        """Answer a POST: returns the whole JSON body, or, for a stream, calls ``start_stream()`` once and then
        ``send(bytes)`` per event (False: the client went away) and returns b""."""
        if path not in ("/v1/completions", "/v1/chat/completions"):
            raise ApiError(404, f"POST {path[:100]}: not found", code="not_found")
        meta, request, stops, stream = self._parse(path, body)
        assert self.codec is not None
        text = _StopText(self.codec, stops)
        tokens: queue.Queue[int | None] = queue.Queue()
        times = [time.perf_counter()]

        def on_token(token: int) -> bool:
            times.append(time.perf_counter())
            tokens.put(token)
            return text.add(token) if stops else False

        request.on_token = on_token
        request.on_done = lambda: tokens.put(None)  # wakes the stream at the end
        try:
            ticket = self.batcher.submit(request)
        except QueueFull as e:
            raise ApiError(503, str(e), kind="server_error", code="overloaded") from None
        except InvalidInputError as e:
            raise ApiError(400, str(e)) from None
        ident = ("chatcmpl-" if meta["chat"] else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not stream:
            generation = self._wait(ticket)
            if self.observe is not None:
                self.observe(len(generation.ids), times)
            if not stops:
                text.ids = list(generation.ids)
                text.text = self.codec.decode(text.ids)
            finish = "stop" if generation.report.stop_reason in ("stop_token", "stop") else "length"
            usage = self._usage(request, generation.ids)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if meta["chat"]:
                choice["message"] = {"role": "assistant", "content": text.text}
            else:
                choice["text"] = text.text
            doc = {"id": ident, "object": "chat.completion" if meta["chat"] else "text_completion",
                   "created": created, "model": self.model, "choices": [choice], "usage": usage}  # fmt: skip
            return (json.dumps(doc) + "\n").encode()
        return self._stream(ticket, request, text, tokens, meta, ident, created, start_stream, send, bool(stops),
                            times)  # fmt: skip

    def _wait(self, ticket: Any) -> Any:
        try:
            return ticket.result(timeout=self.wait_s)
        except TimeoutError:
            ticket.cancel()
            raise ApiError(504, "the generation did not finish in time", kind="server_error") from None
        except InvalidInputError as e:
            raise ApiError(400, str(e)) from None
        except LayerZeroError as e:
            raise ApiError(500, f"generation failed: {e}", kind="server_error") from None

    def _usage(self, request: GenerationRequest, ids: list[int]) -> dict[str, int]:
        n, p = len(ids), len(request.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

    def _stream(self, ticket: Any, request: GenerationRequest, text: _StopText, tokens: queue.Queue, meta: dict,
                ident: str, created: int, start_stream: Callable[[], None], send: Callable[[bytes], bool],
                has_stops: bool, times: list[float]) -> bytes:  # fmt: skip
        chat = meta["chat"]
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bool:
            doc: dict[str, Any] = {"id": ident, "object": kind, "created": created, "model": self.model,
                                   "choices": [] if choice is None else [choice]}  # fmt: skip
            if usage is not None or (meta["usage_chunk"] and choice is not None):
                doc["usage"] = usage
            return send(b"data: " + json.dumps(doc).encode() + b"\n\n")

        def piece(content: str, finish: str | None = None, first: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": content} if first else {"content": content}
                if finish is not None and not content:
                    delta = {}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}

        start_stream()
        alive = event(piece("", first=True)) if chat else True
        while alive:
            token = tokens.get()  # sleeps until a token or the end (on_done puts None)
            if token is None:
                break
            if not has_stops:
                text.add(token)
            chunk = text.ready(final=False)
            if chunk:
                alive = event(piece(chunk))
        if not alive:
            ticket.cancel()
            return b""
        try:
            generation = ticket.result(timeout=self.wait_s)
        except Exception as e:  # the model failed mid-stream: an error event, as OpenAI's streams end
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            send(b"data: " + ApiError(500, f"generation failed: {message}", kind="server_error").body().strip()
                 + b"\n\n")  # fmt: skip
            send(b"data: [DONE]\n\n")
            return b""
        if self.observe is not None:
            self.observe(len(generation.ids), times)
        rest = text.ready(final=True)
        if rest:
            event(piece(rest))
        finish = "stop" if generation.report.stop_reason in ("stop_token", "stop") else "length"
        event(piece("", finish))
        if meta["usage_chunk"]:
            event(None, self._usage(request, generation.ids))
        send(b"data: [DONE]\n\n")
        return b""
