"""Load an ONNX model for compiling, with errors that name what is wrong with the file."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.passes._moe.lazy import UPCAST_SOURCE

__all__ = ["check_external_data", "has_bfloat16", "load_model", "upcast_bfloat16"]

logger = logging.getLogger(__name__)


def check_external_data(path: Path, proto: onnx.ModelProto) -> None:
    """Every external-data file the model names exists next to it (weights are not read)."""
    base = path.parent
    missing: set[str] = set()
    for tensor in _tensors(proto.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        if location is None:
            raise UnsupportedModelError(f"{path}: tensor {tensor.name!r} is external but names no file")
        if not (base / location).is_file():
            missing.add(location)
    if missing:
        names = ", ".join(sorted(missing))
        raise InvalidInputError(
            f"{path}: external-data file(s) missing: {names} (expected next to the model in {base})"
        )


def _tensors(graph: onnx.GraphProto):
    """Every TensorProto of ``graph``: initializers (sparse ones too) and tensor attributes, subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def load_model(path: str | Path) -> ir.Model:
    """Read ``path`` into onnx-ir; external data stays memory-mapped (never copied twice)."""
    path = Path(path)
    if not path.exists():
        raise InvalidInputError(f"{path}: no such file")
    if path.is_dir():
        raise InvalidInputError(f"{path}: is a directory, expected an .onnx file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise UnsupportedModelError(f"{path}: not a valid ONNX model (truncated or not ONNX): {exc}") from None
    except OSError as exc:
        raise InvalidInputError(f"{path}: cannot read: {exc}") from None
    if not proto.graph.node and not proto.graph.output:
        raise UnsupportedModelError(f"{path}: not an ONNX model (no graph found in the file)")
    check_external_data(path, proto)
    try:
        # By path, so that external-data locations resolve against the model's folder, not the working
        # directory (the checker reads the file's graph, never its weights). A model holding ONNX Runtime's
        # onnx-domain kernels (a fused bundle's) is checked as a header with those in their own domain.
        onnx.checker.check_model(str(path) if not _ort_kernels(proto) else _checkable(proto), full_check=False)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UnsupportedModelError(f"{path}: invalid ONNX model: {first}") from None
    _check_ops_known(path, proto)
    del proto
    try:
        return ir.load(path)
    except Exception as exc:
        raise UnsupportedModelError(f"{path}: cannot load: {exc}") from None


#: Kernels ONNX Runtime registers in the onnx domain that are no ONNX operator (``passes/fuse_decoder.py`` writes
#: them): onnx's checker and ``_check_ops_known`` take them as a custom domain's.
ORT_ONNX_DOMAIN_KERNELS = frozenset({"SimplifiedLayerNormalization"})


def _ort_kernels(proto: onnx.ModelProto) -> bool:
    nodes = _all_nodes(proto.graph)
    return any((n.domain or "") in ("", "ai.onnx") and n.op_type in ORT_ONNX_DOMAIN_KERNELS for n in nodes)


def _checkable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A header copy for the checker: ONNX Runtime's onnx-domain kernels in a domain of their own, and the external
    initializers (whose files ``check_external_data`` checked) as graph inputs of the same type and shape."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for node in _all_nodes(copy.graph):
        if (node.domain or "") in ("", "ai.onnx") and node.op_type in ORT_ONNX_DOMAIN_KERNELS:
            node.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    inputs = {i.name for i in copy.graph.input}
    kept = [t for t in copy.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    for t in copy.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL and t.name not in inputs:
            copy.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    return copy


def _check_ops_known(path: Path, proto: onnx.ModelProto) -> None:
    """Ops of the standard domains must exist in the model's opset; custom domains pass through."""
    opsets = {o.domain or "": o.version for o in proto.opset_import}
    local = {(f.domain, f.name) for f in proto.functions}
    for node in _all_nodes(proto.graph):
        domain = node.domain or ""
        if domain not in ("", "ai.onnx", "ai.onnx.ml") or (domain, node.op_type) in local:
            continue
        if domain != "ai.onnx.ml" and node.op_type in ORT_ONNX_DOMAIN_KERNELS:
            continue
        version = opsets.get(domain, opsets.get("", 1))
        if not onnx.defs.has(node.op_type, domain):
            where = f"node {node.name!r}" if node.name else "a node"
            raise UnsupportedModelError(
                f"{path}: unknown op {node.op_type!r} in domain {domain or 'ai.onnx'!r} ({where}); "
                f"it is not an ONNX operator at opset {version}"
            )


def _all_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _all_nodes(g)


def has_bfloat16(model: ir.Model) -> bool:
    """Whether any value, initializer or graph input / output of ``model`` is bfloat16 (weights are not read)."""
    bf16 = ir.DataType.BFLOAT16
    for graph in model.graphs():
        for value in (*graph.inputs, *graph.outputs, *graph.initializers.values()):
            if value.dtype == bf16:
                return True
        for node in graph:
            if any(v.dtype == bf16 for v in node.outputs):
                return True
    return False


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values given as their uint16 bits, as float32 (exact: the bits become the high half); one
    float32-sized buffer, shifted in place."""
    wide = np.ascontiguousarray(bits, dtype=np.uint32)
    wide <<= 16
    return wide.view(np.float32)


def _upcast_tensor(tensor: ir.TensorProtocol, name: str | None) -> ir.LazyTensor:
    """``tensor`` (bfloat16) as a float32 tensor computed on every read (never cached: a weight read by a pass is
    upcast, used and dropped, so the model is never held in float32). External data is read with a plain file read,
    not through a memory map: the pages of a map stay in the process's RSS as long as the map lives (all of a
    13.8 GB file once every weight was read), a read's buffer goes with the array."""

    def read() -> ir.Tensor:
        if isinstance(tensor, ir.ExternalTensor):
            count = int(np.prod(tensor.shape.numpy(), dtype=np.int64))
            with open(tensor.path, "rb") as f:
                f.seek(tensor.offset or 0)
                bits = np.fromfile(f, dtype=np.uint16, count=count)
            if bits.size != count:
                raise UnsupportedModelError(f"{tensor.path}: tensor {name!r} is cut short ({bits.size} of {count})")
            array = bfloat16_bits_to_float32(bits).reshape(tensor.shape.numpy())
            del bits
        else:
            array = np.asarray(tensor.numpy(), dtype=np.float32)
        return ir.Tensor(array, name=name)

    view = _Bfloat16View(read, dtype=ir.DataType.FLOAT, shape=ir.Shape(tensor.shape), name=name)
    setattr(view, UPCAST_SOURCE, tensor)  # passes/_moe/lazy.py reads one expert of it alone
    return view


class _Bfloat16View(ir.LazyTensor):
    """A bfloat16 tensor read as float32 (``_upcast_tensor``), which names its source (``UPCAST_SOURCE``)."""


def upcast_bfloat16(model: ir.Model) -> int:
    """Make a bfloat16 model compute in float32, in place; returns how many tensors changed.

    ONNX Runtime's CPU kernels take no bfloat16 MatMul (nor can verification draw bfloat16 inputs), so a bfloat16
    export (``layerzero export`` of a checkpoint saved in bf16) is compiled as the same graph in float32: every
    bfloat16 value (graph inputs and outputs included) becomes float32, a ``Cast`` to bfloat16 casts to float32, a
    bfloat16 ``Constant`` / ``ConstantOfShape`` value is upcast, and every bfloat16 initializer becomes a lazy
    float32 view of its bytes (``_upcast_tensor``: each read upcasts it anew; external data stays mapped). The
    upcast is exact (bfloat16 is float32 with its low 16 mantissa bits zero); what differs from the bfloat16 graph
    is only the rounding of its intermediate values, which now stay float32.
    """
    bf16, f32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    changed = 0
    for graph in model.graphs():
        for value in list(graph.initializers.values()):
            tensor = value.const_value
            if tensor is not None and tensor.dtype == bf16:
                value.const_value = _upcast_tensor(tensor, value.name)
                changed += 1
        values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
        for node in graph:
            values += [v for v in node.outputs if v is not None]
            if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
                to = node.attributes.get("to")
                if to is not None and to.value == bf16.value:
                    node.attributes["to"] = ir.AttrInt64("to", f32.value)
                    changed += 1
            elif node.op_type in ("Constant", "ConstantOfShape") and node.domain in ("", "ai.onnx"):
                attr = node.attributes.get("value")
                if attr is not None and attr.type == ir.AttributeType.TENSOR and attr.value.dtype == bf16:
                    upcast = ir.Tensor(np.asarray(attr.value.numpy(), dtype=np.float32), name=attr.value.name)
                    node.attributes["value"] = ir.AttrTensor("value", upcast)
                    changed += 1
        for value in values:
            if value.dtype == bf16:
                value.dtype = f32
                changed += 1
    return changed
