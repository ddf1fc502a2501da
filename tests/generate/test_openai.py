"""The OpenAI-compatible endpoints (runtime/openai_api.py) with the real ``openai`` client: chat and text
completions, streamed and not, on a tiny Llama and a tiny Qwen3-MoE export with a tokenizer and a chat template;
greedy text equals ``layerzero generate --prompt``; stop strings, usage, concurrency and hostile bodies.
"""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
openai = pytest.importorskip("openai", reason="the OpenAI endpoint tests use the openai client (pip install openai)")

from layerzero.cli import main  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402
from layerzero.runtime.generate_server import GenerateServer, GenerateServerConfig  # noqa: E402
from layerzero.runtime.text import TextCodec  # noqa: E402
from tests.tiny_bundle import free_ports  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB = 128
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} w1 {{ m['content'] }} w2 {% endfor %}"
    "{% if add_generation_prompt %}assistant w1 {% endif %}"
)


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {f"w{i}": i for i in range(VOCAB - 5)}
    words.update({"<s>": VOCAB - 5, "system": VOCAB - 4, "user": VOCAB - 3, "assistant": VOCAB - 2, "</s>": VOCAB - 1})
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))  # fmt: skip


def _export(tmp: Path, name: str, model: torch.nn.Module) -> Path:
    model.eval().save_pretrained(tmp / name)
    _tokenizer(tmp / name)
    assert main(["export", str(tmp / name), "-o", str(tmp / f"{name}-onnx" / "model.onnx")]) == 0
    assert main(["compile", str(tmp / f"{name}-onnx" / "model.onnx"), "-o", str(tmp / f"{name}.lz")]) == 0
    return tmp / f"{name}.lz"


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def bundle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2, eos_token_id=VOCAB - 1,
                  bos_token_id=VOCAB - 5)  # fmt: skip
    if request.param == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=128, **common))
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                             num_experts_per_tok=2, head_dim=16, **common)  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
        model.set_experts_implementation("batched_mm")
    return _export(tmp, request.param, model)


