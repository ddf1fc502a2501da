"""Write the group-mask example next to this file: model.onnx (a 4-block transformer) and router.onnx.

python examples/groups/build.py
layerzero compile examples/groups/model.onnx -o routed.lz --groups examples/groups/spec.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx

from layerzero.models.routed_groups import build_routed_example

HERE = Path(__file__).resolve().parent


def main(out: Path = HERE) -> int:
    model, router, _spec = build_routed_example()
    onnx.save_model(model, out / "model.onnx")
    onnx.save_model(router, out / "router.onnx")
    print(f"wrote {out / 'model.onnx'} and {out / 'router.onnx'}; the spec is {out / 'spec.yaml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(Path(a) for a in sys.argv[1:])))
