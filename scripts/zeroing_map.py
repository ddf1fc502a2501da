"""Draw docs/zeroing_map.png: the zeroing map of a real profile of the example MoE model.

    python scripts/zeroing_map.py [--out docs/zeroing_map.png] [--html map.html] [--keep DIR]

The model: ``layerzero.models.moe`` with 4 layers of 8 experts (top-2, residual). Some experts get a
router bias (the builder's ``never_routed`` knob, NEVER_ROUTED_BIAS, set per layer here): -100 means never
routed, a few units below zero means rarely. It is compiled, profiled on 64 requests of 4-32 random tokens
(impact on 8), and the profile is drawn with ``layerzero report``. Needs matplotlib (the ``report`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from layerzero.calibration import profile_bundle
from layerzero.compile import compile_file
from layerzero.models.moe import NEVER_ROUTED_BIAS, MoEConfig, build_moe
from layerzero.report_map import write_report

CONFIG = MoEConfig(hidden=32, ffn=64, experts=8, top_k=2, layers=4, residual=True, seed=7)
#: layer -> {expert: router bias}; the rest 0.
BIASES = {
    0: {7: NEVER_ROUTED_BIAS},
    1: {2: -1.5, 5: NEVER_ROUTED_BIAS},
    2: {0: -2.0, 4: -4.0},
    3: {3: NEVER_ROUTED_BIAS, 6: NEVER_ROUTED_BIAS, 1: -3.0},
}
REQUESTS = 64
IMPACT_SAMPLES = 8


def example_model() -> onnx.ModelProto:
    model = build_moe(CONFIG)
    for init in model.graph.initializer:
        for layer, biases in BIASES.items():
            if init.name == f"{CONFIG.path(layer)}.gate.bias":
                bias = numpy_helper.to_array(init).copy()
                for expert, value in biases.items():
                    bias[expert] = value
                init.CopyFrom(numpy_helper.from_array(bias, init.name))
    return model


def example_traffic(requests: int = REQUESTS, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"hidden": rng.standard_normal((int(rng.integers(4, 33)), CONFIG.hidden), dtype=np.float32)}
        for _ in range(requests)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=root / "docs" / "zeroing_map.png")
    parser.add_argument("--html", type=Path, help="also write the HTML report here")
    parser.add_argument("--keep", type=Path, help="keep model.onnx, model.lz and profile.json in this directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="layerzero-map-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        onnx.save(example_model(), work / "model.onnx")
        compile_file(work / "model.onnx", work / "model.lz", overwrite=True)
        doc = profile_bundle(work / "model.lz", example_traffic(), impact_samples=IMPACT_SAMPLES, data="example")
        doc["bundle"]["path"] = "moe-example.lz"  # the picture names no temp dir
        (work / "profile.json").write_text(json.dumps(doc, indent=1))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_report(doc, args.out)
        print(f"wrote {args.out}")
        if args.html:
            write_report(doc, args.html)
            print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
