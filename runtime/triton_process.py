"""Triton Inference Server as ``layerzero serve`` runs it through PyTriton: one started Triton and its loopback
ports (``TritonInstance``), stopping one and the Python-backend stubs a killed one leaves (``retire``), the
ports it needs, and the fixes PyTriton needs before a start (``patch_pytriton``: the stub handshake's 1 s
timeout, tensors with no elements, tritonserver's harmless CPU-machine error lines).

PyTriton's Python-backend stub links the interpreter's libpython: ``libpython_on_library_path`` prepends
``sysconfig.get_config_var("LIBDIR")`` to ``LD_LIBRARY_PATH`` for the Triton process it launches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sysconfig
import threading
from pathlib import Path
from typing import Any

from layerzero.errors import InvalidInputError
from layerzero.runtime.triton_repo import IOSpec

__all__ = [
    "TritonInstance",
    "check_port_free",
    "free_ports",
    "kill_orphan_stubs",
    "libpython_on_library_path",
    "patch_pytriton",
    "retire",
    "tensor_of",
    "triton_log_line_shown",
]

logger = logging.getLogger(__name__)


def tensor_of(spec: IOSpec) -> Any:
    from pytriton.model_config import Tensor

    dtype = spec.numpy_dtype
    if dtype is None:
        raise InvalidInputError(f"{spec.name!r}: {spec.data_type} cannot be served through PyTriton")
    return Tensor(name=spec.name, dtype=dtype, shape=spec.dims or (1,))


def free_ports(host: str, n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(n)]
        for probe in probes:
            probe.bind((host, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


@dataclasses.dataclass
class TritonInstance:
    """One PyTriton ``Triton`` and the loopback ports it listens on."""

    triton: Any
    http_port: int
    grpc_port: int

    def alive(self) -> bool:
        # PyTriton notices a dead tritonserver only once its exit callbacks ran (~1.5 s on a loaded machine):
        # the process's own state answers at once (gone, or a zombie not reaped yet).
        pid = self.pid
        if pid is not None:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X"):
                        return False
            except FileNotFoundError:
                return False
            except OSError:
                pass  # no /proc: PyTriton's answer below
        try:
            return bool(self.triton.is_alive())
        except Exception:
            return False

    def describe(self) -> dict[str, Any]:
        """Its loopback ports and process id (``/status``)."""
        return {"http_port": self.http_port, "grpc_port": self.grpc_port, "pid": self.pid}

    @property
    def pid(self) -> int | None:
        server = getattr(self.triton, "_triton_server", None)
        cmd = getattr(server, "_tritonserver_running_cmd", None)
        return getattr(cmd, "pid", None)


def retire(instance: TritonInstance, wait: bool = False) -> None:
    """Stop a Triton (its process, stubs, workspace); in the background unless ``wait``: stopping takes a while
    and the supervisor must not wait on it while requests do."""
    workspace = getattr(getattr(instance.triton, "_workspace", None), "path", None)

    def stop() -> None:
        with contextlib.suppress(Exception):
            instance.triton.stop()
        if workspace is not None:
            kill_orphan_stubs(Path(workspace))

    if wait:
        stop()
    else:
        threading.Thread(target=stop, name="layerzero-retire", daemon=True).start()


def check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket() as probe:
        # As Triton does: a port held only by TIME_WAIT connections is free; one with a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise InvalidInputError(f"{what} {port}: cannot listen on {host}:{port}: {e.strerror}") from e


def kill_orphan_stubs(workspace: Path) -> None:
    """SIGKILL the Python-backend stubs of a Triton that died (a SIGKILLed tritonserver leaves them running,
    reparented to init, and they ignore SIGTERM): the processes whose program is this workspace's stub."""
    stub = str(workspace / "tritonserver" / "backends" / "python" / "triton_python_backend_stub").encode()
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    program = f.read().split(b"\0", 1)[0]
            except OSError:
                continue
            if program == stub:
                with contextlib.suppress(OSError):
                    os.kill(int(entry), signal.SIGKILL)
                    logger.info("killed the orphaned Python-backend stub %s of a dead Triton", entry)


#: How long a PyTriton Python-backend stub (and this process) waits for the model's handshake socket.
_HANDSHAKE_TIMEOUT_S = 30.0
_HANDSHAKE_DEFAULT = b"def get_config_from_handshake_server(socket_path: pathlib.Path, timeout_s: float = 1.0)"
_handshake_patched = False


