"""A new user's first steps on a tiny Llama and a tiny Qwen3-MoE: what export -> flag -> compile -> inspect ->
generate say must be true (README, inspect of a bundle, one parameter count, the generate report's size and
per-row truth, an empty id being an error)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corpus"))

from corpus_export import get_generate_export  # noqa: E402
from corpus_families import FAMILIES  # noqa: E402

from layerzero.cli import main  # noqa: E402
from layerzero.flags import flaggable_scopes  # noqa: E402
from layerzero.loader import load_model  # noqa: E402
from layerzero.runtime import Engine  # noqa: E402
from layerzero.summary import find_moe, summarize  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

ROOT = Path(__file__).resolve().parents[2]
ARTEFACT = "_empty_nn_module_stack_from_metadata_hook"
PROMPT = [5, 17, 99, 3, 42, 7]


def _out(capsys: pytest.CaptureFixture) -> str:
    captured = capsys.readouterr()
    return " ".join((captured.out + captured.err).split())


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache-carrying `layerzero export` of a tiny random Llama."""
    tmp = tmp_path_factory.mktemp("texts")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "hf")
    assert main(["export", str(tmp / "hf"), "-o", str(tmp / "model.onnx")]) == 0
    return tmp / "model.onnx"


@pytest.fixture(scope="module")
def qwen() -> Path:
    """The corpus's tiny Qwen3-MoE (2 layers, 4 experts, top-2), exported with the cache (cached)."""
    family = FAMILIES["qwen3_moe"]
    kwargs = {**family.kwargs, "initializer_range": 0.2, "eos_token_id": None, "bos_token_id": None}
    return get_generate_export(dataclasses.replace(family, name="qwen3_moe_generate", kwargs=kwargs)) / "model.onnx"


@pytest.fixture(scope="module")
def qwen_bundle(qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("texts-qwen") / "model.lz"
    assert main(["compile", str(qwen), "-o", str(out)]) == 0
    return out


def test_readme_says_what_a_cache_export_can_flag(llama: Path, capsys) -> None:
    scopes = {c.scope for c in flaggable_scopes(load_model(llama))}
    assert "model.layers.1.mlp" in scopes and "model.layers.1.self_attn.o_proj" in scopes
    assert "model.layers.1" not in scopes and "model.layers.1.self_attn" not in scopes
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "its `mlp` or `self_attn` can" not in readme
    assert "In a cache-carrying export neither a whole decoder layer nor its `self_attn` can be flagged" in readme
    assert "`layerzero flag llama.onnx --list` shows exactly what can" in readme
    assert main(["flag", str(llama), "model.layers.1.self_attn", "-o", str(llama.with_name("x.onnx"))]) == 2
    assert "`layerzero flag MODEL --list` lists the scopes a flag can name" in _out(capsys)


@pytest.mark.parametrize("which", ["llama", "qwen"])
def test_inspect_and_flag_list_count_alike_and_hide_exporter_artefacts(which: str, request, capsys) -> None:
    path = request.getfixturevalue(which)
    summary = summarize(load_model(path))
    assert not any(s.startswith(ARTEFACT) for s in summary.scope_nodes)
    candidates = flaggable_scopes(load_model(path))
    assert candidates and not any(c.scope.startswith(ARTEFACT) for c in candidates)
    for c in candidates:
        assert (c.nodes, c.params) == (summary.scope_nodes[c.scope], summary.scope_params.get(c.scope, 0)), c.scope
    assert main(["inspect", str(path), "--depth", "4"]) == 0
    assert ARTEFACT not in _out(capsys)


def test_inspect_of_a_bundle_knows_its_rewritten_moe_blocks(qwen_bundle: Path, capsys) -> None:
    findings = find_moe(load_model(qwen_bundle / "model.onnx"))
    assert [(f.scope, f.rewritten) for f in findings] == [("model.layers.0.mlp", True), ("model.layers.1.mlp", True)]
    assert main(["inspect", str(qwen_bundle)]) == 0
    out = _out(capsys)
    assert "candidate" not in out and "not rewritten" not in out
    assert out.count("rewritten by compile into its skipping form") == 2


def test_compile_counts_a_removed_mlp(llama: Path, tmp_path: Path, capsys) -> None:
    flagged = tmp_path / "flagged.onnx"
    assert main(["flag", str(llama), "model.layers.1.mlp", "-o", str(flagged)]) == 0
    assert main(["compile", str(flagged), "-o", str(tmp_path / "m.lz")]) == 0
    out = _out(capsys)
    assert "layers 2 total: 0 removed whole, 1 with a part removed; 1 scope removed (below)" in out
    assert "removed model.layers.1.mlp" in out


def test_generate_json_is_compact_unless_steps(qwen_bundle: Path, capsys) -> None:
    ids = ",".join(map(str, PROMPT))
    assert main(["generate", str(qwen_bundle), "--prompt-ids", ids, "--max-new-tokens", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert "steps" not in report and report["step_count"] == 8
    counts = report["skipped_steps"]
    assert counts and all(0 < n <= 8 for n in counts.values())
    argv = ["generate", str(qwen_bundle), "--prompt-ids", ids, "--max-new-tokens", "8", "--json", "--steps"]
    assert main(argv) == 0
    full = json.loads(capsys.readouterr().out)["report"]
    assert len(full["steps"]) == 8
    recount: dict[str, int] = {}
    for step in full["steps"]:
        for p in step["skipped_paths"]:
            recount[p] = recount.get(p, 0) + 1
    assert recount == counts  # greedy: the same steps, the compact form is their count


def test_batch_row_that_stops_early_has_its_own_report(qwen_bundle: Path) -> None:
    engine = Engine.load(qwen_bundle)
    mine, other = [100, 1, 2, 3], [9, 8]
    alone = engine.generate(mine, max_new_tokens=8, stop_tokens=())
    other_alone = engine.generate(other, max_new_tokens=8, stop_tokens=())
    # A stop id the first row makes at step k >= 1 (first time) and the other row not within k + 1 steps.
    k, stop = next(
        (k, t) for k, t in enumerate(alone.ids) if k and alone.ids.index(t) == k and t not in other_alone.ids[: k + 1]
    )
    rows = engine.generate([mine, other], max_new_tokens=8, stop_tokens=[stop])
    first = rows[0]
    assert first.ids == alone.ids[: k + 1] and first.report.stop_reason == "stop_token"
    assert len(rows[1].ids) > k + 1  # the batch ran on after the first row stopped
    assert len(first.report.steps) == k + 1 and first.report.batch_rows == 2
    own = set.intersection(*(set(s.skipped_paths) for s in first.report.steps))
    assert first.report.skipped_paths == sorted(own)
    assert "(of the batch of 2)" in first.report.summary()


@pytest.mark.parametrize("bad", ["1,,2", "1,2,", ",1"])
def test_prompt_ids_with_an_empty_item_is_an_error(qwen_bundle: Path, bad: str, capsys) -> None:
    assert main(["generate", str(qwen_bundle), f"--prompt-ids={bad}", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is empty" in err[0] and repr(bad) in err[0], err
