"""``layerzero compile --activation-sparsity S`` end to end (issue 23) on a tiny Llama with random weights: the
calibration's allocation in the manifest, the realized sparsity each request reports, scale 0 (``layerzero run
--no-activation-sparsity``) equal to the dense compile, the guard's back-off of the activation scale, bad values."""

from __future__ import annotations

import itertools
import json
import logging
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from layerzero.contract import ACTIVATION_SCALE_INPUT
from layerzero.runtime import Engine
from layerzero.runtime.guard import GuardConfig, GuardedEngine

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")

from tests.tiny_llama import prefill_feeds  # noqa: E402

LAYERS, HIDDEN, FFN, VOCAB, SEQ = 2, 64, 128, 128, 48
TARGET = 0.3


def _feeds(seq: int = SEQ, seed: int = 3) -> dict[str, np.ndarray]:
    return prefill_feeds(VOCAB, LAYERS, seq, seed, head_dim=HIDDEN // 4)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory):
    """The export, its dense compile and its compile at --activation-sparsity 0.3 calibrated on ``_feeds()``."""
    from layerzero.cli import main

    tmp = tmp_path_factory.mktemp("activation_compile")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "llama")
    assert main(["export", str(tmp / "llama"), "-o", str(tmp / "m.onnx")]) == 0
    calibration = tmp / "calibration.npz"
    np.savez(calibration, **_feeds())
    assert main(["compile", str(tmp / "m.onnx"), "-o", str(tmp / "dense.lz")]) == 0
    args = ["compile", str(tmp / "m.onnx"), "-o", str(tmp / "sparse.lz"), "--activation-sparsity", str(TARGET),
            "--activation-calibration", str(calibration), "--max-deviation", "100"]  # fmt: skip
    assert main(args) == 0
    # The same without the head rotation (--activation-rotation none): scale 0 is then the dense compile bitwise.
    assert main([*args[:3], str(tmp / "sparse-norot.lz"), *args[4:], "--activation-rotation", "none"]) == 0
    return tmp


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def test_manifest_records_the_allocation_and_the_deviation(bundles: Path) -> None:
    manifest = _manifest(bundles / "sparse.lz")
    record = manifest["activation_sparsity"]
    assert record["target"] == TARGET and record["method"] == "wina" and record["allocation"] == "greedy"
    assert record["form"] in ("reference", "native")
    kinds = ("self_attn.qkv", "self_attn.o", "mlp.gate_up", "mlp.down")
    assert sorted(record["groups"]) == sorted(f"model.layers.{i}.{k}" for i in range(LAYERS) for k in kinds)
    assert all(0.0 <= v <= 0.95 for v in record["groups"].values())
    assert abs(record["realized_on_calibration"] - TARGET) < 0.02, record["realized_on_calibration"]
    assert "calibration.npz" in record["calibration"] and record["calibration_rows"] == SEQ
    # The sparsity's impact: verification compared with the dense model and accepted it under --max-deviation.
    v = manifest["verification"]
    assert v["passed"] and v["activation_sparsity"] == TARGET and v["dense_at_scale_0"] is True
    assert record["deviation"]["logits"] > 0  # deviates on purpose
    activation = [d for d in manifest["dynamic"] if d["kind"] == "activation"]
    assert sorted(d["path"] for d in activation) == sorted(record["groups"])
    assert _manifest(bundles / "dense.lz")["activation_sparsity"] is None
    # The head rotation (--activation-rotation heads, the default) ran on every attention and passed its check.
    rotation = record["rotation"]
    assert rotation["kind"] == "heads" and rotation["layers"] == LAYERS and rotation["refused"] == [], rotation
    assert 0 <= rotation["check"] < 1e-4
    assert _manifest(bundles / "sparse-norot.lz")["activation_sparsity"]["rotation"] is None


