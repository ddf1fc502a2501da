"""The few CUDA runtime calls the TensorRT backend needs: device memory, copies, a stream.

Through cuda-python (``cuda.bindings.runtime``, older releases: ``cuda.cudart``): NVIDIA's own thin binding,
a small wheel with no other dependency, the one TensorRT's Python samples use, and it speaks raw device
pointers (ints), which is what ``IExecutionContext.set_tensor_address`` and the kernels' C ABI take. CuPy or torch
would do the same job at the cost of a 100 MB-1 GB dependency and a second memory pool.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

__all__ = ["Cuda", "CudaUnavailableError", "DeviceBuffer", "import_cudart"]

logger = logging.getLogger(__name__)


class CudaUnavailableError(ImportError):
    """cuda-python is not installed (or no CUDA driver / device is usable)."""


def import_cudart() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError as e:
            raise CudaUnavailableError(
                "the TensorRT backend needs cuda-python for device memory: pip install cuda-python "
                f"(matching your CUDA driver's major version): {e}"
            ) from e
    return cudart


class Cuda:
    """A device, one stream on it, and checked cudart calls (raising ``RuntimeError`` with cudart's message)."""

    def __init__(self, device: int = 0) -> None:
        self.rt = import_cudart()
        self.device = int(device)
        self._check(self.rt.cudaSetDevice(self.device), f"cudaSetDevice({self.device})")
        self.stream = self._check(self.rt.cudaStreamCreate(), "cudaStreamCreate")

    def _check(self, result: Any, what: str) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            _, text = self.rt.cudaGetErrorString(err)
            raise RuntimeError(f"{what} failed: {text.decode() if isinstance(text, bytes) else text}")
        return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)

    @property
    def stream_handle(self) -> int:
        """The cudaStream_t as an int (what TensorRT's execute_async_v3 and the kernels' C ABI take)."""
        return int(self.stream)  # cuda-python: int() of a handle type is the handle's value

    def malloc(self, nbytes: int) -> int:
        return int(self._check(self.rt.cudaMalloc(max(1, int(nbytes))), f"cudaMalloc({nbytes})"))

    def free(self, ptr: int) -> None:
        if ptr:
            self._check(self.rt.cudaFree(ptr), "cudaFree")

    def upload(self, dst: int, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes:
            kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
            self._check(
                self.rt.cudaMemcpyAsync(dst, array.ctypes.data, array.nbytes, kind, self.stream), "cudaMemcpy H2D"
            )
            self.synchronize()  # `array` may be a temporary: do not return before the copy has read it

    def download(self, array: np.ndarray, src: int) -> np.ndarray:
        if array.nbytes:
            kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            self._check(
                self.rt.cudaMemcpyAsync(array.ctypes.data, src, array.nbytes, kind, self.stream), "cudaMemcpy D2H"
            )
        return array

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device."""
        if nbytes:
            kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
            self._check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), "cudaMemcpy D2D")

    def synchronize(self) -> None:
        self._check(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def event_timer(self) -> tuple[Any, Any]:
        start = self._check(self.rt.cudaEventCreate(), "cudaEventCreate")
        end = self._check(self.rt.cudaEventCreate(), "cudaEventCreate")
        return start, end

    def record(self, event: Any) -> None:
        self._check(self.rt.cudaEventRecord(event, self.stream), "cudaEventRecord")

    def elapsed_ms(self, start: Any, end: Any) -> float:
        self._check(self.rt.cudaEventSynchronize(end), "cudaEventSynchronize")
        return float(self._check(self.rt.cudaEventElapsedTime(start, end), "cudaEventElapsedTime"))

    def close(self) -> None:
        if self.stream is not None:
            self.rt.cudaStreamDestroy(self.stream)
            self.stream = None


class DeviceBuffer:
    """A device allocation that grows on demand (reused across runs of the same engine)."""

    def __init__(self, cuda: Cuda) -> None:
        self.cuda = cuda
        self.ptr = 0
        self.nbytes = 0

    def ensure(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            self.release()
            self.ptr = self.cuda.malloc(nbytes)
            self.nbytes = nbytes
        return self.ptr

    def release(self) -> None:
        if self.ptr:
            try:
                self.cuda.free(self.ptr)
            except RuntimeError as e:  # at interpreter exit the context may be gone already
                logger.debug("cudaFree failed: %s", e)
        self.ptr, self.nbytes = 0, 0
