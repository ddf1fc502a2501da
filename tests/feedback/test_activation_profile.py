"""``layerzero profile --activations`` and ``layerzero compile --profile P --activation-sparsity S`` (issue 23) on a
tiny Llama with random weights: the profile records each projection group's magnitude distribution; a compile
calibrated from it allocates the same levels and thresholds as one calibrated directly on the same request."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch", reason="export tests need torch (pip install -e '.[export]')")
transformers = pytest.importorskip("transformers", reason="export tests need transformers")

from tests.tiny_llama import prefill_feeds  # noqa: E402

LAYERS, HIDDEN, FFN, VOCAB, SEQ = 2, 64, 128, 128, 48
TARGET = 0.3
KINDS = ("self_attn.qkv", "self_attn.o", "mlp.gate_up", "mlp.down")


def _feeds(seq: int = SEQ, seed: int = 3) -> dict[str, np.ndarray]:
    return prefill_feeds(VOCAB, LAYERS, seq, seed, head_dim=HIDDEN // 4)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export; its dense compile profiled with --activations on one request; compiles at S = 0.3 calibrated on
    that request directly and from the profile."""
    from layerzero.cli import main

    tmp = tmp_path_factory.mktemp("activation_profile")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.2,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "llama")
    assert main(["export", str(tmp / "llama"), "-o", str(tmp / "m.onnx")]) == 0
    feeds = _feeds()
    np.savez(tmp / "calibration.npz", **feeds)  # one request (compile --activation-calibration)
    np.savez(tmp / "requests.npz", **{k: v[None] for k, v in feeds.items()})  # the same, as [R = 1, ...] (profile)
    assert main(["compile", str(tmp / "m.onnx"), "-o", str(tmp / "dense.lz")]) == 0
    args = ["profile", str(tmp / "dense.lz"), "--data", str(tmp / "requests.npz"), "--activations",
            "--impact-samples", "0", "-o", str(tmp / "p.json")]  # fmt: skip
    assert main(args) == 0
    common = ["--activation-sparsity", str(TARGET), "--max-deviation", "100"]
    # Unrotated, as a compile from a profile is (its distributions are the dense bundle's, recorded unrotated).
    args = ["compile", str(tmp / "m.onnx"), "-o", str(tmp / "direct.lz"), "--activation-calibration",
            str(tmp / "calibration.npz"), "--activation-rotation", "none", *common]  # fmt: skip
    assert main(args) == 0
    # The groups' probes are measured on --activation-calibration's request in both (the profile's distributions
    # replace only the samples).
    assert main(["compile", str(tmp / "m.onnx"), "-o", str(tmp / "profiled.lz"), "--profile", str(tmp / "p.json"),
                 "--activation-calibration", str(tmp / "calibration.npz"), *common]) == 0  # fmt: skip
    return tmp


def _record(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())["activation_sparsity"]


def _thresholds(bundle: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(bundle / "model.onnx"))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if "activation_thresholds" in t.name}


def test_profile_records_each_groups_distribution(built: Path) -> None:
    doc = json.loads((built / "p.json").read_text())
    record = doc["activations"]
    assert record["version"] == 1 and record["quantile_steps"] == 1000
    groups = record["groups"]
    assert sorted(groups) == sorted(f"model.layers.{i}.{k}" for i in range(LAYERS) for k in KINDS)
    for name, g in groups.items():
        k = FFN if name.endswith("mlp.down") else HIDDEN
        assert g["channels"] == k and g["rows"] == SEQ, name
        per_channel = np.asarray(g["channel_quantiles"]["values"])
        assert per_channel.shape == (21, k) and np.all(np.diff(per_channel, axis=0) >= 0), name
        assert g["channel_quantiles"]["levels"][0] == 0 and g["channel_quantiles"]["levels"][-1] == 1
        for criterion in ("magnitude", "wina"):
            table = np.asarray(g["quantiles"][criterion])
            assert table.shape == (1001,) and np.all(np.diff(table) >= 0)
            assert len(g["error"][criterion]) == len(g["levels"]) and g["error"][criterion][0] == 0


def test_compile_from_the_profile_equals_direct_calibration(built: Path) -> None:
    """The same request profiled or calibrated on: the same levels per group and the same thresholds (to float32
    rounding: the profile ran the dense bundle, the direct calibration the model mid-compile; both exact at the
    quantile table's levels, 1/1000 apart, and linear between two)."""
    direct, profiled = _record(built / "direct.lz"), _record(built / "profiled.lz")
    assert direct["calibration_source"] == "requests" and profiled["calibration_source"] == "profile"
    assert profiled["calibration"] == (f"the profile {built / 'p.json'} (deviation measured on "
                                       f"{built / 'calibration.npz'})")  # fmt: skip
    assert direct["probes"] == profiled["probes"] == [0.3, 0.5, 0.7]
    assert profiled["calibration_rows"] == direct["calibration_rows"] == SEQ
    assert profiled["rotation"] is None and direct["rotation"] is None  # the default rotation needs the samples
    assert profiled["groups"].keys() == direct["groups"].keys()
    for name, level in direct["groups"].items():
        assert profiled["groups"][name] == pytest.approx(level, abs=1e-9), name
    np.testing.assert_allclose(np.asarray(profiled["curve"]), np.asarray(direct["curve"]), rtol=1e-6, atol=1e-9)
    # The realized sparsity: counted on the samples directly, read off the table from the profile.
    assert abs(profiled["realized_on_calibration"] - direct["realized_on_calibration"]) < 2e-3
    a, b = _thresholds(built / "direct.lz"), _thresholds(built / "profiled.lz")
    assert a.keys() == b.keys() and len(a) == LAYERS * len(KINDS)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=0, err_msg=name)