def test_report_realizes_the_target_on_the_calibration_inputs(bundles: Path) -> None:
    engine = Engine.load(bundles / "sparse.lz")
    assert engine.has_activation_scale_input
    assert ACTIVATION_SCALE_INPUT not in {s.name for s in engine.input_specs}  # the runtime's input, not the user's
    report = engine.run(_feeds()).report
    entries = {d["path"]: d for d in engine.manifest["dynamic"] if d["kind"] == "activation"}
    assert set(report.activation_sparsity) == set(entries)
    params = {p: sum(d["params"]) for p, d in entries.items()}
    realized = sum(params[p] * s for p, s in report.activation_sparsity.items()) / sum(params.values())
    # Calibrated on the dense activations; later groups see the sparse model's: within a few %.
    assert abs(realized - TARGET) < 0.05, (realized, report.activation_sparsity)
    # The rows not read count as zeroed parameters (on top of what the compile removed).
    want = sum(round(params[p] * s) for p, s in report.activation_sparsity.items())
    assert report.skipped_params == want
    static = engine.report_template().zeroed_params_ratio  # what the compile removed (the same every request)
    assert want > 0 and report.zeroed_params_ratio == pytest.approx(static + want / report.params_before)
    assert "activations" in report.summary() and report.to_dict()["activation_sparsity"]
    # Scale 0: nothing zeroed (random weights: no exact zeros in the activations).
    assert all(s == 0 for s in engine.run(_feeds(), activation_scale=0.0).report.activation_sparsity.values())


