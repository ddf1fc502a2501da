"""The graph contract: every name a compiled graph shares with the runtime, serving and the profiler.

A leaf module (standard library only): passes, the compiler, the runtime and serving import these names from
here, so each exists once.

- A dynamic pass (MoE expert skipping, gated branches, group masks) makes its skip decision a graph output
  ``layerzero::mask::<path>`` (one mechanism, no side channel: ``docs/architecture.md``) and records one
  ``DynamicPath`` in the model metadata ``layerzero.dynamic`` (a JSON list); the compiler copies that list into
  the bundle manifest's ``dynamic`` section, the runtime reads it to turn masks into the per-request report.
  Mask layout: shape ``[..., len(subpaths)]`` (``[T, E]`` for a MoE block: token × expert), or ``[...]`` when
  there is one subpath (a gate: ``[T]`` or ``[]``; a group: ``[]``). True / nonzero = that subpath RUNS.
- ``layerzero::router::<path>`` (optional), shape ``[T]``: each token's top-1 routing probability.
- ``layerzero::threshold``: a float32 scalar graph input whose initializer holds the compiled zeroing
  threshold, so the runtime (the guard's back-off) can change it per request without recompiling.
- ``layerzero::activation_scale`` (``passes/sparsify_activations.py``): a float32 scalar graph input, initialised
  to 1, that multiplies every calibrated activation threshold (0 = dense, the A/B switch); one input of its own,
  not ``layerzero::threshold``, whose compiled default is 0 (exact) and whose unit is a router weight.
- The force-off variant (``passes/force_off.py``, run by the profiler): one bool input
  ``layerzero::force_off::<path>`` per path (True = off) and one output ``layerzero::block::<path>``.
- ``ai.layerzero::MoE``: the MoE pass's target-independent skipping form, which each target lowers; its input
  and attribute layout is ``passes/_moe_node.py`` (``MoENode``).
- Reserved: a model to compile may not have a graph input or output starting with ``layerzero::`` nor a metadata
  key of ``RESERVED_META_KEYS`` (``reserved_name_problem``: refused at load, exit 2); any other name a pass adds is
  made unique (``passes/_builder.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

__all__ = [
    "ACTIVATION_SCALE_INPUT",
    "ATTENTION_OP",
    "BLOCK_PREFIX",
    "CACHE_BUFFER_META_KEY",
    "DYNAMIC_META_KEY",
    "FORCE_OFF_PREFIX",
    "MASK_PREFIX",
    "MOE_DOMAIN",
    "MOE_OP",
    "QLINEAR_OP",
    "REFUSED_META_KEY",
    "RESERVED_META_KEYS",
    "ROUTER_PREFIX",
    "RUNTIME_PREFIX",
    "SOLIDIFIED_META_KEY",
    "SPARSE_LINEAR_CODE_LAYOUT",
    "SPARSE_LINEAR_OP",
    "THRESHOLD_INPUT",
    "DynamicPath",
    "is_runtime_output",
    "reserved_name_problem",
]

#: Every graph input / output the compiler adds for the runtime starts with this; none is the user's.
RUNTIME_PREFIX = "layerzero::"
#: Skip-mask graph outputs: ``layerzero::mask::<path>``.
MASK_PREFIX = RUNTIME_PREFIX + "mask::"
#: Routing-confidence graph outputs: ``layerzero::router::<path>``.
ROUTER_PREFIX = RUNTIME_PREFIX + "router::"
#: The run-time zeroing threshold (graph input with an initializer; ONNX Runtime lists it as overridable).
THRESHOLD_INPUT = RUNTIME_PREFIX + "threshold"
#: The run-time multiplier of the activation-sparsity thresholds (graph input with an initializer, default 1).
ACTIVATION_SCALE_INPUT = RUNTIME_PREFIX + "activation_scale"
#: The force-off variant's graph inputs, one per dynamic path.
FORCE_OFF_PREFIX = RUNTIME_PREFIX + "force_off::"
#: The force-off variant's graph outputs, one per dynamic path: the value the path writes.
BLOCK_PREFIX = RUNTIME_PREFIX + "block::"
#: Model metadata key of the dynamic paths (a JSON list of ``DynamicPath.to_dict()``).
DYNAMIC_META_KEY = "layerzero.dynamic"
#: Model metadata key of the gated branches found but not made dynamic (JSON list of path, kind, reason).
REFUSED_META_KEY = "layerzero.dynamic.refused"
#: Model metadata key, "1" when every past input may be a cache buffer longer than the rows in use (the attention
#: op writes the new rows where the mask ends; ``passes/native_attention.py``): the generate loop then binds one
#: buffer as each layer's past and present, and nothing copies the cache a step.
CACHE_BUFFER_META_KEY = "layerzero.kv_cache_buffer"
#: Model metadata key of the paths solidification removed (JSON list of subpath, path, kind, params).
SOLIDIFIED_META_KEY = "layerzero.solidified"
#: The metadata keys the passes keep their records in: a model that already has one is refused (issue 20).
RESERVED_META_KEYS = (DYNAMIC_META_KEY, REFUSED_META_KEY, SOLIDIFIED_META_KEY)
#: The skipping form ``ai.layerzero::MoE`` that the targets' lowerings replace.
MOE_DOMAIN = "ai.layerzero"
MOE_OP = "MoE"
#: The activation-sparse linear ``ai.layerzero::SparseLinear`` (``passes/sparsify_activations.py``'s native form).
SPARSE_LINEAR_OP = "SparseLinear"
#: The dense quantized linear ``ai.layerzero::QLinear`` (``passes/native_linear.py``, ``--linear-kernel native``).
QLINEAR_OP = "QLinear"
#: The attention core ``ai.layerzero::Attention`` (``passes/native_attention.py``, ``--linear-kernel native``).
ATTENTION_OP = "Attention"
#: The layout of SparseLinear's q8 / q4 codes (attribute ``code_layout``): 2 = column tiles of 8192, each q4 row's
#: whole 64-byte chunks 4x4-transposed (``plugins/quant.py`` ``quantize_k_blocks``; 1 was the same with tiles of
#: 2048). liblayerzero_ort.so refuses another value (a bundle compiled with an older layout gives a one-line error,
#: never wrong numbers).
SPARSE_LINEAR_CODE_LAYOUT = 2


def is_runtime_output(name: str) -> bool:
    """Whether a graph output is the runtime's (a mask or a router output), not the user's."""
    return name.startswith((MASK_PREFIX, ROUTER_PREFIX))


def reserved_name_problem(inputs: Iterable[str], outputs: Iterable[str], metadata_keys: Iterable[str]) -> str | None:
    """Why a model to compile cannot keep its names (None when it can): a graph input or output named with
    ``RUNTIME_PREFIX`` (the runtime would take it for its own: a mask, the threshold), or a metadata key the passes
    keep their records in (``RESERVED_META_KEYS``). Every other name a pass adds is made unique instead."""
    for where, names in (("input", inputs), ("output", outputs)):
        for name in names:
            if name.startswith(RUNTIME_PREFIX):
                return (
                    f"the model's {where} {name!r} uses the prefix {RUNTIME_PREFIX!r}, which LayerZero reserves for "
                    "the inputs and outputs it adds (masks, the threshold); rename it"
                )
    for key in metadata_keys:
        if key in RESERVED_META_KEYS:
            return (
                f"the model's metadata key {key!r} is where LayerZero records its dynamic paths (a model LayerZero "
                "compiled already? compile the original); rename or remove it"
            )
    return None


@dataclasses.dataclass(frozen=True)
class DynamicPath:
    """One dynamic path of a compiled model, as recorded in its metadata and the bundle manifest."""

    path: str  # e.g. "model.layers.0.mlp"
    kind: str  # "moe" | "gate" | "group"
    subpaths: tuple[str, ...]  # e.g. ("model.layers.0.mlp.experts.0", ...), one per mask's last axis
    params: tuple[int, ...]  # parameters each subpath touches when it runs
    mask_output: str
    router_output: str | None = None
    detail: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["subpaths"] = list(self.subpaths)
        out["params"] = list(self.params)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DynamicPath:
        return cls(
            path=d["path"],
            kind=d["kind"],
            subpaths=tuple(d["subpaths"]),
            params=tuple(int(p) for p in d["params"]),
            mask_output=d["mask_output"],
            router_output=d.get("router_output"),
            detail=dict(d.get("detail") or {}),
        )
