"""The ONNX Runtime runs of activation calibration (issue 23; ``activation_calibration`` re-exports both):
``collect_activations``, each projection group's input on calibration requests, and ``output_deviation``, the
model-output deviation of a set of thresholds from the dense model (the probes', ``max_error``'s and ``refine``'s
measure); ``cached_output_deviation``, the same through a cache of measured deviations kept across compiles
(``ProbeCache``: the probes of a 1B model are ~10 minutes of a compile, the same for every level and weight
format)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from layerzero.contract import RUNTIME_PREFIX
from layerzero.errors import InvalidInputError, UnsupportedModelError
from layerzero.passes.sparsify_activations import ActivationGroup

__all__ = [
    "ProbeCache",
    "cached_output_deviation",
    "collect_activations",
    "model_key",
    "output_deviation",
    "probe_cache_dir",
]

Evaluate = Callable[[Mapping[str, np.ndarray]], float]


def collect_activations(
    model: ir.Model, groups: Sequence[ActivationGroup], requests: Iterable[Mapping[str, np.ndarray]],
    max_tokens: int = 2048,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Every group's input ``x`` on ``requests`` (``[T, K]`` float32, at most ``max_tokens`` rows each).

    The model (with the groups' inputs as extra outputs, removed again before returning) is saved to a temporary
    folder with its weights in external data and the session is made from that file: a model loaded from a file
    with external data (every export over 2 GB) has initializers that name their data relative to the source's
    folder, which a session made from serialised bytes cannot resolve, and a model over 2 GB cannot be one
    protobuf anyway."""
    import tempfile
    from pathlib import Path

    from layerzero.ort_runner import create_session

    graph = model.graph
    added = []
    for g in groups:
        if g.x not in graph.outputs:
            graph.outputs.append(g.x)
            added.append(g.x)
    # ir.save loads the source's external tensors at or under its threshold into memory and releases their memory
    # map, which a live view of one (an array of the pass's) refuses (BufferError): those few small ones are lent
    # as in-memory copies instead, and every one is put back afterwards.
    inline = 1 << 10  # shape constants ONNX Runtime's shape inference reads stay in the file
    swapped = []
    for g in model.graphs():
        for value in g.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and tensor.nbytes <= inline:
                swapped.append((value, tensor))
                value.const_value = ir.Tensor(np.array(tensor.numpy()), name=tensor.name)
    try:
        with tempfile.TemporaryDirectory(prefix="layerzero-calibration-") as tmp:
            path = Path(tmp) / "calibration.onnx"
            ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=inline)
            if _unrunnable_moe(model):  # a copy with those blocks lowered (read back from the file just written)
                copy = ir.load(path)
                lower_unrunnable_moe(copy)
                path = Path(tmp) / "calibration-lowered.onnx"
                ir.save(copy, path, external_data=path.name + ".data", size_threshold_bytes=inline)
                del copy
            session = create_session(path, label="the calibration model")
            try:
                return _run_requests(session, groups, requests, max_tokens)
            finally:
                del session
    finally:
        for value in added:
            graph.outputs.remove(value)
        for value, tensor in swapped:
            value.const_value = tensor


def _unrunnable_moe(model: ir.Model) -> list[ir.Node]:
    """The ``ai.layerzero::MoE`` nodes of ``model`` a session cannot run as they are: every one without
    liblayerzero_ort.so, else those its kernel refuses (``lower_moe_native.native_supports``: PhiMoE's sparsemixer
    routing, an expert weight a feed may override, ...). The calibration runs before the target's lowering."""
    from layerzero.passes._moe_node import is_moe_node
    from layerzero.passes.lower_moe_native import native_supports
    from layerzero.plugins.ort_library import find_ort_library

    nodes = [n for n in model.graph if is_moe_node(n)]
    if find_ort_library() is None:
        return nodes
    return [n for n in nodes if native_supports(n) is not None]


def lower_unrunnable_moe(model: ir.Model) -> bool:
    """Lower ``_unrunnable_moe``'s nodes in place as the onnxruntime target would (``LowerMoE``: the native kernel's
    blocks stay, the others take the lowering ``auto`` picks without it); True when there were any."""
    if not _unrunnable_moe(model):
        return False
    from layerzero.passes.lower_moe import LowerMoE
    from layerzero.passes.shape_inference import InferShapes
    from layerzero.plugins.ort_library import find_ort_library

    InferShapes()(model)
    library = find_ort_library() is not None
    LowerMoE(lowering="native" if library else "auto", native_present=library)(model)
    return True


