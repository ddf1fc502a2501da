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
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerzero.errors import InvalidInputError
from layerzero.runtime.bundle_files import (
    BUNDLE_FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MODEL_NAME,
    check_integrity,
    check_protect,
    check_replaceable,
    clean_stale_temp_dirs,
    current_umask,
    fingerprint_files,
    fsync_tree,
    is_plain_file_name,
    move_into_place,
    publish_staged,
    sampled_sha256,
    sha256_file,
)

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


#: Weights go to ``<model_file>.data`` when the model's initializers total more than this many bytes.
DEFAULT_EXTERNAL_THRESHOLD_BYTES = 256 * 1024 * 1024
#: When weights go external, tensors of at least this many bytes do; smaller ones stay in the model file.
EXTERNAL_TENSOR_MIN_BYTES = 1024
# A serialized protobuf cannot exceed 2 GiB, whatever threshold the caller asked for.
_PROTOBUF_LIMIT_BYTES = 2**31 - 64 * 1024 * 1024



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
    check_protect(out, protect)
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
        fsync_tree(tmp)
        move_into_place(tmp, out, overwrite=overwrite)
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
    if not isinstance(model_file, str) or not is_plain_file_name(model_file):
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
    if not isinstance(model_file, str) or not is_plain_file_name(model_file):
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
