"""One micro-batch's passes with activation offloading's copies (pp 1), walked by the trace's
own rules (tracegen/program.py, ``RoleProgram._offload`` and ``backward``), for the fast path:
how much longer the forward and the backward take than without the copies.

* A store follows each offloaded layer's forward on the device-to-host stream, and the forward
  of the layer after next waits for it (Transformer Engine's double buffer).
* A layer's reload starts with the backward of the layer above, once its store and the reload
  before it are done; its backward waits for it.
* Under ZeRO-3 with prefetched gathers, each block's gather is issued as the block before it
  becomes ready to start (not waiting on a store), on the data-parallel stream, and each
  backward's reduce-scatter follows it there; elsewhere a block's collectives are in its
  times (``fastpath_stages.block_ns``) and the stream stays empty. Compute beside the
  stream's collectives runs 1 + κ times slower (``GPUSpec.comm_interference``, as replay
  runs it): the chain's compute waits less for copies than for gathers, so a walk without
  it charged a stream-bound backward's copies twice over.

pp 1: one micro-batch's copies end before the next one's begin (each reload needs its store,
the backward needs every reload), so a micro-batch's waits are the same in every one.
"""

from __future__ import annotations

from typing import NamedTuple


class Block(NamedTuple):
    offloaded: bool
    fwd_ns: int  # the chain's time in the block (its compute, and blocking collectives)
    bwd_ns: int
    gather_ns: int  # ZeRO-3 with prefetch: its gathers, on the stream beside the chain
    scatter_ns: int  # and its gradients' reduce-scatter after its backward
    copy_ns: int  # an offloaded layer's copy to host memory, or back


def waits(blocks: list[Block], kappa: float = 0.0) -> tuple[int, int]:
    """(forward, backward) ns the copies add to one micro-batch's passes (``kappa``: the
    interference of a collective in flight with compute)."""
    fwd, bwd = _passes(blocks, kappa, copies=True)
    fwd0, bwd0 = _passes(blocks, kappa, copies=False)
    return fwd - fwd0, bwd - bwd0


def _run(start: int, ns: int, busy_until: int, kappa: float) -> int:
    """When compute of ``ns`` alone ends, begun at ``start`` with the stream busy until
    ``busy_until``: at 1 / (1 + κ) of its rate while the stream is busy."""
    beside = busy_until - start
    if beside <= 0 or not kappa:
        return start + ns
    if beside >= ns * (1 + kappa):
        return start + round(ns * (1 + kappa))
    return start + ns + round(beside * kappa / (1 + kappa))


def _passes(blocks: list[Block], kappa: float, *, copies: bool) -> tuple[int, int]:
    """(forward ns, backward ns) of one micro-batch, with the copies or without."""
    n = len(blocks)
    ready = [0] * n  # each block's gathers done
    stream = ready[0] = blocks[0].gather_ns if n else 0
    t = d2h = wait = 0
    stores: dict[int, int] = {}
    for k, b in enumerate(blocks):  # forward
        if k + 1 < n:  # the next block's gathers, issued as this one could start
            stream = ready[k + 1] = max(stream, t, ready[k]) + blocks[k + 1].gather_ns
        start = max(t, ready[k], wait)
        t = _run(start, b.fwd_ns, stream, kappa)
        wait = 0
        if copies and b.offloaded:
            wait = d2h  # the store before this one's
            d2h = stores[k] = max(t, d2h) + b.copy_ns
    fwd_end = t
    if n:  # the backward's first gathers: once the stream is free
        stream = ready[n - 1] = stream + blocks[n - 1].gather_ns
    h2d = 0
    loaded: dict[int, int] = {}
    for k in range(n - 1, -1, -1):  # backward
        base = max(t, ready[k])
        if k > 0:  # the next block's gathers
            stream = ready[k - 1] = max(stream, base) + blocks[k - 1].gather_ns
        start = max(base, loaded.get(k, 0))
        if copies and k > 0 and blocks[k - 1].offloaded:  # its reload, prefetched
            h2d = loaded[k - 1] = max(start, h2d, stores[k - 1]) + blocks[k - 1].copy_ns
        t = _run(start, blocks[k].bwd_ns, stream, kappa)
        stream = max(stream, t) + blocks[k].scatter_ns
    return fwd_end, t - fwd_end
