"""Continuous batching (runtime/batcher.py): concurrent generations share decode steps, and each request gets the
ids it gets alone.

A tiny Llama (random weights) exported with the KV cache; requests join a running batch at different steps,
leave at different steps (their own max_new_tokens, stop token, stop callback, cancel), with their own sampling
options; greedy ids must equal ``Engine.generate`` of the same prompt alone, sampled ids the same seed alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from layerzero.cli import main  # noqa: E402
from layerzero.errors import InvalidInputError  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402
from layerzero.runtime.batcher import ContinuousBatcher, GenerationRequest, QueueFull  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB = 128
PROMPTS = [[5, 17, 99, 3, 42, 7], [8], [33, 2, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [64, 64], [120, 7, 7, 1]]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("batcher")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "llama")
    assert main(["export", str(tmp / "llama"), "-o", str(tmp / "m.onnx")]) == 0
    assert main(["compile", str(tmp / "m.onnx"), "-o", str(tmp / "m.lz")]) == 0
    return tmp / "m.lz"


@pytest.fixture(scope="module")
def engine(bundle: Path) -> Engine:
    return Engine.load(bundle)


def _alone(engine: Engine, prompt: list[int], **options) -> list[int]:
    return engine.generate(prompt, stop_tokens=(), **options).ids


def test_concurrent_greedy_requests_get_their_solo_ids(engine: Engine) -> None:
    lengths = [12, 3, 20, 7, 1, 16]
    expected = [_alone(engine, p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
    with ContinuousBatcher(engine, max_batch=4, max_queue=16) as batcher:
        tickets = [batcher.submit(GenerationRequest(p, max_new_tokens=n, stop_tokens=()))
                   for p, n in zip(PROMPTS, lengths)]  # fmt: skip
        results = [t.result(timeout=120) for t in tickets]
        assert batcher.rows_stepped > batcher.steps_run  # steps were shared
        assert batcher.step_seconds > batcher.run_seconds > 0  # the batcher's own work is measured apart
    for got, want, n in zip(results, expected, lengths):
        assert got.ids == want and got.report.new_tokens == n and got.report.stop_reason == "max_new_tokens"
        assert [s.tokens for s in got.report.steps] == [len(got.prompt_ids)] + [1] * (n - 1)


def test_requests_joining_a_running_batch_at_later_steps(engine: Engine) -> None:
    expected = [_alone(engine, p, max_new_tokens=10) for p in PROMPTS[:4]]
    with ContinuousBatcher(engine, max_batch=8) as batcher:
        tickets = []
        for p in PROMPTS[:4]:
            tickets.append(batcher.submit(GenerationRequest(p, max_new_tokens=10, stop_tokens=())))
            time.sleep(0.02)  # arrive while the others decode
        assert [t.result(timeout=120).ids for t in tickets] == expected


def test_sampling_options_per_request(engine: Engine) -> None:
    sampled = dict(temperature=0.9, top_k=20, top_p=0.9, seed=7)
    want_sampled = _alone(engine, PROMPTS[0], max_new_tokens=12, **sampled)
    want_greedy = _alone(engine, PROMPTS[2], max_new_tokens=12)
    with ContinuousBatcher(engine) as batcher:
        a = batcher.submit(GenerationRequest(PROMPTS[0], max_new_tokens=12, stop_tokens=(), **sampled))
        b = batcher.submit(GenerationRequest(PROMPTS[2], max_new_tokens=12, stop_tokens=()))
        assert a.result(timeout=120).ids == want_sampled and b.result(timeout=120).ids == want_greedy


def test_stop_token_callback_and_cancel_end_one_row(engine: Engine) -> None:
    solo = _alone(engine, PROMPTS[0], max_new_tokens=12)
    stop_at = solo[4]
    seen: list[int] = []
    with ContinuousBatcher(engine) as batcher:
        by_token = batcher.submit(GenerationRequest(PROMPTS[0], max_new_tokens=12, stop_tokens=(stop_at,)))
        by_callback = batcher.submit(
            GenerationRequest(
                PROMPTS[0], max_new_tokens=12, stop_tokens=(), on_token=lambda t: seen.append(t) or len(seen) == 3
            )
        )
        other = batcher.submit(GenerationRequest(PROMPTS[2], max_new_tokens=12, stop_tokens=()))
        got = by_token.result(timeout=120)
        assert got.ids == solo[: solo.index(stop_at) + 1] and got.report.stop_reason == "stop_token"
        got = by_callback.result(timeout=120)
        assert got.ids == solo[:3] == seen and got.report.stop_reason == "stop"
        assert other.result(timeout=120).ids == _alone(engine, PROMPTS[2], max_new_tokens=12)
        slow = threading.Event()
        cancelled = batcher.submit(
            GenerationRequest(
                PROMPTS[1], max_new_tokens=200, stop_tokens=(), on_token=lambda t: slow.wait(0.01) and None
            )
        )
        time.sleep(0.2)
        cancelled.cancel()
        got = cancelled.result(timeout=120)
        assert got.report.stop_reason == "cancelled" and got.ids == _alone(
            engine, PROMPTS[1], max_new_tokens=len(got.ids)
        )


def test_queue_bound_and_bad_requests(engine: Engine) -> None:
    gate = threading.Event()
    with ContinuousBatcher(engine, max_batch=1, max_queue=1) as batcher:
        first = batcher.submit(
            GenerationRequest([1, 2], max_new_tokens=50, stop_tokens=(), on_token=lambda t: gate.wait(10) and None)
        )
        deadline = time.monotonic() + 30
        while batcher.active == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.active == 1 and batcher.queued == 0
        queued = batcher.submit(GenerationRequest([3], max_new_tokens=2, stop_tokens=()))
        with pytest.raises(QueueFull):
            batcher.submit(GenerationRequest([4], max_new_tokens=2, stop_tokens=()))
        gate.set()
        assert len(first.result(timeout=120).ids) == 50 and len(queued.result(timeout=120).ids) == 2
        for bad, message in (([], "empty"), ([VOCAB], "outside the vocabulary"), ([-1], "outside the vocabulary")):
            with pytest.raises(InvalidInputError, match=message):
                batcher.submit(GenerationRequest(bad))
        with pytest.raises(InvalidInputError, match="top_p"):
            batcher.submit(GenerationRequest([1], top_p=0))


def test_cache_is_trimmed_when_long_rows_leave(engine: Engine) -> None:
    with ContinuousBatcher(engine) as batcher:
        long = batcher.submit(GenerationRequest(PROMPTS[3], max_new_tokens=3, stop_tokens=()))
        short = batcher.submit(GenerationRequest([8], max_new_tokens=12, stop_tokens=()))
        long.result(timeout=120)
        assert short.result(timeout=120).ids == _alone(engine, [8], max_new_tokens=12)
        assert batcher.active == 0 and not batcher._cache and np.asarray(batcher._mask).size == 0


def test_eight_rows_at_2048_tokens_of_context_get_their_solo_ids(engine: Engine) -> None:
    """8 rows of long prompts (1,100 to 2,040 tokens: up to ~900 columns of left padding), leaving at different
    steps (the cache's leading columns cut as the longest rows go) while two more requests join a running batch
    (padded in): every row's greedy ids equal its solo run, and the cache was cut. The first 8 lengths are
    multiples of 4 (runtime/batcher.py's ``PAD_ALIGN``): all 8 join at the first step; the 1,990-token request
    waits for a step where the batch's width is congruent to its length (tests/generate/test_batcher_exact.py)."""
    rng = np.random.default_rng(24)
    lengths = [2040, 1100, 1900, 1500, 2000, 1236, 1800, 1652, 1990, 1300]
    news = [3, 12, 5, 9, 2, 14, 7, 10, 6, 8]
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    expected = [_alone(engine, p, max_new_tokens=n) for p, n in zip(prompts, news)]
    widths: list[tuple[int, int]] = []  # (rows, past length) of every decode step
    with ContinuousBatcher(engine, max_batch=8, max_queue=16) as batcher:
        run = batcher._run

        def recording(feeds, **kw):
            if feeds["input_ids"].shape[1] == 1:
                widths.append((feeds["input_ids"].shape[0], feeds["past_key_values.0.key"].shape[2]))
            return run(feeds, **kw)

        batcher._run = recording
        tickets = [batcher.submit(GenerationRequest(p, max_new_tokens=n, stop_tokens=()))
                   for p, n in zip(prompts, news)]  # fmt: skip
        results = [t.result(timeout=600) for t in tickets]
    for got, want in zip(results, expected):
        assert got.ids == want
    assert max(rows for rows, _ in widths) == 8
    # The 2,040-token row (past 2,040 and 2,041 at its two decode steps) leaves after 3 tokens: the steps after it
    # attend to a shorter past than it had.
    assert widths[-1][1] < 2040 and max(past for _, past in widths) == 2040 + 1
