"""The cache buffers of ``--weights int4 --linear-kernel native`` bundles (``CACHE_BUFFER_META_KEY``): the compile
marks the bundle and reads the past's length from the mask; ``Engine.generate`` then binds one buffer per past /
present pair, and every step writes only its new rows. Greedy ids equal the copying loop's (``LAYERZERO_KV_BUFFER=0``)
for one prompt, for a left-padded batch, through the direct and the public IO binding; the buffers really are
what the session wrote (not a copy); a bundle without the mark keeps the copying loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from layerzero.cli import main
from layerzero.contract import CACHE_BUFFER_META_KEY
from layerzero.runtime import generate as gen
from layerzero.runtime.engine import Engine
from tests.passes.test_native_attention import _export
from tests.plugins.native_build import build_ort_test_library

PROMPT = [3, 17, 42, 8, 99, 5, 61]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> tuple[Path, Path]:
    """(int4 native bundle, int4 MatMulNBits bundle) of a tiny grouped-query Llama."""
    lib = build_ort_test_library()
    tmp = tmp_path_factory.mktemp("kvbuf")
    export = _export(tmp, 2, "dynamo")
    mp = pytest.MonkeyPatch()
    mp.setenv("LAYERZERO_PLUGIN_DIR", str(lib.parent))
    native, plain = tmp / "native.lz", tmp / "plain.lz"
    assert main(["compile", str(export), "-o", str(native), "--weights", "int4", "--linear-kernel", "native"]) == 0
    assert main(["compile", str(export), "-o", str(plain), "--weights", "int4", "--no-verify"]) == 0
    yield native, plain
    mp.undo()


def _meta(bundle: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(bundle / "model.onnx", load_external_data=False).metadata_props}


def _generate(engine: Engine, prompt, monkeypatch, buffers: bool, new: int = 24):
    monkeypatch.setenv("LAYERZERO_KV_BUFFER", "1" if buffers else "0")
    seen: list[gen._BoundSteps] = []
    real = gen._BoundSteps

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(gen, "_BoundSteps", spy)
    out = engine.generate(prompt, max_new_tokens=new, stop_tokens=())
    monkeypatch.setattr(gen, "_BoundSteps", real)
    assert len(seen) == 1
    return out, seen[0]


def test_native_bundle_is_marked_and_reads_the_past_length_from_the_mask(bundles):
    native, plain = bundles
    assert _meta(native).get(CACHE_BUFFER_META_KEY) == "1" and CACHE_BUFFER_META_KEY not in _meta(plain)
    graph = onnx.load(native / "model.onnx", load_external_data=False).graph
    pasts = {i.name for i in graph.input if i.name.startswith("past_key_values.")}
    for node in graph.node:
        if node.op_type == "Shape" and set(node.input) & pasts:
            attrs = {a.name: a.i for a in node.attribute}
            assert not attrs.get("start", 0) <= 2 < attrs.get("end", 4), node.name  # no read of the past's length


@pytest.mark.parametrize("threads", [1, 2])
def test_buffers_give_the_copying_loops_ids(bundles, monkeypatch, threads):
    native, _ = bundles
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(build_ort_test_library().parent))
    engine = Engine.load(native, intra_op_num_threads=threads)
    with_buffers, steps = _generate(engine, PROMPT, monkeypatch, True)
    assert steps._buffers and all(a.shape[2] == len(PROMPT) + 24 for a in steps._buffers.values())
    copying, plain_steps = _generate(engine, PROMPT, monkeypatch, False)
    assert not plain_steps._buffers
    assert with_buffers.ids == copying.ids and len(with_buffers.ids) == 24
    # The session wrote into the numpy buffers themselves: the first 7 + 23 rows in use, the last row never fed.
    k0 = steps._buffers["past_key_values.0.key"]
    assert np.abs(k0[:, :, : len(PROMPT) + 23]).min(axis=-1).max() > 0 and not k0[:, :, -1].any()
    one, _ = _generate(engine, PROMPT[:1], monkeypatch, True, new=6)  # a 1-token prompt: a mask of 1 key first
    assert one.ids == _generate(engine, PROMPT[:1], monkeypatch, False, new=6)[0].ids
    batch = [PROMPT[:3], PROMPT, PROMPT[2:6]]  # left-padded rows of three lengths
    a, _ = _generate(engine, batch, monkeypatch, True, new=10)
    b, _ = _generate(engine, batch, monkeypatch, False, new=10)
    assert [g.ids for g in a] == [g.ids for g in b]


def test_public_binding_with_buffers(bundles, monkeypatch):
    native, _ = bundles
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(build_ort_test_library().parent))
    engine = Engine.load(native)
    direct, _ = _generate(engine, PROMPT, monkeypatch, True)
    monkeypatch.setattr(gen, "_direct_binding", lambda session, binding: None)
    public, steps = _generate(engine, PROMPT, monkeypatch, True)
    assert steps._buffers and public.ids == direct.ids


def test_unmarked_bundle_keeps_the_copying_loop(bundles, monkeypatch):
    _, plain = bundles
    _, steps = _generate(Engine.load(plain), PROMPT, monkeypatch, True, new=4)
    assert not steps._buffers
