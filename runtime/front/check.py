"""The checks of one KServe v2 inference request, the same for HTTP and gRPC: ``check_request``, fed by a JSON
decoder (``decode_json``: the HTTP body) or a protobuf decoder (``decode_protobuf``: a ``ModelInferRequest``).

    facts = RequestFacts(spec)                       # the model's inputs, outputs, id ranges, limits
    check_request(facts, decode_json("m", head, binary))
    check_request(facts, decode_protobuf(raw, facts.max_request_bytes))

Refused (``RequestError``: a 4xx status and one line; the same line for the same request on either protocol):
1. an unknown model (404); a ``segment`` parameter that is not a string, the front's own request id parameter;
   outputs the model does not have;
2. an unknown or repeated input, a wrong datatype, a shape whose rank or fixed dims differ from the model's,
   with a negative dim, more elements than a request can carry, or empty (no elements) where the model cannot
   take that (``may_be_empty``: a KV cache's past on a first step can be);
3. binary data whose size differs from the shape's, values whose count differs, JSON values of the wrong type;
4. integer ids outside an embedding's rows (``FrontSpec.index_ranges``); a missing input.
What only one encoding can get wrong (JSON that is not an object, a message that is not a ``ModelInferRequest``,
binary data past the body) is the decoder's refusal, with a line of its own.

A decoded request is read lazily, in the order of the checks: a request wrong in two ways gets the first
refusal in that order whatever its encoding.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from layerzero.runtime.front.spec import REQUEST_ID, FrontSpec, RequestError
from layerzero.runtime.triton_repo import IOSpec

__all__ = [
    "GRPC_CONTENTS",
    "KSERVE",
    "MAX_RANK",
    "RequestFacts",
    "check_model",
    "check_range",
    "check_request",
    "decode_json",
    "decode_protobuf",
    "may_be_empty",
]

# KServe v2 datatypes by Triton config type, and bytes per element (0: variable, BYTES).
KSERVE = {
    "TYPE_BOOL": ("BOOL", 1), "TYPE_UINT8": ("UINT8", 1), "TYPE_UINT16": ("UINT16", 2),
    "TYPE_UINT32": ("UINT32", 4), "TYPE_UINT64": ("UINT64", 8), "TYPE_INT8": ("INT8", 1),
    "TYPE_INT16": ("INT16", 2), "TYPE_INT32": ("INT32", 4), "TYPE_INT64": ("INT64", 8),
    "TYPE_FP16": ("FP16", 2), "TYPE_FP32": ("FP32", 4), "TYPE_FP64": ("FP64", 8), "TYPE_BF16": ("BF16", 2),
    "TYPE_STRING": ("BYTES", 0),
}  # fmt: skip
MAX_RANK = 16
#: The InferTensorContents field that carries each KServe datatype (FP16 / BF16: raw_input_contents only).
GRPC_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                 "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                 "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                 "FP64": "fp64_contents", "BYTES": "bytes_contents"}  # fmt: skip
#: A gRPC parameter with none of its values set: never a string.
_UNSET = object()


class RequestFacts:
    """What a request is checked against, from the ``FrontSpec``: one per front process, shared by its fronts."""

    def __init__(self, spec: FrontSpec) -> None:
        self.model_name = spec.model_name
        self.inputs: dict[str, IOSpec] = {s.name: s for s in spec.inputs}
        self.outputs = frozenset(spec.outputs)
        self.ranges = dict(spec.index_ranges)
        self.empty_axes = {name: tuple(axes) for name, axes in spec.empty_axes.items()}
        self.max_request_bytes = spec.max_request_bytes
        # Per input, made once (not per request): (KServe datatype, bytes per element), its numpy dtype, and the
        # Python types its JSON values may have (and whether a bool is one: only for BOOL).
        self.kserve = {s.name: KSERVE.get(s.data_type, (s.data_type, 0)) for s in spec.inputs}
        self.dtypes = {s.name: s.numpy_dtype for s in spec.inputs}
        self.json_types: dict[str, tuple[tuple[type, ...], bool]] = {}
        for s in spec.inputs:
            if self.kserve[s.name][1] and s.numpy_dtype is not None:
                kind = np.dtype(s.numpy_dtype).kind if s.data_type != "TYPE_BF16" else "f"
                ok = (bool,) if kind == "b" else (int,) if kind in "iu" else (int, float)
                self.json_types[s.name] = (ok, kind == "b")


def may_be_empty(shape: Any, axes: Any) -> bool:
    """Whether a tensor of ``shape`` with no elements is one the model takes: each 0 on one of ``axes``
    (``model_facts.empty_axes``: a KV cache's past, empty on a client's first step)."""
    return all(d != 0 or i in axes for i, d in enumerate(shape))


def check_model(facts: RequestFacts, model: str) -> None:
    if model != facts.model_name:
        raise RequestError(404, f"no model {model[:100]!r}; this server serves {facts.model_name!r}")


def check_request(facts: RequestFacts, request: Any, collect: bool = False) -> tuple[int, list | None]:
    """Check one decoded request (``decode_json`` / ``decode_protobuf``); raise ``RequestError``.

    Returns the bytes of binary data its inputs take and, with ``collect``, what remains to check of the
    binary data once its header is known valid (the id range checks: (name, dtype, count, offset) each), or
    None when some input had its values in the header (nothing to remember).
    """
    check_model(facts, request.model)
    params = request.params()
    segment = params.get("segment")
    if segment is not None and not isinstance(segment, str):
        raise RequestError(400, 'the request parameter "segment" must be a string')
    if REQUEST_ID in params:  # the front's own (it names a request's cached answer): never a client's
        raise RequestError(400, f'the request parameter "{REQUEST_ID}" is reserved')
    for name in request.outputs():
        if name not in facts.outputs:
            raise RequestError(400, f'"outputs" must name outputs of the model: {sorted(facts.outputs)}')
    request.check_structure()
    seen: set[str] = set()
    offset = 0
    ranges: list | None = [] if collect else None
    for tensor in request.inputs():
        name = tensor.name
        spec = facts.inputs.get(name)
        if spec is None:
            raise RequestError(400, f"unknown input {name[:100]!r}; the model's inputs: {sorted(facts.inputs)}")
        if name in seen:
            raise RequestError(400, f"input {name!r} is given twice")
        seen.add(name)
        datatype, itemsize = facts.kserve[name]
        if tensor.datatype != datatype:
            raise RequestError(400, f"input {name!r}: datatype must be {datatype}, got {str(tensor.datatype)[:40]!r}")
        shape = tensor.shape()
        if shape is None:
            raise RequestError(400, f"input {name!r}: shape must be a list of at most {MAX_RANK} integers")
        count = _check_shape(facts, spec, shape)
        binary = tensor.binary(offset)
        if binary is not None:
            size, buffer, at, offset = binary
            if itemsize and size != count * itemsize:
                raise RequestError(400, f"input {name!r}: {size} bytes of binary data != {count} elements × {itemsize}")
            if at + size > len(buffer):
                raise RequestError(400, f"input {name!r}: binary_data_size {size} runs past the body")
            if itemsize and name in facts.ranges:
                dtype = facts.dtypes[name]
                check_range(facts, name, np.frombuffer(buffer, dtype=dtype, count=count, offset=at))
                if ranges is not None:
                    ranges.append((name, dtype, count, at))
            continue
        values = tensor.values(datatype)
        if len(values) != count:
            raise RequestError(400, f"input {name!r}: {len(values)} values for shape {shape} ({count} elements)")
        if itemsize and not tensor.typed and name in facts.json_types:
            ok, bools = facts.json_types[name]
            if not all(isinstance(v, ok) and (bools or not isinstance(v, bool)) for v in values):
                raise RequestError(400, f"input {name!r}: values must be {datatype} numbers")
        if name in facts.ranges:
            check_range(facts, name, values)
        ranges = None
    missing = sorted(set(facts.inputs) - seen)
    if missing:
        raise RequestError(400, f"missing input(s) {missing}")
    request.check_end(offset)
    return offset, ranges


def _check_shape(facts: RequestFacts, spec: IOSpec, shape: list[int]) -> int:
    """Check a request's ``shape`` of input ``spec``; its number of elements."""
    name = spec.name
    if any(d < 0 for d in shape):
        raise RequestError(400, f"input {name!r}: shape {shape} has a negative dim")
    if len(shape) != len(spec.dims):
        raise RequestError(400, f"input {name!r}: shape {shape} has rank {len(shape)}, the model expects "
                                f"{len(spec.dims)} (dims {list(spec.dims)}, -1 = any)")  # fmt: skip
    for got, want in zip(shape, spec.dims, strict=True):
        if want > 0 and got != want:
            raise RequestError(400, f"input {name!r}: shape {shape} does not match the model's dims "
                                    f"{list(spec.dims)} (-1 = any)")  # fmt: skip
    # Bounded before any product can grow: each element takes at least one byte of the body.
    count = 1
    for d in shape:
        count *= d
        if count > facts.max_request_bytes:
            raise RequestError(400, f"input {name!r}: shape {shape[:8]} has more elements than a request "
                                    f"of at most {facts.max_request_bytes} bytes can carry")  # fmt: skip
    if count == 0 and not may_be_empty(shape, facts.empty_axes.get(name, ())):
        raise RequestError(400, f"input {name!r}: shape {shape} is empty (an empty sequence cannot be served)")
    return count


