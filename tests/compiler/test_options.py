"""CompileOptions checks itself when built: one-line InvalidInputError naming the option."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from layerzero.errors import InvalidInputError
from layerzero.options import MOE_LOWERINGS, CompileOptions


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"assume_finite": 1}, r"option assume_finite: expected True or False, got 1"),
        ({"verify": "no"}, r"option verify: expected True or False"),
        ({"dynamic": None}, r"option dynamic: expected True or False"),
        ({"max_iterations": 0}, r"option max_iterations: must be >= 1, got 0"),
        ({"max_iterations": True}, r"option max_iterations: expected an integer >= 1, got True"),
        ({"max_iterations": 2.5}, r"option max_iterations: expected an integer"),
        ({"fold_max_elements": -1}, r"option fold_max_elements: must be >= 0"),
        ({"seed": -3}, r"option seed: must be >= 0"),
        ({"chunked_verify_bytes": 0}, r"option chunked_verify_bytes: must be >= 1"),
        ({"stability_window": 0}, r"option stability_window: must be >= 1"),
        ({"atol": math.nan}, r"option atol: must be a finite number >= 0, got nan"),
        ({"rtol": -1e-3}, r"option rtol: must be a finite number >= 0"),
        ({"rtol": "0.1"}, r"option rtol: expected a number >= 0, got '0.1'"),
        ({"zeroing_threshold": math.inf}, r"option zeroing_threshold: must be a finite number >= 0, got inf"),
        ({"max_deviation": -1.0}, r"option max_deviation: must be a finite number >= 0"),
        ({"impact_tolerance": math.nan}, r"option impact_tolerance: must be a finite number"),
        ({"target": "trt"}, r"option target: 'trt' is not one of onnxruntime, tensorrt"),
        ({"moe_lowering": "ortmoe"}, r"option moe_lowering: 'ortmoe' is not one of auto, if, ort-moe"),
        ({"stability_unit": "token"}, r"option stability_unit: 'token' is not one of requests, tokens"),
        ({"flag_pattern": ""}, r"option flag_pattern: expected a non-empty pattern"),
        ({"groups": 3}, r"option groups: expected a file path, got int"),
        ({"profile": 1.5}, r"option profile: expected a file path, got float"),
        ({"sample_inputs": ["a.npz"]}, r"option sample_inputs: expected a file path, got list"),
        ({"shapes": [("x", (1, 2))]}, r"option shapes: expected a dict"),
        ({"shapes": {"x": (1, -2)}}, r"option shapes\['x'\]: expected integer dims >= 0"),
        ({"shapes": {"x": 4}}, r"option shapes\['x'\]: expected a sequence, got int"),
        ({"solidify": "layers.0.moe.experts.1"}, r"option solidify: expected a sequence of subpath names"),
        ({"solidify": (1, 2)}, r"option solidify: expected a sequence of subpath names"),
    ],
)
def test_a_bad_option_is_named(changes: dict, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message) as info:
        CompileOptions(**changes)
    assert "\n" not in str(info.value)


def test_replace_is_checked_too() -> None:
    with pytest.raises(InvalidInputError, match="option target"):
        dataclasses.replace(CompileOptions(), target="tpu")


def test_good_values_are_normalised() -> None:
    options = CompileOptions(
        atol=1,
        seed=np.int64(7),
        shapes={"x": [np.int64(2), 3]},
        groups="spec.yaml",
        solidify=["a.b"],
        max_deviation=0,
    )
    assert options.atol == 1.0 and isinstance(options.atol, float)
    assert options.seed == 7 and type(options.seed) is int
    assert options.shapes == {"x": (2, 3)}
    assert options.groups == Path("spec.yaml")
    assert options.solidify == ("a.b",)
    assert options.max_deviation == 0.0
    assert options.to_dict()["groups"] == "spec.yaml"
    assert CompileOptions().to_dict() == CompileOptions(**dataclasses.asdict(CompileOptions())).to_dict()


def test_moe_lowerings_agree_with_the_pass() -> None:
    from layerzero.passes.lower_moe import LOWERINGS

    assert tuple(LOWERINGS) == MOE_LOWERINGS