def _same(got: np.ndarray, want: np.ndarray, bundle: str, name: str) -> None:
    """Bitwise without the head rotation; with it, the same product in another order: within float rounding."""
    if bundle == "sparse-norot.lz":
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("bundle", ["sparse-norot.lz", "sparse.lz"])
def test_scale_0_equals_the_dense_compile(bundles: Path, capsys, bundle: str) -> None:
    from layerzero.cli import main

    feeds = _feeds(seq=9, seed=11)
    dense = Engine.load(bundles / "dense.lz").run(feeds).outputs
    engine = Engine.load(bundles / bundle)
    sparse = engine.run(feeds).outputs
    assert not np.allclose(sparse["logits"], dense["logits"], rtol=1e-3, atol=1e-3)
    off = engine.run(feeds, activation_scale=0.0).outputs
    for name in dense:
        _same(off[name], dense[name], bundle, name)
    # The CLI's A/B switch: the same through `layerzero run --no-activation-sparsity`.
    npz = bundles / "ab.npz"
    np.savez(npz, **feeds)
    capsys.readouterr()
    assert main(["run", str(bundles / bundle), "--inputs", str(npz), "--no-activation-sparsity", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    got = np.asarray(doc["outputs"]["logits"]["values"], np.float32)
    _same(got, dense["logits"], bundle, "logits")
    assert all(s == 0 for s in doc["report"]["activation_sparsity"].values())


def test_guard_backoff_divides_the_activation_scale(bundles: Path, caplog) -> None:
    engine = Engine.load(bundles / "sparse.lz")
    dense = Engine.load(bundles / "dense.lz")
    # Every request sampled and every sampled request over the bound: a back-off after each request.
    config = GuardConfig(sample_rate=1.0, fallback_bound=0.0, min_window_requests=1, backoff_above=0.0,
                         backoff_factor=2.0, backoff_floor=0.3)  # fmt: skip
    guard = GuardedEngine(engine, dense, config)
    feeds = _feeds(seq=9, seed=5)
    assert guard.activation_scale() == 1.0
    with caplog.at_level(logging.WARNING, logger="layerzero.runtime.guard"):
        first = guard.run(feeds)
    assert first.route == "fallback" and guard.activation_scale() == 0.5
    assert "activation scale 1 -> 0.5" in caplog.text
    # The next request ran at scale 0.5: its report is that of the engine at 0.5 (fewer channels zeroed).
    second = guard.run(feeds, masks=True)
    want = engine.run(feeds, activation_scale=0.5).report.activation_sparsity
    assert second.report.activation_sparsity == pytest.approx(want)
    at_1 = engine.run(feeds).report.activation_sparsity
    assert sum(want.values()) < sum(at_1.values())
    # 0.25 is below the floor 0.3: 0, the dense model exactly.
    assert guard.activation_scale() == 0.0 and guard.stats()["segments"]["default"]["activation_scale"] == 0.0
    third = guard.run(feeds)
    assert all(s == 0 for s in third.report.activation_sparsity.values())
    assert guard.stats()["segments"]["default"]["backoffs"] == 2  # scale 0 and threshold 0: nothing more to do


@pytest.mark.parametrize("bundle", ["sparse-norot.lz", "sparse.lz"])
def test_no_activation_sparsity_starts_the_guard_dense(bundles: Path, bundle: str) -> None:
    engine = Engine.load(bundles / bundle)
    engine.activation_scale = 0.0  # what --no-activation-sparsity sets
    guard = GuardedEngine(engine, None, GuardConfig(sample_rate=0.0))
    assert guard.activation_scale() == 0.0
    out = guard.run(_feeds(seq=9, seed=11)).outputs["logits"]
    want = Engine.load(bundles / "dense.lz").run(_feeds(seq=9, seed=11)).outputs["logits"]
    _same(out, want, bundle, "logits")


def _exit_code(args: list[str]) -> int:
    from layerzero.cli import main

    try:
        return main(args)
    except SystemExit as exc:  # argparse's own checks (a value out of range) exit 2 the same way
        return int(exc.code)


def _no_matmul(path: Path) -> Path:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--activation-sparsity", "0.99", "--max-deviation", "1"], "must be <= 0.95"),
        (["--activation-sparsity", "-0.1", "--max-deviation", "1"], "must be >= 0"),
        (["--activation-sparsity", "0.3"], "give max_deviation (--max-deviation)"),
        (["--activation-calibration", "x.npz"], "needs activation_sparsity > 0"),
        (
            ["--activation-sparsity", "0.3", "--max-deviation", "1", "--activation-rotation", "spin"],
            "invalid choice: 'spin'",
        ),
    ],
)
def test_bad_values_are_one_line_exit_2(bundles: Path, capsys, extra, needle) -> None:
    out = bundles / "bad.lz"
    assert _exit_code(["compile", str(bundles / "m.onnx"), "-o", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "Traceback" not in err, err
    assert not out.exists()


def test_an_unknown_rotation_is_refused_by_the_options() -> None:
    from layerzero.errors import InvalidInputError
    from layerzero.options import CompileOptions

    with pytest.raises(InvalidInputError, match="activation_rotation"):
        CompileOptions(activation_sparsity=0.3, max_deviation=1.0, activation_rotation="spin")
    assert CompileOptions().activation_rotation == "heads"


def test_no_float_matmul_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bad.lz"
    args = ["compile", str(_no_matmul(tmp_path / "relu.onnx")), "-o", str(out), "--activation-sparsity", "0.3",
            "--max-deviation", "1"]  # fmt: skip
    assert _exit_code(args) == 2
    err = capsys.readouterr().err.strip()
    assert "no float MatMul" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def _unknown_rank_model(path: Path, known: bool) -> Path:
    """Layer 0's projection reads a value computed from a ``com.microsoft.FusedMatMul`` output (no onnx schema, no
    value_info: a float of unknown rank); with ``known`` layer 1's projection reads the graph input (rank known)."""
    rng = np.random.default_rng(5)
    w = [helper.make_tensor(f"w{i}", TensorProto.FLOAT, [32, 32], rng.standard_normal(32 * 32).astype(np.float32))
         for i in range(3)]  # fmt: skip
    nodes = [
        helper.make_node("FusedMatMul", ["x", "w0"], ["f"], domain="com.microsoft", name="/model/pre/FusedMatMul"),
        helper.make_node("Add", ["x", "f"], ["s"], name="/model/pre/Add"),  # float, its shape unknown
        helper.make_node("MatMul", ["s", "w1"], ["a"], name="/model/layers.0/mlp/up_proj/MatMul"),
        helper.make_node("MatMul", ["x" if known else "a", "w2"], ["b"], name="/model/layers.1/mlp/up_proj/MatMul"),
        helper.make_node("Add", ["a", "b"], ["y"], name="/model/Add"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])], w)  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    proto = helper.make_model(graph, opset_imports=opsets)
    onnx.save(proto, str(path))
    return path


