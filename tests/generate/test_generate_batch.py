"""Batched generation and the guard's ``max_tokens`` in generation.

A batch of prompts of different lengths, left-padded, must give exactly the tokens of transformers' batched
greedy ``generate`` (left padding, attention mask, pad id) on the same weights, row by row, with each row
stopping on its own stop token. The guard's ``max_tokens`` caps prompt + new tokens: a longer prompt is a
one-line error, generation stops at the cap.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

from layerzero.cli import main  # noqa: E402
from layerzero.errors import InvalidInputError  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402
from layerzero.runtime.guard import GuardConfig, GuardedEngine  # noqa: E402
from tests.tiny_llama import greedy_llama_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB, NEW, PAD = 128, 12, 0
PROMPTS = [[5, 17, 99, 3, 42, 7], [9, 8], [100, 1, 2, 3]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = greedy_llama_config(2, VOCAB, pad_token_id=PAD)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("batch") / "tiny-llama"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bundle(model_dir: Path) -> Path:
    exported, lz = model_dir.parent / "model.onnx", model_dir.parent / "model.lz"
    assert main(["export", str(model_dir), "-o", str(exported)]) == 0
    assert main(["compile", str(exported), "-o", str(lz)]) == 0
    return lz


def _hf_batched(model_dir: Path, prompts: list[list[int]], stop: int | None = None) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=stop)
    if stop is None:
        kwargs["min_new_tokens"] = NEW
    out = model.generate(ids, attention_mask=mask, **kwargs)[:, width:].tolist()
    rows = []
    for row in out:  # transformers pads a finished row; cut after its stop token
        rows.append(row[: row.index(stop) + 1] if stop is not None and stop in row else row)
    return rows


def test_batch_matches_transformers_batched_greedy(model_dir: Path, bundle: Path) -> None:
    expected = _hf_batched(model_dir, PROMPTS)
    engine = Engine.load(bundle)
    out = engine.generate(PROMPTS, max_new_tokens=NEW, stop_tokens=(), pad_token_id=PAD)
    assert [g.ids for g in out] == expected
    assert [g.prompt_ids for g in out] == PROMPTS
    # Each row alone gives its own tokens too: padding changes nothing.
    for prompt, row in zip(PROMPTS, expected):
        assert engine.generate(prompt, max_new_tokens=NEW, stop_tokens=()).ids == row
    assert all(g.report.new_tokens == NEW and g.report.stop_reason == "max_new_tokens" for g in out)


def test_batch_rows_stop_on_their_own(model_dir: Path, bundle: Path) -> None:
    plain = _hf_batched(model_dir, PROMPTS)
    stop = plain[1][2]  # the third token of row 1: rows stop at different steps (or not at all)
    expected = _hf_batched(model_dir, PROMPTS, stop=stop)
    assert len({len(r) for r in expected}) > 1, "the rows should stop at different steps"
    out = Engine.load(bundle).generate(PROMPTS, max_new_tokens=NEW, stop_tokens=[stop], pad_token_id=PAD)
    assert [g.ids for g in out] == expected
    for g in out:
        assert g.report.stop_reason == ("stop_token" if g.ids[-1] == stop else "max_new_tokens")
        assert len(g.report.steps) == len(g.ids)


def test_guard_max_tokens_caps_generation(model_dir: Path, bundle: Path) -> None:
    engine = Engine.load(bundle)
    source = bundle.parent / "model.onnx"
    guard = GuardedEngine(engine, source, GuardConfig(sample_rate=0.0, max_tokens=10))
    full = engine.generate(PROMPTS[0], max_new_tokens=NEW, stop_tokens=()).ids
    assert len(full) == NEW  # the plain engine knows nothing of the guard: no cap
    from layerzero.runtime.generate import generate

    out = generate(guard, PROMPTS[0], max_new_tokens=NEW, stop_tokens=())
    assert out.ids == full[: 10 - len(PROMPTS[0])] and out.report.stop_reason == "max_tokens"
    batch = generate(guard, PROMPTS, max_new_tokens=NEW, stop_tokens=(), pad_token_id=PAD)
    assert [len(p) + len(g.ids) for p, g in zip(PROMPTS, batch)] == [10, 10, 10]
    assert batch[0].ids == full[:4]
    with pytest.raises(InvalidInputError, match=r"^the prompt has 10 tokens, the limit is max_tokens=10") as info:
        generate(guard, list(range(1, 11)), max_new_tokens=2)
    assert "\n" not in str(info.value)
    # An explicit max_tokens on a plain engine does the same.
    short = engine.generate(PROMPTS[1], max_new_tokens=NEW, max_tokens=5, stop_tokens=())
    assert len(short.ids) == 3 and short.report.stop_reason == "max_tokens"


def test_cli_batch_equals_transformers_batched_greedy(
    model_dir: Path, bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    expected = _hf_batched(model_dir, PROMPTS)
    args = [f"--prompt-ids={','.join(map(str, p))}" for p in PROMPTS]
    common = ["--max-new-tokens", str(NEW), "--pad-id", str(PAD)]
    assert main(["generate", str(bundle), *args, *common, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["ids"] for r in doc["results"]] == expected
    assert [r["prompt_ids"] for r in doc["results"]] == PROMPTS
    assert all(r["report"]["new_tokens"] == NEW for r in doc["results"])
    # The same prompts from a file (one per line, blank lines ignored): one line of ids per prompt, in order.
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(",".join(map(str, p)) for p in PROMPTS) + "\n\n")
    assert main(["generate", str(bundle), "--prompt-ids-file", str(prompts_file), *common]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [",".join(map(str, row)) for row in expected]
    assert captured.err.count("report ") == len(PROMPTS) and "batch of 3" in captured.err
    # A text file needs a tokenizer (this model has none): a one-line error, exit 2.
    assert main(["generate", str(bundle), "--prompt-file", str(prompts_file)]) == 2
    assert "--prompt-file needs a tokenizer.json" in capsys.readouterr().err
