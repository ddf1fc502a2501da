"""Argument parsing and printing shared by the verbs."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from layerzero.errors import InvalidInputError
from layerzero.options import DEVICES, MOE_LOWERINGS, STABILITY_UNITS, CompileOptions

__all__ = [
    "MAX_DIM",
    "MAX_ELEMENTS",
    "add_device",
    "add_flag_pattern",
    "add_force",
    "add_guard_arguments",
    "add_impact_tolerance",
    "add_moe_lowering",
    "add_stability_unit",
    "add_stability_window",
    "add_threads",
    "check_output_dir",
    "check_output_file",
    "console",
    "fraction",
    "integer",
    "number",
    "one_line_errors",
    "parse_feeds",
    "parse_shapes",
    "port",
    "positive",
    "progress",
    "source_of",
    "stderr",
    "thread_options",
    "write_file_atomic",
]

console = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


#: The largest dim, and element count, a --shape may ask for: 2**31 elements of float32 is already 8 GiB of
#: one sample input, far past any verification run, and numpy would fail with a traceback further on.
MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**31


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> argparse.FileType:
    """An argparse ``type=`` for a finite float in [lo, hi] (``lo_open``: (lo, hi]); the error names the value,
    argparse adds the option (exit 2)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
        if lo is not None and (value < lo or (lo_open and value == lo)):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {'>' if lo_open else '>='} {lo:g}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"{text!r}: must be <= {hi:g}")
        return value

    parse.__name__ = "number"
    return parse  # type: ignore[return-value]


def integer(lo: int | None = None, hi: int | None = None) -> argparse.FileType:
    """An argparse ``type=`` for an integer in [lo, hi] (no 300-digit numbers, no floats)."""

    def parse(text: str) -> int:
        text = text.strip()
        if len(text) > 20:
            raise argparse.ArgumentTypeError(f"{text[:20]!r}...: integer too large")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {lo}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"{value}: must be <= {hi}")
        return value

    parse.__name__ = "integer"
    return parse  # type: ignore[return-value]


def one_line_errors(p: argparse.ArgumentParser) -> None:
    """Make ``p`` report a bad argument as one line (``layerzero VERB: error: argument --x: ...``), exit 2,
    without the usage block argparse prints first: the house rule is one line naming the problem."""

    def error(message: str) -> None:
        p.exit(2, f"{p.prog}: error: {message} (see --help)\n")

    p.error = error  # type: ignore[method-assign]


#: A TCP port (``0`` is not: Triton needs fixed ports).
port = integer(1, 65535)
#: A fraction (a sample rate, a threshold): finite, in [0, 1].
fraction = number(0, 1)
#: A finite number > 0 (a bound, a window).
positive = number(0, lo_open=True)


# The flags several verbs share: one definition each (type, default, choices from ``layerzero.options``), used by
# every verb that has the flag; ``help`` says what the flag does for that verb where that differs.
_Parser = argparse.ArgumentParser | argparse._ArgumentGroup


def add_force(p: _Parser, help: str) -> None:
    """``--force``: replace an existing output (``help``: which one, and when)."""
    p.add_argument("--force", action="store_true", help=help)


def add_device(p: _Parser, help: str = "execution device (default cpu)") -> None:
    """``--device`` (``DEVICES``, default cpu)."""
    p.add_argument("--device", choices=DEVICES, default=CompileOptions.device, help=help)


def add_no_activation_sparsity(p: _Parser) -> None:
    """``--no-activation-sparsity``: run with ``layerzero::activation_scale`` 0, the dense model exactly (A/B)."""
    p.add_argument(
        "--no-activation-sparsity",
        action="store_true",
        help="run a bundle compiled with --activation-sparsity dense (activation scale 0: the dense outputs exactly)",
    )


def apply_activation_flag(engine: Any, args: argparse.Namespace) -> None:
    """``--no-activation-sparsity``: every request of ``engine`` runs at activation scale 0."""
    if getattr(args, "no_activation_sparsity", False):
        engine.activation_scale = 0.0


def add_flag_pattern(p: _Parser) -> None:
    """``--flag-pattern``: the names of zero flags (``CompileOptions.flag_pattern``)."""
    default = CompileOptions.flag_pattern
    p.add_argument("--flag-pattern", default=default, help=f"names of zero flags; '*' is the scope (default {default})")


def add_moe_lowering(p: _Parser) -> None:
    """``--moe-lowering`` (``MOE_LOWERINGS``, ``CompileOptions.moe_lowering``)."""
    p.add_argument(
        "--moe-lowering",
        choices=MOE_LOWERINGS,
        default=CompileOptions.moe_lowering,
        help="MoE blocks on onnxruntime: per-expert If subgraphs, com.microsoft.MoE, the liblayerzero_ort.so "
        "custom op (layerzero plugins build), or auto (default: native when built, else measured)",
    )


def add_impact_tolerance(p: _Parser, help: str) -> None:
    """``--impact-tolerance T`` (``CompileOptions.impact_tolerance``, 0.01); ``help`` should name the default."""
    default = CompileOptions.impact_tolerance
    p.add_argument("--impact-tolerance", type=number(0), default=default, metavar="T", help=help)


def add_stability_window(p: _Parser, help: str, *, default: int | None = CompileOptions.stability_window) -> None:
    """``--stability-window N`` (an integer >= 1; ``default`` None: not set)."""
    p.add_argument("--stability-window", type=integer(1), default=default, metavar="N", help=help)


def add_stability_unit(p: _Parser, help: str) -> None:
    """``--stability-unit`` (``STABILITY_UNITS``, ``CompileOptions.stability_unit``)."""
    p.add_argument("--stability-unit", choices=STABILITY_UNITS, default=CompileOptions.stability_unit, help=help)


