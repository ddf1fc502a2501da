"""Hand-made traffic whose profile is known: a MoE whose expert 3 is never routed and whose expert 2 only
picks the first token of odd requests; its bundle and its profile, shared by the feedback tests.

Tests reach the helpers through the ``fb`` fixture (``from conftest import`` clashes with sibling folders'
conftest modules, see tests/passes/conftest.py) and the case through ``moe_case``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from layerzero.calibration import profile_bundle
from layerzero.compile import compile_file
from layerzero.models.moe import MoEConfig, build_moe, moe_layer_weights
from layerzero.options import CompileOptions

CONFIG = MoEConfig(hidden=16, ffn=32, experts=4, top_k=2, never_routed=(3,), form="dense")
PATH = "layers.0.moe"
TOKENS = (3, 5, 2, 4, 6, 1)  # tokens of each request
IMPACT_SAMPLES = 4


def router_weight() -> np.ndarray:
    """Expert 0 reads feature 1, expert 1 feature 2, expert 2 is 20 x feature 0 (the switch), expert 3 nothing
    (its bias is NEVER_ROUTED_BIAS)."""
    w = np.zeros((CONFIG.experts, CONFIG.hidden), np.float32)
    w[0, 1], w[1, 2], w[2, 0] = 1.0, 1.0, 20.0
    return w


def designed_moe(config: MoEConfig = CONFIG) -> onnx.ModelProto:
    model = build_moe(config)
    for init in model.graph.initializer:
        if init.name == f"{PATH}.gate.weight":
            init.CopyFrom(numpy_helper.from_array(router_weight(), init.name))
    return model


def designed_traffic() -> list[dict[str, np.ndarray]]:
    """Feature 0 is -1 everywhere but +1 on the first token of odd requests: only there expert 2's logit (20)
    beats experts 0 and 1 (standard normal features); expert 3 (bias -100) never does."""
    rng = np.random.default_rng(0)
    requests = []
    for r, tokens in enumerate(TOKENS):
        x = rng.standard_normal((tokens, CONFIG.hidden), dtype=np.float32)
        x[:, 0] = -1.0
        if r % 2:
            x[0, 0] = 1.0
        requests.append({"hidden": x})
    return requests


def expected_masks(requests: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    """[T, E] bool per request: the top-2 experts of each token, by numpy."""
    bias = moe_layer_weights(CONFIG, 0)["router_bias"]
    masks = []
    for feeds in requests:
        logits = feeds["hidden"].astype(np.float64) @ router_weight().T.astype(np.float64) + bias
        top = np.argsort(-logits, axis=-1, kind="stable")[:, : CONFIG.top_k]
        mask = np.zeros(logits.shape, bool)
        np.put_along_axis(mask, top, True, axis=-1)
        masks.append(mask)
    return masks


@dataclasses.dataclass
class MoECase:
    root: Path
    model: Path
    bundle: Path
    data: Path  # a directory of .npz files, one request each
    requests: list[dict[str, np.ndarray]]
    profile: Path
    doc: dict


@pytest.fixture(scope="session")
def moe_case(tmp_path_factory: pytest.TempPathFactory) -> MoECase:
    root = tmp_path_factory.mktemp("feedback")
    onnx.save(designed_moe(), root / "model.onnx")
    # The per-expert `If` lowering pinned: the tests read its nodes and open plain sessions on the bundle.
    compile_file(root / "model.onnx", root / "model.lz", CompileOptions(moe_lowering="if"))
    requests = designed_traffic()
    data = root / "requests"
    data.mkdir()
    for r, feeds in enumerate(requests):
        np.savez(data / f"{r:03d}.npz", **feeds)
    doc = profile_bundle(root / "model.lz", requests, impact_samples=IMPACT_SAMPLES, data=str(data))
    (root / "profile.json").write_text(json.dumps(doc))
    return MoECase(root, root / "model.onnx", root / "model.lz", data, requests, root / "profile.json", doc)


def record(doc: dict, path: str) -> dict:
    return next(p for p in doc["paths"] if p["path"] == path)


@pytest.fixture(scope="session")
def fb() -> SimpleNamespace:
    return SimpleNamespace(
        CONFIG=CONFIG,
        PATH=PATH,
        TOKENS=TOKENS,
        IMPACT_SAMPLES=IMPACT_SAMPLES,
        designed_moe=designed_moe,
        designed_traffic=designed_traffic,
        expected_masks=expected_masks,
        record=record,
    )
