"""The generate endpoint (``layerzero.runtime.generate_server``) on 127.0.0.1: streamed JSON lines equal to
``Engine.generate``, bounded and validated requests (each refusal a 4xx with one JSON line), the guard's
``max_tokens``.

The model is a hand-built cache-carrying "counter" LM in the layout ``layerzero export`` writes: the logits
of token i put all weight on i + 1 (mod V), the present key/value append one row per token to the past (so
the cache must be carried: a wrong past length is a shape error in the next step's mask), eos = V - 1.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from layerzero.errors import UnsupportedModelError
from layerzero.runtime import Engine
from layerzero.runtime.generate import GENERATE_META_KEY
from layerzero.runtime.generate_server import GENERATE_PATH, GenerateServer, GenerateServerConfig, serve_generate
from layerzero.runtime.guard import GuardConfig, GuardedEngine
from tests.generate.counter_lm import counter_lm
from tests.tiny_bundle import free_ports

V = 16


def _counter_lm(path: Path) -> Path:
    model = counter_lm(V, check_mask=True)
    helper.set_model_props(model, {GENERATE_META_KEY: json.dumps({"vocab_size": V, "eos_token_id": [V - 1]})})
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _counter_lm(tmp_path_factory.mktemp("generate_server") / "counter.onnx")


@pytest.fixture()
def server(model: Path):
    config = GenerateServerConfig(port=0, max_new_tokens_cap=64, max_prompt_tokens=32, max_request_bytes=4096)
    with GenerateServer(Engine.load(model), config) as s:
        yield s


def _post(server: GenerateServer, body: bytes | dict, headers: dict | None = None) -> tuple[int, list[dict], dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", GENERATE_PATH, body=data, headers=headers or {})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, [json.loads(line) for line in text.splitlines() if line], dict(resp.getheaders())


def test_stream_equals_engine_generate(model: Path, server: GenerateServer) -> None:
    expected = Engine.load(model).generate([1, 2, 3], max_new_tokens=20)
    assert expected.ids == list(range(4, V)) and expected.report.stop_reason == "stop_token"
    status, lines, headers = _post(server, {"prompt_ids": [1, 2, 3], "max_new_tokens": 20})
    assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
    assert [line["token"] for line in lines[:-1]] == expected.ids
    final = lines[-1]
    assert final["ids"] == expected.ids and final["prompt_ids"] == [1, 2, 3]
    assert final["report"]["stop_reason"] == "stop_token" and final["report"]["new_tokens"] == len(expected.ids)
    status, lines, _ = _post(server, {"prompt_ids": [5], "max_new_tokens": 3, "stream": False})
    assert status == 200 and len(lines) == 1 and lines[0]["ids"] == [6, 7, 8]
    assert lines[0]["report"]["stop_reason"] == "max_new_tokens"
    status, lines, _ = _post(server, {"prompt_ids": [5], "max_new_tokens": 4, "stop_ids": [7], "stream": False})
    assert lines[0]["ids"] == [6, 7]
    # Sampling options pass through: top_k 1 is greedy whatever the temperature.
    status, lines, _ = _post(server, {"prompt_ids": [2], "max_new_tokens": 3, "temperature": 2.0, "top_k": 1,
                                      "seed": 3, "stream": False})  # fmt: skip
    assert status == 200 and lines[0]["ids"] == [3, 4, 5]
    assert server.status()["counters"]["generated_tokens"] == len(expected.ids) + 3 + 2 + 3


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"prompt": "hi"}, 400, "unknown key"),
        ({"prompt_ids": []}, 400, "prompt_ids is required"),
        ({"prompt_ids": [1, V]}, 400, f"token id {V} is outside the vocabulary [0, {V})"),
        ({"prompt_ids": [1, -1]}, 400, "token id -1"),
        ({"prompt_ids": [1, 2.5]}, 400, "integers"),
        ({"prompt_ids": [1] * 33}, 400, "at most 32"),
        ({"prompt_ids": [1], "max_new_tokens": 65}, 400, "max_new_tokens=65: must be in [1, 64]"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, 400, "max_new_tokens=0"),
        ({"prompt_ids": [1], "max_new_tokens": True}, 400, "integer"),
        ({"prompt_ids": [1], "top_p": 0}, 400, "top_p=0"),
        ({"prompt_ids": [1], "temperature": -1}, 400, "temperature=-1"),
        ({"prompt_ids": [1], "stream": "yes"}, 400, "stream must be"),
        (b"x" * 5000, 413, "at most 4096"),
        ({"prompts": [[1]], "prompt_ids": [1]}, 400, "not both"),
        ({"prompts": []}, 400, "prompts must be a non-empty list"),
        ({"prompts": [[1], []]}, 400, "prompts[1] must be a non-empty list"),
        ({"prompts": [[1], [V]]}, 400, f"prompts[1]: token id {V} is outside"),
        ({"prompts": [[1]] * 17}, 400, "at most 16 are accepted"),
        ({"prompts": [[1], [2]], "pad_token_id": V}, 400, f"pad_token_id={V}"),
    ],
)
def test_refusals_are_one_line_4xx(server: GenerateServer, body, status: int, words: str) -> None:
    got, lines, _ = _post(server, body)
    assert got == status and len(lines) == 1 and set(lines[0]) == {"error"}
    assert words in lines[0]["error"] and "\n" not in lines[0]["error"]


def test_missing_length_unknown_path_method_and_busy(server: GenerateServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", GENERATE_PATH)
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["error"]
    conn.close()
    for method, path, status in (("GET", "/nope", 404), ("PUT", GENERATE_PATH, 405), ("POST", "/v1/other", 404)):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request(method, path, body=b"{}")
        resp = conn.getresponse()
        assert resp.status == status and "error" in json.loads(resp.read())
        conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/healthz")
    assert conn.getresponse().read() == b"ok\n"
    conn.close()
    held = [server._slots.acquire(blocking=False) for _ in range(server.config.max_concurrent)]
    assert all(held)
    try:
        status, lines, headers = _post(server, {"prompts": [[1]]})  # a batch request takes a slot
        assert status == 503 and headers["Retry-After"] == "1" and "retry" in lines[0]["error"]
    finally:
        for _ in held:
            server._slots.release()
    assert _post(server, {"prompt_ids": [1], "max_new_tokens": 1})[0] == 200
    counters = server.status()["counters"]
    assert counters["busy"] == 1 and counters["errors_4xx"] >= 4


def test_single_prompts_queue_on_the_continuous_batch_and_503_past_it(model: Path) -> None:
    from layerzero.runtime.batcher import GenerationRequest

    config = GenerateServerConfig(port=0, max_new_tokens_cap=64, batch_rows=1, max_queue=1)
    gate = threading.Event()
    with GenerateServer(Engine.load(model), config) as server:
        entered = threading.Event()

        def hold(token: int) -> None:
            entered.set()
            gate.wait(30)

        blocker = server.batcher.submit(GenerationRequest([1, 2], max_new_tokens=3, stop_tokens=(), on_token=hold))
        assert entered.wait(30) and server.batcher.active == 1
        queued: list = []
        waiting = threading.Thread(target=lambda: queued.append(_post(server, {"prompt_ids": [5], "stream": False,
                                                                               "max_new_tokens": 4})))
        waiting.start()
        while server.batcher.queued == 0:
            time.sleep(0.01)
        status, lines, headers = _post(server, {"prompt_ids": [7]})  # the row and the queue are taken
        assert status == 503 and headers["Retry-After"] == "1" and "queued" in lines[0]["error"]
        gate.set()
        waiting.join(60)
        blocker.result(60)
        status, lines, _ = queued[0]
        assert status == 200 and lines[-1]["ids"] == Engine.load(model).generate([5], max_new_tokens=4).ids
        assert server.status()["counters"]["busy"] == 1


def test_batch_equals_engine_generate_per_prompt(model: Path, server: GenerateServer) -> None:
    prompts = [[1, 2, 3], [5], [12, 13]]
    engine = Engine.load(model)
    expected = [engine.generate(p, max_new_tokens=20) for p in prompts]
    assert [len(e.ids) for e in expected] == [12, 10, 2]  # each row stops at eos on its own step
    status, lines, headers = _post(server, {"prompts": prompts, "max_new_tokens": 20, "pad_token_id": 0})
    assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
    steps, final = [line["tokens"] for line in lines[:-1]], lines[-1]
    assert len(steps) == 12 and all(len(tokens) == 3 for tokens in steps)
    for r, e in enumerate(expected):  # a row's streamed ids, then null once it has finished
        assert [tokens[r] for tokens in steps] == e.ids + [None] * (12 - len(e.ids))
    assert [res["ids"] for res in final["results"]] == [e.ids for e in expected]
    assert [res["prompt_ids"] for res in final["results"]] == prompts
    assert [res["report"]["stop_reason"] for res in final["results"]] == ["stop_token"] * 3
    status, lines, _ = _post(server, {"prompts": prompts, "max_new_tokens": 3, "stream": False})
    assert status == 200 and len(lines) == 1
    assert [res["ids"] for res in lines[0]["results"]] == [[4, 5, 6], [6, 7, 8], [14, 15]]


def test_concurrent_requests_each_get_their_own_tokens(server: GenerateServer) -> None:
    results: dict[int, list[int]] = {}

    def ask(start: int) -> None:
        _, lines, _ = _post(server, {"prompt_ids": [start], "max_new_tokens": 5, "stream": False})
        results[start] = lines[0]["ids"]

    threads = [threading.Thread(target=ask, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {s: [(s + k) % V for k in range(1, 6)] for s in range(4)}


def test_guard_max_tokens_and_serve_hook(model: Path) -> None:
    engine = Engine.load(model)
    guard = GuardedEngine(engine, model, GuardConfig(sample_rate=0.0, max_tokens=6))
    with serve_generate(guard, port=0) as server:
        assert server is not None
        status, lines, _ = _post(server, {"prompt_ids": [1, 2], "max_new_tokens": 10, "stream": False})
        assert status == 200 and lines[0]["ids"] == [3, 4, 5, 6]
        assert lines[0]["report"]["stop_reason"] == "max_tokens"
        status, lines, _ = _post(server, {"prompt_ids": [1, 2, 3, 4, 5, 6]})
        assert status == 400 and "max_tokens=6" in lines[0]["error"]
    # A model that cannot generate (no past/present, no logits) gets no endpoint: serve goes on without it.
    plain = model.parent / "plain.onnx"
    onnx.save(onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) '
                                      "{ y = Relu(x) }"), str(plain))  # fmt: skip
    with serve_generate(Engine.load(plain), port=0) as none:
        assert none is None
    with pytest.raises(UnsupportedModelError, match="input_ids"):
        GenerateServer(Engine.load(plain))


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory):
    """`layerzero serve` of the compiled counter bundle (Triton, the fronts, control and generate), started once."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from layerzero.cli import main
    from layerzero.runtime.server import pytriton_available

    if not pytriton_available():
        pytest.skip("PyTriton is not importable (pip install 'layerzero[serve]')")
    tmp_path = tmp_path_factory.mktemp("served_counter")
    bundle = tmp_path / "counter.lz"
    assert main(["compile", str(model), "-o", str(bundle)]) == 0
    http_port, grpc_port, control_port, generate_port = free_ports(4)
    log = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "layerzero", "serve", str(bundle), "--port-http", str(http_port),
        "--port-grpc", str(grpc_port), "--port-metrics", str(control_port), "--port-generate", str(generate_port),
        "--generate-max-new-tokens", "8", "--instances", "1", "--no-standby",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        for port in (control_port, generate_port):  # Triton's side is healthy before the endpoint binds
            while True:
                assert process.poll() is None, log.read_text()[-3000:]
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                    conn.request("GET", "/healthz")
                    if conn.getresponse().status == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
        generate = GenerateServer.__new__(GenerateServer)  # only its port, for _post
        generate._httpd, generate.config = None, GenerateServerConfig(port=generate_port)
        yield SimpleNamespace(http=http_port, grpc=grpc_port, control=control_port, generate=generate, log=log,
                              bundle=bundle)  # fmt: skip
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


