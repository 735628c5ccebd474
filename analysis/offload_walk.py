"""One micro-batch's passes with activation offloading's copies (pp 1), walked by the trace's
own rules (tracegen/program.py, ``RoleProgram._offload`` and ``backward``), for the fast path:
how much longer the forward and the backward take than without the copies.

* A store follows each offloaded layer's forward on the device-to-host stream, and the forward
  of the layer after next waits for it (Transformer Engine's double buffer) — its compute
  does: under ZeRO-3 without prefetch its blocking gathers run first, beside the wait
  (walked after it, a copy-bound forward was charged a gather a layer: +1.6%, agreement
  bench seed 607).
* A layer's reload starts with the backward of the layer above, once its store and the reload
  before it are done; its backward waits for it.
* Under ZeRO-3 with prefetched gathers, each block's gathers are issued as the block before it
  becomes ready to start (not waiting on a store), on the data-parallel streams — the dense
  parameters' and, on a MoE model, the experts' beside it (their groups' communicators,
  as replay runs them) — and each backward's reduce-scatters follow them there; elsewhere a
  block's collectives are in its times (``fastpath_stages.block_ns``) and the streams stay
  empty. Compute beside n collectives in flight runs 1 + κ·n times slower
  (``GPUSpec.comm_interference``, as replay runs it; ``dp_tails.slowed``): the chain's
  compute waits less for copies than for gathers, so a walk without it charged a
  stream-bound backward's copies twice over. (The two streams were once one, the expert
  gathers after the dense ones: a layer then looked long enough to hide its copy where
  replay's ran 1.6× the layer — 6.2% on a draw of the agreement bench, seed 604.)

pp 1: one micro-batch's copies end before the next one's begin (each reload needs its store,
the backward needs every reload), so a micro-batch's waits are the same in every one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from analysis.dp_tails import slowed


class Block(NamedTuple):
    offloaded: bool
    fwd_ns: int  # the chain's time in the block (its compute, and blocking collectives)
    bwd_ns: int
    gather_ns: tuple[int, int]  # ZeRO-3 with prefetch: its gathers on each stream (dense,
    scatter_ns: tuple[int, int]  # expert), and its gradients' reduce-scatters after its backward
    copy_ns: int  # an offloaded layer's copy to host memory, or back
    # ZeRO-3 without prefetch: the forward's blocking gathers that open the block (in fwd_ns),
    # which do not wait for a store — only its compute does
    lead_ns: int = 0


def waits(blocks: list[Block], kappa: float = 0.0) -> tuple[int, int]:
    """(forward, backward) ns the copies add to one micro-batch's passes (``kappa``: the
    interference of a collective in flight with compute)."""
    fwd, bwd = _passes(blocks, kappa, copies=True)
    fwd0, bwd0 = _passes(blocks, kappa, copies=False)
    return fwd - fwd0, bwd - bwd0


def gathered_delay(blocks: list[Block], ready: Sequence[int], busy: Sequence[int],
                   kappa: float = 0.0) -> int:
    """``overlap_param_gather`` beside the copies: how much later the forward ends with each
    block waiting for its bucket's parameter gather (``ready``, the streams' gathers serial
    from the step's start, busy until each of ``busy``) than with the copies alone. Where the
    copies pace the forward, only the gathers before the first store delay it; the gathers'
    own delay, walked without the copies, charged a copy-bound forward for gathers it hid
    (a negative delay: 8.1% fast on a draw of the agreement bench, seed 606)."""
    return (_passes(blocks, kappa, copies=True, gates=ready, busy=busy)[0]
            - _passes(blocks, kappa, copies=True)[0])


class _Streams:
    """The data-parallel streams (dense, expert): each runs its collectives one after the
    other, in the order they are issued."""

    def __init__(self) -> None:
        self.ends = [0, 0]

    def issue(self, at: int, ns: tuple[int, int]) -> int:
        """Collectives of ``ns`` a stream issued at ``at``: when the last of them ends (``at``
        where there are none)."""
        done = at
        for i, d in enumerate(ns):
            if d:
                self.ends[i] = max(self.ends[i], at) + d
                done = max(done, self.ends[i])
        return done


def _passes(blocks: list[Block], kappa: float, *, copies: bool,
            gates: Sequence[int] = (), busy: Sequence[int] = ()) -> tuple[int, int]:
    """(forward ns, backward ns) of one micro-batch, with the copies or without; ``gates``:
    when each block may start at the earliest, with other streams busy until each of
    ``busy`` (``gathered_delay``)."""
    n = len(blocks)
    ready = [0] * n  # each block's gathers done
    streams = _Streams()
    if n:
        ready[0] = streams.issue(0, blocks[0].gather_ns)
    t = d2h = wait = 0
    stores: dict[int, int] = {}
    for k, b in enumerate(blocks):  # forward
        if k + 1 < n:  # the next block's gathers, issued as this one could start
            ready[k + 1] = streams.issue(max(t, ready[k]), blocks[k + 1].gather_ns)
        opened = max(t, ready[k], gates[k] if gates else 0) + b.lead_ns
        start = max(opened, wait)
        t = round(slowed(start, b.fwd_ns - b.lead_ns, [*streams.ends, *busy], kappa))
        wait = 0
        if copies and b.offloaded:
            wait = d2h  # the store before this one's
            d2h = stores[k] = max(t, d2h) + b.copy_ns
    fwd_end = t
    if n:  # the backward's first gathers: once the streams are free
        ready[n - 1] = streams.issue(0, blocks[n - 1].gather_ns)
    h2d = 0
    loaded: dict[int, int] = {}
    for k in range(n - 1, -1, -1):  # backward
        base = max(t, ready[k])
        if k > 0:  # the next block's gathers
            ready[k - 1] = streams.issue(base, blocks[k - 1].gather_ns)
        start = max(base, loaded.get(k, 0))
        if copies and k > 0 and blocks[k - 1].offloaded:  # its reload, prefetched
            h2d = loaded[k - 1] = max(start, h2d, stores[k - 1]) + blocks[k - 1].copy_ns
        t = round(slowed(start, blocks[k].bwd_ns, [*streams.ends, *busy], kappa))
        streams.issue(t, blocks[k].scatter_ns)
    return fwd_end, t - fwd_end
