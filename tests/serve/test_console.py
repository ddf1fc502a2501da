"""The web console (``GET /`` of the control port) in a real browser: Debian's headless Chromium, driven through
its DevTools protocol (a minimal WebSocket client below, standard library only), against ``layerzero serve`` on
127.0.0.1. The page loads with no external request, shows the numbers ``/metrics`` shows, a click on the
kill-switch button turns the kill switch on, and a path name with markup is shown as text.

Chromium is a system package (``apt-get install chromium``; .ci/run installs it); without it the test skips, and
fails under ``LAYERZERO_REQUIRE_NATIVE=1`` (CI).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from layerzero.models import example_feeds
from layerzero.runtime.console import CONSOLE_CSP, CONSOLE_HTML
from layerzero.runtime.server import pytriton_available

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not pytriton_available(), reason="PyTriton is not importable (pip install 'layerzero[serve]')"),
]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    if os.environ.get("LAYERZERO_REQUIRE_NATIVE") == "1":
        pytest.fail("LAYERZERO_REQUIRE_NATIVE=1 but chromium is not installed (apt-get install chromium)")
    pytest.skip("chromium is not installed (apt-get install chromium)")


class DevTools:
    """One DevTools page session over a WebSocket (RFC 6455: client frames masked, text frames only)."""

    def __init__(self, ws_url: str) -> None:
        m = re.match(r"ws://([^:/]+):(\d+)(/.*)", ws_url)
        self.sock = socket.create_connection((m.group(1), int(m.group(2))), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {m.group(3)} HTTP/1.1\r\nHost: {m.group(1)}:{m.group(2)}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                           ).encode())  # fmt: skip
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert b" 101 " in head.split(b"\r\n")[0], head
        self.next_id = 0
        self.events: list[dict] = []

    def _recv_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "DevTools closed the connection"
            data += chunk
        return data

    def _recv(self) -> dict:
        message = b""
        while True:
            b0, b1 = self._recv_exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._recv_exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._recv_exact(8))[0]
            message += self._recv_exact(n)
            if b0 & 0x80:
                return json.loads(message)

    def call(self, method: str, **params: object) -> dict:
        self.next_id += 1
        payload = json.dumps({"id": self.next_id, "method": method, "params": params}).encode()
        mask = os.urandom(4)
        n = len(payload)
        header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                  if n < 65536 else bytes([0x80 | 127]) + struct.pack(">Q", n))  # fmt: skip
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        while True:
            message = self._recv()
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]
            self.events.append(message)

    def js(self, expression: str) -> object:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 20.0) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {expression}")


@pytest.fixture(scope="module")
def server(tiny_model: SimpleNamespace, net: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("console-log") / "serve.log"
    args = ["--reference", str(tiny_model.source), "--sample-rate", "0.5", "--no-grpc"]
    with net.serve(tiny_model.bundle, log, *args) as served:
        yield SimpleNamespace(http=served.http, control=served.control, config=tiny_model.config)


@pytest.fixture(scope="module")
def browser(server):
    binary = _chromium()
    profile = tempfile.mkdtemp(prefix="lz-chromium-")
    process = subprocess.Popen(
        [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
         "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            assert process.poll() is None, "chromium exited at start"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        tools = DevTools(page["webSocketDebuggerUrl"])
        tools.call("Network.enable")
        yield tools
    finally:
        process.kill()
        process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        shutil.rmtree(profile, ignore_errors=True)


def _infer(server: SimpleNamespace, n: int) -> None:
    import tritonclient.http as client_lib

    client = client_lib.InferenceServerClient(server.http)
    try:
        for i in range(n):
            ids = example_feeds(server.config, seq=4, seed=i)["input_ids"]
            tensor = client_lib.InferInput("input_ids", list(ids.shape), "INT64")
            tensor.set_data_from_numpy(ids)
            assert client.infer("layerzero", [tensor]).as_numpy("logits").shape[-1] == server.config.vocab_size
    finally:
        client.close()


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip


def _open(browser: DevTools, server: SimpleNamespace) -> None:
    browser.call("Page.enable")
    browser.call("Page.navigate", url=server.control + "/")
    browser.wait("document.body && document.body.dataset.loaded === '1'")


def _click(browser: DevTools, element_id: str) -> None:
    """A real click: mouse events at the element's centre, not a call of its handler."""
    box = browser.js(f"(() => {{ const r = document.getElementById('{element_id}').getBoundingClientRect(); "
                     "return [r.x + r.width / 2, r.y + r.height / 2]; })()")  # fmt: skip
    for kind in ("mousePressed", "mouseReleased"):
        browser.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)