def test_a_group_whose_input_rank_is_unknown_is_refused_not_calibrated(tmp_path: Path, capsys) -> None:
    """The calibration left such a group in and asked the probes' session for a group the pass had refused: an
    error naming no sparsified group (found by a fuzzer of projection graphs). Now it is recorded as refused and the
    others are sparsified; when it is every group, one line says so (exit 2)."""
    from layerzero.compile import compile_model
    from layerzero.contract import REFUSED_META_KEY
    from layerzero.options import CompileOptions

    model = onnx.load(str(_unknown_rank_model(tmp_path / "one.onnx", known=True)))
    result = compile_model(model, CompileOptions(activation_sparsity=0.3, max_deviation=1e9))
    want = [("model.layers.0.mlp.up", "its input's rank is unknown")]
    assert [(r["path"], r["reason"]) for r in json.loads(result.model.metadata_props[REFUSED_META_KEY])] == want
    assert [(r["path"], r["reason"]) for r in result.activation_sparsity["refused"]] == want
    assert set(result.activation_sparsity["groups"]) == {"model.layers.1.mlp.up"}
    out = tmp_path / "bad.lz"
    args = ["compile", str(_unknown_rank_model(tmp_path / "none.onnx", known=False)), "-o", str(out),
            "--activation-sparsity", "0.3", "--max-deviation", "1"]  # fmt: skip
    assert _exit_code(args) == 2
    err = capsys.readouterr().err.strip()
    assert "input rank of every projection group is unknown" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("extra", [["--quant-block", "64"], ["--quant-asymmetric"]])
def test_a_quantization_the_sparse_kernel_cannot_read_is_refused_before_calibrating(
    bundles: Path, capsys, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    """The SparseLinear kernel reads symmetric blocks of 32 only; the quantization refused other options after the
    whole calibration (15 minutes of probes on a 1B model). Now one line, exit 2, before calibrating."""
    from layerzero import pipeline
    from tests.plugins.native_build import build_ort_test_library

    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(build_ort_test_library().parent))

    def calibrated(*args, **kwargs):
        raise AssertionError("calibrated before refusing")

    monkeypatch.setattr(pipeline, "_calibrate_on", calibrated)
    out = bundles / "bad-block.lz"
    args = ["compile", str(bundles / "m.onnx"), "-o", str(out), "--activation-sparsity", "0.3", "--max-deviation",
            "100", "--weights", "int4", *extra]  # fmt: skip
    assert _exit_code(args) == 2
    err = capsys.readouterr().err.strip()
    assert "reads symmetric blocks of 32 along K only" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_a_deviation_above_max_deviation_fails_naming_the_sparsity(bundles: Path, capsys) -> None:
    out = bundles / "tight.lz"
    args = ["compile", str(bundles / "m.onnx"), "-o", str(out), "--activation-sparsity", "0.5",
            "--activation-calibration", str(bundles / "calibration.npz"), "--max-deviation", "1e-6"]  # fmt: skip
    assert _exit_code(args) == 1
    err = capsys.readouterr().err.strip()
    assert "activation sparsity's (--activation-sparsity 0.5)" in err and "--max-deviation" in err, err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_options_check_the_activation_fields(tmp_path: Path) -> None:
    from layerzero.errors import InvalidInputError
    from layerzero.options import CompileOptions

    o = CompileOptions(activation_sparsity=0.3, activation_calibration=str(tmp_path / "c.json"), max_deviation=0.1)
    assert o.to_dict()["activation_calibration"] == str(tmp_path / "c.json") and o.activation_method == "wina"
    assert CompileOptions(activation_sparsity=0.4, verify=False).activation_sparsity == 0.4  # unverified: no bound
    for bad in ({"activation_sparsity": 0.96, "max_deviation": 1}, {"activation_sparsity": float("nan")},
                {"activation_method": "teal"}, {"activation_sparsity": True},
                {"activation_sparsity": 0.3, "verify": False, "dynamic": False},
                {"activation_impact_tolerance": 0.1, "verify": False},
                {"activation_sparsity": 0.3, "verify": False, "activation_impact_tolerance": -0.1},
                {"activation_sparsity": 0.3, "verify": False, "activation_impact_tolerance": math.inf},
                {"activation_refine": 1, "verify": False},
                {"activation_sparsity": 0.3, "verify": False, "activation_refine": -1},
                {"activation_sparsity": 0.3, "verify": False, "activation_refine": 1.5}):  # fmt: skip
        with pytest.raises(InvalidInputError, match="option activation_"):
            CompileOptions(**bad)
    o = CompileOptions(activation_sparsity=0.3, verify=False, activation_impact_tolerance=0.05)
    assert o.activation_impact_tolerance == 0.05


