"""Expert weights read one expert at a time: the MoE rewrite never holds a block's stacked experts whole.

A real-size MoE (OLMoE-1B-7B: 16 layers of 64 experts, 1.5 GB of float32 experts per layer) does not fit in memory
as float32 copies of its experts, so the stacked ``[E, ...]`` weight the rewrite matches is an ``ExpertStack``: its
shape and dtype, and a function giving one expert's matrix (read from the initializer: a slice of an in-memory
array, a read of the external-data file at that expert's offset, a bfloat16 one upcast as it is read). The rewrite's
transforms (transposed experts, the gate / up rows of a fused projection) are recorded as per-expert steps, and the
``ai.layerzero::MoE`` node's weights are ``ExpertTensor``\\ s over them: ``QuantizeWeights`` quantizes them expert by
expert straight into the codes; anything else reading them (``numpy()``) gets the whole float stack, computed then
and not kept.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

__all__ = ["ExpertStack", "ExpertTensor", "expert_stack", "stack_of"]

#: Upcast tensors (``compiler/loader.py``'s bfloat16 views) carry their source here, so one expert can be read alone.
UPCAST_SOURCE = "layerzero_bfloat16_source"


class ExpertStack:
    """``[E, ...]`` weights given one expert at a time (``expert(e)``, a C-contiguous array of ``shape[1:]``)."""

    def __init__(
        self, shape: tuple[int, ...], dtype: np.dtype, expert: Callable[[int], np.ndarray], key: tuple | None = None
    ) -> None:
        """``key``: what the experts are (their source and the steps since), equal for two stacks of the same
        values (the verification's reference reads the compile's file again); None: no identity."""
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._expert = expert
        self.key = key

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def expert(self, e: int) -> np.ndarray:
        if not -self.shape[0] <= e < self.shape[0]:
            raise IndexError(f"expert {e} of {self.shape[0]}")
        return np.ascontiguousarray(self._expert(e % self.shape[0]), dtype=self.dtype)

    def __getitem__(self, e: int) -> np.ndarray:
        return self.expert(int(e))

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        for e in range(self.shape[0]):
            out[e] = self.expert(e)
        return out if dtype is None else out.astype(dtype)

    def transposed(self) -> ExpertStack:
        """Each expert's matrix transposed (``[E, a, b]`` → ``[E, b, a]``)."""
        key = None if self.key is None else (*self.key, "T")
        return ExpertStack((self.shape[0], *self.shape[1:][::-1]), self.dtype, lambda e: self.expert(e).T, key)

    def rows(self, rows: np.ndarray) -> ExpertStack:
        """Each expert's rows ``rows`` (axis 1)."""
        rows = np.asarray(rows)
        key = None if self.key is None else (*self.key, "rows", tuple(rows.tolist()))
        shape = (self.shape[0], len(rows), *self.shape[2:])
        return ExpertStack(shape, self.dtype, lambda e: self.expert(e)[rows], key)


def transposed(weight: np.ndarray | ExpertStack) -> np.ndarray | ExpertStack:
    """``[E, a, b]`` → ``[E, b, a]``, contiguous (a stack stays lazy)."""
    if isinstance(weight, ExpertStack):
        return weight.transposed()
    return np.ascontiguousarray(weight.transpose(0, 2, 1))


def select_rows(weight: np.ndarray | ExpertStack, rows: np.ndarray) -> np.ndarray | ExpertStack:
    """``weight[:, rows, :]``, contiguous (a stack stays lazy)."""
    if isinstance(weight, ExpertStack):
        return weight.rows(rows)
    return np.ascontiguousarray(weight[:, rows, :])


def _file_reader(tensor: ir.ExternalTensor, dtype: np.dtype, upcast: bool) -> Callable[[int], np.ndarray]:
    """One expert of an external tensor, read from its file (a plain read: its buffer goes with the array)."""
    shape = tuple(int(d) for d in tensor.shape)
    count = int(np.prod(shape[1:], dtype=np.int64))
    stored = np.dtype(np.uint16) if upcast else dtype

    def read(e: int) -> np.ndarray:
        with open(tensor.path, "rb") as f:
            f.seek((tensor.offset or 0) + e * count * stored.itemsize)
            bits = np.fromfile(f, dtype=stored, count=count)
        if bits.size != count:
            raise ValueError(f"{tensor.path}: tensor {tensor.name!r} is cut short at expert {e}")
        if upcast:
            wide = bits.astype(np.uint32)
            wide <<= 16
            return wide.view(np.float32).reshape(shape[1:])
        return bits.reshape(shape[1:])

    return read


def _file_key(tensor: ir.ExternalTensor, how: str) -> tuple:
    """An external tensor's identity: its file (by inode and modification time too), offset, shape, how it is read."""
    import os

    stat = os.stat(tensor.path)
    shape = tuple(int(d) for d in tensor.shape)
    return (os.path.realpath(tensor.path), stat.st_ino, stat.st_mtime_ns, tensor.offset or 0, shape, how)


def expert_stack(value: ir.Value) -> ExpertStack | None:
    """The initializer ``value`` (rank >= 2, a float type) as an ``ExpertStack`` read expert by expert, or None where
    it need not or cannot be read so (an in-memory tensor, a ``Constant`` node: the caller reads it whole)."""
    tensor = value.const_value
    if tensor is None or value.is_graph_input() or tensor.shape is None or len(tensor.shape) < 2:
        return None
    shape = tuple(int(d) for d in tensor.shape)
    source = getattr(tensor, UPCAST_SOURCE, None)
    if source is not None:  # a bfloat16 tensor computed in float32 (compiler/loader.py)
        if isinstance(source, ir.ExternalTensor):
            key = _file_key(source, "bfloat16->float32")
            return ExpertStack(shape, np.float32, _file_reader(source, np.dtype(np.float32), upcast=True), key)
        return None
    if isinstance(tensor, ExpertTensor):
        return tensor.stack
    try:
        dtype = np.dtype(tensor.dtype.numpy())
    except Exception:  # a dtype without a numpy form
        return None
    if dtype.kind != "f":
        return None
    if isinstance(tensor, ir.ExternalTensor):
        if tensor.dtype == ir.DataType.BFLOAT16:
            return None
        return ExpertStack(shape, dtype, _file_reader(tensor, dtype, upcast=False), _file_key(tensor, dtype.str))
    return None  # in memory already (a small model): read whole, as before


class ExpertTensor(ir.LazyTensor):
    """An initializer over an ``ExpertStack``: ``numpy()`` computes the whole stack (not cached), ``stack`` gives the
    experts one at a time."""

    def __init__(self, stack: ExpertStack, name: str | None = None) -> None:
        self.stack = stack
        super().__init__(
            lambda: ir.Tensor(np.asarray(stack), name=name),
            dtype=ir.DataType.from_numpy(stack.dtype),
            shape=ir.Shape(stack.shape),
            name=name,
        )


def stack_of(value: ir.Value | None) -> ExpertStack | None:
    """The ``ExpertStack`` behind ``value``'s constant, None when it has none."""
    tensor = None if value is None else value.const_value
    return tensor.stack if isinstance(tensor, ExpertTensor) else None
