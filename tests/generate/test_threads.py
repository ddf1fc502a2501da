"""``--threads N`` / ``--no-spin`` (``layerzero generate`` and ``serve``): ONNX Runtime's intra-op pool of the
engine's sessions.

A tiny hand-made causal LM (the shape ``layerzero export`` writes: ids, mask, positions and one layer's KV cache
in, logits and presents out) whose logits make token t follow t - 1 + 1: what it generates is known exactly. The
sessions' own options are read back (``InferenceSession.get_session_options``), so the test sees what ONNX
Runtime was given, not what the CLI meant to give.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import save

from layerzero.cli import build_parser, main
from layerzero.cli._common import thread_options
from layerzero.runtime import Engine
from tests.generate.counter_lm import counter_lm

V = 12


def _next_token_lm(path: Path) -> Path:
    """logits[b, s] = one-hot(ids[b, s] + 1 mod V) * 10; present = Concat(past, embedding of the new ids)."""
    save(counter_lm(V), str(path))
    return path


@pytest.fixture
def lm(tmp_path: Path) -> Path:
    return _next_token_lm(tmp_path / "lm.onnx")


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[Engine]:
    """Every engine ``Engine.load`` makes while the test runs (the CLI's, the guard's reference)."""
    engines: list[Engine] = []
    original = Engine.load.__func__

    def load(cls, path, **kwargs):
        engine = original(cls, path, **kwargs)
        engines.append(engine)
        return engine

    monkeypatch.setattr(Engine, "load", classmethod(load))
    return engines


def _threads(engine: Engine) -> int:
    return int(engine.backend.session.get_session_options().intra_op_num_threads)


def _spinning(engine: Engine) -> str | None:
    """The session's ``session.intra_op.allow_spinning`` entry ("0" / "1"), None when not set (ORT's default)."""
    options = engine.backend.session.get_session_options()
    try:
        return options.get_session_config_entry("session.intra_op.allow_spinning") or None
    except RuntimeError:
        return None


@pytest.mark.parametrize("n", [1, 2, 3])
def test_generate_threads_sizes_the_session(lm: Path, loaded: list[Engine], n: int, capsys) -> None:
    code = main(["generate", str(lm), "--prompt-ids", "3", "--max-new-tokens", "4", "--threads", str(n), "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["ids"] == [4, 5, 6, 7]
    assert [_threads(e) for e in loaded] == [n]


def test_generate_without_threads_leaves_onnxruntime_its_choice(lm: Path, loaded: list[Engine], capsys) -> None:
    assert main(["generate", str(lm), "--prompt-ids", "3", "--max-new-tokens", "2", "--json"]) == 0
    assert [_threads(e) for e in loaded] == [0]  # 0: ONNX Runtime's default (one thread per core)
    assert [_spinning(e) for e in loaded] == [None]


def test_generate_no_spin_makes_idle_workers_sleep(lm: Path, loaded: list[Engine], capsys) -> None:
    argv = ["generate", str(lm), "--prompt-ids", "3", "--max-new-tokens", "3", "--threads", "2", "--no-spin", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == [4, 5, 6]
    assert [(_threads(e), _spinning(e)) for e in loaded] == [(2, "0")]


def test_backend_allow_spinning_option(lm: Path) -> None:
    assert _spinning(Engine.load(lm, allow_spinning=True)) == "1"
    assert _spinning(Engine.load(lm, allow_spinning=False)) == "0"
    assert _spinning(Engine.load(lm)) is None


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_generate_bad_threads_is_one_line(lm: Path, bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(lm), "--prompt-ids", "3", "--threads", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--threads" in err and "Traceback" not in err


def test_generate_threads_on_a_backend_without_a_pool_is_refused(lm: Path, capsys) -> None:
    code = main(["generate", str(lm), "--prompt-ids", "3", "--threads", "2", "--backend", "tensorrt"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--threads 2" in err and "tensorrt" in err


def test_serve_threads_sizes_the_engine_and_the_reference(
    tmp_path: Path, lm: Path, loaded: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --threads 2``: the served engine's session and the guard's reference's (loaded when first used) get
    2 threads. Triton is not started: the server class is replaced by one that hands the guard back."""
    from layerzero.cli import serve
    from layerzero.runtime import server as server_module

    got = {}

    class Stop(Exception):
        pass

    class FakeServer:
        def __init__(self, guard, config) -> None:
            got["guard"] = guard
            raise Stop

    monkeypatch.setattr(server_module, "LayerZeroServer", FakeServer)
    monkeypatch.setattr(server_module, "pytriton_available", lambda: True)
    bundle = tmp_path / "bundle"
    assert main(["compile", str(lm), "-o", str(bundle), "--no-verify"]) == 0
    argv = ["serve", str(bundle), "--threads", "2", "--no-spin", "--reference", str(lm)]
    args = build_parser(["serve"]).parse_args(argv)
    assert thread_options(args) == {"intra_op_num_threads": 2, "allow_spinning": False}
    loaded.clear()
    with pytest.raises(Stop):
        serve.run(args)
    guard = got["guard"]
    assert [(_threads(e), _spinning(e)) for e in loaded] == [(2, "0")]  # the served engine
    feeds = guard.engine.first_step_feeds({"input_ids": np.array([[3]])})
    reference = guard._ref()  # what sampling, fallback and the kill switch run
    assert (_threads(reference), _spinning(reference)) == (2, "0")
    np.testing.assert_array_equal(reference.run(feeds).outputs["logits"], guard.engine.run(feeds).outputs["logits"])
