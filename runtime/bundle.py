"""Engine bundles: the directory ``layerzero compile`` writes and ``Engine.load`` reads.

A bundle is a directory holding the compiled model and a JSON manifest::

    model.lz/
        manifest.json       # what was compiled, from what, with which options, what was removed
        model.onnx          # the compiled graph
        model.onnx.data     # its weights, only when they are big (see ``write_bundle``)

``write_bundle`` is atomic: everything is written into a temporary directory next to the destination, flushed
to disk, and renamed into place, so a reader sees either no bundle, the old one, or the complete new one.
``read_bundle`` checks the layout (manifest, model file, every external-data file the model references)
without loading any weights, so a broken bundle fails at load time with a message that names the missing file.

``read_bundle`` accepts bundle directories only. A plain ``.onnx`` file is not a bundle; ``Engine.load``
runs one directly as an uncompiled model with an empty manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerzero.errors import InvalidInputError

if TYPE_CHECKING:
    import onnx
    import onnx_ir

__all__ = [
    "BUNDLE_FORMAT",
    "DEFAULT_EXTERNAL_THRESHOLD_BYTES",
    "EXTERNAL_TENSOR_MIN_BYTES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MODEL_NAME",
    "Bundle",
    "check_external_data",
    "check_integrity",
    "check_replaceable",
    "clean_stale_temp_dirs",
    "fingerprint_files",
    "publish_staged",
    "read_bundle",
    "sampled_sha256",
    "sha256_file",
    "write_bundle",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MODEL_NAME = "model.onnx"
BUNDLE_FORMAT = "layerzero-bundle"
FORMAT_VERSION = 1

#: Weights go to ``<model_file>.data`` when the model's initializers total more than this many bytes.
DEFAULT_EXTERNAL_THRESHOLD_BYTES = 256 * 1024 * 1024
#: When weights go external, tensors of at least this many bytes do; smaller ones stay in the model file.
EXTERNAL_TENSOR_MIN_BYTES = 1024
# A serialized protobuf cannot exceed 2 GiB, whatever threshold the caller asked for.
_PROTOBUF_LIMIT_BYTES = 2**31 - 64 * 1024 * 1024

_CHUNK_BYTES = 1024 * 1024


@dataclasses.dataclass
class Bundle:
    """A bundle on disk, checked by ``read_bundle``: its directory, parsed manifest and model file."""

    path: Path
    manifest: dict[str, Any]
    model_path: Path

    @property
    def external_data_paths(self) -> list[Path]:
        """The external-data files next to the model (``model.onnx.data``), if any."""
        return sorted(p for p in self.path.iterdir() if p.name.startswith(self.model_path.name + ".data"))


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex SHA-256 of a file, read in 1 MiB chunks so that big models are never held in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------- writing


def write_bundle(
    out_dir: str | os.PathLike[str],
    model: onnx.ModelProto | onnx_ir.Model,
    manifest: Mapping[str, Any],
    *,
    overwrite: bool = False,
    protect: Sequence[str | os.PathLike[str]] = (),
    external_threshold_bytes: int = DEFAULT_EXTERNAL_THRESHOLD_BYTES,
) -> Path:
    """Write ``model`` and ``manifest`` as a bundle directory at ``out_dir``, atomically; return its path.

    Everything is written into a temporary directory in ``out_dir``'s parent (same file system, so the final
    ``os.rename`` is atomic), fsynced, then renamed to ``out_dir``. On any failure the temporary directory is
    removed and ``out_dir`` is left as it was (absent, or the previous bundle when overwriting).

    Args:
        out_dir: The bundle directory to create.
        model: The compiled model. Neither form is modified. A ``ModelProto`` must hold its weights in memory
            (not references to external files); an ``onnx_ir.Model`` may reference external data, which is
            copied into the bundle.
        manifest: JSON-serialisable metadata. ``format``, ``format_version``, ``model_file`` and
            ``layerzero_version`` are filled in when absent.
        overwrite: Replace an existing bundle at ``out_dir``. Only a LayerZero bundle or an empty directory is
            ever replaced, never another file or a directory with other content.
        protect: Paths that must survive the write (the compile's input files): ``out_dir`` may be neither one
            of them nor a directory containing one.
        external_threshold_bytes: When the model's initializers total more than this, tensors of at least
            ``EXTERNAL_TENSOR_MIN_BYTES`` go to ``<model_file>.data`` next to the model.

    Raises:
        InvalidInputError: ``out_dir`` exists (without ``overwrite``), is protected, or is not replaceable;
            the manifest is not JSON-serialisable; the model's weights are not available.
    """
    out = Path(os.path.abspath(out_dir))
    _check_protect(out, protect)
    if os.path.lexists(out):
        if not overwrite:
            raise InvalidInputError(f"{out} already exists; pass overwrite=True (--force) to replace it")
        check_replaceable(out)

    full_manifest = _complete_manifest(manifest)
    libraries = _custom_op_libraries(model)
    if libraries:  # the runtime registers these with the session (runtime/backends/onnxruntime.py)
        full_manifest.setdefault("libraries", libraries)
    model_file = full_manifest["model_file"]
    try:
        manifest_text = json.dumps(full_manifest, indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"the bundle manifest is not JSON-serialisable: {e}") from e

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale_temp_dirs(out.parent, out.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise InvalidInputError(f"cannot write the bundle {out}: {e.strerror or e}") from None
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700: a Triton service account could not read it
        _save_model(model, tmp / model_file, external_threshold_bytes)
        full_manifest["integrity"] = fingerprint_files(tmp, model_file)
        manifest_text = json.dumps(full_manifest, indent=2) + "\n"
        (tmp / MANIFEST_NAME).write_text(manifest_text, encoding="utf-8")
        _fsync_tree(tmp)
        _move_into_place(tmp, out, overwrite=overwrite)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InvalidInputError(f"cannot write the bundle {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote bundle %s", out)
    return out


def _complete_manifest(manifest: Mapping[str, Any]) -> dict[str, Any]:
    from layerzero import __version__

    full = dict(manifest)
    full.setdefault("format", BUNDLE_FORMAT)
    full.setdefault("format_version", FORMAT_VERSION)
    full.setdefault("layerzero_version", __version__)
    full.setdefault("model_file", MODEL_NAME)
    # This writer writes this format, nothing else: a caller's other value would make an unreadable bundle.
    if full["format"] != BUNDLE_FORMAT or full["format_version"] != FORMAT_VERSION:
        raise InvalidInputError(
            f"manifest format {full['format']!r} version {full['format_version']!r}: write_bundle writes "
            f"{BUNDLE_FORMAT!r} version {FORMAT_VERSION}; leave both fields out"
        )
    model_file = full["model_file"]
    if not isinstance(model_file, str) or not _is_plain_file_name(model_file):
        raise InvalidInputError(f"manifest model_file must be a plain file name, got {model_file!r}")
    return full


def _custom_op_libraries(model: onnx.ModelProto | onnx_ir.Model) -> list[str]:
    """File names of the custom-op libraries the model's nodes need (``ai.layerzero::MoE``: liblayerzero_ort.so)."""
    import onnx

    from layerzero.plugins.ort_library import libraries_for_ops

    if isinstance(model, onnx.ModelProto):
        ops = {(n.domain, n.op_type) for g in _proto_graphs(model.graph) for n in g.node}
    else:
        ops = {(n.domain, n.op_type) for n in model.graph.all_nodes()}
    return libraries_for_ops(ops)


def _is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and Path(name).name == name and "\\" not in name


def _check_protect(out: Path, protect: Sequence[str | os.PathLike[str]]) -> None:
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
    _fsync_tree(staging)
    if out.exists():
        check_replaceable(out)
    _move_into_place(staging, out, overwrite=overwrite)


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


def _move_into_place(tmp: Path, out: Path, *, overwrite: bool) -> None:
    aside: Path | None = None
    with locked(out.parent):
        if not (overwrite and os.path.lexists(out)):
            if os.path.lexists(out):  # appeared since the check above
                raise InvalidInputError(f"{out} already exists; pass overwrite=True (--force) to replace it")
            os.rename(tmp, out)
            _fsync_dir(out.parent)
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
        _fsync_dir(out.parent)
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
        if not isinstance(file_name, str) or not _is_plain_file_name(file_name):
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


def _fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes the rename durable; not every platform/file system allows it.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _save_model(model: onnx.ModelProto | onnx_ir.Model, path: Path, threshold: int) -> None:
    import onnx

    location = path.name + ".data"
    if isinstance(model, onnx.ModelProto):
        _check_proto_weights_loaded(model)
        total = sum(_proto_tensor_nbytes(t) for t in _proto_initializers(model.graph))
        if not _goes_external(total, threshold):
            onnx.save_model(model, str(path))
            return
        # onnx.save_model(save_as_external_data=True) strips the weights out of the caller's proto; onnx_ir's
        # save leaves the model unchanged and reads the proto's tensors without copying them all first.
        import onnx_ir as ir

        model = ir.from_proto(model)
    else:
        import onnx_ir as ir

        if not isinstance(model, ir.Model):
            raise InvalidInputError(f"write_bundle needs an onnx.ModelProto or onnx_ir.Model, got {type(model)}")
        total = sum(v.const_value.nbytes for v in _ir_initializers(model))
    if _goes_external(total, threshold):
        ir.save(model, path, external_data=location, size_threshold_bytes=EXTERNAL_TENSOR_MIN_BYTES - 1)
        logger.debug("saved %s with %.1f MiB of external data", path, total / 2**20)
        return
    with _ir_weights_in_memory(model):
        ir.save(model, path)


def _goes_external(total_bytes: int, threshold: int) -> bool:
    return total_bytes > threshold or total_bytes >= _PROTOBUF_LIMIT_BYTES


def _ir_initializers(model: onnx_ir.Model) -> Iterator[onnx_ir.Value]:
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value


@contextlib.contextmanager
def _ir_weights_in_memory(model: onnx_ir.Model) -> Iterator[None]:
    # An onnx_ir model loaded from a file references that file's external data by a relative path, which would
    # dangle inside the bundle; load those tensors for the save, then put the originals back.
    import onnx_ir as ir

    external = [v for v in _ir_initializers(model) if isinstance(v.const_value, ir.ExternalTensor)]
    originals = [v.const_value for v in external]
    try:
        loaded = ir.external_data.convert_tensors_from_external(originals)
        for value, tensor in zip(external, loaded, strict=True):
            value.const_value = tensor
        yield
    finally:
        for value, tensor in zip(external, originals, strict=True):
            value.const_value = tensor


def _proto_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _proto_graphs(attr.g)
            for sub in attr.graphs:
                yield from _proto_graphs(sub)


def _proto_initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    for g in _proto_graphs(graph):
        yield from g.initializer
        for sparse in g.sparse_initializer:
            yield sparse.values
            yield sparse.indices


def _proto_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of the model (initializers, attribute tensors, in all subgraphs); weights not needed."""
    for g in _proto_graphs(model.graph):
        yield from g.initializer
        for sparse in g.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                for sparse in attr.sparse_tensors:
                    yield sparse.values
                    yield sparse.indices


def _proto_tensor_nbytes(tensor: onnx.TensorProto) -> int:
    import onnx

    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return tensor.ByteSize()
    return math.prod(tensor.dims) * itemsize


def _is_external(tensor: onnx.TensorProto) -> bool:
    import onnx

    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _check_proto_weights_loaded(model: onnx.ModelProto) -> None:
    for tensor in _proto_tensors(model):
        if _is_external(tensor):
            raise InvalidInputError(
                f"tensor {tensor.name!r} of the model still references external data; load the model with "
                "onnx.load(..., load_external_data=True) or pass an onnx_ir.Model to write_bundle"
            )


# --------------------------------------------------------------------------------------------------- reading


def read_bundle(path: str | os.PathLike[str], *, full_check: bool = False) -> Bundle:
    """Open and check the bundle directory ``path``, without loading weights.

    The files are checked against the manifest's fingerprints (``check_integrity``): the model file's sha256,
    the data files' sizes and sampled fingerprint; ``full_check`` (or ``LAYERZERO_FULL_CHECK=1``) also hashes
    the data files whole.

    Raises:
        InvalidInputError: the path is missing or not a directory (e.g. a plain ``.onnx`` file: compile
            it, or give it to ``Engine.load`` to run it uncompiled), the manifest is missing, not JSON, not a
            LayerZero bundle or from a newer LayerZero, or the model or one of its external-data files is
            missing.
    """
    root = Path(path)
    if not root.exists():
        raise InvalidInputError(f"bundle {root} does not exist")
    if not root.is_dir():
        hint = (
            f"; did you pass the .onnx file? compile it first with `layerzero compile {root} -o <bundle>` "
            "(Engine.load also runs a plain .onnx file, uncompiled)"
            if root.suffix == ".onnx"
            else ""
        )
        raise InvalidInputError(f"bundle {root} is not a directory{hint}")

    full_check = full_check or os.environ.get("LAYERZERO_FULL_CHECK", "") not in ("", "0")
    manifest = _read_manifest(root)
    model_file = manifest.get("model_file", MODEL_NAME)
    if not isinstance(model_file, str) or not _is_plain_file_name(model_file):
        raise InvalidInputError(f"{root / MANIFEST_NAME}: model_file must be a plain file name, got {model_file!r}")
    model_path = root / model_file
    if not model_path.is_file():
        raise InvalidInputError(f"bundle {root} is incomplete: its model file {model_file} is missing")
    _check_inside(root, model_path)
    check_external_data(model_path)
    check_integrity(root, manifest, full=full_check)
    return Bundle(path=root, manifest=manifest, model_path=model_path)


def _check_inside(root: Path, path: Path) -> None:
    # A symlink is fine inside the bundle; one leading out of it would run (or read) a file the bundle does not own.
    if not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root)):
        raise InvalidInputError(f"{path} is a link to a file outside the bundle {root}; refusing to read it")


def _read_manifest(root: Path) -> dict[str, Any]:
    manifest_path = root / MANIFEST_NAME
    if manifest_path.is_file():
        _check_inside(root, manifest_path)
    if not manifest_path.is_file():
        raise InvalidInputError(
            f"{root} is not a LayerZero bundle: {MANIFEST_NAME} is missing (create bundles with `layerzero compile`)"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidInputError(f"{manifest_path} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise InvalidInputError(f"{manifest_path}: format is {found!r}, expected {BUNDLE_FORMAT!r}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InvalidInputError(f"{manifest_path}: format_version must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise InvalidInputError(
            f"{root} has bundle format_version {version}, written by a newer LayerZero "
            f"({manifest.get('layerzero_version', 'unknown')}); this one reads up to {FORMAT_VERSION}: "
            "upgrade layerzero"
        )
    return manifest


def check_external_data(model_path: Path) -> None:
    """Check that every external-data file ``model_path`` references exists, stays in its directory and is
    long enough, parsing the graph only (``load_external_data=False``).

    Raises:
        InvalidInputError: naming the model and the bad file.
    """
    import onnx

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as e:  # protobuf raises its own DecodeError; any failure means a corrupt file
        raise InvalidInputError(f"{model_path} is not a readable ONNX model: {e}") from e
    base = Path(os.path.realpath(model_path.parent))
    needed: dict[str, int] = {}
    for tensor in _proto_tensors(model):
        if not _is_external(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise InvalidInputError(f"{model_path}: tensor {tensor.name!r} is external but has no location")
        try:
            end = int(info.get("offset", 0) or 0) + int(info.get("length", 0) or 0)
        except ValueError as e:
            raise InvalidInputError(f"{model_path}: tensor {tensor.name!r} has a bad external offset/length") from e
        needed[location] = max(needed.get(location, 0), end)
    for location, end in needed.items():
        data_path = Path(os.path.realpath(base / location))
        if not data_path.is_relative_to(base):
            raise InvalidInputError(
                f"{model_path}: external data {location!r} lies outside the model's directory; refusing to read it"
            )
        if not data_path.is_file():
            raise InvalidInputError(
                f"{model_path.parent} is incomplete: the external data file {location} that "
                f"{model_path.name} references is missing (copy the whole bundle directory, or recompile)"
            )
        size = data_path.stat().st_size
        if size < end:
            raise InvalidInputError(
                f"{data_path} is truncated: {size} bytes, but {model_path.name} reads up to byte {end}"
            )
