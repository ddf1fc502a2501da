"""The decode loop's per-step work outside ONNX Runtime (issue 22, "decode that uses the cores").

- ``Report.add_dynamic``: one reduction per mask instead of one per subpath (a decode step of the bench's
  Qwen3-MoE-style model, 8 layers x 32 experts, made 256 numpy calls: ~2 ms of a ~26 ms step on this machine); it
  must give the same skipped paths and parameters as the per-column rule it replaces, on every mask shape.
- the IO-bound steps' run options carry ``gpu_graph_id`` so ONNX Runtime's per-run lookup of it does not raise and
  catch a C++ exception (~140 µs a step measured here).
- ``StepSkips``: the bound steps' skipped paths in one reduction over all of a MoE's masks (~14 µs against
  ``result_from``'s ~94 µs for 8 layers x 32 experts, measured here); the same paths as ``add_dynamic``.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from layerzero.runtime.generate import _step_run_options
from layerzero.runtime.report import Report, StepSkips, index_dynamic

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


@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (2, 5), (0,), (3,)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_skips_matches_add_dynamic(shape: tuple[int, ...], seed: int) -> None:
    # The decode loop's one-reduction form (StepSkips) gives add_dynamic's paths, in its order, and the masks.
    rng = np.random.default_rng(seed)
    dynamic = _dynamic(32)[:-1]  # a MoE's layers: every mask routes 32 subpaths
    names = ["logits", *(e["mask_output"] for e in dynamic), "layerzero::router::l0"]
    outputs = {e["mask_output"]: rng.random((*shape, 32)) > 0.85 for e in dynamic}
    outputs[f"{PREFIX}l2"][..., 7] = False
    skips = StepSkips(names, index_dynamic(dynamic), PREFIX)
    assert skips.applies
    report = Report()
    report.add_dynamic(outputs, dynamic, mask_prefix=PREFIX, router_prefix="layerzero::router::", keep_masks=True)
    found = skips(outputs)
    assert found is not None
    assert found[0] == report.skipped_paths
    assert ("l2.e7" in found[0]) == bool(np.prod(shape))
    assert found[1].keys() == report.masks.keys()
    assert all(np.array_equal(found[1][k], report.masks[k]) for k in found[1])
    # The decode loop's deferred form: the masks copied side by side now, the paths found later from the copy.
    side = skips.side(outputs)
    assert side is not None and side.shape == (*shape, 32 * len(dynamic))
    for mask in outputs.values():  # the step's outputs overwritten by the next one: the copy keeps this step's
        mask[...] = True
    later = skips.from_side(side)
    assert later[0] == found[0]
    assert all(np.array_equal(later[1][k], found[1][k]) for k in found[1])


def test_step_skips_declines_what_it_cannot_vectorize() -> None:
    index = index_dynamic(_dynamic(4))  # the last entry has one subpath: the whole report decides
    names = list(index)
    assert not StepSkips(names, index, PREFIX).applies
    assert StepSkips(names, index, PREFIX)({n: np.zeros((1, 4), bool) for n in names}) is None
    assert not StepSkips([f"{PREFIX}unknown"], index, PREFIX).applies  # a mask without a manifest entry
    assert not StepSkips(["logits"], index, PREFIX).applies  # no masks at all
    moe = names[:-1]
    skips = StepSkips(moe, index, PREFIX)
    assert skips.applies
    ragged = {moe[0]: np.ones((1, 4), bool), moe[1]: np.ones((2, 4), bool), moe[2]: np.ones((1, 4), bool)}
    assert skips(ragged) is None  # masks of different shapes: not one reduction
    assert skips({n: np.ones((1, 5), bool) for n in moe}) is None  # a width other than the manifest's
    assert skips.side(ragged) is None and skips.side({n: np.ones((1, 5), bool) for n in moe}) is None
    assert StepSkips(names, index, PREFIX).side({n: np.zeros((1, 4), bool) for n in names}) is None
