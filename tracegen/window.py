"""Sliding-window attention under context parallelism: what each rank attends and receives.

Megatron-Core's context parallelism splits a sequence into 2·cp chunks of L = s/(2·cp) tokens,
rank r holding chunks r and 2·cp − 1 − r (load balance for causal attention). Under a window
of W keys (a query at position i attends to keys max(0, i − W + 1) … i) Transformer Engine
(``AttnFuncWithCPAndKVP2PSWA``, ``cp_comm_type = "p2p"``) sends each chunk only the halo of
keys before it that the window reaches, min(W − 1, a·L) tokens for chunk a, from the ranks that
own them, and runs one attention call a chunk over [halo, chunk]; where the window reaches
further back than (cp − 1)·L tokens it falls back to gathering all K/V (``use_p2p_swa``), as
``cp_comm_type = "all_gather"`` always does. Either way a rank's attention is its two chunks'
windowed query-key pairs; the busiest rank's (the one whose chunks lie past the first window)
sets the layer's pace.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class CpWindow:
    """One layer's windowed attention on the busiest context-parallel rank."""

    pairs: int  # its query-key pairs (both chunks)
    halo_tokens: int  # K/V tokens it receives from other ranks (0: K/V gathered whole)


def prefix_pairs(n: int, w: int) -> int:
    """Pairs of the first n queries of a sequence under a window of w keys: Σ min(k, w), k ≤ n."""
    if n <= w:
        return n * (n + 1) // 2
    return w * (w + 1) // 2 + (n - w) * w


def chunk_pairs(a: int, chunk: int, w: int) -> int:
    """Pairs of chunk ``a``'s queries (positions a·chunk … (a + 1)·chunk − 1)."""
    return prefix_pairs((a + 1) * chunk, w) - prefix_pairs(a * chunk, w)


def _received(r: int, cp: int, chunk: int, w: int) -> int:
    """Halo tokens rank ``r`` receives: for each of its chunks the min(w − 1, a·chunk) keys
    before it, less those in its own other chunk."""
    own = (r, 2 * cp - 1 - r)
    got = 0
    for a in own:
        lo, hi = a * chunk - min(w - 1, a * chunk), a * chunk
        mine = sum(max(0, min(hi, (b + 1) * chunk) - max(lo, b * chunk)) for b in own if b < a)
        got += hi - lo - mine
    return got


def cp_window(seq: int, cp: int, w: int, comm: str) -> CpWindow:
    """The busiest rank's pairs and received halo under ``comm`` ("p2p": the halo exchange
    where TE takes it, else K/V gathered; "all_gather": gathered)."""
    chunk = seq // (2 * cp)
    pairs = max(chunk_pairs(r, chunk, w) + chunk_pairs(2 * cp - 1 - r, chunk, w)
                for r in range(cp))
    if comm != "p2p" or w - 1 > (cp - 1) * chunk:
        return CpWindow(pairs, 0)
    return CpWindow(pairs, max(_received(r, cp, chunk, w) for r in range(cp)))