def check_range(facts: RequestFacts, name: str, values: Any) -> None:
    """Every id in ``values`` (an integer array, a list of ints from JSON, protobuf's repeated ints) is in
    [0, rows)."""
    rows = facts.ranges[name]
    if isinstance(values, np.ndarray):
        if values.dtype.kind == "i" and (not values.size or int(values.view(f"u{values.itemsize}").max()) < rows):
            return  # one pass: seen as unsigned, a negative id is above every row count
    elif not values or (min(values) >= 0 and max(values) < rows):
        return  # JSON or protobuf ids are Python ints already: no array to build for a few of them
    array = np.asarray(values)
    if array.size and (int(array.min()) < 0 or int(array.max()) >= rows):
        bad = int(array.min()) if int(array.min()) < 0 else int(array.max())
        raise RequestError(400, f"input {name!r}: id {bad} is out of range [0, {rows})")


# --------------------------------------------------------------------------------------------- JSON (HTTP)


def decode_json(model: str, head: bytes, binary: bytes = b"") -> _JsonRequest:
    """The KServe v2 JSON request ``head`` (the body, or its part before the binary data) for ``model``."""
    try:
        doc = json.loads(head)
    except RecursionError:
        raise RequestError(400, "the request JSON is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise RequestError(400, 'the request must be a JSON object with a list "inputs" (KServe v2)')
    return _JsonRequest(model, doc, binary)


class _JsonRequest:
    __slots__ = ("binary", "doc", "model")

    def __init__(self, model: str, doc: dict, binary: bytes) -> None:
        self.model, self.doc, self.binary = model, doc, binary

    def params(self) -> dict:
        params = self.doc.get("parameters", {})
        if not isinstance(params, dict):
            raise RequestError(400, '"parameters" must be an object')
        return params

    def outputs(self) -> list:
        outputs = self.doc.get("outputs", [])
        if not isinstance(outputs, list):
            return [None]
        return [o.get("name") if isinstance(o, dict) and isinstance(o.get("name"), str) else None for o in outputs]

    def check_structure(self) -> None:
        pass

    def inputs(self) -> Iterator[_JsonTensor]:
        for tensor in self.doc["inputs"]:
            if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
                raise RequestError(400, 'each input must be an object with a "name"')
            yield _JsonTensor(tensor, self.binary)

    def check_end(self, offset: int) -> None:
        if offset != len(self.binary):
            raise RequestError(400, f"the binary data holds {len(self.binary)} bytes, the inputs declare {offset}")


class _JsonTensor:
    __slots__ = ("buffer", "datatype", "doc", "name")
    typed = False  # JSON values may be of any type: checked

    def __init__(self, doc: dict, buffer: bytes) -> None:
        self.doc, self.buffer = doc, buffer  # the request's binary data, every input's
        self.name, self.datatype = doc["name"], doc.get("datatype")

    def shape(self) -> list[int] | None:
        shape = self.doc.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):  # fmt: skip
            return None
        return shape

    def binary(self, offset: int) -> tuple[int, bytes, int, int] | None:
        """(its bytes, the buffer that holds them, where they start there, where the next input's start), or None:
        its values are in the JSON. ``offset``: where its binary data start (after the previous inputs')."""
        params = self.doc.get("parameters", {})
        if not isinstance(params, dict):
            raise RequestError(400, f"input {self.name!r}: parameters must be an object")
        size = params.get("binary_data_size")
        if size is None:
            return None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RequestError(400, f"input {self.name!r}: binary_data_size must be a non-negative integer")
        return size, self.buffer, offset, offset + size  # the inputs' binary data follow one another

    def values(self, datatype: str) -> list:
        data = self.doc.get("data")
        if not isinstance(data, list):
            raise RequestError(400, f'input {self.name!r}: "data" must be a list (or use binary_data_size)')
        return _flatten(data, self.name)


