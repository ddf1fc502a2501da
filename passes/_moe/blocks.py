"""Find MoE blocks: from each router, the nodes that may combine the experts, each form tried in turn.

A candidate is a router (``router.match_router``). Downstream of it the search collects the nodes that may
combine the experts' outputs (``combination_ends``), tries the forms ``combine.FORMS`` lists for each, and
checks the block (``check_block``): no intermediate value read outside it, weight shapes and dtypes that
fit. A router that is no block becomes a ``Refusal`` (``passes/_match.py``, kind ``"moe"``) naming the block's
scope, the node where the furthest attempt (``furthest``: of every form tried at every end) failed, and the
check that failed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from layerzero.passes._graph import common_scope, scope_of
from layerzero.passes._match import Refusal, furthest
from layerzero.passes._moe.combine import FORMS
from layerzero.passes._moe.router import Router, match_router, router_candidate, sparsemixer_head
from layerzero.passes._moe.walk import STD, NoMatch, Walk, label, need, static_dim

__all__ = ["MoEMatch", "Refusal", "find_moe_blocks"]


@dataclasses.dataclass
class MoEMatch:
    path: str
    form: str  # a name of combine.FORMS: "batched_mm" | "dense" | "unrolled" | "sorted" | "input_scaled"
    router: Router
    hidden: ir.Value  # [T, H]
    output: ir.Value  # [T, H]: what the block's consumers read
    normalize: int
    activation: str
    w_gate: np.ndarray  # [E, F, H]
    w_up: np.ndarray  # [E, F, H]
    w_down: np.ndarray  # [E, H, F]
    nodes: list[ir.Node]  # the experts' nodes (router excluded), dead once ``output`` is replaced
    # The expert part's variants (experts.ExpertFFN): biases [E, F] / [E, F] / [E, H] (None: none) and
    # swiglu_oai's parameters.
    b_gate: np.ndarray | None = None
    b_up: np.ndarray | None = None
    b_down: np.ndarray | None = None
    activation_alpha: float = 1.702
    activation_limit: float = 7.0
    # Llama 4 (form "input_scaled", top-1): the expert reads its token scaled by the routing weight, ``y_t =
    # expert_e(sigmoid(l_te) · x_t)``. The skipping form computes it as ``MoE(x · sigmoid(max_e l_te))`` with
    # the chosen expert's weight 1 (softmax scores, ``normalize``: the top-1 probability over itself).
    input_scale: bool = False

    @property
    def experts(self) -> int:
        return int(self.w_gate.shape[0])

    @property
    def params_per_expert(self) -> list[int]:
        arrays = (self.w_gate, self.w_up, self.w_down, self.b_gate, self.b_up, self.b_down)
        per_expert = sum(int(np.prod(a.shape[1:], dtype=np.int64)) for a in arrays if a is not None)
        return [per_expert] * self.experts


def combination_ends(router: Router, depth: int | None = None) -> list[ir.Node]:
    """Nodes downstream of the router that may combine the experts' outputs, nearest first, within ``depth``
    hops (12; 16 from a router that builds its own routing matrix, Llama 4, whose experts' sum lies 13 hops
    past it in a TorchScript export)."""
    if depth is None:
        depth = 12 if router.matrix is None else 16
    seen: set[ir.Node] = set()
    frontier = [router.values, router.indices, *([router.matrix] if router.matrix is not None else [])]
    ends: list[ir.Node] = []
    for _ in range(depth):
        nxt = []
        for value in frontier:
            for user, _ in value.uses():
                if user in seen or user.domain not in STD:
                    continue
                seen.add(user)
                nxt.extend(user.outputs)
                if user.op_type == "ReduceSum" and router.values in user.inputs:
                    continue  # the renormalisation's sum
                if user.op_type in ("ReduceSum", "Einsum", "ScatterND"):
                    ends.append(user)
                elif user.op_type in ("Add", "Sum"):
                    # Every Add of the chain, outermost first: the last one may be a residual connection.
                    chain = [user]
                    while True:
                        uses = chain[-1].outputs[0].uses()
                        if len(uses) != 1 or uses[0][0].op_type not in ("Add", "Sum"):
                            break
                        chain.append(uses[0][0])
                    ends.extend(n for n in reversed(chain) if n not in ends)
        frontier = nxt
    return ends


def block_scope(nodes: list[ir.Node]) -> str:
    """The scope the nodes that have one share (nodes without a scope do not count)."""
    return common_scope([s for s in map(scope_of, nodes) if s])


def check_block(match: MoEMatch, shareable: set[ir.Node]) -> None:
    inside = set(match.nodes)
    for node in match.nodes:
        if node in shareable:
            continue  # read elsewhere too: it stays for those readers, nothing of the experts' compute
        for out in node.outputs:
            if out is match.output:
                continue
            need(not out.is_graph_output(), f"{out.name}, inside the experts, is a graph output")
            for user, _ in out.uses():
                need(user in inside, f"{out.name}, inside the experts, is also read by {user.op_type} ({user.name})")
    x = match.hidden
    hidden_size = match.w_gate.shape[2]
    need(
        match.w_down.shape == (match.experts, hidden_size, match.w_gate.shape[1]),
        f"down weights {list(match.w_down.shape)} do not fit gate weights {list(match.w_gate.shape)}",
    )
    need(static_dim(x, 1) in (None, hidden_size), f"hidden state {x.name} is not [T, {hidden_size}]")
    need(
        x.dtype is not None and x.dtype.numpy() == match.w_gate.dtype == match.w_down.dtype,
        f"hidden state {x.name} and expert weights differ in dtype",
    )
    need(match.router.logits.dtype == x.dtype, "router logits and hidden state differ in dtype")


def find_moe_blocks(graph: ir.Graph) -> tuple[list[MoEMatch], list[Refusal]]:
    """Every MoE block of ``graph`` (not its subgraphs) and, for each router that is no block, why: a
    ``Refusal`` of kind ``"moe"`` (path: the block's scope; node: where the furthest attempt stopped)."""
    matches: list[MoEMatch] = []
    rejections: list[Refusal] = []
    claimed: set[ir.Node] = set()
    # Router heads: TopK candidates, and the first ArgMax of a PhiMoE sparsemixer (no TopK).
    heads = [
        n for n in graph if (n.op_type == "TopK" and n.domain in STD and router_candidate(n)) or sparsemixer_head(n)
    ]
    for topk in heads:
        try:
            router = match_router(topk)
        except NoMatch as exc:
            failure = NoMatch(exc.reason, topk)  # reported at the router's head
            rejections.append(Refusal.of(block_scope([topk]) or topk.name or "", failure, kind="moe"))
            continue
        ends = combination_ends(router)
        failures: list[NoMatch] = []  # each form's deepest failure at each end, its progress the nodes matched
        ends_of: dict[int, ir.Node] = {}  # id(failure) -> the end it was tried at
        found = None
        for end in ends:
            if end in claimed:
                continue
            for form, matcher in FORMS.get(end.op_type, ()):
                w = Walk()
                try:
                    parts = matcher(w, end, router)
                    if end not in w.nodes:
                        w.nodes.append(end)
                    router_nodes = {router.topk, router.scores, *router.nodes}
                    block = [n for n in w.nodes if n not in router_nodes]
                    found = MoEMatch(
                        path=block_scope([topk, end]),
                        form=form,
                        router=router,
                        output=end.outputs[0],
                        nodes=block,
                        **parts,
                    )
                    check_block(found, w.shareable)
                    break
                except NoMatch as exc:
                    found = None
                    w.note(exc)
                    deepest = w.deepest
                    why = deepest.reason
                    reason = why if why.startswith(form) else f"{form}: {why}"
                    failure = NoMatch(reason, *(deepest.nodes or (end,)), progress=deepest.progress)
                    failures.append(failure)
                    ends_of[id(failure)] = end
            if found is not None:
                break
        if found is None:
            # The attempt that got furthest says best why this is no block.
            best = furthest(failures)
            if best is not None:
                scope = block_scope([topk, ends_of[id(best)]]) or block_scope([topk])
            else:
                scope = block_scope([topk])
                best = NoMatch(
                    "no combination of expert outputs downstream of the router (a ReduceSum over the top-k slots, "
                    "an Einsum / ReduceSum with a routing matrix, or a sum of per-expert outputs)",
                    topk,
                )
            rejections.append(Refusal.of(scope, best, kind="moe"))
            continue
        claimed.update(found.nodes)
        matches.append(found)
    # The group-limit TopKs of a matched router (DeepSeek-V3 style) are parts of it, not routers of their own.
    parts = {label(n) for m in matches for n in m.router.nodes if n.op_type == "TopK"}
    rejections = [r for r in rejections if r.node not in parts]
    return matches, rejections
