"""Recognise mixture-of-experts blocks in the shapes real exports take, as parts with variants.

- ``walk``: backward matching over producers, the shared checks, one commute helper;
- ``router``: scores, top-k, normalisation, the routing matrix; one file per router variant in ``routers/``
  (``ROUTER_VARIANTS``: a new variant is one part file and one row);
- ``experts``: the per-expert FFN (gate/up fused or not), with ``gating`` (the gated units: activation, swiglu)
  and ``projections`` (the projection variants and their biases);
- ``combine``: how expert outputs are combined, one matcher per block shape (``FORMS``: rules as data);
- ``blocks``: the search from each router, the block check, and the refusals with their reasons.

Every check that fails raises ``NoMatch`` saying which (``passes/_match.py``, the passes' one failure
vocabulary); the attempt that got furthest is the reason a router is no block, recorded as a ``Refusal`` of
kind ``"moe"``.
"""

from __future__ import annotations

from layerzero.passes._match import NoMatch, Refusal
from layerzero.passes._moe.blocks import MoEMatch, find_moe_blocks
from layerzero.passes._moe.router import Router, match_router

__all__ = ["MoEMatch", "NoMatch", "Refusal", "Router", "find_moe_blocks", "match_router"]