def test_bad_profiles_are_one_line_exit_2(built: Path, tmp_path: Path, capsys) -> None:
    from layerzero.cli import main

    # A bundle compiled with --activation-sparsity is no source of dense activations.
    out = tmp_path / "q.json"
    args = ["profile", str(built / "direct.lz"), "--data", str(built / "requests.npz"), "--activations", "-o", str(out)]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "compiled with --activation-sparsity" in err and err.count("\n") == 1 and not out.exists()
    # A profile whose groups do not match the model.
    doc = json.loads((built / "p.json").read_text())
    del doc["activations"]["groups"]["model.layers.1.mlp.down"]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    args = ["compile", str(built / "m.onnx"), "-o", str(tmp_path / "x.lz"), "--profile", str(tmp_path / "bad.json"),
            "--activation-sparsity", "0.3", "--max-deviation", "100"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no activations of group 'model.layers.1.mlp.down'" in err and err.count("\n") == 1
    assert not (tmp_path / "x.lz").exists()


def _impact(built: Path, tolerance: float, cap: float = 0.9) -> dict:
    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions

    options = CompileOptions(activation_sparsity=cap, activation_impact_tolerance=tolerance, verify=False,
                             activation_calibration=built / "calibration.npz", activation_rotation="none")  # fmt: skip
    return compile_model(built / "m.onnx", options).activation_sparsity


def test_impact_tolerance_chooses_the_largest_sparsity_within_it(built: Path) -> None:
    """--impact-tolerance T with --activation-sparsity S: the largest sparsity <= S on the greedy path whose measured
    deviation (largest relative L2 change of an output) is <= T; a tighter T gives a lower sparsity."""
    loose, tight = _impact(built, 0.3), _impact(built, 0.05)
    for record, bound in ((loose, 0.3), (tight, 0.05)):
        assert record["allocation"] == "max_error" and record["impact_tolerance"] == bound
        assert record["impact"] <= bound
        measured = dict(map(tuple, record["curve"]))
        assert measured[record["chosen"]] == record["impact"]
        # The next level measured (if any) is the first above the bound: the chosen one is the largest within it.
        above = [s for s, d in record["curve"] if s > record["chosen"]]
        assert len(above) <= 1 and all(measured[s] > bound for s in above)
        assert abs(record["realized_on_calibration"] - record["chosen"]) < 0.02
    assert 0 < tight["chosen"] < loose["chosen"] <= 0.9


def test_impact_tolerance_on_the_command_line(built: Path, tmp_path: Path, capsys) -> None:
    from layerzero.cli import main

    out = tmp_path / "t.lz"
    capsys.readouterr()
    # Unrotated: compared with the profile's allocation below.
    args = ["compile", str(built / "m.onnx"), "-o", str(out), "--activation-sparsity", "0.9", "--impact-tolerance",
            "0.05", "--activation-calibration", str(built / "calibration.npz"), "--no-verify",
            "--activation-rotation", "none"]  # fmt: skip
    assert main(args) == 0
    record = _record(out)
    assert record["impact_tolerance"] == 0.05 and record["chosen"] == _impact(built, 0.05)["chosen"]
    assert f"impact tolerance 0.05: chose sparsity {record['chosen']:g}" in capsys.readouterr().out
    # Without --impact-tolerance: S exactly (the greedy), never the solidify default 0.01 as a bound.
    assert _record(built / "direct.lz")["allocation"] == "greedy" and "impact_tolerance" not in _record(
        built / "direct.lz"
    )
    # From the profile: the same levels measured (on --activation-calibration's request).
    from layerzero.compile import compile_model
    from layerzero.options import CompileOptions

    options = CompileOptions(activation_sparsity=0.9, activation_impact_tolerance=0.05, verify=False,
                             activation_calibration=built / "calibration.npz", profile=built / "p.json")  # fmt: skip
    profiled = compile_model(built / "m.onnx", options).activation_sparsity
    assert profiled["calibration_source"] == "profile" and "deviation measured on" in profiled["calibration"]
    assert profiled["chosen"] == record["chosen"]
    np.testing.assert_allclose(np.asarray(profiled["curve"]), np.asarray(record["curve"]), rtol=1e-4)
    # A bad tolerance is one line, exit 2.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # argparse's own range check
        main([*args[:7], "-1", *args[8:]])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_profile_of_an_activation_sparse_bundle_measures_impact_without_its_groups(built: Path, tmp_path: Path) -> None:
    """A plain profile (impact sampled) of a bundle compiled with --activation-sparsity: its groups are counted but
    not forced off (before: the force-off variant fed And() an int64 kept count and did not load)."""
    from layerzero.cli import main

    out = tmp_path / "s.json"
    assert main(["profile", str(built / "direct.lz"), "--data", str(built / "requests.npz"), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    groups = {p["path"] for p in doc["paths"] if p["kind"] == "activation"}
    assert groups == {f"model.layers.{i}.{k}" for i in range(LAYERS) for k in KINDS}