@pytest.fixture(scope="module")
def server(bundle: Path):
    config = GenerateServerConfig(port=0, max_new_tokens_cap=64, max_prompt_tokens=64, model_name="tiny")
    with GenerateServer(Engine.load(bundle), config) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: GenerateServer):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def _cli_text(bundle: Path, prompt: str, n: int, capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    assert main(["generate", str(bundle), "--prompt", prompt, "--max-new-tokens", str(n), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["text"]


def test_models_lists_the_served_model(client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_text_equals_layerzero_generate(client, bundle: Path, capsys) -> None:
    # A prompt whose greedy text does not end at once in the end token: the comparison must not be vacuous.
    for i in range(40):
        prompt = f"w{i + 5} w{i + 17} w{i + 9} w3"
        want = _cli_text(bundle, prompt, 12, capsys)
        if len(want.split()) >= 3:
            break
    assert len(want.split()) >= 3, want
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want and got.object == "text_completion"
    codec = TextCodec.for_engine(Engine.load(bundle))
    assert got.usage.prompt_tokens == len(codec.encode(prompt))
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert got.choices[0].finish_reason in ("length", "stop")
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    pieces = list(streamed)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == want
    assert pieces[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_chat_completion_stream_and_not(client, bundle: Path, capsys) -> None:
    messages = [{"role": "system", "content": "w9 w9"}, {"role": "user", "content": "w4 w8 w15"}]
    codec = TextCodec.for_engine(Engine.load(bundle))
    rendered = codec.chat_prompt(messages)
    assert rendered == "<s>system w1 w9 w9 w2 user w1 w4 w8 w15 w2 assistant w1 "
    engine = Engine.load(bundle)
    want_ids = engine.generate(codec.chat_ids(messages), max_new_tokens=10).ids
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == codec.decode(want_ids)
    assert got.usage.prompt_tokens == len(codec.chat_ids(messages)) and got.usage.completion_tokens == len(want_ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == codec.decode(want_ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want_ids)
    assert chunks[-2].choices[0].finish_reason == got.choices[0].finish_reason


def test_stop_strings_end_the_text_before_them(client, bundle: Path) -> None:
    for i in range(40):
        prompt = f"w{i + 5} w{i + 17}"
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        words = full.split()
        if len(words) >= 4:
            break
    assert len(words) >= 4, full
    stop = " ".join(words[2:4])
    cut = full[: full.index(stop)]
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < 16
    streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_seeded_sampling_repeats_and_concurrent_requests_equal_solo(client) -> None:
    kwargs = dict(model="tiny", prompt="w1 w2 w3", max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text
    prompts = [f"w{i} w{i + 7} w{i + 3}" for i in range(6)]
    solo = [client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text
            for p in prompts]  # fmt: skip
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        out = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=10, temperature=0)
        together[i] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together[i] for i in range(len(prompts))] == solo


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1]", 400, "JSON object"),
        (json.dumps({"prompt": "w1"}).encode(), 400, "model is required"),
        (json.dumps({"model": "gpt-4", "prompt": "w1"}).encode(), 404, "does not exist"),
        (json.dumps({"model": "tiny", "prompt": "w1", "n": 2}).encode(), 400, "n = 1"),
        (json.dumps({"model": "tiny", "prompt": "w1", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "tiny", "prompt": "w1", "max_tokens": 10**9}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "tiny", "prompt": "w1", "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"model": "tiny", "prompt": "w1", "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"model": "tiny", "prompt": "w1", "stop": ["a"] * 5}).encode(), 400, "stop"),
        (json.dumps({"model": "tiny", "prompt": "w1", "frequency_penalty": 1}).encode(), 400, "not supported"),
        (json.dumps({"model": "tiny", "prompt": "w1", "bogus": 1}).encode(), 400, "unknown parameter"),
        (json.dumps({"model": "tiny", "prompt": ["a", "b"]}).encode(), 400, "several prompts"),
        (json.dumps({"model": "tiny", "prompt": [VOCAB + 5]}).encode(), 400, "outside the vocabulary"),
        (json.dumps({"model": "tiny", "prompt": "w1 " * 100}).encode(), 400, "at most 64"),
        (json.dumps({"model": "tiny", "prompt": "w1", "stream": "yes"}).encode(), 400, "stream"),
    ],
)
def test_hostile_completion_bodies_get_openai_errors(server: GenerateServer, body: bytes, status: int, words: str):
    got, doc = _raw(server, "/v1/completions", body)
    assert got == status, doc
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
    assert words in doc["error"]["message"] and "\n" not in doc["error"]["message"]


@pytest.mark.parametrize(
    "messages, words",
    [
        ([], "non-empty list"),
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user", "content": 3}], "must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text parts"),
    ],
)
def test_hostile_chat_bodies(server: GenerateServer, messages, words: str) -> None:
    got, doc = _raw(server, "/v1/chat/completions", json.dumps({"model": "tiny", "messages": messages}).encode())
    assert got == 400 and words in doc["error"]["message"]


def test_openai_client_raises_its_own_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w1")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], n=3)


def _raw(server: GenerateServer, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_layerzero_serve_answers_the_openai_client(bundle: Path, tmp_path: Path) -> None:
    # The real `layerzero serve` process (Triton for KServe, the generate port with the OpenAI routes).
    import subprocess
    import sys
    import time

    from layerzero.runtime.server import pytriton_available

    if not pytriton_available():
        pytest.skip("PyTriton is not importable (pip install 'layerzero[serve]')")
    # Distinct ports: all four held open while picked (one socket at a time could get the same port twice, and
    # serve refused "the HTTP, gRPC and control ports must differ": a CI flake).
    http_port, grpc_port, control_port, generate_port = free_ports(4)
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "layerzero", "serve", str(bundle), "--port-http", str(http_port),
               "--port-grpc", str(grpc_port), "--port-metrics", str(control_port), "--port-generate",
               str(generate_port), "--no-grpc", "--no-reference", "--model-name", "tiny"]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{generate_port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        assert [m.id for m in models.data] == ["tiny"]
        codec = TextCodec.for_engine(Engine.load(bundle))
        messages = [{"role": "user", "content": "w4 w8 w15"}]
        want = codec.decode(Engine.load(bundle).generate(codec.chat_ids(messages), max_new_tokens=8).ids)
        got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        assert got.choices[0].message.content == want
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                stream=True)  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    finally:
        import contextlib
        import os
        import signal

        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
