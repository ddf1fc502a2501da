"""Complex-valued rotary embeddings rewritten as real arithmetic for the export (DeepSeek-V2, Llama 4).

transformers computes these families' RoPE as a complex product: the rotary module returns ``freqs_cis =
polar(1, positions · inv_freq) · scaling`` (complex64 [batch, seq, dim / 2]) and ``apply_rotary_emb`` views each
(even, odd) pair of q / k as a complex number and multiplies. Neither torch.onnx exporter has complex tensors
("No decompositions registered for the complex-valued input"), so the export failed for both families.

:func:`real_rotary` swaps, for the duration of the export only, the rotary modules' ``forward`` for one returning
the same numbers as a real tensor [batch, seq, dim / 2, 2] (cos, sin) · scaling, and the modeling module's
``apply_rotary_emb`` for the product written out, ``(a + ib)(c + is) = (ac − bs) + i(as + bc)``, which is what
the complex product computes. Everything is restored on exit (the swap is process-wide: the modeling module is
shared with every other user of transformers in the process).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

__all__ = ["real_rotary"]

#: Modeling module → the axis of q / k where ``apply_rotary_emb`` broadcasts the [batch, seq, dim / 2] rotation:
#: DeepSeek-V2's q_pe / k_pe are [batch, heads, seq, dim] (``freqs_cis.unsqueeze(1)``), Llama 4's q / k
#: [batch, seq, heads, dim] (``freqs_cis[:, :, None, :]``).
_HEADS_AXIS = {
    "transformers.models.deepseek_v2.modeling_deepseek_v2": 1,
    "transformers.models.llama4.modeling_llama4": 2,
}


def _rotary_forward(torch: Any, scaled: Any) -> Any:
    """The rotary module's ``forward``, returning (cos, sin) · scaling as a trailing axis of 2."""

    def forward(self: Any, x: Any, position_ids: Any) -> Any:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        return torch.stack([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling

    return scaled(forward) if scaled is not None else forward


def _apply_rotary(torch: Any, axis: int) -> Any:
    def apply_rotary_emb(xq: Any, xk: Any, freqs_cis: Any) -> tuple[Any, Any]:
        cos, sin = freqs_cis[..., 0].unsqueeze(axis), freqs_cis[..., 1].unsqueeze(axis)

        def rotate(x: Any) -> Any:
            pairs = x.float().reshape(*x.shape[:-1], -1, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

        return rotate(xq), rotate(xk)

    return apply_rotary_emb


def _complex_rotaries(torch: Any, model: Any) -> list[Any]:
    """The model's rotary modules whose output is complex (probed on one position)."""
    found = []
    for module in model.modules():
        if not type(module).__name__.endswith("RotaryEmbedding") or not hasattr(module, "inv_freq"):
            continue
        try:
            with torch.no_grad():
                probe = module(torch.zeros(1, 1, 1), torch.zeros(1, 1, dtype=torch.int64))
        except Exception:  # a rotary module of another signature: not one this rewrite knows
            continue
        if torch.is_tensor(probe) and probe.is_complex():
            found.append(module)
    return found


@contextlib.contextmanager
def real_rotary(torch: Any, model: Any) -> Iterator[bool]:
    """Within the block, ``model``'s complex rotary embeddings compute in real arithmetic (yields whether any
    was rewritten). A model whose complex rotary lives in a modeling module this does not know is left as it is
    (the exporter then names the complex input, as before)."""
    modules = _complex_rotaries(torch, model)
    where = type(modules[0]).__module__ if modules else ""  # the model's own class may be export's subclass
    modeling, axis = sys.modules.get(where), _HEADS_AXIS.get(where)
    if not modules or modeling is None or axis is None or not hasattr(modeling, "apply_rotary_emb"):
        yield False
        return
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update as scaled
    except ImportError:  # an older transformers: default RoPE only
        scaled = None
    original = modeling.apply_rotary_emb
    forward = _rotary_forward(torch, scaled)
    modeling.apply_rotary_emb = _apply_rotary(torch, axis)
    for module in modules:
        module.forward = types.MethodType(forward, module)
    try:
        yield True
    finally:
        modeling.apply_rotary_emb = original
        for module in modules:
            del module.forward