def test_json_calibration_requests(bundles: Path, tmp_path: Path) -> None:
    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions

    path = tmp_path / "c.json"

    def encode(v: np.ndarray):  # nested lists, or shape + flat values where a dim is empty (the past)
        return v.tolist() if v.size else {"shape": list(v.shape), "values": []}

    path.write_text(json.dumps([{k: encode(v) for k, v in _feeds(seq=24, seed=s).items()} for s in (1, 2)]))
    options = CompileOptions(activation_sparsity=0.2, activation_calibration=path, verify=False)
    record = compile_model(bundles / "m.onnx", options).activation_sparsity
    assert record["calibration"] == f"{path} (2 requests)" and record["calibration_rows"] == 48
    assert abs(record["realized_on_calibration"] - 0.2) < 0.02
    path.write_text(json.dumps([{"nope": [1]}]))
    from layerzero.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="names 'nope', which is no input"):
        compile_model(bundles / "m.onnx", options)
    path.write_text(json.dumps({k: v.tolist() for k, v in _feeds(seq=4).items()}))  # the empty past: rank 3
    with pytest.raises(InvalidInputError, match=r"the calibration inputs do not run on the model: .*rank"):
        compile_model(bundles / "m.onnx", options)


def test_validate_feeds_takes_the_scale_as_the_runtimes_input_and_generate_runs_at_it(bundles: Path) -> None:
    from layerzero.errors import InvalidInputError

    engine = Engine.load(bundles / "sparse.lz")
    feeds = _feeds(seq=9, seed=11)
    arrays = engine.validate_feeds({**feeds, ACTIVATION_SCALE_INPUT: 0})
    assert arrays[ACTIVATION_SCALE_INPUT].dtype == np.float32 and float(arrays[ACTIVATION_SCALE_INPUT]) == 0.0
    assert ACTIVATION_SCALE_INPUT not in engine.validate_feeds(feeds)  # unset: the compiled 1
    with pytest.raises(InvalidInputError, match="activation_scale: expected a finite number >= 0"):
        engine.validate_feeds({**feeds, ACTIVATION_SCALE_INPUT: -1})
    dense = Engine.load(bundles / "dense.lz")
    assert ACTIVATION_SCALE_INPUT not in dense.validate_feeds({**feeds, ACTIVATION_SCALE_INPUT: 0})  # dense already
    # The guard's decode loop (what `serve` runs) goes through Engine.run: --no-activation-sparsity holds there.
    prompt = [int(i) for i in feeds["input_ids"][0]]
    want = dense.generate(prompt, max_new_tokens=6).ids
    engine.activation_scale = 0.0
    guard = GuardedEngine(engine, None, GuardConfig(sample_rate=0.0))
    from layerzero.runtime.generate import generate

    assert generate(guard, prompt, max_new_tokens=6).ids == want
    assert engine.generate(prompt, max_new_tokens=6).ids == want  # Engine.generate steps through run() then
    # The compiled scale sparsifies (the probed allocation at 0.3 may keep these 6 greedy ids of a random model);
    # 4x its thresholds through the guard's loop do change them.
    engine.activation_scale = None
    assert any(s > 0 for s in engine.run(feeds).report.activation_sparsity.values())
    engine.activation_scale = 4.0
    assert generate(GuardedEngine(engine, None, GuardConfig(sample_rate=0.0)), prompt, max_new_tokens=6).ids != want


def test_default_calibration_is_the_seeded_sets_or_the_sample_inputs(bundles: Path) -> None:
    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions

    options = CompileOptions(activation_sparsity=0.3, verify=False)
    record = compile_model(bundles / "m.onnx", options).activation_sparsity
    assert record["calibration"].startswith("3 seeded sample input sets (default, ")  # what verification runs on
    assert abs(record["realized_on_calibration"] - 0.3) < 0.02 and record["calibration_rows"] > 0
    sample = bundles / "calibration.npz"
    options = CompileOptions(activation_sparsity=0.3, verify=False, sample_inputs=sample)
    record = compile_model(bundles / "m.onnx", options).activation_sparsity
    assert record["calibration"] == f"the sample inputs {sample}" and record["calibration_rows"] == SEQ