@pytest.mark.slow
def test_layerzero_serve_has_the_generate_endpoint(served) -> None:
    """`layerzero serve` of a compiled cache-carrying bundle answers POST /v1/generate beside Triton."""
    status, lines, _ = _post(served.generate, {"prompt_ids": [1, 2], "max_new_tokens": 5})
    assert status == 200 and [line.get("token") for line in lines[:-1]] == [3, 4, 5, 6, 7]
    assert lines[-1]["ids"] == [3, 4, 5, 6, 7]
    status, lines, _ = _post(served.generate, {"prompt_ids": [1], "max_new_tokens": 9})
    assert status == 400 and "max_new_tokens=9: must be in [1, 8]" in lines[0]["error"]
    log = " ".join(served.log.read_text().split())
    # Issue 20: on a CPU machine tritonserver's CUDA start-up lines read as errors; they are not shown.
    assert "CudaDriverHelper" not in log and "pinned memory pool" not in log and "Started HTTPService" in log
    assert f"generate: POST http://127.0.0.1:{served.generate.port}/v1/generate" in log


def _first_step(ids: list[int], past: int = 0) -> dict[str, np.ndarray]:
    """A client's first KV-cache step: the prompt, its mask and positions, and an empty past."""
    n = len(ids)
    empty = np.zeros((1, 1, past, 2), np.float32)
    return {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, past + n), np.int64),
            "position_ids": np.arange(past, past + n, dtype=np.int64)[None], "past_key_values.0.key": empty,
            "past_key_values.0.value": empty}  # fmt: skip


