"""What every part of the front shares: the ``FrontSpec`` a front process is started with, the request id key,
the one-line ``RequestError`` and the marker the infer callable's errors carry."""

from __future__ import annotations

import dataclasses
import json
import re

from layerzero.runtime.triton_repo import IOSpec

__all__ = ["MARKER", "REQUEST_ID", "FrontSpec", "RequestError", "one_line"]

#: The header / gRPC metadata key of the front's request id, forwarded by Triton as a request parameter.
REQUEST_ID = "layerzero-request-id"
#: The infer callable raises with this marker; Triton/PyTriton wrap it in a traceback, the front finds it
#: again and answers its status and line, nothing else.
MARKER = re.compile(r"\[layerzero (\d{3})\] ([^\n\\]*)")


def one_line(message: str, limit: int = 400) -> str:
    """``message`` on one line (whitespace runs made one space), at most ``limit`` characters."""
    line = " ".join(str(message).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class RequestError(Exception):
    """A request refused with an HTTP status (4xx) and a one-line message; counted as a request error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(one_line(message))
        self.status = status


@dataclasses.dataclass
class FrontSpec:
    """What a front process needs: the model facts it validates against and its limits."""

    model_name: str
    inputs: list[IOSpec]
    outputs: list[str]
    index_ranges: dict[str, int]
    host: str
    http_port: int
    grpc_port: int | None  # None: no gRPC front
    max_request_bytes: int
    client_timeout_s: float
    restart_wait_s: float
    instances: int = 2
    empty_axes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # see model_facts.empty_axes

    def to_json(self) -> str:
        doc = dataclasses.asdict(self)
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> FrontSpec:
        doc = json.loads(text)
        doc["inputs"] = [IOSpec(s["name"], s["data_type"], tuple(s["dims"])) for s in doc["inputs"]]
        return cls(**doc)