def patch_pytriton() -> None:
    """Give PyTriton's stub handshake 30 s instead of its fixed 1 s (idempotent; a no-op on a PyTriton whose
    source differs), and let its tensor store carry tensors with no elements (``_EMPTY_COPY``).

    Why: Triton starts a model's instances in parallel; instance 0's stub starts the handshake server, the
    others give up after 1 s without its socket, and the model fails to load. On a loaded machine (2 shared
    cores) that happened on most starts, and a server that cannot start (or restart) is down. The stubs run
    the copy of ``pytriton/proxy/communication.py`` PyTriton puts in the model store: the copy gets the longer
    default, and so does this process's own call.
    """
    global _handshake_patched
    if _handshake_patched:
        return
    _handshake_patched = True
    try:
        import pytriton.models.model as model_module
        from pytriton.proxy import communication
    except ImportError:
        return
    _patch_empty_tensors()
    _patch_triton_log()
    replacements: dict[str, tuple[bytes, bytes]] = {"data.py": (_EMPTY_COPY, _EMPTY_COPY_FIXED)}
    source = Path(communication.__file__).read_bytes()
    if _HANDSHAKE_DEFAULT in source:
        patched = _HANDSHAKE_DEFAULT.replace(b"1.0)", f"{_HANDSHAKE_TIMEOUT_S})".encode())
        replacements["communication.py"] = (_HANDSHAKE_DEFAULT, patched)
        original_get = communication.get_config_from_handshake_server

        def get_config(socket_path: Any, timeout_s: float = _HANDSHAKE_TIMEOUT_S) -> dict:
            return original_get(socket_path, timeout_s=max(timeout_s, _HANDSHAKE_TIMEOUT_S))

        model_module.get_config_from_handshake_server = get_config
    else:
        logger.debug("PyTriton's handshake is not the one patched here; left as it is")
    model_class = model_module.Model
    original_files, original_generate = model_class.get_proxy_model_files, model_class.generate_model

    def get_proxy_model_files(self: Any) -> dict[str, bytes]:
        files = original_files(self)
        for key, content in files.items():
            for name, (old, new) in replacements.items():
                if key.endswith("/" + name):
                    files[key] = content.replace(old, new)
        return files

    def generate_model(self: Any, model_repository: Path) -> None:
        original_generate(self, model_repository)
        for name, (old, new) in replacements.items():
            copy = Path(model_repository) / self.model_name / str(self.model_version) / name
            if copy.is_file():
                copy.write_bytes(copy.read_bytes().replace(old, new))

    model_class.get_proxy_model_files = get_proxy_model_files
    model_class.generate_model = generate_model


#: PyTriton's tensor store copies each frame with ``memoryview.cast("B")``, which refuses a view with a zero in
#: its shape: a tensor with no elements (a KV cache's empty past on a client's first step) failed in the
#: Python-backend stub with "cannot cast view with zeros in shape or strides". An empty frame is copied as b"".
_EMPTY_COPY = b'= frame.cast("B")\n'
_EMPTY_COPY_FIXED = b'= frame.cast("B") if frame.nbytes else b""\n'


def _patch_empty_tensors() -> None:
    """The same fix in this process (the infer callable's answers go through the same store)."""
    from pytriton.proxy import data

    store = data.TensorStore
    original = store._copy_frames
    if getattr(original, "layerzero_patched", False):
        return

    def copy_frames(self: Any, frames: list, shm: Any, offset: int) -> int:
        frames = [b"" if isinstance(f, memoryview) and not f.nbytes else f for f in frames]
        return original(self, frames, shm, offset)

    copy_frames.layerzero_patched = True  # type: ignore[attr-defined]
    store._copy_frames = copy_frames


#: Lines tritonserver writes on every start on a machine without a CUDA driver (a CPU machine): errors and
#: warnings by their look, harmless there (there is no GPU to pin memory for or to pool), and one more it
#: writes whatever the machine for a model whose config PyTriton gives as content rather than a file.
_HARMLESS_TRITON_LINES = (
    "CudaDriverHelper has not been initialized",
    "Unable to allocate pinned system memory, pinned memory pool will not be available: CUDA driver version is "
    "insufficient",
    "CUDA memory pool disabled",
    "Failed to set config modification time: model_config_content_name_ is empty",
)
_CPU_NOTE = ("Triton: no CUDA driver on this machine: serving on the CPU (its CUDA memory pools are off; "
             "tritonserver's CudaDriverHelper / pinned memory lines about that are harmless, not shown)")


def triton_log_line_shown(line: str) -> bool:
    """Whether a tritonserver log line is shown: not one of ``_HARMLESS_TRITON_LINES``, which read as errors."""
    return not any(harmless in line for harmless in _HARMLESS_TRITON_LINES)


def _patch_triton_log() -> None:
    """tritonserver's output, which PyTriton prints line by line, without ``_HARMLESS_TRITON_LINES``; on a CPU
    machine one line (ours, INFO) says what they were."""
    from pytriton.server import triton_server

    server_class = triton_server.TritonServer
    original = server_class._record_logs
    if getattr(original, "layerzero_patched", False):
        return
    noted = threading.Event()

    def record_logs(self: Any, chunk: bytes | str) -> None:
        # PyTriton reads the output unbuffered: a chunk holds parts of lines; whole lines are judged.
        text = chunk.decode("utf-8", errors="replace") if isinstance(chunk, bytes) else chunk
        text = self.__dict__.pop("_layerzero_partial", "") + text
        *lines, rest = text.split("\n")
        if rest:
            self._layerzero_partial = rest
        shown = []
        for line in lines:
            if triton_log_line_shown(line):
                shown.append(line + "\n")
            elif "CudaDriverHelper" in line and not noted.is_set():
                noted.set()
                logger.info(_CPU_NOTE)
        if shown:
            original(self, "".join(shown))

    record_logs.layerzero_patched = True  # type: ignore[attr-defined]
    server_class._record_logs = record_logs


def libpython_on_library_path() -> None:
    # Also the wheel's bundled libraries (libcudart, ...): PyTriton copies tritonserver into a workspace, where
    # the binary's relative RPATH to nvidia_pytriton.libs no longer resolves.
    import pytriton

    bundled = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    for libdir in (sysconfig.get_config_var("LIBDIR"), str(bundled) if bundled.is_dir() else None):
        if not libdir:
            continue
        current = os.environ.get("LD_LIBRARY_PATH", "")
        if libdir not in current.split(os.pathsep):
            os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, current) if p)
