"""The file side of a bundle: publishing a staged directory atomically, the refusal to replace what is not a
bundle, the lock of concurrent writers, the temp directories a dead process left, and the integrity fingerprint
(``fingerprint_files`` at write time, ``check_integrity`` at load). ``layerzero.runtime.bundle`` writes and reads
bundles with these.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from layerzero.errors import InvalidInputError

__all__ = [
    "BUNDLE_FORMAT",
    "CHUNK_BYTES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MODEL_NAME",
    "check_integrity",
    "check_protect",
    "check_replaceable",
    "clean_stale_temp_dirs",
    "current_umask",
    "fingerprint_files",
    "fsync_dir",
    "fsync_tree",
    "is_plain_file_name",
    "locked",
    "move_into_place",
    "publish_staged",
    "sampled_sha256",
    "sha256_file",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MODEL_NAME = "model.onnx"
BUNDLE_FORMAT = "layerzero-bundle"
FORMAT_VERSION = 1
CHUNK_BYTES = 1024 * 1024


def is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and Path(name).name == name and "\\" not in name


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex SHA-256 of a file, read in 1 MiB chunks so that big models are never held in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------- writing


def check_protect(out: Path, protect: Sequence[str | os.PathLike[str]]) -> None:
    out_real = Path(os.path.realpath(out))
    for p in protect:
        p_real = Path(os.path.realpath(p))
        if p_real == out_real:
            raise InvalidInputError(f"refusing to write the bundle over the input {p}; choose another output path")
        if p_real.is_relative_to(out_real):
            raise InvalidInputError(
                f"refusing to write the bundle to {out}: it contains the input {p}; choose another output path"
            )


def publish_staged(staging: Path, out: Path, *, overwrite: bool) -> None:
    """Move a bundle staged in ``staging`` (a sibling temp dir of ``out``) into place atomically.

    For targets that add files (a TensorRT plan) to what ``write_bundle`` staged: synced to disk, ``out`` checked
    to be replaceable, then swapped in so that a reader never sees a half bundle.
    """
    fsync_tree(staging)
    if out.exists():
        check_replaceable(out)
    move_into_place(staging, out, overwrite=overwrite)


def check_replaceable(out: Path) -> None:
    # overwrite=True deletes what is there: make sure it is a bundle (or nothing), never e.g. a home dir.
    # NOTE: the first check runs outside the swap lock, where a concurrent writer's swap (out -> aside, new -> out)
    # can make `out` vanish for a moment: what is gone needs no protecting; the check under the lock decides.
    # One lstat decides "absent / a directory / something else": two calls (exists, then is_dir) can straddle
    # a concurrent swap and see a directory that is gone by the second read as "not a directory".
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise InvalidInputError(f"refusing to overwrite {out}: it is not a directory, so not a LayerZero bundle")
    manifest = None
    for _attempt in range(5):  # a concurrent swap may replace `out` between our reads: read again
        try:
            if not any(out.iterdir()):
                return
            manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
            break
        except FileNotFoundError:
            if not os.path.lexists(out):
                return
        except (OSError, ValueError):
            break
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise InvalidInputError(
            f"refusing to overwrite {out}: it is not a LayerZero bundle (no valid {MANIFEST_NAME}); "
            "remove it yourself or choose another output path"
        )


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    # An exclusive flock on the parent directory itself (no lock file left behind) serialises the swaps of
    # concurrent writers to one output: each sees a consistent `out`, the last one wins, nothing is left aside.
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the swap below is still atomic per rename
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def move_into_place(tmp: Path, out: Path, *, overwrite: bool) -> None:
    aside: Path | None = None
    with locked(out.parent):
        if not (overwrite and os.path.lexists(out)):
            if os.path.lexists(out):  # appeared since the check above
                raise InvalidInputError(f"{out} already exists; pass overwrite=True (--force) to replace it")
            os.rename(tmp, out)
            fsync_dir(out.parent)
            return
        check_replaceable(out)  # again, under the lock: another writer may have put something else there
        # Reserve a unique name for the old bundle, then swap: old -> aside, new -> out, delete aside.
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        os.rmdir(aside)
        os.rename(out, aside)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(aside, out)  # put the old bundle back
            raise
        fsync_dir(out.parent)
    shutil.rmtree(aside, ignore_errors=True)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: Temporary directories LayerZero makes, with the pid of the process that made them: ``.NAME.tmp-PID-*``,
#: ``.NAME.old-PID-*`` next to a bundle, ``layerzero-verify-PID-*`` (and other ``layerzero-*-PID-*``) in the
#: system temp dir.
_TEMP_PID = re.compile(r"^(?:\..+\.(?:tmp|old)|layerzero-[a-z]+)-(\d+)-[^/]*$")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's live process (or a number that is no pid): leave it
    return True


def clean_stale_temp_dirs(parent: str | os.PathLike[str] | None = None, name: str | None = None) -> list[Path]:
    """Remove the temporary directories of LayerZero processes that died (killed mid-compile); return them.

    Looks in ``parent`` for ``.NAME.tmp-PID-*`` / ``.NAME.old-PID-*`` (``name`` given: that bundle's only) and in
    the system temp dir for ``layerzero-*-PID-*``; a directory is removed only when its PID is not running.
    """
    removed: list[Path] = []
    places = [Path(tempfile.gettempdir())]
    if parent is not None:
        places.append(Path(parent))
    for place in places:
        try:
            entries = list(os.scandir(place))
        except OSError:
            continue
        for entry in entries:
            match = _TEMP_PID.match(entry.name)
            if match is None or (name is not None and place != places[0] and not entry.name.startswith(f".{name}.")):
                continue
            if not entry.is_dir(follow_symlinks=False) or _pid_alive(int(match.group(1))):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
            logger.info("removed %s, left by a LayerZero process that died", entry.path)
    return removed


# --------------------------------------------------------------------------------------------------- integrity

#: Blocks hashed for the cheap fingerprint of a data file: 64 KiB at 17 evenly spaced offsets (first and last
#: included), ~1 MiB read whatever the file's size.
_SAMPLE_BLOCKS = 17
_SAMPLE_BYTES = 64 * 1024


def sampled_sha256(path: str | os.PathLike[str]) -> str:
    """A cheap fingerprint of a (multi-GB) file: the SHA-256 of its size and of blocks at fixed offsets."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        last = max(0, size - _SAMPLE_BYTES)
        for i in range(_SAMPLE_BLOCKS):
            f.seek(last * i // (_SAMPLE_BLOCKS - 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def fingerprint_files(root: Path, model_file: str) -> dict[str, dict[str, Any]]:
    """The manifest's ``integrity`` section: size + sha256 of the model file; size, sampled and full sha256 of
    each external-data file next to it."""
    doc: dict[str, dict[str, Any]] = {model_file: {"size": (root / model_file).stat().st_size,
                                                   "sha256": sha256_file(root / model_file)}}  # fmt: skip
    for path in sorted(root.iterdir()):
        if path.name.startswith(model_file + ".data") and path.is_file():
            doc[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path),
                              "sampled_sha256": sampled_sha256(path)}  # fmt: skip
    return doc


def check_integrity(root: Path, manifest: Mapping[str, Any], *, full: bool = False) -> None:
    """Check the bundle's files against the manifest's ``integrity`` section. The model file: size and sha256.
    Data files: size and the sampled fingerprint, which costs ~1 MiB of reads whatever their size; ``full``:
    their sha256 too.

    A bundle without the section (written by a LayerZero before it existed, or a manifest edited by hand) is
    refused too: nothing says its ``model.onnx`` is the model its manifest describes, and the runtime refuses
    what it cannot check rather than run another model under this one's report. Recompiling writes it.

    Raises:
        InvalidInputError: naming the file that differs from what was compiled, or the bundle without a
            fingerprint and the command that writes one.
    """
    integrity = manifest.get("integrity")
    if integrity is None:
        raise InvalidInputError(
            f"bundle {root} has no integrity fingerprint (written by an older LayerZero); recompile it: "
            f"layerzero compile SOURCE.onnx -o {root} --force"
        )
    if not isinstance(integrity, dict) or not all(isinstance(v, dict) for v in integrity.values()):
        raise InvalidInputError(f"{root / MANIFEST_NAME}: integrity must map file names to their fingerprints")
    for file_name, expected in integrity.items():
        if not isinstance(file_name, str) or not is_plain_file_name(file_name):
            raise InvalidInputError(f"{root / MANIFEST_NAME}: integrity names {file_name!r}, not a plain file name")
        path = root / file_name
        try:
            size = path.stat().st_size
            if size != expected.get("size"):
                raise _Mismatch(f"{size} bytes, compiled as {expected.get('size')}")
            if "sampled_sha256" in expected and sampled_sha256(path) != expected["sampled_sha256"]:
                raise _Mismatch("its sampled fingerprint differs")
            if ("sampled_sha256" not in expected or full) and sha256_file(path) != expected.get("sha256"):
                raise _Mismatch("its sha256 differs")
        except FileNotFoundError:
            raise InvalidInputError(f"bundle {root} is incomplete: {file_name} is missing") from None
        except _Mismatch as e:
            raise InvalidInputError(
                f"{path} is not the file this bundle was compiled with ({e}); recompile, or restore the bundle"
            ) from None


class _Mismatch(Exception):
    pass


def fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    # Directory fsync makes the rename durable; not every platform/file system allows it.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