def _flatten(data: list, name: str) -> list:
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) > MAX_RANK:
                    raise RequestError(400, f"input {name!r}: data is nested deeper than {MAX_RANK}")
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


# ------------------------------------------------------------------------------------------ protobuf (gRPC)


#: (ModelInferRequest.FromString, DecodeError), imported on the first gRPC request (not per request: an
#: import statement in a function costs a module lookup each call), not on import (grpc is the serve extra's).
_PROTOBUF: tuple[Any, type[Exception]] | None = None


def _load_protobuf() -> tuple[Any, type[Exception]]:
    global _PROTOBUF
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import service_pb2

    _PROTOBUF = (service_pb2.ModelInferRequest.FromString, DecodeError)
    return _PROTOBUF


def decode_protobuf(raw: bytes, max_request_bytes: int) -> _ProtoRequest:
    """The ``ModelInferRequest`` message ``raw`` (at most ``max_request_bytes``)."""
    if len(raw) > max_request_bytes:
        raise RequestError(413, f"the message is {len(raw)} bytes; at most {max_request_bytes} are accepted")
    parse, decode_error = _PROTOBUF or _load_protobuf()
    try:
        request = parse(raw)
    except (decode_error, RecursionError, ValueError):
        raise RequestError(400, "the message is not a ModelInferRequest") from None
    return _ProtoRequest(request)


