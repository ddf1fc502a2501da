"""liblayerzero_ort.so's source stamp: CMake compiles the same stamp of the sources into the library that
``plugins/ort_library.py`` computes from them, and layerzero refuses a library built from other sources before it
registers it for a model (a stale build ignores attributes it does not know, e.g. a bundle's ``code_layout``)."""

from __future__ import annotations

import onnxruntime as ort
import pytest

from layerzero.plugins import ort_library
from layerzero.plugins.loader import PluginError


def test_the_library_carries_the_stamp_of_its_sources(ort_lib):
    stamp = ort_library.source_stamp()
    assert stamp is not None and len(stamp) == 16
    assert ort_library.library_stamp(ort_lib) == stamp
    ort_library.check_fresh(ort_lib)  # no error


def test_the_stamp_is_read_from_the_file_not_a_loaded_image(ort_lib, tmp_path):
    # A process that checked a stale build, then rebuilt it at the same path, must see the rebuild: the stamp comes
    # from the file's bytes (a dlopen of the same path would return the image loaded first).
    import ctypes

    stamp = ort_library.source_stamp()
    copy = tmp_path / ort_library.ORT_LIBRARY
    data = ort_lib.read_bytes()
    copy.write_bytes(data)
    fn = ctypes.CDLL(str(copy)).LayerZeroOrtSourceStamp  # loaded (and kept mapped) under this path
    fn.restype = ctypes.c_char_p
    assert fn().decode() == stamp == ort_library.library_stamp(copy)
    marker = b"layerzero-ort-source-stamp:" + stamp.encode()
    assert data.count(marker) == 1
    copy.unlink()
    copy.write_bytes(data.replace(marker, b"layerzero-ort-source-stamp:0123456789abcdef"))  # "rebuilt"
    assert ort_library.library_stamp(copy) == "0123456789abcdef"
    assert fn().decode() == stamp  # the loaded image is still the first build's


def test_a_library_from_other_sources_is_refused_in_one_line(ort_lib, monkeypatch):
    monkeypatch.delenv("LAYERZERO_ORT_ANY_BUILD", raising=False)
    monkeypatch.setattr(ort_library, "source_stamp", lambda: "0123456789abcdef")
    with pytest.raises(PluginError) as info:
        ort_library.register(ort.SessionOptions(), [str(ort_lib)])
    text = str(info.value)
    assert "\n" not in text and str(ort_lib) in text and "0123456789abcdef" in text
    assert "rebuild it with `layerzero plugins build`" in text
    # The A/B switch lets any build through.
    monkeypatch.setenv("LAYERZERO_ORT_ANY_BUILD", "1")
    assert ort_library.register(ort.SessionOptions(), [str(ort_lib)]) == [ort_lib]


def test_a_library_without_a_stamp_reads_as_none(tmp_path):
    not_a_library = tmp_path / "liblayerzero_ort.so"
    not_a_library.write_bytes(b"\x7fELF not really")
    assert ort_library.library_stamp(not_a_library) is None


def test_a_stale_library_counts_as_not_built_where_it_is_optional(ort_lib, tmp_path, monkeypatch, caplog):
    # The demo / the auto lowering ask find_ort_library; a build from other sources must not make them fail later
    # at registration: it is passed over (a warning), and a bundle that needs it still gets the one-line reason.
    monkeypatch.delenv("LAYERZERO_ORT_ANY_BUILD", raising=False)
    monkeypatch.setattr(ort_library, "source_stamp", lambda: "0123456789abcdef")
    monkeypatch.setattr(ort_library, "default_build_dir", lambda: tmp_path / "none")
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(ort_lib.parent))
    with caplog.at_level("WARNING", logger=ort_library.__name__):
        assert ort_library.find_ort_library() is None
    assert "0123456789abcdef" in caplog.text and "it is not used" in caplog.text
    with pytest.raises(PluginError) as info:
        ort_library.ort_library_path()
    assert "rebuild it with `layerzero plugins build`" in str(info.value) and "\n" not in str(info.value)
    monkeypatch.setattr(ort_library, "source_stamp", lambda: ort_library.library_stamp(ort_lib))
    assert ort_library.find_ort_library() == ort_lib.parent / ort_library.ORT_LIBRARY