def _run_requests(
    session, groups: Sequence[ActivationGroup], requests: Iterable[Mapping[str, np.ndarray]], max_tokens: int
) -> dict[str, np.ndarray]:
    names = [g.x.name for g in groups]
    got: dict[str, list[np.ndarray]] = {g.name: [] for g in groups}
    rows = 0
    for feeds in requests:
        values = session.run(names, dict(feeds))
        for g, v in zip(groups, values, strict=True):
            got[g.name].append(np.asarray(v, np.float32).reshape(-1, g.channels))
        rows += got[groups[0].name][-1].shape[0] if groups else 0
        if rows >= max_tokens:
            break
    return {n: np.concatenate(v)[:max_tokens] for n, v in got.items() if v}


def output_deviation(model: ir.Model, requests: Sequence[Mapping[str, np.ndarray]]) -> Evaluate:
    """The probes' and ``max_error``'s measure on ``model`` (reference form, plain ONNX Runtime): for thresholds,
    the largest relative L2 change of a user output (``layerzero::`` outputs left out) from the dense model over
    ``requests``, the unit of the profile's zeroing impact.

    One session serves every evaluation: a copy of the model with every group in ``SparsifyActivations``' reference
    form and its thresholds made graph inputs (zeros: the dense model, which is the reference), so a probe costs
    one run of the requests, not a session."""
    from layerzero.ort_runner import create_session
    from layerzero.passes.shape_inference import InferShapes
    from layerzero.passes.sparsify_activations import SparsifyActivations, find_groups
    from layerzero.runtime.guard import relative_l2

    if not requests:
        raise InvalidInputError("activation impact tolerance: no calibration request to measure the deviation on")
    proto = ir.to_proto(model)
    names = [o.name for o in proto.graph.output if not o.name.startswith(RUNTIME_PREFIX)]
    # A model loaded from a file with external data (every export over 2 GB) names its data relative to that file's
    # folder: the session made from bytes resolves them there (no copy of the weights is written).
    folders = {t.const_value.base_dir for g in model.graphs() for t in g.initializers.values()
               if isinstance(t.const_value, ir.ExternalTensor)}  # fmt: skip
    if len(folders) > 1:
        raise UnsupportedModelError(f"activation impact tolerance: external data in {len(folders)} folders")
    data_dir = next(iter(folders), None) or None
    variant = ir.from_proto(proto)
    if data_dir:  # the copy's external tensors read from where the model's do
        for g in variant.graphs():
            for v in g.initializers.values():
                if isinstance(v.const_value, ir.ExternalTensor):
                    v.const_value.base_dir = data_dir
    InferShapes()(variant)
    groups = find_groups(variant)
    SparsifyActivations({g.name: np.ones(g.channels, np.float32) for g in groups}, native=False)(variant)
    lower_unrunnable_moe(variant)  # after the pass: an expert group's mask is then before its lowered block
    inputs: dict[str, tuple[str, np.dtype]] = {}
    graph_inputs = {v.name for v in variant.graph.inputs}
    for g in groups:
        init = variant.graph.initializers.get(f"{g.name}.activation_thresholds")
        if init is None:  # refused by the pass (its rank unknown): never sparsified
            continue
        if init.name not in graph_inputs:
            variant.graph.inputs.append(init)
        inputs[g.name] = (init.name, init.const_value.numpy().dtype)
    session = create_session(ir.to_proto(variant).SerializeToString(), external_data_dir=data_dir,
                             label="the activation-sparse calibration model")  # fmt: skip
    channels = {g.name: g.channels for g in groups}

    def run(thresholds: Mapping[str, np.ndarray]) -> list[list[np.ndarray]]:
        unknown = sorted(set(thresholds) - set(inputs))
        if unknown:
            raise InvalidInputError(f"activation thresholds name {unknown[0]!r}, which is no sparsified group")
        feeds = {name: np.asarray(thresholds[g], dtype) if g in thresholds else np.zeros(channels[g], dtype)
                 for g, (name, dtype) in inputs.items()}  # fmt: skip
        return [session.run(names, {**dict(r), **feeds}) for r in requests]

    dense = run({})

    def evaluate(thresholds: Mapping[str, np.ndarray]) -> float:
        worst = 0.0
        for got_all, want in zip(run(thresholds), dense, strict=True):
            for got, base in zip(got_all, want, strict=True):
                if np.issubdtype(np.asarray(base).dtype, np.floating):
                    worst = max(worst, float(relative_l2(np.asarray(got), np.asarray(base))))
        return worst

    return evaluate


