"""The passes' one vocabulary for "this rewrite does not apply".

A matcher raises :class:`NoMatch` with the reason and the nodes it had matched when the check failed; a pass
that tries several ways (router variants, operand orders, leaves of a chain) keeps the attempt that got furthest
(:func:`furthest`, :class:`Attempts`) and reports that one. A pass that records why it left something as it was
(in the model's metadata, in the compile summary) records a :class:`Refusal`, made from the failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import onnx_ir as ir

__all__ = ["Attempts", "NoMatch", "Refusal", "furthest", "label", "need"]


def label(node: ir.Node) -> str:
    """``"<op_type> <name>"`` of a node (its first output's name when the node has none)."""
    name = node.name or (node.outputs[0].name if node.outputs and node.outputs[0].name else "")
    return f"{node.op_type} {name}".rstrip()


class NoMatch(Exception):
    """A check of a matcher failed: ``reason`` says which, ``nodes`` are the nodes matched so far (the last one
    is where the attempt stopped). ``progress`` orders attempts (default: how many nodes were matched)."""

    def __init__(self, reason: str, *nodes: ir.Node, progress: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.nodes: tuple[ir.Node, ...] = tuple(n for n in nodes if n is not None)
        self.progress = len(self.nodes) if progress is None else progress

    @property
    def where(self) -> str:
        """The node where the attempt stopped, as ``"<op_type> <name>"`` ("" when none was matched)."""
        return label(self.nodes[-1]) if self.nodes else ""

    def __str__(self) -> str:
        return self.reason


def need(condition: object, reason: str, *nodes: ir.Node) -> None:
    """Raise :class:`NoMatch` (``reason``, ``nodes``) unless ``condition`` holds."""
    if not condition:
        raise NoMatch(reason, *nodes)


def furthest(failures: Iterable[NoMatch]) -> NoMatch | None:
    """The failure that got furthest (the first of equals), or None for none."""
    best: NoMatch | None = None
    for failure in failures:
        if best is None or failure.progress > best.progress:
            best = failure
    return best


class Attempts:
    """Several ways to match one thing: each ``with attempts.trying():`` block that raises :class:`NoMatch`
    is recorded; :meth:`best` is the one that got furthest.

    >>> attempts = Attempts()
    >>> for variant in variants:
    ...     with attempts.trying():
    ...         return variant.match(node)
    >>> raise attempts.best() or NoMatch("no variant")
    """

    def __init__(self) -> None:
        self.failures: list[NoMatch] = []

    @contextlib.contextmanager
    def trying(self) -> Iterator[None]:
        try:
            yield
        except NoMatch as failure:
            self.failures.append(failure)

    def best(self) -> NoMatch | None:
        return furthest(self.failures)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """What a pass left as it was, and why: ``path`` (a scope or dynamic path), ``reason``, ``node`` (where the
    furthest attempt stopped, ``"<op_type> <name>"``) and ``kind`` (what was refused: "moe", "gate", ...)."""

    path: str
    reason: str
    node: str = ""
    kind: str = ""

    @classmethod
    def of(cls, path: str, failure: NoMatch, kind: str = "") -> Refusal:
        return cls(path, failure.reason, failure.where, kind)

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v or k in ("path", "reason")}

    @classmethod
    def from_json(cls, d: dict[str, str], kind: str = "") -> Refusal:
        return cls(str(d["path"]), str(d["reason"]), str(d.get("node", "")), str(d.get("kind", kind)))
