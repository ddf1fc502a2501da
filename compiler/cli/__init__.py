"""The ``layerzero`` command line: one module per verb, each module's docstring is its --help.

Exit codes: 0 ok, 1 verification failed, 2 bad input (a malformed model, an unknown op, a missing
file, a wrong shape). Errors print one line on stderr naming what is wrong.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from layerzero import __version__
from layerzero.errors import LayerZeroError

__all__ = ["main"]

VERBS = (
    "inspect", "compile", "run", "profile", "report", "demo", "serve", "triton-export", "plugins",
    "export", "flag", "generate",
)


def _module_name(verb: str) -> str:
    # A verb may have dashes (triton-export); its module has underscores (triton_export.py).
    return f"layerzero.cli.{verb.replace('-', '_')}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layerzero",
        description="An ONNX compiler that removes computation which is zero, and its runtime.",
    )
    parser.add_argument("--version", action="version", version=f"layerzero {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the passes do")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        module = importlib.import_module(_module_name(verb))
        doc = (module.__doc__ or "").strip()
        p = sub.add_parser(
            verb,
            help=doc.splitlines()[0] if doc else verb,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