_KSERVE_TYPE = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}


def _kserve_http(port: int, feeds: dict[str, np.ndarray]) -> tuple[int, dict]:
    inputs = [{"name": k, "shape": list(v.shape), "datatype": _KSERVE_TYPE[v.dtype], "data": v.ravel().tolist()}
              for k, v in feeds.items()]  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v2/models/layerzero/infer", body=json.dumps({"inputs": inputs}).encode())
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    conn.close()
    return resp.status, doc


def _kserve_grpc(port: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import grpc
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="layerzero")
    for name, value in feeds.items():
        request.inputs.add(name=name, datatype=_KSERVE_TYPE[value.dtype], shape=list(value.shape))
        request.raw_input_contents.append(np.ascontiguousarray(value).tobytes())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                    response_deserializer=service_pb2.ModelInferResponse.FromString)  # fmt: skip
        answer = infer(request, timeout=60)
    return {o.name: np.frombuffer(raw, np.float32).reshape(list(o.shape))
            for o, raw in zip(answer.outputs, answer.raw_output_contents, strict=True)}  # fmt: skip


@pytest.mark.slow
def test_a_first_step_with_an_empty_past_is_served(served, model: Path) -> None:
    """Issue 20: every KV-cache client's first request has an empty past ([1, heads, 0, head_dim]); the front
    took it for an empty sequence (400). It is served over HTTP and gRPC, equal to the engine; an empty
    input_ids, which the model cannot take, is still refused."""
    import grpc

    feeds = _first_step([1, 2, 3])
    want = Engine.load(model).run(feeds).outputs
    assert want["present.0.key"].shape == (1, 1, 3, 2)
    status, doc = _kserve_http(served.http, feeds)
    assert status == 200, doc
    got = {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in doc["outputs"]}
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)
    got = _kserve_grpc(served.grpc, feeds)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)
    # The next step carries the first one's presents as its past.
    second = _first_step([4], past=3)
    second["past_key_values.0.key"], second["past_key_values.0.value"] = want["present.0.key"], want["present.0.value"]
    status, doc = _kserve_http(served.http, second)
    assert status == 200, doc
    empty_ids = _first_step([])
    status, doc = _kserve_http(served.http, empty_ids)
    assert status == 400 and "input 'input_ids'" in doc["error"] and "empty" in doc["error"], doc
    with pytest.raises(grpc.RpcError) as caught:
        _kserve_grpc(served.grpc, empty_ids)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in (caught.value.details() or "")


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.mark.slow
def test_metrics_count_inferences_and_generations_once(served) -> None:
    """Issue 20: requests_total counted every decode step (37 after 1 inference and 3 generations) and
    generation had no metrics of its own. After 1 inference, 3 generations (13 tokens) and 1 refused one, one
    scrape of the control port shows each counted once, the guard's runs apart."""
    before = _scrape(served.control)
    status, doc = _kserve_http(served.http, _first_step([1, 2, 3]))
    assert status == 200, doc
    tokens = []
    for prompt, n in (([1, 2], 5), ([5], 3), ([10], 8)):  # 5 tokens, 3, then 5 (eos V - 1 = 15 stops it)
        status, lines, _ = _post(served.generate, {"prompt_ids": prompt, "max_new_tokens": n, "stream": n != 3})
        assert status == 200
        tokens.append(len(lines[-1]["ids"]))
    assert tokens == [5, 3, 5]
    status, _, _ = _post(served.generate, {"prompt_ids": [1], "max_new_tokens": 9})
    assert status == 400
    after = _scrape(served.control)

    def delta(name: str, labels: tuple = ()) -> float:
        if labels:
            return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)
        return _total(after, name) - _total(before, name)

    assert delta("layerzero_requests_total") == 1  # inference requests only
    assert delta("layerzero_guard_runs_total") == 1 + sum(tokens)  # one guard run per generated token here
    assert delta("layerzero_generate_requests_total") == 4
    assert delta("layerzero_generate_tokens_total") == sum(tokens)
    assert delta("layerzero_generate_time_to_first_token_seconds_count") == 3
    assert delta("layerzero_generate_inter_token_latency_seconds_count") == sum(t - 1 for t in tokens)
    assert delta("layerzero_generate_errors_total", (("code", "400"),)) == 1
    assert delta("layerzero_generate_errors_total") == 1
    assert delta("layerzero_request_errors_total") == 0
    assert after[("layerzero_generate_time_to_first_token_seconds_sum", ())] > 0
    # The generate port serves the same registry.
    assert _scrape(served.generate.port)[("layerzero_generate_tokens_total", ())] == after[
        ("layerzero_generate_tokens_total", ())]
