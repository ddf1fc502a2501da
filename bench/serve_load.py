"""Bounded load test: the same bundle served bare (PyTriton + ONNX Runtime) and by `layerzero serve`.

    python bench/serve_load.py                      # 10,000 requests from 8 concurrent clients, per server
    python bench/serve_load.py --quick              # 1,000 requests
    python bench/serve_load.py --requests 2000 --clients 4 --protocol grpc --sample-rate 0
    python bench/serve_load.py --hostile            # 8 clients x 1,000 requests, 5 % malformed, layerzero serve
    python bench/serve_load.py --hostile --quick    # 8 clients x 125 requests
    python bench/serve_load.py --front-only --quick # the inference front alone: its CPU per request

Builds the example transformer (consumed zero flags, two blocks zeroed), compiles it, then serves the SAME
compiled model.onnx (i) with a bare PyTriton infer function around an onnxruntime session and
(ii) with `layerzero serve` (the bundle; guard on at --sample-rate, reference = the source),
one after the other, each on free 127.0.0.1 ports, and sends the same requests to each from --clients threads
(tritonclient, one client per thread, after a warm-up). Prints p50/p95/p99 latency, throughput and errors
side by side, then the guard's in-process overhead (Engine.run vs GuardedEngine.run, off and sampling).

Target: 0 errors, LayerZero p50 within 3 ms of bare PyTriton. Needs the serve extra (PyTriton, tritonclient).
Every run is bounded by --requests and --max-seconds per server.

--hostile serves the bundle with `layerzero serve` alone and sends --clients x --per-client KServe v2 HTTP/JSON
requests, --malformed-rate of them malformed (huge or empty shapes, ids out of range, wrong datatype, bad or
deeply nested JSON, a list-valued segment, unknown inputs) mixed in at random. Every valid request must be
answered 200 with the outputs Engine.run gives, every malformed one with a 4xx; and the server's
layerzero_requests_total / layerzero_request_errors_total must have moved by exactly the valid / malformed
counts. Prints the tally; exits 1 on any miss.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

VOCAB = 256


def _free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _build(tmp: Path) -> tuple[Path, Path]:
    import onnx

    from layerzero.compile import compile_file
    from layerzero.models import TransformerConfig, build_transformer
    from layerzero.options import CompileOptions

    config = TransformerConfig(flag_form="consumed", zero_blocks=(1, 2))
    source = tmp / "source.onnx"
    onnx.save(build_transformer(config), str(source))
    bundle = tmp / "model.lz"
    compile_file(source, bundle, CompileOptions(dynamic=False))
    return source, bundle


# ------------------------------------------------------------------------------------- (i) bare PyTriton


def bare_server(model: str, http_port: int, grpc_port: int, instances: int) -> None:
    """A PyTriton server around a plain onnxruntime session (what one writes without LayerZero)."""
    import sysconfig

    import onnxruntime as ort
    import pytriton
    from pytriton.model_config import ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    wheel_libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"  # libcudart, ...
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (sysconfig.get_config_var("LIBDIR"), str(wheel_libs), os.environ.get("LD_LIBRARY_PATH")) if p
    )
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])

    def infer(requests: list) -> list[dict[str, np.ndarray]]:
        return [{"logits": session.run(["logits"], {"input_ids": r["input_ids"]})[0]} for r in requests]

    from layerzero.runtime.triton_process import patch_pytriton

    patch_pytriton()  # the same start-up fix `layerzero serve` has (1 s stub handshake -> 30 s)
    config = TritonConfig(http_address="127.0.0.1", http_port=http_port, grpc_address="127.0.0.1",
                          grpc_port=grpc_port, allow_metrics=False, exit_timeout_secs=5)  # fmt: skip
    # PyTriton's stub handshake has a fixed 1 s timeout that a loaded machine misses now and then; `layerzero
    # serve` tries 5 times, and so does the bare server (else the comparison fails to start, not to serve).
    for attempt in range(5):
        triton = Triton(config=config)
        try:
            triton.bind(
                model_name="layerzero",
                infer_func=[infer] * instances,
                inputs=[Tensor(name="input_ids", dtype=np.int64, shape=(-1, -1))],
                outputs=[Tensor(name="logits", dtype=np.float32, shape=(-1, -1, VOCAB))],
                config=ModelConfig(batching=False),
            )
            triton.run()
        except Exception:
            with contextlib.suppress(Exception):
                triton.stop()
            if attempt == 4:
                raise
            time.sleep(1.0 + attempt)
            continue
        break
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # serve() stops cleanly on KeyboardInterrupt
    try:
        triton.serve()
    finally:
        triton.stop()


# ------------------------------------------------------------------------------------------------- load


def _wait_ready(name: str, http_port: int, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{http_port}/v2/models/layerzero/ready"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name}: the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name}: the server is not ready after {timeout:g}s")


def _wait_standby(name: str, control_port: int, process: subprocess.Popen, timeout: float = 180.0) -> None:
    import json

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name}: the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{control_port}/status", timeout=5) as response:
                if json.loads(response.read()).get("standby_ready"):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name}: no standby Triton after {timeout:g}s")


def _stop(process: subprocess.Popen) -> None:
    # SIGTERM to the server alone, so that it stops Triton and the Python-backend stubs in order (the stubs
    # ignore SIGTERM), then SIGKILL to whatever is left of its session.
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _session_cpu(sid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the processes of session ``sid`` (a server started with
    ``start_new_session=True``), by role: the server process, the inference front, tritonserver, the stubs."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[-1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if int(fields[3]) != sid:
            continue
        program = command.split(b"\0", 1)[0]
        role = ("server process" if int(entry) == sid else "front" if b"layerzero.runtime.front" in command
                else "Python-backend stubs" if program.endswith(b"triton_python_backend_stub")
                else "tritonserver" if program.endswith(b"tritonserver")
                else f"other: {os.path.basename(program).decode(errors='replace')[:20]}")  # fmt: skip
        found[role] = found.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found


def load(url: str, protocol: str, requests: int, clients: int, seq: int, max_seconds: float) -> dict:
    """Send ``requests`` requests from ``clients`` threads; their latencies (s), wall time and errors."""
    if protocol == "http":
        import tritonclient.http as lib
    else:
        import tritonclient.grpc as lib
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(1, seq), dtype=np.int64)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    per_client = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]
    deadline = [0.0]
    # The barrier's action runs before any thread is released: the clock starts when the warm-up is over.
    start_gate = threading.Barrier(clients + 1, action=lambda: deadline.__setitem__(0, time.monotonic() + max_seconds))

    def client(i: int) -> None:
        c = lib.InferenceServerClient(url)
        tensor = lib.InferInput("input_ids", list(ids.shape), "INT64")
        tensor.set_data_from_numpy(ids)
        try:
            for _ in range(20):  # warm-up, not counted
                c.infer("layerzero", [tensor])
            start_gate.wait()
            for _ in range(per_client[i]):
                if time.monotonic() > deadline[0]:
                    break
                t0 = time.perf_counter()
                try:
                    out = c.infer("layerzero", [tensor]).as_numpy("logits")
                    if out is None or out.shape != (1, seq, VOCAB) or not np.isfinite(out).all():
                        errors[i] += 1
                except Exception:
                    errors[i] += 1
                latencies[i].append(time.perf_counter() - t0)
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    start_gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"latencies": [x for xs in latencies for x in xs], "errors": int(sum(errors)), "wall": wall}


def summarize(phases: list[dict]) -> dict:
    lat = np.array([x for p in phases for x in p["latencies"]]) * 1e3
    wall = sum(p["wall"] for p in phases)
    return {
        "requests": int(lat.size),
        "errors": int(sum(p["errors"] for p in phases)),
        "p50": float(np.percentile(lat, 50)),
        "p95": float(np.percentile(lat, 95)),
        "p99": float(np.percentile(lat, 99)),
        "mean": float(lat.mean()),
        "throughput": lat.size / wall,
    }


# ------------------------------------------------------------------------------------- guard overhead


def guard_overhead(source: Path, bundle: Path, seq: int, n: int) -> list[tuple[str, float, float]]:
    """Per-call time of Engine.run, and of GuardedEngine.run with the guard off and sampling 1 %."""
    from layerzero.runtime import Engine
    from layerzero.runtime.guard import GuardConfig, GuardedEngine

    engine = Engine.load(bundle)
    feeds = {"input_ids": np.random.default_rng(0).integers(0, VOCAB, size=(1, seq), dtype=np.int64)}
    off = GuardedEngine(engine, source, GuardConfig(sample_rate=0.0))
    sampling = GuardedEngine(engine, source, GuardConfig(sample_rate=0.01, seed=1))
    sampling.preload_reference()
    rows = []
    for name, fn in (
        ("Engine.run", lambda: engine.run(feeds)),
        ("GuardedEngine.run, guard off", lambda: off.run(feeds)),
        ("GuardedEngine.run, sample 1 %", lambda: sampling.run(feeds)),
    ):
        for _ in range(50):
            fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        rows.append((name, statistics.median(times) * 1e6, statistics.fmean(times) * 1e6))
    assert not off.reference_loaded, "the guard loaded its reference while off"
    return rows


# ------------------------------------------------------------------------------------------- --hostile


def _malformed(ids: np.ndarray) -> list[tuple[str, bytes]]:
    """Malformed KServe v2 JSON bodies, each named; every one must be answered with a 4xx."""
    import json

    def tensor(**changes: object) -> dict:
        t = {"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.ravel().tolist()}
        t.update(changes)
        return t

    def body(*tensors: dict, **extra: object) -> bytes:
        return json.dumps({"inputs": list(tensors), **extra}).encode()

    n = ids.size
    return [
        ("huge shape", body(tensor(shape=[1, 1_000_000_000, 16]))),
        ("huge rank-2 shape", body(tensor(shape=[1, 1_000_000_000]))),
        ("empty sequence", body(tensor(shape=[1, 0], data=[]))),
        ("id out of range", body(tensor(data=[VOCAB + 7] * n))),
        ("negative id", body(tensor(data=[-3] * n))),
        ("wrong datatype", body(tensor(datatype="FP32"))),
        ("short data", body(tensor(data=[1]))),
        ("unknown input", body(tensor(name="nope"))),
        ("not json", b"{inputs: oops"),
        ("deep json", b"[" * 5000 + b"]" * 5000),
        ("segment list", body(tensor(), parameters={"segment": ["default"]})),
        ("no inputs", b"{}"),
    ]


def _metric_totals(control_port: int) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{control_port}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = {"layerzero_requests_total": 0.0, "layerzero_request_errors_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["layerzero_requests_total"], totals["layerzero_request_errors_total"]


def hostile(args: argparse.Namespace) -> int:
    """8 clients x 1,000 requests with 5 % malformed ones: every valid one right, the counters add up."""
    import http.client
    import json

    from layerzero.runtime import Engine

    per_client = min(args.per_client, 125) if args.quick else args.per_client
    with tempfile.TemporaryDirectory(prefix="serve_load.") as tmp_name:
        tmp = Path(tmp_name)
        source, bundle = _build(tmp)
        engine = Engine.load(bundle)
        rng = np.random.default_rng(0)
        valid = []
        for k in range(8):  # a few distinct requests, each with the answer Engine.run gives
            ids = rng.integers(0, VOCAB, size=(1, 4 + k), dtype=np.int64)
            tensor = {"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.ravel().tolist()}
            valid.append((json.dumps({"inputs": [tensor]}).encode(), engine.run({"input_ids": ids}).outputs["logits"]))
        malformed = _malformed(rng.integers(0, VOCAB, size=(1, 6), dtype=np.int64))
        http_port, grpc_port, control_port = _free_ports(3)
        command = [sys.executable, "-m", "layerzero", "serve", str(bundle), "--port-http", str(http_port),
                   "--port-grpc", str(grpc_port), "--port-metrics", str(control_port), "--reference", str(source),
                   "--sample-rate", str(args.sample_rate), "--instances", str(args.instances)]  # fmt: skip
        log = tmp / "serve.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        tally = {"valid sent": 0, "valid ok": 0, "valid wrong": 0, "valid failed": 0, "malformed sent": 0,
                 "malformed 4xx": 0, "malformed other": 0}  # fmt: skip
        kinds: dict[str, int] = {}
        lock = threading.Lock()
        try:
            _wait_ready("layerzero serve", http_port, process)
            _wait_standby("layerzero serve", control_port, process)
            before = _metric_totals(control_port)
            deadline = time.monotonic() + args.max_seconds

            def client(i: int) -> None:
                local = dict.fromkeys(tally, 0)
                local_kinds: dict[str, int] = {}
                crng = np.random.default_rng(100 + i)
                conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
                for _ in range(per_client):
                    if time.monotonic() > deadline:
                        break
                    bad = crng.random() < args.malformed_rate
                    if bad:
                        name, body = malformed[int(crng.integers(len(malformed)))]
                        local_kinds[name] = local_kinds.get(name, 0) + 1
                    else:
                        body, want = valid[int(crng.integers(len(valid)))]
                    local["malformed sent" if bad else "valid sent"] += 1
                    try:
                        conn.request("POST", "/v2/models/layerzero/infer", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
                        response = conn.getresponse()
                        answer = response.read()
                        if response.getheader("Connection", "").lower() == "close":
                            conn.close()
                    except (OSError, http.client.HTTPException):
                        conn.close()
                        local["malformed other" if bad else "valid failed"] += 1
                        continue
                    if bad:
                        local["malformed 4xx" if 400 <= response.status < 500 else "malformed other"] += 1
                    elif response.status != 200:
                        local["valid failed"] += 1
                    else:
                        [output] = json.loads(answer)["outputs"]
                        got = np.asarray(output["data"], np.float32).reshape(output["shape"])
                        local["valid ok" if np.allclose(got, want, atol=1e-4, rtol=1e-4) else "valid wrong"] += 1
                conn.close()
                with lock:
                    for key, value in local.items():
                        tally[key] += value
                    for key, value in local_kinds.items():
                        kinds[key] = kinds.get(key, 0) + value

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            after = _metric_totals(control_port)
            alive = process.poll() is None
        except Exception:
            lines = [x for x in log.read_text(errors="replace").splitlines() if not x.startswith(("I1", "I0"))]
            print("--- layerzero serve log ---", *lines[-40:], sep="\n", file=sys.stderr)
            raise
        finally:
            _stop(process)
    requests_delta, errors_delta = after[0] - before[0], after[1] - before[1]
    sent = tally["valid sent"] + tally["malformed sent"]
    print(f"\n--hostile: {args.clients} clients x {per_client} requests, {args.malformed_rate:.0%} malformed, "
          f"{wall:.1f} s ({sent / wall:,.0f} req/s), {os.cpu_count()} CPUs")  # fmt: skip
    for key, value in tally.items():
        print(f"  {key:18}{value:>8,}")
    print("  malformed kinds    " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    print(f"  layerzero_requests_total       +{requests_delta:,.0f}  (valid sent {tally['valid sent']:,})")
    print(f"  layerzero_request_errors_total +{errors_delta:,.0f}  (malformed sent {tally['malformed sent']:,})")
    print(f"  sum {requests_delta + errors_delta:,.0f} of {sent:,} sent; server alive after the run: {alive}")
    ok = (
        alive
        and tally["valid ok"] == tally["valid sent"]
        and tally["malformed 4xx"] == tally["malformed sent"]
        and requests_delta == tally["valid sent"]
        and errors_delta == tally["malformed sent"]
        and sent == args.clients * per_client
    )
    print(f"target (every valid request right, every malformed one 4xx, counters add up): {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


# ---------------------------------------------------------------------------- --front-only: the front alone


def stand_in_triton(http_port: int, grpc_port: int, seq: int) -> None:
    """Triton's two loopback ports as the front sees them, answering every inference at once with zero logits
    (1, seq, VOCAB): what is left of a request's cost is the front's."""
    import concurrent.futures
    import json

    import grpc
    from tritonclient.grpc import service_pb2

    logits = np.zeros((1, seq, VOCAB), np.float32).tobytes()
    head = json.dumps({"model_name": "layerzero", "model_version": "1", "outputs": [{
        "name": "logits", "datatype": "FP32", "shape": [1, seq, VOCAB],
        "parameters": {"binary_data_size": len(logits)}}]}).encode()  # fmt: skip
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nInference-Header-Content-Length: "
              b"%d\r\nContent-Length: %d\r\n\r\n" % (len(head), len(head) + len(logits))) + head + logits  # fmt: skip
    response = service_pb2.ModelInferResponse(model_name="layerzero", model_version="1")
    output = response.outputs.add()
    output.name, output.datatype = "logits", "FP32"
    output.shape.extend([1, seq, VOCAB])
    response.raw_output_contents.append(logits)
    grpc_answer = response.SerializeToString()

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: object) -> object:
            return grpc.unary_unary_rpc_method_handler(lambda raw, context: grpc_answer)

    grpc_server = grpc.server(concurrent.futures.ThreadPoolExecutor(16), handlers=[Handler()])
    grpc_server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    grpc_server.start()

    def connection(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = conn.makefile("rb")
        with contextlib.suppress(OSError), conn:
            while line := reader.readline():
                length = 0
                while (line := reader.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                reader.read(length)
                conn.sendall(answer)

    with socket.create_server(("127.0.0.1", http_port)) as server:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=connection, args=(conn,), daemon=True).start()


def _process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_only(args: argparse.Namespace) -> int:
    """The inference front (its own process, as `layerzero serve` starts it) before a stand-in Triton that
    answers at once: the same requests sent to the stand-in directly and through the front, in alternating
    rounds; the front's CPU per request and the latency it adds. No model, no PyTriton: what the front's own
    code costs, without Triton's and ORT's noise. Profile it with cProfile (thread CPU time) around
    ``_FrontHandler.handle`` in a process of your own; the front's counters must equal the requests sent."""
    from layerzero.runtime.front import FrontProcess, FrontSpec
    from layerzero.runtime.triton_repo import IOSpec

    ports = _free_ports(4)
    stand_in = subprocess.Popen([sys.executable, __file__, "--stand-in", str(ports[0]), str(ports[1]),
                                 "--seq", str(args.seq)], start_new_session=True)  # fmt: skip
    spec = FrontSpec(model_name="layerzero", inputs=[IOSpec("input_ids", "TYPE_INT64", (-1, -1))],
                     outputs=["logits"], index_ranges={"input_ids": VOCAB}, host="127.0.0.1", http_port=ports[2],
                     grpc_port=ports[3], max_request_bytes=64 << 20, client_timeout_s=30.0, restart_wait_s=60.0,
                     instances=args.instances)  # fmt: skip
    front = FrontProcess(spec)
    try:
        deadline = time.monotonic() + 60
        while True:  # the stand-in listens
            try:
                socket.create_connection(("127.0.0.1", ports[0]), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or stand_in.poll() is not None:
                    raise RuntimeError("the stand-in Triton did not start") from None
                time.sleep(0.1)
        front.start()
        front.set_triton(ports[0], ports[1], stand_in.pid)
        assert front.pid is not None
        direct = ports[0] if args.protocol == "http" else ports[1]
        fronted = ports[2] if args.protocol == "http" else ports[3]
        phases: dict[str, list[dict]] = {"stand-in direct": [], "through the front": []}
        cpu, sent_before = 0.0, front.requests
        load_before = os.getloadavg()[0]
        per_round = max(args.clients, args.requests // args.rounds)
        for r in range(args.rounds):
            order = [("stand-in direct", direct), ("through the front", fronted)]
            for name, port in order if r % 2 == 0 else order[::-1]:
                before = _process_cpu(front.pid)
                phases[name].append(load(f"127.0.0.1:{port}", args.protocol, per_round, args.clients, args.seq,
                                         args.max_seconds / args.rounds))  # fmt: skip
                if name == "through the front":
                    cpu += _process_cpu(front.pid) - before
        counted, errors = front.requests - sent_before, front.errors
    finally:
        front.close()
        _stop(stand_in)
    results = {name: summarize(p) for name, p in phases.items()}
    through = results["through the front"]
    warmups = 20 * args.clients * args.rounds  # load() warms each client up with 20 requests, not timed
    print(f"\n--front-only: {through['requests']:,} requests x {args.clients} clients, {args.protocol}, seq "
          f"{args.seq}, {os.cpu_count()} CPUs, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'':18}{'stand-in direct':>20}{'through the front':>20}{'delta':>12}")
    for label, key in (("p50 ms", "p50"), ("p99 ms", "p99"), ("throughput req/s", "throughput")):
        a, b = results["stand-in direct"][key], through[key]
        print(f"{label:18}{a:>20,.3f}{b:>20,.3f}{b - a:>+12,.3f}")
    print(f"front CPU per request: {cpu * 1e3 / max(1, through['requests'] + warmups):.3f} ms (warm-ups included)")
    print(f"front counted {counted:,} requests ({through['requests'] + warmups:,} sent), {errors} errors")
    ok = counted == through["requests"] + warmups and errors == 0 and through["errors"] == 0
    print(f"target (every request answered and counted once, no error): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests per server (default 10,000)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--quick", action="store_true", help="1,000 requests per server")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    parser.add_argument("--seq", type=int, default=16, help="tokens per request (default 16)")
    parser.add_argument("--instances", type=int, default=2, help="model instances on each server (default 2)")
    parser.add_argument("--sample-rate", type=float, default=0.01, help="LayerZero guard sample rate (default 0.01)")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="time bound per server (default 300)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating load phases per server (default 4)")
    parser.add_argument("--hostile", action="store_true", help="malformed requests mixed in (layerzero serve only)")
    parser.add_argument("--per-client", type=int, default=1000, help="--hostile: requests per client (default 1000)")
    parser.add_argument("--malformed-rate", type=float, default=0.05, help="--hostile: share malformed (0.05)")
    parser.add_argument("--front-only", action="store_true",
                        help="the inference front alone before a stand-in Triton: its CPU per request")
    parser.add_argument("--bare-server", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--stand-in", nargs=2, type=int, metavar=("HTTP", "GRPC"), help=argparse.SUPPRESS)
    parser.add_argument("--port-http", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port-grpc", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_server:
        bare_server(args.bare_server, args.port_http, args.port_grpc, args.instances)
        return 0
    if args.stand_in:
        stand_in_triton(*args.stand_in, args.seq)
        return 0
    if args.hostile:
        return hostile(args)
    if args.quick:
        args.requests = min(args.requests, 1000)
    if args.front_only:
        return front_only(args)

    with tempfile.TemporaryDirectory(prefix="serve_load.") as tmp_name:
        tmp = Path(tmp_name)
        source, bundle = _build(tmp)
        ports = _free_ports(5)
        commands = {
            # The bundle's own model.onnx: the comparison is the serving stack, not the model.
            "bare PyTriton + ORT": (
                [sys.executable, __file__, "--bare-server", str(bundle / "model.onnx"), "--port-http", str(ports[0]),
                 "--port-grpc", str(ports[1]), "--instances", str(args.instances)], ports[0], ports[1]),
            "layerzero serve": (
                [sys.executable, "-m", "layerzero", "serve", str(bundle), "--port-http", str(ports[2]),
                 "--port-grpc", str(ports[3]), "--port-metrics", str(ports[4]), "--reference", str(source),
                 "--sample-rate", str(args.sample_rate), "--instances", str(args.instances)], ports[2], ports[3]),
        }  # fmt: skip
        # Both servers up at once (idle one costs no CPU); the load alternates between them in ABBA rounds so
        # that drift in the machine's load (shared cores) hits both alike.
        processes, logs = {}, {}
        try:
            for name, (command, _, _) in commands.items():
                logs[name] = tmp / f"{name.split()[0]}.log"
                with open(logs[name], "wb") as out:
                    processes[name] = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                                       start_new_session=True)  # fmt: skip
            for name, (_, http_port, _) in commands.items():
                _wait_ready(name, http_port, processes[name])
            # layerzero serve starts its standby Triton after it serves: not while the load is measured.
            _wait_standby("layerzero serve", ports[4], processes["layerzero serve"])
            phases: dict[str, list[dict]] = {name: [] for name in commands}
            cpu: dict[str, dict[str, float]] = {name: {} for name in commands}  # seconds under load, by role
            load_before = os.getloadavg()[0]
            order = list(commands)
            per_round = max(args.clients, args.requests // args.rounds)
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    _, http_port, grpc_port = commands[name]
                    url = f"127.0.0.1:{http_port if args.protocol == 'http' else grpc_port}"
                    budget = args.max_seconds / args.rounds
                    before = _session_cpu(processes[name].pid)
                    phases[name].append(load(url, args.protocol, per_round, args.clients, args.seq, budget))
                    for role, seconds in _session_cpu(processes[name].pid).items():
                        cpu[name][role] = cpu[name].get(role, 0.0) + seconds - before.get(role, 0.0)
        except Exception:
            for name, log in logs.items():  # Triton's own I-lines left out
                lines = [x for x in log.read_text(errors="replace").splitlines() if not x.startswith(("I1", "I0"))]
                print(f"--- {name} log ---", *lines[-40:], sep="\n", file=sys.stderr)
            raise
        finally:
            for process in processes.values():
                _stop(process)
        results = {name: summarize(p) for name, p in phases.items()}
        load_after = os.getloadavg()[0]
        overhead = guard_overhead(source, bundle, args.seq, n=2000 if not args.quick else 500)

    names = list(results)
    print(f"\n{args.requests:,} requests x {args.clients} clients, {args.protocol}, seq {args.seq}, "
          f"{args.instances} instances, guard sample rate {args.sample_rate:g}, {os.cpu_count()} CPUs, "
          f"load average {load_before:.1f} -> {load_after:.1f}")  # fmt: skip
    print(f"{'':18}{names[0]:>22}{names[1]:>22}{'delta':>12}")
    rows = [("p50 ms", "p50", 3), ("p95 ms", "p95", 3), ("p99 ms", "p99", 3), ("mean ms", "mean", 3),
            ("throughput req/s", "throughput", 1), ("requests", "requests", 0), ("errors", "errors", 0)]  # fmt: skip
    for label, key, digits in rows:
        a, b = results[names[0]][key], results[names[1]][key]
        print(f"{label:18}{a:>22,.{digits}f}{b:>22,.{digits}f}{b - a:>+12,.{digits}f}")
    p50_delta = results[names[1]]["p50"] - results[names[0]]["p50"]
    errors = sum(r["errors"] for r in results.values())
    ok = errors == 0 and p50_delta <= 3.0
    print(f"target (0 errors, p50 within 3 ms): {'met' if ok else 'NOT met'} (p50 delta {p50_delta:+.3f} ms)")
    print("\nCPU per request under load, ms (user + system, by process)")
    roles = sorted({role for name in names for role in cpu[name]})
    for role in [*roles, "total"]:
        values = [(sum(cpu[n].values()) if role == "total" else cpu[n].get(role, 0.0)) * 1e3
                  / max(1, results[n]["requests"]) for n in names]  # fmt: skip
        print(f"{role:24}{values[0]:>16.2f}{values[1]:>22.2f}{values[1] - values[0]:>+12.2f}")
    print("\nguard overhead in-process (compiled bundle, one request)")
    print(f"{'':34}{'median us':>12}{'mean us':>12}{'vs Engine':>12}")
    base = overhead[0][1]
    for name, median, mean in overhead:
        print(f"{name:34}{median:>12.1f}{mean:>12.1f}{median - base:>+12.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
