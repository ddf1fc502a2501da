"""The exception types of LayerZero, one per kind of failure.

This module is a leaf (it imports nothing of ours), so passes, the runtime and the
compiler can all raise the same types. The CLI maps them to exit codes:
``UnsupportedModelError`` / ``InvalidInputError`` -> 2, ``VerificationError`` / ``CompilerError`` -> 1.
"""

from __future__ import annotations

__all__ = [
    "CompilerError",
    "InvalidInputError",
    "LayerZeroError",
    "UnsupportedModelError",
    "VerificationError",
]


class LayerZeroError(Exception):
    """Base class of every error LayerZero raises on purpose."""

    exit_code = 2


class UnsupportedModelError(LayerZeroError):
    """The model (file, graph, op or scope) cannot be compiled; the message names what and why."""


class InvalidInputError(LayerZeroError):
    """A user-supplied input (feed, shape, file, option) is wrong; the message names it."""


class CompilerError(LayerZeroError):
    """A pass failed on a model it should have handled: a LayerZero bug. The message names the pass; nothing is
    written. Exit 1, like a verification failure (the model is fine, the compiler is not)."""

    exit_code = 1


class VerificationError(LayerZeroError):
    """The compiled model does not match the reference within tolerance."""

    exit_code = 1

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result  # the VerificationResult, when there is one
