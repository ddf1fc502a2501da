"""Bundle write/read: round trip, atomicity, overwrite and protect rules, external data, clear errors."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper
import onnx.parser
import onnx_ir as ir
import pytest

import layerzero
from layerzero.errors import InvalidInputError
from layerzero.runtime import bundle as bundle_mod
from layerzero.runtime.bundle import (
    BUNDLE_FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MODEL_NAME,
    read_bundle,
    sha256_file,
    write_bundle,
)

BIG_ELEMENTS = 80 * 1024  # float32: 320 KiB
SMALL_THRESHOLD = 64 * 1024


def _model(n: int = 4) -> onnx.ModelProto:
    """y = x + w, with w a float32[n] initializer."""
    model = onnx.parser.parse_model(
        f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[{n}] x) => (float[{n}] y) {{
            y = Add(x, w)
        }}
        """
    )
    w = np.arange(n, dtype=np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(w, "w"))
    onnx.checker.check_model(model)
    return model


def _manifest() -> dict:
    return {
        "target": "onnxruntime",
        "source": {"path": "/abs/in.onnx", "sha256": "0" * 64},
        "options": {"assume_finite": True},
        "stats": {"nodes_before": 3, "nodes_after": 1, "params_before": 100, "params_after": 77},
        "layers": {"total": 4, "zeroed": ["layers.1"]},
        "removed": [{"scope": "layers.1", "kind": "declared-flag", "params": 23, "nodes": 2}],
        "verification": {"passed": True},
    }


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_round_trip_fills_format_fields(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "m.lz", _model(), _manifest())
    assert out == tmp_path / "m.lz"
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, MODEL_NAME]

    b = read_bundle(out)
    assert b.path == out
    assert b.model_path == out / MODEL_NAME
    assert b.manifest["format"] == BUNDLE_FORMAT
    assert b.manifest["format_version"] == FORMAT_VERSION
    assert b.manifest["model_file"] == MODEL_NAME
    assert b.manifest["layerzero_version"] == layerzero.__version__
    assert b.manifest["layers"] == {"total": 4, "zeroed": ["layers.1"]}
    assert b.external_data_paths == []
    loaded = onnx.load(b.model_path)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(loaded.graph.initializer[0]), np.arange(4))
    assert _leftovers(tmp_path, "m.lz") == []


def test_onnx_ir_model_round_trip(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "m.lz", ir.from_proto(_model()), {})
    loaded = onnx.load(read_bundle(out).model_path)
    assert [i.name for i in loaded.graph.initializer] == ["w"]


def test_failure_during_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_save(proto, f, *args, **kwargs):
        Path(f).write_bytes(b"partial")  # a half-written file, then the disk fills up
        raise OSError("No space left on device")

    monkeypatch.setattr(onnx, "save_model", broken_save)
    with pytest.raises(InvalidInputError, match="No space"):
        write_bundle(tmp_path / "m.lz", _model(), _manifest())
    assert list(tmp_path.iterdir()) == []


def test_failure_while_overwriting_keeps_old_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = write_bundle(tmp_path / "m.lz", _model(), {"tag": "old"})

    def broken_fsync(fd: int) -> None:
        raise OSError("I/O error")

    monkeypatch.setattr(bundle_mod.os, "fsync", broken_fsync)
    with pytest.raises(InvalidInputError, match="I/O error"):
        write_bundle(out, _model(8), {"tag": "new"}, overwrite=True)
    assert read_bundle(out).manifest["tag"] == "old"
    assert _leftovers(tmp_path, "m.lz") == []


def test_failed_swap_restores_old_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = write_bundle(tmp_path / "m.lz", _model(), {"tag": "old"})
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".m.lz.tmp-"):  # moving the new bundle in fails
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(bundle_mod.os, "rename", rename)
    with pytest.raises(InvalidInputError, match="rename failed"):
        write_bundle(out, _model(8), {"tag": "new"}, overwrite=True)
    assert read_bundle(out).manifest["tag"] == "old"
    assert _leftovers(tmp_path, "m.lz") == []


def test_unserialisable_manifest_is_rejected_before_writing(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="JSON"):
        write_bundle(tmp_path / "m.lz", _model(), {"bad": object()})
    with pytest.raises(InvalidInputError, match="leave both fields out"):
        write_bundle(tmp_path / "m.lz", _model(), {"format_version": FORMAT_VERSION + 1})
    with pytest.raises(InvalidInputError, match="plain file name"):
        write_bundle(tmp_path / "m.lz", _model(), {"model_file": "../escape.onnx"})
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_without_flag(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "m.lz", _model(), {"tag": "old"})
    with pytest.raises(InvalidInputError, match=r"m\.lz already exists"):
        write_bundle(out, _model(), {"tag": "new"})
    assert read_bundle(out).manifest["tag"] == "old"


def test_overwrite_replaces_bundle(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "m.lz", _model(), {"tag": "old"})
    (out / "stale.txt").write_text("from the old bundle")
    write_bundle(out, _model(8), {"tag": "new"}, overwrite=True)
    assert read_bundle(out).manifest["tag"] == "new"
    assert not (out / "stale.txt").exists()
    assert _leftovers(tmp_path, "m.lz") == []


def test_overwrite_never_deletes_a_non_bundle(tmp_path: Path) -> None:
    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(InvalidInputError, match="not a LayerZero bundle"):
        write_bundle(precious, _model(), {}, overwrite=True)
    assert (precious / "thesis.tex").exists()

    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(InvalidInputError, match="not a directory"):
        write_bundle(a_file, _model(), {}, overwrite=True)
    assert a_file.read_text() == "x"


