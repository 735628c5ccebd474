"""Combined 1F1B's merged pass as a plan (``Strategy.overlap_moe_ep_comm``): which blocks of
a forward and a backward run together, in what order, where each pass is cut at its
expert-parallel all-to-alls, and where --delay-wgrad-compute's weight gradients go. Pure
functions of the blocks and items, shared by the trace (``RoleProgram.merged``) and the fast
path (``analysis/merged_pass.py``), so the two order a merged pass alike by construction."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from tracegen import ops as O

if TYPE_CHECKING:  # the program module imports this one; its types are annotations here
    from tracegen.program import ParamBlock, Tagged
    from tracegen.strategy import Strategy

T = TypeVar("T")


class MergedPlan(NamedTuple):
    """Combined 1F1B's merged pass as groups of (pass, block) in order, and the index of the
    group before which the pass's sends go (``RoleProgram.merged``)."""

    groups: list[tuple[tuple[str, ParamBlock], ...]]
    sends_at: int


def merged_plan(f_blocks: list[ParamBlock], b_blocks: list[ParamBlock]) -> MergedPlan:
    """The merged pass of a forward through ``f_blocks`` and a backward through ``b_blocks``
    (``RoleProgram.merged``; the same chunk's without a pipeline): the forward's leading
    blocks (the embedding), the backward's trailing ones reversed (the head and loss), then
    the forward's k-th layer with the backward's k-th from the end (the backward's pieces
    first), the layers the backward has more, those the forward has more; the sends; the
    forward's trailing blocks, the backward's leading ones (Megatron-Core's
    ``TransformerModelChunkSchedulePlan.run``: pre-process forward, post-process backward,
    the layers in pairs, then alone, post_forward and post_backward, post-process forward,
    pre-process backward)."""
    f_pre, f_mid, f_post = _split_layers(f_blocks)
    b_pre, b_mid, b_post = _split_layers(b_blocks)
    both = min(len(f_mid), len(b_mid))
    groups = [*[(("F", x),) for x in f_pre], *[(("B", x),) for x in reversed(b_post)],
              *[(("B", b_mid[-1 - k]), ("F", f_mid[k])) for k in range(both)],
              *[(("B", x),) for x in reversed(b_mid[:len(b_mid) - both])],
              *[(("F", x),) for x in f_mid[both:]]]
    sends_at = len(groups)
    groups += [*[(("F", x),) for x in f_post], *[(("B", x),) for x in reversed(b_pre)]]
    return MergedPlan(groups, sends_at)


def _split_layers(blocks: list[ParamBlock]
                  ) -> tuple[list[ParamBlock], list[ParamBlock], list[ParamBlock]]:
    """A chunk's blocks as (those before its first layer, its layers, those after)."""
    layers = [i for i, x in enumerate(blocks) if x.is_layer]
    lo, hi = (layers[0], layers[-1] + 1) if layers else (len(blocks), len(blocks))
    return blocks[:lo], blocks[lo:hi], blocks[hi:]


# The blocks whose weight-gradient GEMMs --delay-wgrad-compute defers (Megatron-Core's
# ``build_layer_callables``: the attention module, the MLP — experts and shared experts — and an
# MTP module's projection have ``backward_dw``; the router has none)
DELAYED_WGRAD_BLOCKS = ("layer", "dense_layer", "window_layer", "window_dense_layer", "mtp")


def defers_wgrads(s: Strategy, name: str, block: ParamBlock) -> bool:
    """Whether ``block``'s pass ``name`` has weight gradients --delay-wgrad-compute defers."""
    return s.delay_wgrad_compute and name == "B" and block.name in DELAYED_WGRAD_BLOCKS


def delayed_wgrads(run: list[Tagged]) -> tuple[list[Tagged], list[Tagged]]:
    """A backward piece's items less the weight-gradient GEMMs --delay-wgrad-compute defers
    (the router's stays), and those (``merged_issues``)."""
    kept: list[Tagged] = []
    later: list[Tagged] = []
    for entry in run:
        it, _, phase = entry
        wgrad = (isinstance(it, O.Op) and phase == "bwd" and it.name.endswith("_wgrad")
                 and not it.name.startswith("router"))
        (later if wgrad else kept).append(entry)
    return kept, later


K = TypeVar("K")
A = TypeVar("A")


def merged_issues(groups: list[list[tuple[str, list[tuple[K, K | None, A | None]]]]],
                  sends_at: int) -> Iterator[tuple[str, K | None, A | None]]:
    """A merged pass in issue order (``RoleProgram.merged``, ``merged_pass.merged_pieces``):
    each group's pieces in ``merged_turns``' order as ("F" or "B", run, all-to-all or None),
    ("S", None, None) where the sends go (before group ``sends_at``), and, with
    --delay-wgrad-compute, the backward's deferred weight gradients as ("W", run, None) right
    after its next all-to-all is issued — the experts' after their own dispatch's backward,
    attention's after the next layer's combine — or after the sends (Megatron-Core runs the
    last layer's attention ``backward_dw`` after the P2P sends), or at the end: on the compute
    stream, waited for by nothing of the pass but the compute stream's order."""
    pending: list[K] = []
    for i, group in enumerate(groups):
        if i == sends_at:
            yield "S", None, None
            yield from (("W", run, None) for run in pending)
            pending = []
        for name, (run, later, a2a) in merged_turns(group):
            yield name, run, a2a
            if later is not None:
                pending.append(later)
            if name == "B" and a2a is not None:
                yield from (("W", run, None) for run in pending)
                pending = []
    if sends_at == len(groups):
        yield "S", None, None
    yield from (("W", run, None) for run in pending)


def merged_turns(cut: list[tuple[str, list[T]]]) -> Iterator[tuple[str, T]]:
    """The pieces of passes run together (each pass's ``ep_pieces``, by pass name) in the
    order they are issued: each pass's first piece in turn, then each one's second, …"""
    for turn in range(max(len(pieces) for _, pieces in cut)):
        for name, pieces in cut:
            if turn < len(pieces):
                yield name, pieces[turn]


def ep_pieces(chain: list[Tagged]
              ) -> list[tuple[list[Tagged], Tagged | None]]:
    """A pass's items cut at its expert-parallel all-to-alls (the MoE dispatch and combine):
    (the run before one, that all-to-all), …, (the rest, None)."""
    out: list[tuple[list[Tagged], Tagged | None]] = []
    run: list[Tagged] = []
    for entry in chain:
        it = entry[0]
        if isinstance(it, O.Comm) and it.axis == "ep" and it.coll == "ALL_TO_ALL":
            out.append((run, entry))
            run = []
        else:
            run.append(entry)
    out.append((run, None))
    return out
