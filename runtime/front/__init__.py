"""The inference fronts of ``layerzero serve`` (HTTP and gRPC), in a process of their own.

    front = FrontProcess(FrontSpec(...))       # the parent (``LayerZeroServer``) starts it
    front.start()                              # returns once both ports listen (or raises, one line)
    front.set_triton(http_port, grpc_port, pid)
    front.errors                               # requests refused or failed in the front, counted there
    front.stop()                               # nothing left running

Why a process: the fronts' Python (reading, validating and forwarding each request) shared the GIL with
PyTriton's proxy and the infer callable; with 8 clients the front doubled p50. Here it has an interpreter of its
own: ``python -m layerzero.runtime.front`` reads a ``FrontSpec`` (the model facts it validates against: inputs,
outputs, index ranges, limits) as one JSON line on stdin, answers one line (ready, or the error), then follows
commands on stdin, one JSON line each: ``{"triton": [http_port, grpc_port, pid]}`` (where to forward),
``{"restarting": true}`` (hold requests: the supervisor is replacing Triton), ``{"stop": true}``. The end of
stdin (the parent died) stops it too.

Counts the parent must report reach it through a small shared file mapping written only by the front (slot 0:
errors, slot 1: inference requests seen): the parent reads them at scrape time, so nothing is counted twice
or lost when the front dies and is restarted (the mapping is the parent's and outlives it).

The modules, one responsibility each: ``spec`` (the ``FrontSpec``, ``RequestError``), ``process`` (the parent's
``FrontProcess`` and the process's ``main``), ``upstream`` (Triton as the front sees it: ``Upstream``, the
HTTP/1.1 client ``TritonConnection``), ``check`` (one ``check_request`` for both protocols, fed by a JSON and
a protobuf decoder), ``http_front`` and ``grpc_front`` (the two listeners).

Each forwarded inference request carries a header (HTTP) or metadata entry (gRPC) ``layerzero-request-id``,
which Triton hands to the infer callable as a request parameter: a request sent again after Triton died
with it in flight is run and counted once (see ``LayerZeroServer._infer``).
"""

from layerzero.runtime.front.body import BodyReader
from layerzero.runtime.front.check import RequestFacts, check_request, decode_json, decode_protobuf, may_be_empty
from layerzero.runtime.front.grpc_front import GrpcFront
from layerzero.runtime.front.http_front import InferenceFront
from layerzero.runtime.front.process import FrontProcess
from layerzero.runtime.front.spec import REQUEST_ID, FrontSpec, RequestError, one_line
from layerzero.runtime.front.upstream import Upstream

__all__ = [
    "REQUEST_ID",
    "BodyReader",
    "FrontProcess",
    "FrontSpec",
    "GrpcFront",
    "InferenceFront",
    "RequestError",
    "RequestFacts",
    "Upstream",
    "check_request",
    "decode_json",
    "decode_protobuf",
    "may_be_empty",
    "one_line",
]
