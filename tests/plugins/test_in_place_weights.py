"""The weights liblayerzero_ort.so's kernels read in place come to them in anonymous huge pages, not the file mapping.

``runtime/backends/_in_place.py``: the ONNX Runtime backend reads the external initializers an ``ai.layerzero`` node
consumes into 2 MiB-aligned anonymous memory and lends them with ``add_initializer`` (no copy); ``mmap_weights=True``
keeps ONNX Runtime's mapping of the data file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from layerzero.runtime import Engine
from layerzero.runtime.backends._in_place import in_place_weights

from .test_ort_native import moe_model


def _with_dense(model: onnx.ModelProto, hidden: int) -> onnx.ModelProto:
    """The MoE model with a MatMul on its output (a weight ONNX Runtime's own kernel pre-packs: not ours to move)."""
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((hidden, hidden)).astype(np.float32), "w_o")
    g = model.graph
    g.initializer.append(w)
    g.node.append(helper.make_node("MatMul", ["y", "w_o"], ["z"], name="o_proj"))
    g.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["T", hidden]))
    return model


@pytest.fixture
def moe_file(tmp_path, ort_lib, monkeypatch) -> Path:
    monkeypatch.setenv("LAYERZERO_PLUGIN_DIR", str(ort_lib.parent))
    model, _ = moe_model(8, 512, 512, top_k=2, normalize=1)
    path = tmp_path / "m.onnx"
    onnx.save(_with_dense(model, 512), path, save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    return path


def test_only_our_ops_external_weights_are_read(moe_file):
    lent = in_place_weights(moe_file)
    assert sorted(lent) == ["w_down", "w_gate", "w_up"]  # not the MatMul's w_o
    for name, array in lent.items():
        assert array.ctypes.data % (2 << 20) == 0, f"{name} does not start on a 2 MiB boundary"
    data = {t.name: t for t in onnx.load(str(moe_file)).graph.initializer}
    for name, array in lent.items():
        np.testing.assert_array_equal(array, numpy_helper.to_array(data[name]))


def test_a_model_without_our_ops_lends_nothing(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])
    w = numpy_helper.from_array(np.ones((256, 256), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    path = tmp_path / "d.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), path,
              save_as_external_data=True, location="d.onnx.data", size_threshold=0)  # fmt: skip
    assert in_place_weights(path) == {}


def test_outputs_equal_with_and_without_the_mapping(moe_file):
    rng = np.random.default_rng(0)
    feeds = {"hidden": rng.standard_normal((5, 512)).astype(np.float32),
             "logits": rng.standard_normal((5, 8)).astype(np.float32)}  # fmt: skip
    lent = Engine.load(moe_file, intra_op_num_threads=1).run(feeds)
    mapped = Engine.load(moe_file, intra_op_num_threads=1, mmap_weights=True).run(feeds)
    assert list(lent.outputs) == ["y", "mask", "z"]
    for a, b in zip(lent.outputs.values(), mapped.outputs.values(), strict=True):
        np.testing.assert_array_equal(a, b)


def _memory_after_load(path: Path, **options: object) -> dict[str, int]:
    script = textwrap.dedent(
        f"""
        import json, re, numpy as np
        from layerzero.runtime import Engine
        def kb(field, text):
            return int(re.search(field + r":\\s+(\\d+) kB", text).group(1)) * 1024
        e = Engine.load({str(path)!r}, intra_op_num_threads=1, **{options!r})
        e.run({{"hidden": np.ones((64, 512), np.float32), "logits": np.random.rand(64, 8).astype(np.float32)}})
        rollup = open("/proc/self/smaps_rollup").read()
        print(json.dumps({{"huge": kb("AnonHugePages", rollup), "file": kb("Rss_File", rollup)
                           if "Rss_File" in rollup else kb("RssFile", open("/proc/self/status").read())}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_experts_live_in_huge_pages_not_in_the_file_mapping(moe_file):
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine (/sys/kernel/mm/transparent_hugepage/enabled)")
    experts = sum(a.nbytes for a in in_place_weights(moe_file).values())  # 3 x 8 MB
    lent = _memory_after_load(moe_file)
    mapped = _memory_after_load(moe_file, mmap_weights=True)
    assert lent["huge"] >= 0.9 * experts, f"{lent['huge'] >> 20} MB of huge pages for {experts >> 20} MB of experts"
    # Mapped, a 64-token run touches every expert's pages in the file; lent, none of them.
    assert mapped["file"] - lent["file"] >= 0.9 * experts, (lent, mapped)