def test_console_page_is_self_contained(server, net):
    status, body = net.http("GET", server.control + "/")
    assert status == 200 and body == CONSOLE_HTML
    assert not re.search(rb"(src|href)=\"?(https?:)?//", body)  # nothing from elsewhere
    with urllib.request.urlopen(server.control + "/", timeout=10) as r:
        assert r.headers["Content-Security-Policy"] == CONSOLE_CSP and "default-src 'none'" in CONSOLE_CSP
        assert r.headers["Content-Type"].startswith("text/html")


def test_console_shows_the_metrics_and_a_click_turns_the_kill_switch_on(server, browser, net):
    _infer(server, 6)
    _open(browser, server)
    # What /metrics says now (nothing is served between the two reads).
    metrics = net.http("GET", server.control + "/metrics")[1].decode()
    browser.js("refresh()")
    requests, fallbacks = _metric(metrics, "layerzero_requests_total"), _metric(metrics, "layerzero_fallbacks_total")
    assert requests == 6
    assert browser.js("document.getElementById('requests').textContent") == str(int(requests))
    assert browser.js("document.getElementById('fallbacks').textContent") == str(int(fallbacks))
    ratio = _metric(metrics, "layerzero_zeroed_params_ratio")
    assert ratio > 0 and browser.js("document.getElementById('zeroed').textContent") == f"{100 * ratio:.1f}%"
    rows = browser.js("[...document.querySelectorAll('#segments tr')].map(r => r.cells[0].textContent + '=' + "
                      "r.cells[1].textContent)")  # fmt: skip
    assert rows == ["default=6"]
    assert browser.js("document.getElementById('kill-state').textContent") == "off"
    _click(browser, "kill")
    browser.wait("document.getElementById('kill-state').textContent.startsWith('on')")
    assert json.loads(net.http("GET", server.control + "/status")[1])["guard"]["kill_switch"] is True
    assert _metric(net.http("GET", server.control + "/metrics")[1].decode(), "layerzero_kill_switch") == 1
    # The threshold form posts to /threshold; a refused value shows the endpoint's one-line error.
    browser.js("document.getElementById('threshold').value = '0.25'; "
               "document.getElementById('threshold-form').requestSubmit()")  # fmt: skip
    browser.wait("document.querySelector('#segments tr').cells[4].textContent === '0.2500'")
    assert all(e.get("method") != "Network.requestWillBeSent" or e["params"]["request"]["url"].startswith(
        server.control) for e in browser.events)  # fmt: skip
    _click(browser, "kill")  # the button moved: the state beside it is longer now
    browser.wait("document.getElementById('kill-state').textContent === 'off'")


def test_console_shows_markup_as_text(browser, server):
    # A hostile path name in the metrics: the page's parser and its textContent cells keep it text.
    _open(browser, server)
    text = ('layerzero_skips_total{path="<img src=x onerror=alert(1)>\\"q\\\\"} 3.0\n'
            'layerzero_requests_total{segment="s"} 6.0\n')
    got = browser.js(f"(() => {{ const m = parseMetrics({json.dumps(text)}); fillTable('paths', "
                     "m.filter(s => s.name === 'layerzero_skips_total').map(s => [s.labels.path, String(s.value)])); "
                     "const cell = document.querySelector('#paths td'); "
                     "return [cell.textContent, document.querySelectorAll('#paths img').length]; })()")  # fmt: skip
    assert got == ['<img src=x onerror=alert(1)>"q\\', 0]


def test_console_numbers_match_after_more_requests(server, browser, net):
    _infer(server, 3)
    _open(browser, server)
    metrics = net.http("GET", server.control + "/metrics")[1].decode()
    assert browser.js("document.getElementById('requests').textContent") == str(int(_metric(metrics,
                                                                                        "layerzero_requests_total")))
    assert np.isclose(_metric(metrics, "layerzero_requests_total"), 9)
