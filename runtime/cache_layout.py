"""The KV cache of a ``layerzero export`` model as the decode loops see it: each ``past_key_values.N.key/value``
input, the ``present.N.key/value`` output fed back as it, and the ``[batch, heads, past, dim]`` shape of each
(``cache_layout`` reads them from the model's inputs; ``generate``, the batcher and ``Engine.run`` build empty pasts
and cache buffers with it)."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import numpy as np

from layerzero.errors import UnsupportedModelError

if TYPE_CHECKING:
    from layerzero.runtime.engine import Engine

__all__ = ["CacheLayout", "cache_layout"]

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    names: list[tuple[str, str]]  # (past input, present output) per tensor, in layer order
    dtype: np.dtype
    # (heads, dim) of each past input: [batch, kv_heads, past, head_dim] in most families; MLA's compressed cache
    # (DeepSeek-V3) keeps keys [batch, 1, past, kv_lora_rank] and values [batch, 1, past, qk_rope_head_dim].
    shapes: dict[str, tuple[int, int]]

    def zeros(self, name: str, batch: int, length: int = 0) -> np.ndarray:
        """A zero ``[batch, heads, length, dim]`` array for past input ``name``."""
        heads, dim = self.shapes[name]
        return np.zeros((batch, heads, length, dim), dtype=self.dtype)

    def empty(self, batch: int) -> dict[str, np.ndarray]:
        """An empty past (length 0) for every past input: a prefill's."""
        return {p: self.zeros(p, batch) for p, _ in self.names}


def cache_layout(engine: Engine) -> CacheLayout | None:
    specs = {s.name: s for s in engine.input_specs}
    for name in ("input_ids", "attention_mask", "position_ids"):
        if name not in specs:
            raise UnsupportedModelError(
                f"{engine.model_path}: no {name!r} input; generate needs a model written by `layerzero export` "
                f"(its inputs are {', '.join(specs)})"
            )
    if "logits" not in engine.output_names:
        raise UnsupportedModelError(f"{engine.model_path}: no 'logits' output (outputs: {engine.output_names})")
    past = sorted(((int(m[1]), m[2], n) for n in specs if (m := _PAST.match(n))), key=lambda t: (t[0], t[1] != "key"))
    if not past:
        return None
    names, outputs, shapes = [], set(engine.output_names), {}
    for layer, kind, name in past:
        present = f"present.{layer}.{kind}"
        if present not in outputs:
            raise UnsupportedModelError(f"{engine.model_path}: input {name!r} has no {present!r} output")
        names.append((name, present))
        spec = specs[name]
        shape = spec.shape or ()
        if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            raise UnsupportedModelError(
                f"{engine.model_path}: {spec.name!r} should be [batch, kv_heads, past, head_dim] with static heads "
                f"and head_dim, it is {spec.describe()}"
            )
        shapes[name] = (shape[1], shape[3])
    dtypes = {specs[n].dtype for n, _ in names}
    if len(dtypes) != 1:
        differ = ", ".join(sorted(map(str, dtypes)))
        raise UnsupportedModelError(f"{engine.model_path}: the past inputs differ in dtype ({differ})")
    return CacheLayout(names, specs[past[0][2]].dtype, shapes)
