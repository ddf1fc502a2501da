"""Files: nothing the user did not name as the output is replaced; writes are atomic under concurrency; stale
temp dirs of dead processes are cleaned; permissions follow the umask; bundles are fingerprinted; symlinks out of
a bundle are refused."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from layerzero.errors import InvalidInputError
from layerzero.models import TransformerConfig, build_transformer
from layerzero.runtime import Engine
from layerzero.runtime.bundle import MANIFEST_NAME, MODEL_NAME, read_bundle, write_bundle


def _copy_bundle(tiny: SimpleNamespace, tmp_path: Path) -> Path:
    out = tmp_path / "copy.lz"
    shutil.copytree(tiny.bundle, out)
    return out


def _snapshot(path: Path) -> bytes:
    return path.read_bytes()


# ------------------------------------------------------------------------------------------ output paths


def test_compile_refuses_an_existing_file_and_unwritable_places(tiny: SimpleNamespace, helpers: SimpleNamespace,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    precious = tmp_path / "notes.txt"
    precious.write_text("mine")
    # --force would not replace it (it replaces only a bundle LayerZero wrote): neither message suggests it.
    for force in ((), ("--force",)):
        helpers.one_line(
            helpers.run_cli("compile", tiny.source, "-o", precious, *force),
            "exists and is a file that is not a LayerZero bundle",
            "--force replaces only a bundle LayerZero wrote",
        )
    assert precious.read_text() == "mine"
    helpers.one_line(helpers.run_cli("compile", tiny.source, "-o", "/proc/x.lz", "--no-verify"), "/proc/x.lz")
    helpers.one_line(helpers.run_cli("compile", tiny.source, "-o", tiny.source, "--force"), "input")


def test_run_save_never_replaces_what_is_not_its_output(tiny: SimpleNamespace, helpers: SimpleNamespace,
                                                         tmp_path: Path) -> None:  # fmt: skip
    source_bytes, model_bytes = _snapshot(tiny.source), _snapshot(tiny.bundle / MODEL_NAME)
    ids = "input_ids=1,2,3"
    for target in (tiny.source, tiny.bundle / MODEL_NAME, tiny.bundle / MANIFEST_NAME):
        for force in ((), ("--force",)):
            result = helpers.run_cli("run", tiny.bundle, "--input", ids, "--save", target, *force)
            helpers.one_line(result, "--save")
    assert _snapshot(tiny.source) == source_bytes and _snapshot(tiny.bundle / MODEL_NAME) == model_bytes

    other = tmp_path / "data.npz"
    np.savez(other, something=np.zeros(3))
    helpers.one_line(helpers.run_cli("run", tiny.bundle, "--input", ids, "--save", other), "--force")
    assert list(np.load(other).files) == ["something"]
    helpers.one_line(helpers.run_cli("run", tiny.bundle, "--input", ids, "--save", tmp_path), "directory")
    helpers.one_line(helpers.run_cli("run", tiny.bundle, "--input", ids, "--save", "/proc/out.npz"), "--save")

    out = tmp_path / "out.npz"
    assert helpers.run_cli("run", tiny.bundle, "--input", ids, "--save", out).code == 0
    first = dict(np.load(out))
    assert helpers.run_cli("run", tiny.bundle, "--input", "input_ids=4,5", "--save", out).code == 0  # its own: replaced
    assert np.load(out)["logits"].shape != first["logits"].shape
    assert helpers.run_cli("run", tiny.bundle, "--input", ids, "--save", other, "--force").code == 0
    assert list(np.load(other).files) == ["logits"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_profile_and_report_outputs(tiny: SimpleNamespace, helpers: SimpleNamespace, tmp_path: Path) -> None:
    data = tmp_path / "calib.npz"
    np.savez(data, input_ids=np.random.default_rng(0).integers(0, 64, size=(3, 1, 5)))
    source_bytes = _snapshot(tiny.source)
    for target in (tiny.source, tiny.bundle / MODEL_NAME, data):
        helpers.one_line(helpers.run_cli("profile", tiny.bundle, "--data", data, "-o", target, "--force"), "-o")
    assert _snapshot(tiny.source) == source_bytes
    helpers.one_line(helpers.run_cli("profile", tiny.bundle, "--data", data, "-o", tmp_path), "directory")
    helpers.one_line(helpers.run_cli("profile", tiny.bundle, "--data", data, "-o", "/proc/p.json"), "-o")
    foreign = tmp_path / "config.json"
    foreign.write_text('{"mine": 1}')
    helpers.one_line(helpers.run_cli("profile", tiny.bundle, "--data", data, "-o", foreign), "not a LayerZero profile")

    profile = tmp_path / "profile.json"
    assert helpers.run_cli("profile", tiny.bundle, "--data", data, "-o", profile, "--impact-samples", "0").code == 0
    assert helpers.run_cli("profile", tiny.bundle, "--data", data, "-o", profile, "--impact-samples", "0").code == 0

    page = tmp_path / "index.html"
    page.write_text("<html>someone's page</html>")
    helpers.one_line(helpers.run_cli("report", profile, "-o", page), "not a LayerZero report")
    assert page.read_text() == "<html>someone's page</html>"
    mine = tmp_path / "map.html"
    assert helpers.run_cli("report", profile, "-o", mine).code == 0
    assert helpers.run_cli("report", profile, "-o", mine).code == 0  # its own report: replaced without --force
    png = tmp_path / "map.png"
    assert helpers.run_cli("report", profile, "-o", png).code == 0
    assert helpers.run_cli("report", profile, "-o", png).code == 0
    assert helpers.run_cli("report", profile, "-o", page, "--force").code == 0


def test_report_refuses_its_own_input(tiny: SimpleNamespace, helpers: SimpleNamespace, tmp_path: Path) -> None:
    profile = tmp_path / "p.html"  # a profile that happens to be named .html
    profile.write_text(json.dumps({"format": "layerzero-profile", "version": 1, "paths": []}))
    helpers.one_line(helpers.run_cli("report", profile, "-o", profile, "--force"), "input")


def test_triton_export_never_replaces_a_foreign_model(tiny: SimpleNamespace, helpers: SimpleNamespace,
                                                      tmp_path: Path) -> None:  # fmt: skip
    repo = tmp_path / "repo"
    (repo / "layerzero" / "1").mkdir(parents=True)
    (repo / "layerzero" / "config.pbtxt").write_text('name: "layerzero"\n')
    for force in ((), ("--force",)):
        helpers.one_line(helpers.run_cli("triton-export", tiny.bundle, repo, "--no-reference", *force), "layerzero")
    assert (repo / "layerzero" / "config.pbtxt").read_text() == 'name: "layerzero"\n'
    assert helpers.run_cli("triton-export", tiny.bundle, repo, "--no-reference", "--name", "lz").code == 0
    assert helpers.run_cli("triton-export", tiny.bundle, repo, "--no-reference", "--name", "lz", "--force").code == 0
    assert sorted(p.name for p in repo.iterdir()) == ["layerzero", "lz", "lz_onnx"]
    a_file = tmp_path / "repo-file"
    a_file.write_text("x")
    helpers.one_line(helpers.run_cli("triton-export", tiny.bundle, a_file, "--no-reference"), "not a directory")
    helpers.one_line(helpers.run_cli("triton-export", tiny.bundle, "/proc/repo", "--no-reference"), "/proc/repo")


# ------------------------------------------------------------------------------------ atomic, concurrent


def _small_model(width: int) -> onnx.ModelProto:
    return build_transformer(TransformerConfig(hidden=width, num_layers=1, num_heads=2, ffn=16, vocab_size=32))


def test_concurrent_overwrites_of_one_bundle(tmp_path: Path) -> None:
    out = tmp_path / "m.lz"
    write_bundle(out, _small_model(8), {"writer": -1})
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for _ in range(3):
                write_bundle(out, _small_model(8), {"writer": i}, overwrite=True)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert read_bundle(out).manifest["writer"] in range(8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.lz"]  # no .old-*, no .tmp-*


def test_concurrent_compile_force_processes(tiny: SimpleNamespace, tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "c.lz"
    command = [sys.executable, "-m", "layerzero", "compile", str(tiny.source), "-o", str(out), "--force",
               "--no-verify"]  # fmt: skip
    processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(4)]
    for p in processes:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    Engine.load(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.lz"]


def test_stale_temp_dirs_of_dead_processes_are_cleaned(tiny: SimpleNamespace, helpers: SimpleNamespace,
                                                       tmp_path: Path) -> None:  # fmt: skip
    import tempfile

    dead, alive = helpers.dead_pid(), os.getpid()
    stale = [tmp_path / f".out.lz.tmp-{dead}-abc", tmp_path / f".out.lz.old-{dead}-abc",
             Path(tempfile.gettempdir()) / f"layerzero-verify-{dead}-xyz"]  # fmt: skip
    live = [tmp_path / f".out.lz.tmp-{alive}-abc", Path(tempfile.gettempdir()) / f"layerzero-verify-{alive}-xyz"]
    other = tmp_path / ".other.lz.tmp-1-abc"  # another output's: not this compile's business
    for d in [*stale, *live, other]:
        d.mkdir()
        (d / "model.onnx").write_bytes(b"x" * 1000)
    try:
        assert helpers.run_cli("compile", tiny.source, "-o", tmp_path / "out.lz", "--no-verify").code == 0
        assert not any(d.exists() for d in stale)
        assert all(d.exists() for d in live) and other.exists()
    finally:
        for d in [*stale, *live, other]:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o755), (0o077, 0o700), (0o002, 0o775)])
def test_bundle_permissions_follow_the_umask(umask: int, mode: int, tmp_path: Path) -> None:
    old = os.umask(umask)
    try:
        out = write_bundle(tmp_path / "m.lz", _small_model(8), {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert stat.S_IMODE((out / MODEL_NAME).stat().st_mode) == mode & 0o666


# ----------------------------------------------------------------------------------------- integrity


def test_a_replaced_model_is_refused(tiny: SimpleNamespace, tmp_path: Path) -> None:
    bundle = _copy_bundle(tiny, tmp_path)
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    assert len(manifest["integrity"][MODEL_NAME]["sha256"]) == 64
    onnx.save(build_transformer(TransformerConfig(hidden=32, num_layers=2, num_heads=2, ffn=64)),
              str(bundle / MODEL_NAME))  # fmt: skip
    with pytest.raises(InvalidInputError, match="not the file this bundle was compiled with"):
        Engine.load(bundle)


def test_tampered_external_data_is_refused(tmp_path: Path) -> None:
    out = write_bundle(tmp_path / "m.lz", _small_model(16), {}, external_threshold_bytes=0)
    data = out / (MODEL_NAME + ".data")
    assert data.is_file()
    entry = json.loads((out / MANIFEST_NAME).read_text())["integrity"][data.name]
    assert entry["size"] == data.stat().st_size and len(entry["sampled_sha256"]) == 64
    read_bundle(out, full_check=True)
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF  # the first block is always sampled
    data.write_bytes(bytes(raw))
    with pytest.raises(InvalidInputError, match="sampled fingerprint"):
        read_bundle(out)
    raw[0] ^= 0xFF
    middle = len(raw) // 2 + 3  # most likely between sampled blocks of a larger file; the full check sees it
    raw[middle] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(InvalidInputError, match=data.name):
        read_bundle(out, full_check=True)
    data.write_bytes(bytes(raw[:-1]))
    with pytest.raises(InvalidInputError, match="bytes"):
        read_bundle(out)


def test_symlinks_out_of_the_bundle_are_refused(tiny: SimpleNamespace, tmp_path: Path, helpers) -> None:
    bundle = _copy_bundle(tiny, tmp_path)
    outside = tmp_path / "outside.onnx"
    shutil.move(bundle / MODEL_NAME, outside)
    (bundle / MODEL_NAME).symlink_to(outside)
    with pytest.raises(InvalidInputError, match="outside the bundle"):
        Engine.load(bundle)
    helpers.one_line(helpers.run_cli("run", bundle, "--input", "input_ids=1,2"), "outside the bundle")
    (bundle / MODEL_NAME).unlink()
    inside = bundle / "weights" / "graph.onnx"
    inside.parent.mkdir()
    shutil.move(outside, inside)
    (bundle / MODEL_NAME).symlink_to(inside)  # a link inside the bundle is fine
    Engine.load(bundle)


@pytest.mark.parametrize("manifest", ["[1, 2]", '"text"', "null", '{"format": ["layerzero-bundle"]}', "{" * 5000])
def test_malformed_manifests(manifest: str, tiny: SimpleNamespace, tmp_path: Path, helpers) -> None:
    bundle = _copy_bundle(tiny, tmp_path)
    (bundle / MANIFEST_NAME).write_text(manifest)
    for verb in (["run", bundle, "--input", "input_ids=1,2"], ["triton-export", bundle, tmp_path / "repo"],
                 ["serve", bundle, "--port-http", "1", "--port-grpc", "2"]):  # fmt: skip
        helpers.one_line(helpers.run_cli(*verb), "manifest.json")


def test_integrity_section_itself_malformed(tiny: SimpleNamespace, tmp_path: Path) -> None:
    bundle = _copy_bundle(tiny, tmp_path)
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    for bad in ([1], {"../../etc/passwd": {"size": 1}}, {MODEL_NAME: "abc"}):
        manifest["integrity"] = bad
        (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(InvalidInputError):
            read_bundle(bundle)


def test_a_bundle_without_a_fingerprint_is_refused_naming_the_fix(tiny: SimpleNamespace, tmp_path: Path,
                                                                  helpers: SimpleNamespace) -> None:  # fmt: skip
    # An old bundle (no integrity section): nothing says its model.onnx is the one its manifest describes.
    bundle = _copy_bundle(tiny, tmp_path)
    manifest = json.loads((bundle / MANIFEST_NAME).read_text())
    del manifest["integrity"]
    (bundle / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(InvalidInputError, match=r"no integrity fingerprint.*layerzero compile .* --force"):
        Engine.load(bundle)
    helpers.one_line(helpers.run_cli("run", bundle, "--input", "input_ids=1,2"), "no integrity fingerprint",
                     "--force")  # fmt: skip
    # Recompiling over it (the fix the message names) writes a bundle that loads.
    code = helpers.run_cli("compile", tiny.source, "-o", bundle, "--force", "--no-verify").code
    assert code == 0
    assert "integrity" in json.loads((bundle / MANIFEST_NAME).read_text())
    Engine.load(bundle)
