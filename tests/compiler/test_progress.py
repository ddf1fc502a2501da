"""Long work shows progress on a terminal and stays quiet when piped: `layerzero compile` in a pseudo-terminal
draws its stages and verification's model runs (a chunked verification names its chunks); piped, stderr has none
of it."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from layerzero.models import TransformerConfig, build_transformer

CONFIG = TransformerConfig(num_layers=4, zero_blocks=(1,))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("progress") / "m.onnx"
    onnx.save(build_transformer(CONFIG), path)
    return path


def _in_terminal(code: str, cwd: Path) -> str:
    """Run ``python -c code`` with stdout and stderr on a pseudo-terminal; everything it drew, escapes removed."""
    leader, follower = pty.openpty()
    env = dict(os.environ, COLUMNS="200", TERM="xterm")
    process = subprocess.Popen([sys.executable, "-c", code], stdin=follower, stdout=follower, stderr=follower,
                               cwd=cwd, env=env, close_fds=True)  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            process.kill()
            break
        try:
            data = os.read(leader, 65536)
        except OSError:  # the program closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    process.wait(60)
    os.close(leader)
    assert process.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))


def test_compile_in_a_terminal_shows_stages_and_verification_runs(model: Path, tmp_path: Path) -> None:
    code = f"from layerzero.cli import main; raise SystemExit(main(['compile', {str(model)!r}, '-o', 'm.lz']))"
    drawn = _in_terminal(code, tmp_path)
    assert f"compiling {model}: static passes" in drawn
    assert "verifying: the original on the default inputs" in drawn
    assert "verifying: the compiled model on the" in drawn
    assert re.search(r"\d+/\d+", drawn)  # the bar's done/total


def test_chunked_verification_names_its_chunks(model: Path, tmp_path: Path) -> None:
    code = (
        "from layerzero.cli._common import progress\n"
        "from layerzero.compile import compile_file\n"
        "from layerzero.options import CompileOptions\n"
        "with progress('compiling') as say:\n"
        f"    compile_file({str(model)!r}, 'm.lz', CompileOptions(chunked_verify_bytes=200_000), progress=say)\n"
    )
    drawn = _in_terminal(code, tmp_path)
    chunks = re.findall(r"chunk (\d+)/(\d+)", drawn)
    assert chunks and int(chunks[0][1]) > 1, drawn[-2000:]


def test_compile_piped_stays_quiet(model: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "layerzero.cli", "compile", str(model), "-o", str(tmp_path / "m.lz")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "verifying:" not in done.stderr and "static passes" not in done.stderr
    assert "\x1b[" not in done.stderr


def test_export_in_a_terminal_shows_its_stages(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="export needs torch (pip install -e '.[export]')")
    transformers = pytest.importorskip("transformers", reason="export needs transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    code = "from layerzero.cli import main; raise SystemExit(main(['export', 'llama', '-o', 'm.onnx']))"
    drawn = _in_terminal(code, tmp_path)
    assert "exporting llama: loading the model with transformers" in drawn
    assert "exporting llama: exporting with torch.onnx (dynamo, KV cache)" in drawn
    assert "exported llama" in drawn and (tmp_path / "m.onnx").is_file()
