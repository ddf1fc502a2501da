"""The generate endpoint's requests: its configuration and the checks of a ``POST /v1/generate`` body.

``parse_request`` turns a body into ``generate``'s keyword arguments or raises ``Refused`` (an HTTP status and
one line); see ``layerzero.runtime.generate_server`` for the endpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from layerzero.errors import InvalidInputError

__all__ = ["GENERATE_PATH", "GenerateServerConfig", "Refused", "one_line", "parse_request"]

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
    batch_rows: int = 8  # generations sharing decode steps (the continuous batch)
    max_queue: int = 64  # generations waiting for a row; past it a 503
    model_name: str = "model"  # the OpenAI endpoints' model id

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompt_tokens", "max_new_tokens_cap", "max_concurrent", "max_batch",
                     "batch_rows"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"generate endpoint {name} must be >= 1, got {getattr(self, name)}")
        if not self.client_timeout_s > 0:
            raise InvalidInputError(f"generate endpoint client_timeout_s must be > 0, got {self.client_timeout_s}")


class Refused(Exception):
    """A request refused before any model work: its HTTP ``status`` and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def one_line(message: str, limit: int = 400) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _int(doc: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int | None) -> int | None:
    value = doc.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(400, f"{key} must be an integer, got {json.dumps(value)[:40]}")
    if value < lo or (hi is not None and value > hi):
        raise Refused(400, f"{key}={value}: must be in [{lo}, {hi if hi is not None else 'inf'}]")
    return value


def _float(doc: Mapping[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Refused(400, f"{key} must be a finite number, got {json.dumps(value)[:40]}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise Refused(400, f"{key}={value}: must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    return float(value)


def _ids(doc: Mapping[str, Any], key: str, vocab: int | None, limit: int) -> list[int] | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise Refused(400, f"{key} must be a list of token ids, got {type(value).__name__}")
    if len(value) > limit:
        raise Refused(400, f"{key} has {len(value)} tokens; at most {limit} are accepted")
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int):
            raise Refused(400, f"{key} must hold integers, got {json.dumps(i)[:40]}")
        if i < 0 or (vocab is not None and i >= vocab):
            bound = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise Refused(400, f"{key}: token id {i} is outside the vocabulary {bound}")
    return value


def parse_request(body: bytes, config: GenerateServerConfig, vocab: int | None) -> dict[str, Any]:
    """The validated options of one request (``generate``'s keyword arguments plus ``prompt_ids``, ``stream``).

    Raises ``_Refused`` (status, one line) for anything the module doc lists as a 4xx.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(400, f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise Refused(400, f"the body must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise Refused(400, f"unknown key(s) {unknown}; known: {sorted(_KEYS)}")
    if "prompts" in doc:
        if "prompt_ids" in doc:
            raise Refused(400, "give prompt_ids (one prompt) or prompts (a batch), not both")
        batch = doc["prompts"]
        if not isinstance(batch, list) or not batch:
            raise Refused(400, "prompts must be a non-empty list of token id lists")
        if len(batch) > config.max_batch:
            raise Refused(400, f"prompts has {len(batch)} prompts; at most {config.max_batch} are accepted")
        prompt: list[int] | list[list[int]] = []
        for i, item in enumerate(batch):
            ids = _ids({f"prompts[{i}]": item}, f"prompts[{i}]", vocab, config.max_prompt_tokens)
            if not ids:
                raise Refused(400, f"prompts[{i}] must be a non-empty list of token ids")
            prompt.append(ids)  # type: ignore[arg-type]
    else:
        prompt = _ids(doc, "prompt_ids", vocab, config.max_prompt_tokens) or []
        if not prompt:
            raise Refused(400, "prompt_ids is required: a non-empty list of token ids (or prompts, a batch)")
    stream = doc.get("stream", True)
    if not isinstance(stream, bool):
        raise Refused(400, f"stream must be true or false, got {json.dumps(stream)[:40]}")
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