def test_generate_no_activation_sparsity_gives_the_dense_ids(bundles: Path, capsys) -> None:
    """`layerzero generate --no-activation-sparsity`: the greedy ids of the dense compile (one prompt and a batch);
    without it the prompt skips channels (so the flag is what made them dense; the probed allocation at 0.3 may
    keep these 8 greedy ids of a random model, so the ids are not what tells)."""
    from layerzero.cli import main

    prompt = [int(i) for i in _feeds(seq=9, seed=11)["input_ids"][0]]
    other = [int(i) for i in _feeds(seq=5, seed=12)["input_ids"][0]]
    ids = ",".join(map(str, prompt))

    def generate(bundle: str, *extra: str) -> dict:
        capsys.readouterr()
        args = ["generate", str(bundles / bundle), "--prompt-ids", ids, "--max-new-tokens", "8", "--json", *extra]
        assert main(args) == 0
        return json.loads(capsys.readouterr().out)

    dense = generate("dense.lz")["ids"]
    engine = Engine.load(bundles / "sparse.lz")  # the same prompt at the compiled scale skips channels
    assert any(s > 0 for s in engine.run(_feeds(seq=9, seed=11)).report.activation_sparsity.values())
    off = generate("sparse.lz", "--no-activation-sparsity")
    assert off["ids"] == dense
    assert all(s == 0 for s in off["report"].get("activation_sparsity", {}).values())
    batch = ("--prompt-ids", ",".join(map(str, other)))
    want = [r["ids"] for r in generate("dense.lz", *batch)["results"]]
    got = [r["ids"] for r in generate("sparse.lz", *batch, "--no-activation-sparsity")["results"]]
    assert got == want