def add_threads(p: _Parser) -> None:
    """``--threads N`` (ONNX Runtime's intra-op threads for the engine's sessions; default: its own choice, one per
    core) and ``--no-spin`` (its idle workers sleep instead of spinning); ``thread_options`` turns them into
    ``Engine.load`` options."""
    p.add_argument(
        "--threads",
        type=integer(1, 1024),
        default=None,
        metavar="N",
        help="ONNX Runtime intra-op threads per session (default: onnxruntime's choice, one per core)",
    )
    p.add_argument(
        "--no-spin",
        action="store_true",
        help="idle ONNX Runtime worker threads sleep instead of spinning (faster where other processes share the "
        "cores)",
    )


def thread_options(args: argparse.Namespace, backend: str = "onnxruntime") -> dict[str, Any]:
    """The ``Engine.load`` options ``--threads`` / ``--no-spin`` ask for ({} when neither is given); refused for a
    backend that has no thread pool of ours to size (TensorRT)."""
    threads = getattr(args, "threads", None)
    no_spin = bool(getattr(args, "no_spin", False))
    if threads is None and not no_spin:
        return {}
    if backend not in ("onnxruntime", "ort"):
        flag = f"--threads {threads}" if threads is not None else "--no-spin"
        raise InvalidInputError(f"{flag}: sets ONNX Runtime's thread pool; backend {backend!r} has none")
    options: dict[str, Any] = {} if threads is None else {"intra_op_num_threads": int(threads)}
    if no_spin:
        options["allow_spinning"] = False
    return options


def add_guard_arguments(p: _Parser) -> None:
    """The guard's reference and sampling (``serve``, ``triton-export``): ``--reference``, ``--no-reference``,
    ``--sample-rate``, ``--fallback-bound``, ``--max-tokens``."""
    p.add_argument("--reference", type=Path, metavar="MODEL", help="the reference model (default: the source)")
    p.add_argument("--no-reference", action="store_true", help="no reference model (guard off)")
    p.add_argument("--sample-rate", type=fraction, help="fraction of requests compared (default 0.01 with a reference)")
    p.add_argument("--fallback-bound", type=positive, default=0.05, help="relative L2 error bound (default 0.05)")
    p.add_argument("--max-tokens", type=integer(1), help="requests with more tokens go to the reference")


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
        if any(d > MAX_DIM for d in shapes[name]) or math.prod(shapes[name]) > MAX_ELEMENTS:
            raise InvalidInputError(f"--shape {item[:60]!r}: too large (at most {MAX_ELEMENTS:,} elements)")
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
    """Progress on stderr when it is a terminal (nothing when piped): yields ``say(message, done=None,
    total=None)``; a message alone is a stage (a spinner and the elapsed time), ``done`` / ``total`` draw a bar
    (verification's model runs, a chunked run's chunks)."""
    if not enabled or not stderr.is_terminal:
        yield lambda *_a, **_k: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=stderr, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def say(message: str, done: int | None = None, total: int | None = None) -> None:
            bar.update(task, description=f"{description}: {message}", completed=done or 0, total=total)
            bar.refresh()  # drawn now, not at the next tick: a short stage is still seen

        yield say


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(path: Path, option: str) -> None:
    """Refuse, before any work, an output whose directory cannot be created or written (``-o /proc/x``)."""
    parent = _nearest_existing(Path(os.path.abspath(path)).parent)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{option} {path}: cannot write in {parent} (not a writable directory)")


def check_output_file(
    path: Path,
    option: str,
    *,
    kind: str,
    force: bool,
    is_ours: Callable[[Path], bool],
    protect: Iterable[str | os.PathLike[str]] = (),
    protect_dirs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Refuse an output file that would replace what the user did not name as an output.

    Cases: 1. ``path`` is one of ``protect`` (the source model, the input data) or lies in one of
    ``protect_dirs`` (a bundle): always refused, ``--force`` or not. 2. ``path`` is a directory (or a link to
    one). 3. ``path`` exists and ``is_ours`` says it is not a LayerZero ``kind``: refused unless ``force``.
    4. its directory is not writable.
    """
    real = Path(os.path.realpath(path))
    for p in protect:
        if os.path.lexists(p) and real == Path(os.path.realpath(p)):
            raise InvalidInputError(f"{option} {path}: that is the input {p}; choose another output path")
    for d in protect_dirs:
        if os.path.isdir(d) and real.is_relative_to(os.path.realpath(d)):
            raise InvalidInputError(f"{option} {path}: that is inside the bundle {d}; choose another output path")
    if os.path.isdir(path):
        raise InvalidInputError(f"{option} {path}: is a directory; give a file name")
    if os.path.lexists(path) and not force:
        try:
            ours = is_ours(Path(path))
        except Exception:  # whatever the file holds, it is not ours if we cannot read it as ours
            ours = False
        if not ours:
            raise InvalidInputError(
                f"{option} {path}: exists and is not a LayerZero {kind}; pass --force to replace it"
            )
    check_output_dir(path, option)


def source_of(bundle: Path) -> list[Path]:
    """The model a bundle was compiled from (its manifest's source path), as a list for ``protect``."""
    from layerzero.runtime.bundle import read_bundle

    if not Path(bundle).is_dir():
        return []
    source = (read_bundle(bundle).manifest.get("source") or {}).get("path")
    return [Path(source)] if isinstance(source, str) and source else []


def write_file_atomic(path: Path, data: bytes, option: str = "output") -> None:
    """Write ``data`` to ``path`` through a temp file in its directory + rename: a reader (or a crash) sees the
    old file or the new one, never half; the file's mode follows the umask. OS errors become one line."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise InvalidInputError(f"{option} {path}: cannot write it: {e.strerror or e}") from None
