"""Text in and out of a generating bundle: its tokenizer and chat template.

    codec = TextCodec.for_engine(engine)              # None when no tokenizer.json is found
    ids = codec.encode("Hello")                       # the tokenizer's special tokens added (BOS, ...)
    prompt = codec.chat_prompt([{"role": "user", "content": "Hi"}])   # the chat template, rendered
    text = codec.decode(new_ids)                      # special tokens left out

One path for ``layerzero generate --prompt`` and the server's OpenAI endpoints. The tokenizer is the Hugging Face
``tokenizer.json`` (the ``tokenizers`` package) found beside the bundle, beside the model it was compiled from
(``layerzero export`` copies the tokenizer files there), or given explicitly. The chat template is the folder's
``chat_template.jinja`` or the ``chat_template`` of its ``tokenizer_config.json``, rendered as transformers'
``apply_chat_template(..., add_generation_prompt=True)`` does: Jinja2 in a sandbox, ``trim_blocks`` and
``lstrip_blocks``, with ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and
``raise_exception``; the rendered text is encoded without adding special tokens again (the template writes them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layerzero.errors import InvalidInputError

__all__ = ["TextCodec", "find_tokenizer"]

logger = logging.getLogger(__name__)


def find_tokenizer(engine: Any, explicit: Path | None = None) -> Path | None:
    """The ``tokenizer.json`` for ``engine``: ``explicit`` (a file, or a folder holding one), else the one beside
    the bundle, else the one beside the bundle's source model; None when there is none."""
    if explicit is not None:
        path = explicit / "tokenizer.json" if explicit.is_dir() else explicit
        if not path.is_file():
            raise InvalidInputError(f"--tokenizer {explicit}: no tokenizer.json there")
        return path
    bundle = Path(engine.path)
    places = [bundle if bundle.is_dir() else bundle.parent]
    source = (getattr(engine, "manifest", None) or {}).get("source") or {}
    if isinstance(source, dict) and isinstance(source.get("path"), str) and source["path"]:
        places.append(Path(source["path"]).parent)
    return next((p / "tokenizer.json" for p in places if (p / "tokenizer.json").is_file()), None)


def _token_text(value: object) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken written as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class TextCodec:
    """A tokenizer and, when the model folder has one, its chat template (see the module doc)."""

    def __init__(self, tokenizer_path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InvalidInputError("text in/out needs the tokenizers package (pip install tokenizers)") from None
        self.path = Path(tokenizer_path)
        try:
            self.tokenizer = Tokenizer.from_file(str(self.path))
        except Exception as e:
            raise InvalidInputError(f"{self.path}: not a tokenizer.json the tokenizers package reads: "
                                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None  # fmt: skip
        folder = self.path.parent
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            try:
                loaded = json.loads((folder / "tokenizer_config.json").read_text())
                config = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError) as e:
                logger.warning("%s: tokenizer_config.json not read (%s)", folder, e)
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) and template.strip() else None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self._compiled: Any = None

    @classmethod
    def for_engine(cls, engine: Any, explicit: Path | None = None) -> TextCodec | None:
        path = find_tokenizer(engine, explicit)
        return None if path is None else cls(path)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        """The chat template rendered for ``messages`` with the assistant's turn opened."""
        if self.chat_template is None:
            raise InvalidInputError(f"{self.path.parent}: the model has no chat template (no chat_template in "
                                    "tokenizer_config.json, no chat_template.jinja): use /v1/completions")  # fmt: skip
        if self._compiled is None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
            try:
                self._compiled = env.from_string(self.chat_template)
            except TemplateError as e:
                raise InvalidInputError(f"{self.path.parent}: the chat template does not parse: {e}") from None
        from jinja2 import TemplateError

        try:
            return self._compiled.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                         eos_token=self.eos_token)  # fmt: skip
        except TemplateError as e:  # the template's own refusal (e.g. roles that must alternate)
            raise InvalidInputError(f"the chat template refused the messages: {e}") from None

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.chat_prompt(messages), special=False)