def test_report_draws_the_sparsity_map_and_the_curve(bundles: Path, tmp_path: Path, capsys) -> None:
    """`layerzero report BUNDLE`: the calibrated level of every group (layer x projection), the realized sparsity
    of a `layerzero run --json` given as --realized, and the calibration's quality-vs-sparsity curve, as text and
    as HTML: the manifest's numbers and the run's."""
    from layerzero.cli import main

    sparse = bundles / "sparse.lz"
    record = _manifest(sparse)["activation_sparsity"]
    capsys.readouterr()
    assert main(["report", str(sparse)]) == 0
    text = capsys.readouterr().out
    assert f"realized {record['realized_on_calibration']:.3g}" in text
    assert f"; heads rotated in {LAYERS} attentions" in text  # --activation-rotation heads, the default
    lines = text.splitlines()
    for i in range(LAYERS):
        row = next(line for line in lines if line.strip().startswith(f"model.layers.{i} "))
        want = [f"{record['groups'][f'model.layers.{i}.{k}']:.1%}" for k in
                ("self_attn.qkv", "self_attn.o", "mlp.gate_up", "mlp.down")]  # fmt: skip
        assert row.split()[1:] == want, (row, want)
    start = next(k for k, line in enumerate(lines) if "quality vs sparsity" in line) + 1
    curve = [line.split()[:2] for line in lines[start:]]
    assert curve == [[f"{s:.4f}", f"{e:.4g}"] for s, e in record["curve"]] and len(curve) > 2

    npz = tmp_path / "req.npz"
    np.savez(npz, **_feeds(seq=9, seed=11))
    assert main(["run", str(sparse), "--inputs", str(npz), "--json"]) == 0
    run = tmp_path / "run.json"
    run.write_text(capsys.readouterr().out)
    realized = json.loads(run.read_text())["report"]["activation_sparsity"]
    out = tmp_path / "map.html"
    assert main(["report", str(sparse), "--realized", str(run), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    page = out.read_text()
    assert "layerzero report" in page and "<svg" in page
    for name, level in record["groups"].items():
        cell = f"{level:.1%} ({realized[name]:.1%})"
        assert cell in text and cell in page, name
    for s, e in record["curve"]:
        assert f"<td>{s:.4f}</td><td>{e:.4g}</td>" in page

    # A dense bundle has no map; --realized with a profile, or a run of another model: one line, exit 2.
    assert main(["report", str(bundles / "dense.lz")]) == 2
    assert "no activation sparsity" in capsys.readouterr().err
    (tmp_path / "other.json").write_text(json.dumps({"report": {"activation_sparsity": {"x.y": 0.5}}}))
    assert main(["report", str(sparse), "--realized", str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err
    assert "names none of the bundle's activation groups" in err and err.count("\n") == 1


def test_refine_moves_levels_at_the_same_sparsity_and_lowers_the_measured_deviation(bundles: Path) -> None:
    from layerzero.cli import main

    args = ["compile", str(bundles / "m.onnx"), "-o", str(bundles / "refined.lz"), "--activation-sparsity",
            str(TARGET), "--activation-calibration", str(bundles / "calibration.npz"), "--no-verify"]  # fmt: skip
    assert main([*args, "--activation-refine", "2"]) == 0
    record = _manifest(bundles / "refined.lz")["activation_sparsity"]
    plain = _manifest(bundles / "sparse.lz")["activation_sparsity"]
    assert plain["refine"] is None and record["refine"]["rounds"] == 2
    trace = record["refine"]["deviation"]
    assert 1 <= len(trace) <= 3 and all(b < a for a, b in itertools.pairwise(trace))
    assert record["allocation"] == "greedy+refine"
    assert abs(record["realized_on_calibration"] - TARGET) < 0.02
    params = {"qkv": HIDDEN * 2 * HIDDEN, "o": HIDDEN * HIDDEN, "gate_up": HIDDEN * 2 * FFN, "down": FFN * HIDDEN}

    def weighted(levels: dict) -> float:
        return sum(params[n.rsplit(".", 1)[-1]] * v for n, v in levels.items()) / (LAYERS * sum(params.values()))

    assert weighted(record["groups"]) == pytest.approx(weighted(plain["groups"]), abs=1e-6)
    assert weighted(plain["groups"]) == pytest.approx(TARGET, abs=1e-6)


def test_composes_with_int4_and_the_native_kernels(bundles: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--activation-sparsity with --weights int4 --linear-kernel native: the compile verifies, its attention is the
    native op (cache buffers marked), the projections stay activation-sparse, and generate gives the same ids with
    and without the cache buffers."""
    from layerzero.cli import main
    from layerzero.contract import CACHE_BUFFER_META_KEY
    from tests.plugins.native_build import build_ort_test_library

    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(build_ort_test_library().parent))
    out = bundles / "sparse-int4-native.lz"
    args = ["compile", str(bundles / "m.onnx"), "-o", str(out), "--activation-sparsity", str(TARGET),
            "--activation-calibration", str(bundles / "calibration.npz"), "--max-deviation", "100",
            "--weights", "int4", "--linear-kernel", "native"]  # fmt: skip
    assert main(args) == 0
    manifest = _manifest(out)
    assert manifest["verification"]["passed"]
    model = onnx.load(out / "model.onnx", load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert "Attention" in ops and ops & {"SparseLinear", "QLinear"}
    assert {p.key: p.value for p in model.metadata_props}.get(CACHE_BUFFER_META_KEY) == "1"
    engine = Engine.load(out)
    prompt = [5, 9, 17, 3, 44, 12]
    monkeypatch.setenv("LAYERZERO_KV_BUFFER", "1")
    with_buffers = engine.generate(prompt, max_new_tokens=12, stop_tokens=())
    monkeypatch.setenv("LAYERZERO_KV_BUFFER", "0")
    copying = engine.generate(prompt, max_new_tokens=12, stop_tokens=())
    assert with_buffers.ids == copying.ids and len(copying.ids) == 12
    # The bound loop reads an activation bundle's masks only when asked (runtime/generate.py _BoundSteps): each
    # step's masks and (no) skipped paths equal those of the plain loop's whole reports, with and without buffers.
    from layerzero.runtime.generate import generate
    from layerzero.runtime.guard import GuardConfig, GuardedEngine

    guard = GuardedEngine(engine, None, GuardConfig(sample_rate=0.0))
    plain = generate(guard, prompt, max_new_tokens=12, stop_tokens=(), masks=True)
    for buffers in ("1", "0"):
        monkeypatch.setenv("LAYERZERO_KV_BUFFER", buffers)
        bound = engine.generate(prompt, max_new_tokens=12, stop_tokens=(), masks=True)
        assert bound.ids == plain.ids == copying.ids
        for a, b in zip(bound.report.steps, plain.report.steps, strict=True):
            assert a.skipped_paths == b.skipped_paths == []
            assert a.masks == b.masks and len(a.masks) == len(engine.dynamic_index) > 0
