"""The decode loop's per-step work outside ONNX Runtime (issue 22, "decode that uses the cores").

- ``Report.add_dynamic``: one reduction per mask instead of one per subpath (a decode step of the bench's
  Qwen3-MoE-style model, 8 layers x 32 experts, made 256 numpy calls: ~2 ms of a ~26 ms step on this machine); it
  must give the same skipped paths and parameters as the per-column rule it replaces, on every mask shape.
- the IO-bound steps' run options carry ``gpu_graph_id`` so ONNX Runtime's per-run lookup of it does not raise and
  catch a C++ exception (~140 µs a step measured here).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from layerzero.runtime.generate import _step_run_options
from layerzero.runtime.report import Report

PREFIX = "layerzero::mask::"


def _dynamic(experts: int) -> list[dict]:
    return [
        {"mask_output": f"{PREFIX}l{i}", "path": f"l{i}", "subpaths": [f"l{i}.e{j}" for j in range(experts)],
         "params": [1000 + 10 * i + j for j in range(experts)]}
        for i in range(3)
    ] + [{"mask_output": f"{PREFIX}single", "path": "single", "subpaths": ["single.ffn"], "params": [7]}]  # fmt: skip


def _reference(outputs: dict[str, np.ndarray], dynamic: list[dict]) -> tuple[list[str], int]:
    """The per-subpath rule: a subpath is skipped when its mask column is all zero and not empty."""
    skipped, params = [], 0
    for entry in dynamic:
        array = outputs[entry["mask_output"]]
        for j, sub in enumerate(entry["subpaths"]):
            column = array if len(entry["subpaths"]) == 1 else array[..., j]
            if column.size and not column.any():
                skipped.append(sub)
                params += entry["params"][j]
    return skipped, params


@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (2, 5), (0,), (3,)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_add_dynamic_matches_the_per_subpath_rule(shape: tuple[int, ...], seed: int) -> None:
    rng = np.random.default_rng(seed)
    experts = 32
    dynamic = _dynamic(experts)
    outputs = {e["mask_output"]: rng.random((*shape, experts)) > 0.85 for e in dynamic[:-1]}
    outputs[f"{PREFIX}single"] = rng.random(shape) > 0.5
    outputs[f"{PREFIX}l1"][..., 5] = False  # an expert that runs for no token
    report = Report(params_before=10**6)
    report.add_dynamic(outputs, dynamic, mask_prefix=PREFIX, router_prefix="layerzero::router::")
    skipped, params = _reference(outputs, dynamic)
    assert report.skipped_paths == skipped
    assert report.skipped_params == params
    if np.prod(shape):
        assert "l1.e5" in report.skipped_paths
    else:
        assert report.skipped_paths == []  # an empty mask is no evidence


def test_decode_steps_run_options_name_the_graph_id() -> None:
    base = ort.RunOptions()
    base.log_severity_level = 4
    options = _step_run_options(base)
    assert options.get_run_config_entry("gpu_graph_id") == "-1"  # present: no exception raised per run
    assert options.log_severity_level == 4
    with pytest.raises(RuntimeError):  # what ONNX Runtime hits on every run with the backend's own options
        base.get_run_config_entry("gpu_graph_id")
