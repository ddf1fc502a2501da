"""Run a large model a few layers at a time, so verification never holds all its weights at once.

The graph's top-level nodes are cut, in order, into chunks whose weights fit ``budget_bytes``. Each
chunk becomes a small model whose inputs are the activations earlier chunks produced; its weights are
lent to onnxruntime as memory-mapped arrays (``ort_runner.create_session(external_initializers=...)``), read
straight from the source's external-data file, and released with the chunk's session. Peak memory is
then one chunk's weights (plus what ORT prepacks from them) and the live activations, not the model.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.loader import bfloat16_bits_to_float32
from layerzero.ort_runner import create_session
from layerzero.passes._graph import node_subgraphs
from layerzero.passes._moe.lazy import UPCAST_SOURCE

__all__ = ["ChunkedRunner", "run_in_chunks", "weight_bytes"]

logger = logging.getLogger(__name__)

_EMBED_LIMIT = 1 << 16  # initializers smaller than this travel inside the chunk's proto


def weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


class ChunkedRunner:
    """A verification runner (``layerzero.verify.Runner``): ``run_in_chunks`` of one model with one budget.

    ``model`` is the model, or a function that loads it afresh for every run (the untouched original, whose
    weights then live only as long as one run).
    """

    def __init__(self, model: ir.Model | Callable[[], ir.Model], budget_bytes: int,
                 on_chunk: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
        self.model = model
        self.budget_bytes = budget_bytes
        self.on_chunk = on_chunk

    def run(self, feeds: Mapping[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
        model = self.model if isinstance(self.model, ir.Model) else self.model()
        return run_in_chunks(model, feeds, self.budget_bytes, self.on_chunk)


def _reads(node: ir.Node) -> Iterator[ir.Value]:
    """Values a top-level node reads: its inputs, and outer values its subgraphs read."""
    yield from (v for v in node.inputs if v is not None)
    for sub in node_subgraphs(node):
        graphs = [sub, *sub.subgraphs()]
        inner: set[ir.Value] = set()
        for g in graphs:
            inner.update(g.inputs)
            inner.update(g.initializers.values())
            for n in g:
                inner.update(n.outputs)
        for g in graphs:
            for n in g:
                yield from (v for v in n.inputs if v is not None and v not in inner)
            yield from (v for v in g.outputs if v not in inner)


def _top_level_owner(graph: ir.Graph) -> dict[ir.Node, ir.Node]:
    owner: dict[ir.Node, ir.Node] = {}
    for node in graph:
        owner[node] = node
        for sub in node_subgraphs(node):
            for inner in sub.all_nodes():
                owner[inner] = node
    return owner


# dtypes an OrtValue can wrap without copying (others, e.g. bfloat16 or float8, travel inside the proto).
_WRAPPABLE = frozenset("?bBhHiIlLqQefd")


def _weight_array(value: ir.Value) -> np.ndarray | None:
    """The weight as an array ONNX Runtime can borrow, or None when it must travel inside the proto.

    ``add_external_initializers`` refuses an OrtValue that owns its buffer ("Buffer containing the
    initializer must be owned by the user"), and ``ortvalue_from_numpy`` copies (so owns) any array that is
    not C-contiguous, aligned, in native byte order and of a plain numeric dtype. Weights the passes create
    (e.g. the per-expert transposed / concatenated matrices of the MoE ``If`` lowering) may be Fortran-ordered
    views, so every array is made C-contiguous first; the caller keeps it alive as long as the session.
    """
    tensor = value.const_value
    if isinstance(tensor, ir.ExternalTensor):
        # A read-only memory map: pages are read on use and dropped when the chunk is done.
        array: np.ndarray = np.memmap(
            tensor.path, dtype=tensor.dtype.numpy(), mode="r", offset=tensor.offset or 0, shape=tuple(tensor.shape)
        )
    else:
        array = tensor.numpy()
    if array.dtype.char not in _WRAPPABLE:
        return None
    # NOTE: a copy here (non-contiguous, unaligned or byte-swapped) is owned by numpy, not by ORT: allowed.
    return np.require(array, dtype=array.dtype.newbyteorder("="), requirements=("C_CONTIGUOUS", "ALIGNED"))


def _gathered_bfloat16(node: ir.Node, inits: set[ir.Value]) -> ir.ExternalTensor | None:
    """The bfloat16 external data behind ``node``'s weight when it is a ``Gather`` / ``GatherND`` (batch_dims 0) of
    an upcast bfloat16 initializer (``loader.upcast_bfloat16``'s lazy float32 view) by computed indices: what
    ``_gather_bfloat16`` runs (no tensor is read to tell); None otherwise."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("Gather", "GatherND") or len(node.inputs) != 2:
        return None
    data, indices = node.inputs
    if data not in inits or indices is None or indices.const_value is not None or not node.outputs[0].name:
        return None
    if node.op_type == "GatherND" and node.attributes.get_int("batch_dims", 0) != 0:
        return None
    source = getattr(data.const_value, UPCAST_SOURCE, None)
    ok = isinstance(source, ir.ExternalTensor) and source.dtype == ir.DataType.BFLOAT16
    return source if ok else None


def _gather_bfloat16(node: ir.Node, source: ir.ExternalTensor, env: dict[str, np.ndarray]) -> None:
    """Run a lone ``Gather`` / ``GatherND`` (batch_dims 0) of an upcast bfloat16 weight (``source``, its external
    data) here, gathering its bits from the file's map and upcasting only what was gathered, into ``env``.

    The upcast ONNX Runtime would gather from is the whole weight in float32 (a batched_mm export's
    ``GatherND(experts, indices)`` reads a [64, 2048, 2048] table per layer to keep the ``T * k`` rows routed:
    1.07 GB read, then the gathered rows); here only the gathered rows' pages are read and only they are upcast.
    Exact: the upcast (bits << 16) commutes with the gather. Indices are ONNX's (negative counts from the end);
    one out of range is a one-line error, as ONNX Runtime's would be.
    """
    data, indices = node.inputs
    if indices.name not in env:
        raise InvalidInputError(f"missing input {indices.name!r} for {node.op_type} {node.name!r}")
    bits = np.memmap(source.path, dtype=np.uint16, mode="r", offset=source.offset or 0, shape=tuple(source.shape))
    index = np.asarray(env[indices.name]).astype(np.int64)
    try:
        if node.op_type == "Gather":
            axis = node.attributes.get_int("axis", 0)
            axis = axis + bits.ndim if axis < 0 else axis
            size = bits.shape[axis]
            if index.size and (index.min() < -size or index.max() >= size):
                raise IndexError(f"an index outside [-{size}, {size})")
            picked = np.take(bits, index, axis=axis)
        else:
            depth = index.shape[-1]
            if depth > bits.ndim:
                raise IndexError(f"index depth {depth} above the data's rank {bits.ndim}")
            for d in range(depth):
                column, size = index[..., d], bits.shape[d]
                if column.size and (column.min() < -size or column.max() >= size):
                    raise IndexError(f"an index outside [-{size}, {size}) on axis {d}")
            picked = bits[tuple(index[..., d] for d in range(depth))]
    except IndexError as exc:
        raise InvalidInputError(f"{node.op_type} {node.name!r} of {data.name!r}: {exc}") from None
    del bits  # the map: its pages leave the resident set with it
    env[node.outputs[0].name] = bfloat16_bits_to_float32(picked)


def run_in_chunks(
    model: ir.Model, feeds: Mapping[str, np.ndarray], budget_bytes: int,
    on_chunk: Callable[[int, int], None] | None = None,
) -> tuple[list[str], list[np.ndarray]]:
    """Outputs of ``model`` on ``feeds``, computed chunk by chunk (see the module docstring); ``on_chunk(k, n)``
    is called before chunk k of n (1-based: progress)."""
    graph = model.graph
    nodes = list(graph)
    owner = _top_level_owner(graph)
    inits = set(graph.initializers.values())
    node_reads = {node: list(_reads(node)) for node in nodes}
    chunks: list[list[ir.Node]] = []
    current: list[ir.Node] = []
    loaded: set[ir.Value] = set()
    size = 0
    gathers: dict[int, ir.ExternalTensor] = {}  # chunk index -> the bf16 data its lone Gather reads here
    for node in nodes:
        source = _gathered_bfloat16(node, inits)
        if source is not None:  # a step of its own, run here (its weight is never loaded whole)
            if current:
                chunks.append(current)
            gathers[len(chunks)] = source
            chunks.append([node])
            current, loaded, size = [], set(), 0
            continue
        new = {v for v in node_reads[node] if v in inits and v not in loaded}
        extra = sum(v.const_value.nbytes for v in new if v.const_value is not None)
        if current and size + extra > budget_bytes:
            chunks.append(current)
            current, loaded, size = [], set(), 0
            new = {v for v in node_reads[node] if v in inits}
            extra = sum(v.const_value.nbytes for v in new if v.const_value is not None)
        current.append(node)
        loaded |= new
        size += extra
    if current:
        chunks.append(current)
    position = {node: i for i, chunk in enumerate(chunks) for node in chunk}
    env: dict[str, np.ndarray] = {k: np.asarray(v) for k, v in feeds.items()}
    outputs = [v.name for v in graph.outputs]
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    # What must stay in ``env`` once each chunk has run: the outputs and what later chunks read.
    needed_after: list[set[str]] = []
    needed = set(outputs)
    for chunk in reversed(chunks):
        needed_after.append(set(needed))
        needed.update(v.name for node in chunk for v in node_reads[node] if v.name)
    needed_after.reverse()
    for index, chunk in enumerate(chunks):
        if on_chunk is not None:
            on_chunk(index + 1, len(chunks))
        if index in gathers:
            _gather_bfloat16(chunk[0], gathers[index], env)
        else:
            _run_chunk(model, chunk, index, position, owner, inits, node_reads, env, opsets)
        # Activations no later chunk reads are dropped as we go.
        needed = needed_after[index]
        for name in [n for n in env if n not in needed and n not in feeds]:
            del env[name]
        gc.collect()
    missing = [n for n in outputs if n not in env]
    if missing:
        raise UnsupportedModelError(f"chunked run produced no value for outputs {missing}")
    logger.info("ran %d chunks of at most %d MB of weights", len(chunks), budget_bytes >> 20)
    return outputs, [env[n] for n in outputs]


def _run_chunk(
    model: ir.Model,
    chunk: list[ir.Node],
    index: int,
    position: dict[ir.Node, int],
    owner: dict[ir.Node, ir.Node],
    inits: set[ir.Value],
    node_reads: dict[ir.Node, list[ir.Value]],
    env: dict[str, np.ndarray],
    opsets: list,
) -> None:
    produced = {out for node in chunk for out in node.outputs}
    reads: list[ir.Value] = []
    for node in chunk:
        for v in node_reads[node]:
            if v not in produced and v not in reads:
                reads.append(v)
    wanted = []
    for v in produced:
        if not v.name:
            continue
        if v.is_graph_output() or any(position.get(owner.get(user)) != index for user, _ in v.uses()):
            wanted.append(v)
    proto_inputs, initializers = [], []
    lent: dict[str, np.ndarray] = {}  # the arrays ORT reads from; the session keeps them alive
    for v in reads:
        if v in inits:
            tensor = v.const_value
            if tensor is None:
                raise UnsupportedModelError(f"initializer {v.name!r} has no data")
            array = None
            if tensor.nbytes >= _EMBED_LIMIT or isinstance(tensor, ir.ExternalTensor):
                array = _weight_array(v)
            if array is None:
                if isinstance(tensor, ir.ExternalTensor):  # its file path means nothing to a proto in memory
                    tensor = ir.tensor(tensor.numpy(), name=v.name)
                initializers.append(ir.serde.serialize_tensor(tensor))
                initializers[-1].name = v.name
            else:
                placeholder = onnx.TensorProto(name=v.name, data_type=tensor.dtype.value, dims=list(tensor.shape))
                placeholder.data_location = onnx.TensorProto.EXTERNAL
                placeholder.external_data.add(key="location", value="layerzero-chunk-placeholder")
                initializers.append(placeholder)
                lent[v.name] = array
        else:
            if v.name not in env:
                raise InvalidInputError(f"missing input {v.name!r} for chunk {index}")
            array = env[v.name]
            elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
            proto_inputs.append(onnx.helper.make_tensor_value_info(v.name, elem, list(array.shape)))
    proto_outputs = [
        onnx.helper.make_value_info(v.name, ir.serde.serialize_type(v.type) if v.type is not None else onnx.TypeProto())
        for v in wanted
    ]
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in chunk], f"chunk{index}", proto_inputs, proto_outputs, initializers
    )
    proto = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)
    # Our custom-op library when built: a chunk may hold ai.layerzero::MoE (the native MoE lowering).
    session = create_session(proto.SerializeToString(), external_initializers=lent, label=f"chunk {index}")
    results = session.run([v.name for v in wanted], {v.name: env[v.name] for v in reads if v not in inits})
    env.update({v.name: r for v, r in zip(wanted, results)})
    del session, lent