class _ProtoRequest:
    __slots__ = ("model", "raw", "request")

    def __init__(self, request: Any) -> None:
        self.request, self.model = request, request.model_name
        self.raw = request.raw_input_contents  # read in place: no copy of the tensors' bytes

    def params(self) -> dict:
        parameters = self.request.parameters
        if not parameters:
            return {}
        out = {}
        for key, value in parameters.items():
            which = value.WhichOneof("parameter_choice")
            out[key] = getattr(value, which) if which is not None else _UNSET
        return out

    def outputs(self) -> Any:
        outputs = self.request.outputs
        return [o.name for o in outputs] if outputs else ()

    def check_structure(self) -> None:
        if self.raw and len(self.raw) != len(self.request.inputs):
            raise RequestError(400, f"{len(self.raw)} raw_input_contents for {len(self.request.inputs)} inputs")

    def inputs(self) -> list[_ProtoTensor]:
        raw = self.raw
        if raw:
            return [_ProtoTensor(tensor, raw[i]) for i, tensor in enumerate(self.request.inputs)]
        return [_ProtoTensor(tensor, None) for tensor in self.request.inputs]

    def check_end(self, offset: int) -> None:
        pass  # each input's raw contents are a field of their own: none can run past another's


class _ProtoTensor:
    __slots__ = ("datatype", "name", "raw", "tensor")
    typed = True  # protobuf's typed contents hold values of their field's type only

    def __init__(self, tensor: Any, raw: bytes | None) -> None:
        self.tensor, self.raw = tensor, raw
        self.name, self.datatype = tensor.name, tensor.datatype

    def shape(self) -> list[int] | None:
        shape = self.tensor.shape
        return [int(d) for d in shape] if len(shape) <= MAX_RANK else None

    def binary(self, offset: int) -> tuple[int, bytes, int, int] | None:
        raw = self.raw
        return (len(raw), raw, 0, offset) if raw is not None else None  # a field of its own

    def values(self, datatype: str) -> Any:
        field = GRPC_CONTENTS.get(datatype)
        return getattr(self.tensor.contents, field) if field is not None else ()
