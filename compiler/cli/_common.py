"""Argument parsing and printing shared by the verbs."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from rich.console import Console

from layerzero.errors import InvalidInputError

__all__ = ["console", "parse_feeds", "parse_shapes", "progress", "stderr"]

console = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


def parse_shapes(items: list[str] | None) -> dict[str, tuple[int, ...]]:
    """``--shape name:d0,d1`` → {"name": (d0, d1)}."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items or []:
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise InvalidInputError(f"--shape {item!r}: expected NAME:D0,D1,... (e.g. input_ids:1,16)")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(",") if d.strip() != "")
        except ValueError:
            raise InvalidInputError(f"--shape {item!r}: dims must be integers") from None
        if any(d < 0 for d in shapes[name]):
            raise InvalidInputError(f"--shape {item!r}: dims must be non-negative")
    return shapes


_SCALAR = re.compile(r"^[-+0-9.eE,\s\[\]]+$")


def parse_feeds(npz: Path | None, items: list[str] | None) -> dict[str, np.ndarray]:
    """Inputs from an .npz file and/or ``name=1,2,3`` / ``name=[[1,2],[3,4]]`` items."""
    feeds: dict[str, np.ndarray] = {}
    if npz is not None:
        try:
            with np.load(npz) as data:
                feeds.update({k: data[k] for k in data.files})
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"{npz}: cannot read inputs (.npz expected): {exc}") from None
    for item in items or []:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise InvalidInputError(f"--input {item!r}: expected NAME=VALUES (e.g. input_ids=1,2,3)")
        text = text.strip()
        if not _SCALAR.match(text):
            raise InvalidInputError(f"--input {name}: {text!r} is not a list of numbers")
        try:
            if text.startswith("["):
                import json

                value = np.asarray(json.loads(text))
            else:
                value = np.asarray([float(x) if any(c in x for c in ".eE") else int(x) for x in text.split(",")])
        except ValueError:
            raise InvalidInputError(f"--input {name}: {text!r} is not a list of numbers") from None
        feeds[name] = value
    return feeds


@contextlib.contextmanager
def progress(description: str, enabled: bool = True) -> Iterator:
    """A status spinner on stderr; yields a function that updates its text."""
    if not enabled or not stderr.is_terminal:
        yield lambda _msg: None
        return
    with stderr.status(description) as status:
        yield lambda msg: status.update(f"{description}: {msg}")