# ---------------------------------------------------------------------------------------------------- probe cache

#: The cache's file format; a file of another version is read as empty.
PROBE_CACHE_VERSION = 1


def probe_cache_dir() -> Path | None:
    """Where measured deviations are kept: ``$LAYERZERO_PROBE_CACHE`` when it names a folder, None (no cache) when
    it is ``0``, else ``$XDG_CACHE_HOME/layerzero/probes`` (``~/.cache/layerzero/probes``)."""
    env = os.environ.get("LAYERZERO_PROBE_CACHE", "")
    if env == "0":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layerzero" / "probes"


def model_key(model: ir.Model) -> str:
    """A content key of ``model`` as ``output_deviation`` runs it: its serialized graph (nodes, attributes, in-memory
    initializers, external data references) and, for each external data file it reads, that file's resolved path,
    size and modification time (the weights themselves are not read)."""
    h = hashlib.sha256(ir.to_proto(model).SerializeToString())
    files = set()
    for g in model.graphs():
        for v in g.initializers.values():
            t = v.const_value
            if isinstance(t, ir.ExternalTensor):
                files.add(Path(t.base_dir or ".", t.location).resolve())
    for f in sorted(files):
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def _arrays_key(h: Any, arrays: Mapping[str, Any]) -> None:
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())


@dataclasses.dataclass
class ProbeCache:
    """Measured deviations of ``output_deviation`` kept across compiles: the same model (``model_key``), the same
    requests and the same thresholds measure the same deviation, so a second compile of a model (another
    ``--activation-sparsity`` level, ``--weights``, ``--linear-kernel``: they act after the probes) reads its probes
    instead of running them. One JSON file per model key; written after every new measurement (atomically); an
    unreadable file is read as empty and rewritten."""

    path: Path | None
    requests_key: str
    entries: dict[str, float] = dataclasses.field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    @classmethod
    def open(cls, model: ir.Model, requests: Sequence[Mapping[str, np.ndarray]],
             folder: Path | None = None) -> ProbeCache:  # fmt: skip
        folder = probe_cache_dir() if folder is None else folder
        h = hashlib.sha256()
        for r in requests:
            _arrays_key(h, r)
            h.update(b"\1")
        if folder is None:
            return cls(None, h.hexdigest())
        cache = cls(folder / f"{model_key(model)}.json", h.hexdigest())
        try:
            doc = json.loads(cache.path.read_text())
            if doc.get("version") == PROBE_CACHE_VERSION and isinstance(doc.get("deviations"), dict):
                cache.entries = {str(k): float(v) for k, v in doc["deviations"].items()}
        except (OSError, ValueError, TypeError, AttributeError):
            cache.entries = {}
        return cache

    def key(self, thresholds: Mapping[str, np.ndarray]) -> str:
        h = hashlib.sha256(self.requests_key.encode())
        _arrays_key(h, {name: np.asarray(t, np.float32) for name, t in thresholds.items()})
        return h.hexdigest()

    def store(self, key: str, deviation: float) -> None:
        self.entries[key] = deviation
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": PROBE_CACHE_VERSION, "deviations": self.entries}))
            tmp.replace(self.path)
        except OSError:  # a read-only or full cache folder: measured, not kept
            pass


def cached_output_deviation(model: ir.Model, requests: Sequence[Mapping[str, np.ndarray]],
                            folder: Path | None = None) -> tuple[Evaluate, ProbeCache]:  # fmt: skip
    """``output_deviation`` through a ``ProbeCache``: thresholds measured before on the same model and requests are
    answered from the cache; the session (and its dense run) is only made at the first measurement the cache does
    not hold. Also returns the cache (its ``hits`` / ``misses``)."""
    if not requests:
        raise InvalidInputError("activation impact tolerance: no calibration request to measure the deviation on")
    cache = ProbeCache.open(model, requests, folder)
    measure: list[Evaluate] = []

    def evaluate(thresholds: Mapping[str, np.ndarray]) -> float:
        key = cache.key(thresholds)
        if key in cache.entries:
            cache.hits += 1
            return cache.entries[key]
        if not measure:
            measure.append(output_deviation(model, requests))
        deviation = float(measure[0](thresholds))
        cache.misses += 1
        cache.store(key, deviation)
        return deviation

    return evaluate, cache
