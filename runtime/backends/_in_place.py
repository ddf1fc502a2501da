"""The weights LayerZero's own ONNX Runtime kernels read in place, moved out of the file mapping.

ONNX Runtime maps a model's external-data file into memory and hands initializers to the kernels as pointers
into that mapping. The kernels of ``liblayerzero_ort.so`` (``ai.layerzero::MoE``, ``SparseLinear``) stream their
weights from there, in place (ONNX Runtime's own MatMul / MatMulNBits pre-pack theirs into memory of their own at
load). A file mapping is backed by 4 KiB page-cache pages: no transparent huge pages (the kernels' ``madvise`` of
them fails quietly), so a decode step that streams hundreds of MB of experts walks the TLB page by page, and under
memory pressure the kernel drops those pages and reads them from disk again mid-generation. Measured on
bench/decode.py's Qwen3-MoE-style fp32 native bundle (1.5 GB; 1 thread, 5 interleaved rounds of 128 tokens, load
8.7): a decode step 49.4 ms from the mapping, 41.5 ms with the experts in anonymous huge pages (int4 bundle, 322
MB: 8.87 → 8.64 ms).

``in_place_weights(path)`` reads exactly those initializers (external data consumed by an ``ai.layerzero`` node) into
2 MiB-aligned anonymous buffers advised as huge pages; the session takes them as user-owned initializers
(``SessionOptions.add_initializer``: no copy; ``add_external_initializers`` copied them all once more, measured).
The price: those bytes are private
memory of the process (not the shared page cache: two processes serving one bundle hold two copies). The ONNX
Runtime backend's ``mmap_weights=True`` keeps the mapping.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
from pathlib import Path

import numpy as np
import onnx

from layerzero.contract import MOE_DOMAIN
from layerzero.errors import InvalidInputError

__all__ = ["in_place_weights"]

logger = logging.getLogger(__name__)

_DOMAIN = MOE_DOMAIN  # the domain of every liblayerzero_ort.so op
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _consumed_by_our_ops(graph: onnx.GraphProto, names: set[str]) -> None:
    for node in graph.node:
        if node.domain == _DOMAIN:
            names.update(i for i in node.input if i)
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                _consumed_by_our_ops(sub, names)


def _advise_huge(buffer: np.ndarray) -> None:
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(ctypes.c_void_p(buffer.ctypes.data), ctypes.c_size_t(buffer.nbytes), _MADV_HUGEPAGE)


def _aligned(nbytes: int) -> np.ndarray:
    """A zero-copy uint8 view of ``nbytes`` in an anonymous mapping that starts on a 2 MiB boundary."""
    size = (nbytes + _HUGE - 1) // _HUGE * _HUGE
    region = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = (-raw.ctypes.data) % _HUGE
    view = raw[start : start + size]
    _advise_huge(view)
    return view[:nbytes]


def in_place_weights(path: Path) -> dict[str, np.ndarray]:
    """The external initializers ``ai.layerzero`` nodes of the model at ``path`` read, each read into anonymous
    huge-page memory (name -> array; empty when there are none). ONNX Runtime takes them with
    ``SessionOptions.add_initializer`` (its user-owned initializers: used in place, never copied, the file's bytes
    of them never read)."""
    proto = onnx.load(str(path), load_external_data=False)
    wanted: set[str] = set()
    _consumed_by_our_ops(proto.graph, wanted)
    lent: dict[str, np.ndarray] = {}
    for tensor in proto.graph.initializer:
        if tensor.name not in wanted or tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        if dtype == np.dtype(object) or tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
            continue  # not a plain array ORT can borrow: left in the file
        count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
        nbytes = count * dtype.itemsize
        source = path.parent / info["location"]
        buffer = _aligned(nbytes)
        with open(source, "rb") as f:
            f.seek(int(info.get("offset", 0)))
            if f.readinto(memoryview(buffer)) != nbytes:
                raise InvalidInputError(f"{source}: shorter than the tensor {tensor.name!r} it holds ({nbytes} bytes)")
        lent[tensor.name] = buffer.view(dtype).reshape(tuple(tensor.dims))
    if lent:
        logger.debug("%s: %d weights read into anonymous huge pages (%d MB)", path, len(lent),
                     sum(a.nbytes for a in lent.values()) >> 20)  # fmt: skip
    return lent
