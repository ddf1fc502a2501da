"""The ``layerzero`` command line: one module per verb, each module's docstring is its --help.

Exit codes: 0 ok, 1 verification failed, 2 bad input (a malformed model, an unknown op, a missing
file, a wrong shape). Errors print one line on stderr naming what is wrong.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from layerzero import __version__
from layerzero.errors import LayerZeroError

__all__ = ["VERBS", "build_parser", "main"]

VERBS = (
    "inspect", "compile", "run", "profile", "report", "demo", "serve", "triton-export", "plugins",
    "export", "flag", "generate",
)


def _module_name(verb: str) -> str:
    # A verb may have dashes (triton-export); its module has underscores (triton_export.py).
    return f"layerzero.cli.{verb.replace('-', '_')}"


def _docstring(verb: str) -> str:
    """A verb module's docstring, read from its source: listing the verbs imports none of them (and nothing
    they import: onnx, onnxruntime, torch)."""
    spec = importlib.util.find_spec(_module_name(verb))
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"no module for the layerzero verb {verb!r}")
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""


def _chosen_verb(argv: Sequence[str]) -> str | None:
    # The first word that is a verb (the top-level options take no value).
    return next((a for a in argv if a in VERBS), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser. Only the verb in ``argv`` (every verb when ``argv`` is None) is imported and gets its
    arguments; the others are listed with the first line of their docstring."""
    chosen = None if argv is None else _chosen_verb(argv)
    parser = argparse.ArgumentParser(
        prog="layerzero",
        description="An ONNX compiler that removes computation which is zero, and its runtime.",
    )
    parser.add_argument("--version", action="version", version=f"layerzero {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the passes do")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        full = argv is None or verb == chosen
        module = importlib.import_module(_module_name(verb)) if full else None
        doc = ((module.__doc__ if module is not None else _docstring(verb)) or "").strip()
        p = sub.add_parser(
            verb,
            help=doc.splitlines()[0] if doc else verb,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if module is not None:
            module.add_arguments(p)
            p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.handler(args) or 0)
    except LayerZeroError as exc:
        print(f"layerzero {args.verb}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"layerzero {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