def test_protect_input_paths(tmp_path: Path) -> None:
    src = tmp_path / "in.onnx"
    onnx.save_model(_model(), src)
    with pytest.raises(InvalidInputError, match="over the input"):
        write_bundle(src, _model(), {}, overwrite=True, protect=[src])
    with pytest.raises(InvalidInputError, match="contains the input"):
        write_bundle(tmp_path, _model(), {}, overwrite=True, protect=[src])
    assert onnx.load(src).graph.node[0].op_type == "Add"


def _big_model() -> onnx.ModelProto:
    model = _model(BIG_ELEMENTS)
    # A small tensor that must stay inside model.onnx (< 1 KiB).
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(4, np.float32), "small"))
    return model


def test_external_data_for_big_weights(tmp_path: Path) -> None:
    model = _big_model()
    out = write_bundle(tmp_path / "m.lz", model, {}, external_threshold_bytes=SMALL_THRESHOLD)
    data = out / f"{MODEL_NAME}.data"
    assert data.stat().st_size >= BIG_ELEMENTS * 4
    assert (out / MODEL_NAME).stat().st_size < 4096
    b = read_bundle(out)
    assert b.external_data_paths == [data]
    header = onnx.load(b.model_path, load_external_data=False)
    external = {t.name for t in header.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert external == {"w"}
    # The caller's proto still holds its weights (onnx.save_model would have stripped them).
    assert model.graph.initializer[0].data_location == onnx.TensorProto.DEFAULT
    assert len(model.graph.initializer[0].raw_data) == BIG_ELEMENTS * 4
    full = onnx.load(b.model_path)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(full.graph.initializer[0]), np.arange(BIG_ELEMENTS))


def test_small_model_stays_in_one_file(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "m.lz", _big_model(), {})  # default threshold: 256 MiB
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, MODEL_NAME]


def test_onnx_ir_model_with_external_source_is_self_contained(tmp_path: Path) -> None:
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = src_dir / "in.onnx"
    onnx.save_model(_big_model(), src, save_as_external_data=True, location="in.onnx.data")
    model = ir.load(src)
    out = write_bundle(tmp_path / "m.lz", model, {})  # under the threshold: weights inlined
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, MODEL_NAME]
    assert isinstance(model.graph.initializers["w"].const_value, ir.ExternalTensor)  # model unchanged
    (src_dir / "in.onnx.data").unlink()
    full = onnx.load(read_bundle(out).model_path)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(full.graph.initializer[0]), np.arange(BIG_ELEMENTS))


def test_proto_with_unloaded_external_data_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "in.onnx"
    onnx.save_model(_big_model(), src, save_as_external_data=True, location="in.onnx.data")
    header = onnx.load(src, load_external_data=False)
    with pytest.raises(InvalidInputError, match=r"'w'.*external data"):
        write_bundle(tmp_path / "m.lz", header, {})
    assert not (tmp_path / "m.lz").exists()


def test_missing_or_truncated_external_data_is_a_clear_error(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "m.lz", _big_model(), {}, external_threshold_bytes=SMALL_THRESHOLD)
    data = out / f"{MODEL_NAME}.data"
    with open(data, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(InvalidInputError, match="truncated"):
        read_bundle(out)
    data.unlink()
    with pytest.raises(InvalidInputError, match=r"external data file model\.onnx\.data .* is missing"):
        read_bundle(out)


def test_read_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="does not exist"):
        read_bundle(tmp_path / "nope.lz")

    onnx_file = tmp_path / "in.onnx"
    onnx.save_model(_model(), onnx_file)
    with pytest.raises(InvalidInputError, match=r"did you pass the \.onnx file.*layerzero compile"):
        read_bundle(onnx_file)

    empty = tmp_path / "empty.lz"
    empty.mkdir()
    with pytest.raises(InvalidInputError, match=r"manifest\.json is missing"):
        read_bundle(empty)

    out = write_bundle(tmp_path / "m.lz", _model(), {})
    manifest_path = out / MANIFEST_NAME
    good = json.loads(manifest_path.read_text())

    manifest_path.write_text("{not json")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        read_bundle(out)

    manifest_path.write_text(json.dumps({**good, "format": "something-else"}))
    with pytest.raises(InvalidInputError, match="format is 'something-else'"):
        read_bundle(out)

    manifest_path.write_text(json.dumps({**good, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(InvalidInputError, match=r"newer LayerZero.*upgrade"):
        read_bundle(out)

    manifest_path.write_text(json.dumps({**good, "model_file": "../in.onnx"}))
    with pytest.raises(InvalidInputError, match="plain file name"):
        read_bundle(out)

    manifest_path.write_text(json.dumps(good))
    (out / MODEL_NAME).unlink()
    with pytest.raises(InvalidInputError, match=r"model file model\.onnx is missing"):
        read_bundle(out)


def test_external_data_outside_bundle_is_refused(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "m.lz", _big_model(), {}, external_threshold_bytes=SMALL_THRESHOLD)
    header = onnx.load(out / MODEL_NAME, load_external_data=False)
    for entry in header.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../elsewhere.data"
    onnx.save_model(header, out / MODEL_NAME)
    (tmp_path / "elsewhere.data").write_bytes(os.urandom(16))
    with pytest.raises(InvalidInputError, match="outside the model's directory"):
        read_bundle(out)


def test_sha256_file(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    payload = os.urandom(3 * 1024 * 1024 + 17)  # spans several 1 MiB chunks
    f.write_bytes(payload)
    assert sha256_file(f) == hashlib.sha256(payload).hexdigest()
