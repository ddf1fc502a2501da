"""Serve a compiled bundle with Triton Inference Server (PyTriton), with the guard, metrics and a kill switch.

KServe v2 inference over HTTP (--port-http) and gRPC (--port-grpc; --no-grpc: none), and a control server on
--port-metrics, all on 127.0.0.1 only. Needs the serve extra: pip install 'layerzero[serve]'.

Every inference request, HTTP or gRPC, is validated by this server's front (a process of its own) before
Triton parses it (body at most --max-request-bytes, shape and dims of each input against the model, data
length, token ids within the embedding); a bad one gets a 4xx (a gRPC status) and one line, and is counted.
Triton itself listens on loopback ports of its own. A standby Triton waits started: when the serving one dies,
it takes over in well under a second (a cold start without it, --no-standby); requests wait meanwhile, and the
ones in flight are sent again (run and counted once). A front that dies is restarted too.

  GET  /metrics       Prometheus text: requests, fallbacks, reference runs, kill switch, threshold, latency
  GET  /status        JSON: model, endpoints, guard state and counters
  GET  /healthz       ok once the model is served
  POST /kill-switch   {"on": true}  every request goes to the reference model, from the next one on
  POST /threshold     {"value": 0.05, "segment": "chat"}   the run-time zeroing threshold

A bundle of a `layerzero export` model also gets a generate endpoint on --port-generate (8003):
POST /v1/generate {"prompt_ids": [1, 2, 3], "max_new_tokens": 16} streams JSON lines, one {"token": id} per
token, then {"ids", "report"}; {"prompts": [[1, 2, 3], [7, 8]], ...} runs a left-padded batch (a {"tokens": [...]}
line per step, then {"results": [...]}); bounded by --generate-max-new-tokens and --generate-max-prompt, through
the guard (kill switch, --max-tokens caps prompt + new tokens). The same port serves the OpenAI API when the
bundle's tokenizer.json is found (beside it or its source model): POST /v1/completions, POST
/v1/chat/completions (the chat template of its tokenizer_config.json), GET /v1/models (the model id is
--model-name). One-prompt generations share decode steps (continuous batching: --generate-batch rows at once,
--generate-queue more waiting, a 503 past that).

--threads N sizes ONNX Runtime's intra-op thread pool of the served engine's sessions (and the reference's).

The reference (for sampling, fallback, the kill switch and --max-tokens) is --reference, or else the model
the bundle was compiled from when it is still there unchanged. Without one, the guard is off. A request
picks its segment with the KServe request parameter "segment". Stops on Ctrl-C / SIGTERM.

examples:
  layerzero serve model.lz
  layerzero serve model.lz --reference model.onnx --sample-rate 0.05 --port-http 9000 --port-grpc 9001
  layerzero serve model.lz --segment chat:sample_rate=0.1,threshold=0.02 --max-tokens 4096
  curl -X POST localhost:8002/kill-switch -d '{"on": true}'
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from pathlib import Path

from layerzero.cli._common import (
    add_device,
    add_guard_arguments,
    add_no_activation_sparsity,
    add_threads,
    apply_activation_flag,
    console,
    fraction,
    integer,
    one_line_errors,
    port,
    positive,
    thread_options,
)
from layerzero.errors import InvalidInputError

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("bundle", type=Path, help="a bundle written by `layerzero compile`")
    p.add_argument("--port-http", type=port, default=8000, help="KServe v2 HTTP port (default 8000)")
    p.add_argument("--port-grpc", type=port, default=8001, help="KServe v2 gRPC port (default 8001)")
    p.add_argument("--port-metrics", type=integer(0, 65535), default=8002,
                   help="control + /metrics port (default 8002)")
    p.add_argument("--model-name", default="layerzero", help="the Triton model name (default layerzero)")
    p.add_argument("--instances", type=integer(1, 64), default=2,
                   help="model instances, i.e. concurrent requests (default 2)")
    p.add_argument("--max-request-bytes", type=integer(1024, 2**34), default=64 * 1024 * 1024, metavar="N",
                   help="largest inference request, HTTP body or gRPC message (default 64 MiB; bigger: 413 / "
                        "RESOURCE_EXHAUSTED)")  # fmt: skip
    p.add_argument("--no-grpc", action="store_true", help="no gRPC port (HTTP only)")
    p.add_argument("--no-standby", action="store_true",
                   help="no standby Triton (half the memory; a restart is a cold start, seconds)")  # fmt: skip
    p.add_argument("--client-timeout", type=positive, default=30.0, metavar="S",
                   help="seconds a client may take to send one request (default 30)")  # fmt: skip
    add_device(p)
    add_no_activation_sparsity(p)
    add_threads(p)
    g = p.add_argument_group("guard")
    add_guard_arguments(g)
    g.add_argument("--window-seconds", type=positive, default=300.0, help="fallback-rate window (default 300)")
    g.add_argument("--backoff-above", type=fraction, default=0.05, help="fallback rate that backs off the threshold")
    g.add_argument("--min-window-requests", type=integer(1), default=100, help="sampled requests before a back-off")
    g.add_argument("--no-auto-backoff", action="store_true", help="never change the zeroing threshold automatically")
    g.add_argument("--threshold", type=fraction, help="starting zeroing threshold (default: the compiled one)")
    g.add_argument("--token-input", help="the input whose last axis counts tokens (default: first integer input)")
    g.add_argument("--segment", action="append", metavar="NAME:KEY=V,...",
                   help="a segment's settings, e.g. chat:sample_rate=0.1,threshold=0.02")  # fmt: skip
    g.add_argument("--kill-switch", action="store_true", help="start with the kill switch on")
    g.add_argument("--seed", type=integer(0, 2**32 - 1), default=0, help="seed of the sampling RNG")
    gen = p.add_argument_group("generate endpoint (bundles of `layerzero export` models)")
    gen.add_argument("--port-generate", type=port, default=8003, help="POST /v1/generate, JSON lines (default 8003)")
    gen.add_argument("--no-generate", action="store_true", help="no generate endpoint")
    gen.add_argument("--generate-max-new-tokens", type=integer(1, 1_000_000), default=1024, metavar="N",
                     help="largest max_new_tokens a request may ask for (default 1024)")  # fmt: skip
    gen.add_argument("--generate-max-prompt", type=integer(1, 10_000_000), default=4096, metavar="N",
                     help="longest prompt in tokens (default 4096)")  # fmt: skip
    gen.add_argument("--generate-batch", type=integer(1, 256), default=8, metavar="N",
                     help="generations that share decode steps (default 8)")  # fmt: skip
    gen.add_argument("--generate-queue", type=integer(0, 100_000), default=64, metavar="N",
                     help="generations that may wait for a row; past them a 503 (default 64)")  # fmt: skip


def parse_segments(items: list[str] | None) -> dict:
    from layerzero.runtime.guard import SegmentConfig

    segments = {}
    for item in items or []:
        name, sep, rest = item.partition(":")
        if not sep or not name:
            raise InvalidInputError(f"--segment {item!r}: expected NAME:sample_rate=R,threshold=T")
        values: dict[str, float] = {}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = pair.partition("=")
            if not eq or key not in ("sample_rate", "threshold"):
                raise InvalidInputError(f"--segment {item!r}: {pair!r} is not sample_rate=R or threshold=T")
            try:
                values[key] = float(value)
            except ValueError:
                raise InvalidInputError(f"--segment {item!r}: {value!r} is not a number") from None
            if not 0.0 <= values[key] <= 1.0:  # also refuses nan
                raise InvalidInputError(f"--segment {item!r}: {key} must be in [0, 1], got {value!r}")
        segments[name] = SegmentConfig(**values)
    return segments


def run(args: argparse.Namespace) -> int:
    from layerzero.runtime.engine import Engine
    from layerzero.runtime.guard import GuardConfig, GuardedEngine
    from layerzero.runtime.server import LayerZeroServer, ServerConfig, pytriton_available
    from layerzero.runtime.triton_repo import default_reference

    if not pytriton_available():
        raise InvalidInputError("`layerzero serve` needs PyTriton: pip install 'layerzero[serve]'")
    if not args.bundle.is_dir():
        raise InvalidInputError(f"{args.bundle} is not a bundle directory (compile the model first)")
    options = {"device": args.device, **thread_options(args)}  # the reference gets the same
    engine = Engine.load(args.bundle, **options)
    apply_activation_flag(engine, args)
    reference = None
    if not args.no_reference:
        reference = args.reference if args.reference is not None else default_reference(engine.manifest)
    sample_rate = args.sample_rate if args.sample_rate is not None else (0.01 if reference is not None else 0.0)
    config = GuardConfig(
        sample_rate=sample_rate,
        fallback_bound=args.fallback_bound,
        window_seconds=args.window_seconds,
        backoff_above=args.backoff_above,
        min_window_requests=args.min_window_requests,
        auto_backoff=not args.no_auto_backoff,
        threshold=args.threshold,
        max_tokens=args.max_tokens,
        token_input=args.token_input,
        segments=parse_segments(args.segment),
        kill_switch=args.kill_switch,
        seed=args.seed,
    )
    guard = GuardedEngine(engine, reference, config, reference_options=options)
    server = LayerZeroServer(
        guard,
        ServerConfig(
            http_port=args.port_http,
            grpc_port=args.port_grpc,
            control_port=args.port_metrics,
            model_name=args.model_name,
            instances=args.instances,
            max_request_bytes=args.max_request_bytes,
            client_timeout_s=args.client_timeout,
            grpc=not args.no_grpc,
            standby=not args.no_standby,
        ),
    )
    from layerzero.runtime.generate_server import serve_generate

    generate = contextlib.nullcontext() if args.no_generate else serve_generate(
        guard, server.metrics, port=args.port_generate, max_new_tokens_cap=args.generate_max_new_tokens,
        max_prompt_tokens=args.generate_max_prompt, client_timeout_s=args.client_timeout,
        batch_rows=args.generate_batch, max_queue=args.generate_queue, model_name=args.model_name,
    )  # fmt: skip
    with server, generate as generating:
        if generating is not None:
            console.print(f"generate: POST {generating.url} (JSON lines; see layerzero.runtime.generate_server)")
            if generating.openai.codec is not None:
                console.print(f"OpenAI API: {generating.url.rsplit('/', 2)[0]}/v1 (completions, chat/completions, "
                              f"models; model {args.model_name!r})")  # fmt: skip
        ends = server.endpoints()
        grpc = f", grpc {ends['grpc']}" if "grpc" in ends else ""
        console.print(f"serving {args.bundle} as {args.model_name!r}: http {ends['http']}{grpc}, "
                      f"control {ends['control']} (/metrics, /status, /kill-switch, /threshold)")  # fmt: skip
        console.print(f"guard: reference {reference or 'none'}, sample rate {sample_rate:g}")
        sys.stdout.flush()
        server.wait()
    return 0
