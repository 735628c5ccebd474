"""Document masking: what attention costs when packed sequences attend within their documents.

Pre-training concatenates documents and cuts the stream into sequences of ``seq_len`` tokens
(Megatron-Core's ``GPTDataset``; Pouransari et al. 2024, "Dataset Decomposition", call it
concat-and-chunk). With a document mask (Llama 3, Dubey et al. 2024 §3.2: "an attention mask
that prevents self-attention between different documents within the same sequence";
Megatron-Core's packed sequences, THD with ``cu_seqlens``; FlashAttention's varlen kernels)
each piece of a document in a sequence is its own causal attention, so a sequence of pieces
ℓᵢ costs Σ ℓᵢ²/2 query-key pairs where one causal sequence costs s²/2.

The expectation is a renewal-theory closed form. Document boundaries form a stationary renewal
process along the stream (the cut falls anywhere in a document). Two positions u tokens
apart lie in one document with probability G(u) = E[(L − u)⁺] / E[L] (the forward
recurrence time from a uniformly placed token, whose survival is ∫ᵤ^∞ P(L > v) dv / μ: Cox
1962, "Renewal Theory", ch. 5), so the expected pairs of a sequence are

    P = ∫₀ˢ (s − u) G(u) du
      = (1/μ) · E[ s·L²/2 − L³/6 ; L ≤ s ] + (1/μ) · E[ s²·L/2 − s³/6 ; L > s ]

(the inner integral ∫₀^min(L,s) (s − u)(L − u) du done for each length L), with μ = E[L].
Documents of one length d ≤ s give s·d/2 − d²/6: s/d aligned documents' s·d/2, less the
pieces a random cut leaves at the sequence's two ends. Lengths are log-normal, ln L ~ N(m, σ²)
(σ = 0: every document μ tokens), whose partial moments are closed forms:
E[L^j ; L ≤ s] = exp(j·m + j²σ²/2) · Φ((ln s − m − jσ²)/σ) (Aitchison and Brown 1957, "The
Lognormal Distribution", §2.8). Corpora's document lengths are heavy-tailed (Krell et al.
2021, Figure 1; Ding et al. 2024, "Fewer Truncations"): σ says how heavy; no default is
taken, as no corpus is every corpus.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

# A log-normal of σ this small is one length to float precision: the closed form's Φ terms
# would divide by it.
_SIGMA_EPS = 1e-9


def _phi(x: float) -> float:
    """The standard normal's distribution function."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _partial_moment(j: int, s: float, mean: float, sigma: float) -> float:
    """E[L^j ; L ≤ s] of a log-normal L of mean ``mean`` and log-σ ``sigma``."""
    if sigma < _SIGMA_EPS:
        return mean**j if mean <= s else 0.0
    mu = math.log(mean) - sigma * sigma / 2
    return math.exp(j * mu + j * j * sigma * sigma / 2) * _phi(
        (math.log(s) - mu - j * sigma * sigma) / sigma)


def masked_pairs(seq: int, mean_tokens: float, sigma: float) -> float:
    """Expected query-key pairs of one ``seq``-token sequence cut from concatenated documents
    of log-normal length (mean ``mean_tokens``, log-σ ``sigma``) under a document mask; a
    causal sequence's s²/2 where documents are far longer than the sequence."""
    s, mu = float(seq), float(mean_tokens)
    below = [_partial_moment(j, s, mu, sigma) for j in (0, 1, 2, 3)]
    long_count, long_tokens = 1.0 - below[0], mu - below[1]  # P(L > s), E[L ; L > s]
    pairs = (s * below[2] / 2 - below[3] / 6 + s * s * long_tokens / 2
             - s**3 * long_count / 6) / mu
    return min(max(pairs, 0.0), s * s / 2)


@dataclasses.dataclass(frozen=True, slots=True)
class DocumentMask:
    """A sequence's attention under a document mask, as the attention kernels see it."""

    pairs: float  # expected query-key pairs of one sequence (causal: s²/2)
    length: int  # the equivalent causal length: s/length calls of it carry the same pairs

    def share(self, seq: int) -> float:
        """The pairs over a causal sequence's."""
        return self.pairs / (seq * seq / 2)


def document_mask(seq: int, mean_tokens: float, sigma: float) -> DocumentMask:
    """``masked_pairs`` and the causal call length n with (s/n)·n²/2 of the same pairs,
    n = 2P/s — the length the attention curve is read at, as for a sliding window
    (``tracegen.ops.attention_fwd``)."""
    pairs = masked_pairs(seq, mean_tokens, sigma)
    return DocumentMask(pairs, max(1, min(seq, round(2 * pairs / seq))))


# --- sequences cut from a simulated stream (the spread the mean hides) ------------------------

# Simulated documents are capped here (~100 MB of arrays at most); at least MIN_SEQUENCES
# sequences are cut, SEQUENCES where the documents allow.
MAX_DOCUMENTS = 3_000_000
MIN_SEQUENCES = 400
SEQUENCES = 20_000


@functools.lru_cache(maxsize=64)
def rank_pairs(seq: int, mean_tokens: float, sigma: float, cp: int = 1, *, seed: int = 0
               ) -> np.ndarray:
    """Each context-parallel rank's pairs of sequences cut at independent random places from a
    simulated stream of log-normal documents (``SEQUENCES`` of them, fewer where the documents
    are short, at least ``MIN_SEQUENCES``), the sequence split whole into 2·cp chunks, rank r
    holding chunks r and 2·cp − 1 − r (Megatron's load balance for causal attention, which
    Llama 3's context parallelism applies to the packed sequence: Dubey et al. 2024 §3.3.2):
    shape (sequences, cp), its rows summing to a sequence's pairs Σ ℓᵢ²/2 (cp = 1: one
    column, the pairs). A query at x in a piece that starts at u attends x − u keys before it,
    so a piece [u, w) adds ∫ (x − u) dx over its part of a chunk. Seeded: the same inputs give
    the same answer."""
    rng = np.random.default_rng(seed)
    sequences = int(min(SEQUENCES, max(MIN_SEQUENCES, MAX_DOCUMENTS * mean_tokens / seq)))
    mu = math.log(mean_tokens) - sigma * sigma / 2
    docs = int(min(MAX_DOCUMENTS, sequences * seq / mean_tokens) * 1.2) + 1_000
    lengths = (np.exp(rng.normal(mu, sigma, docs)) if sigma
               else np.full(docs, float(mean_tokens)))
    ends = np.cumsum(lengths)
    start = ends[min(500, docs // 4)]
    if ends[-1] - seq <= start:  # a sequence of over a million documents: its pieces average
        out = np.full((MIN_SEQUENCES, cp), masked_pairs(seq, mean_tokens, sigma) / cp)
    else:  # out (~1/√documents)
        out = _split(seq, cp, ends, rng.uniform(start, ends[-1] - seq, sequences))
    out.flags.writeable = False  # (cached: shared by every caller)
    return out


def _split(seq: int, cp: int, ends: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``rank_pairs`` of the windows [a, a + seq) over documents ending at ``ends``."""
    first = np.searchsorted(ends, a, side="right")  # the document a falls in
    last = np.searchsorted(ends, a + seq, side="left")  # the one the window's end falls in
    count = last - first + 1
    window = np.repeat(np.arange(len(a)), count)
    doc = np.repeat(first, count) + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count,
                                                                      count)
    u = np.maximum(ends[doc - 1], a[window]) - a[window]  # each piece's start in its window
    w = np.minimum(ends[doc], a[window] + seq) - a[window]  # and end
    chunk = seq / (2 * cp)
    out = np.zeros((len(a), cp))
    for k in range(2 * cp):
        lo = np.clip(k * chunk - u, 0.0, None)
        hi = np.clip(np.minimum(w, (k + 1) * chunk) - u, 0.0, None)
        part = np.where(hi > lo, (hi * hi - lo * lo) / 2, 0.0)
        out[:, min(k, 2 * cp - 1 - k)] += np.bincount(window, weights=part, minlength=len(a))
    return out


def sequence_pairs(seq: int, mean_tokens: float, sigma: float, *, seed: int = 0
                   ) -> np.ndarray:
    """One sequence's pairs (Σ ℓᵢ²/2 over its pieces) for ``rank_pairs``' sequences."""
    pairs: np.ndarray = rank_pairs(seq, mean_tokens, sigma, 1, seed=seed)[:, 0]
    return pairs


def busiest_rank_factor(seq: int, mean_tokens: float, sigma: float, cp: int, mbs: int
                        ) -> float:
    """Under a whole-sequence split: the busiest of cp ranks' pairs of a micro-batch (mbs
    sequences) over the mean rank's — what a layer's attention waits for, every rank
    synchronising with its context-parallel group each layer (≥ 1: 1 where documents are far
    longer than the sequence, whose causal split is balanced, and towards 1 as a chunk holds
    ever more documents)."""
    per = rank_pairs(seq, mean_tokens, sigma, cp)
    groups = len(per) // mbs
    sums = per[: groups * mbs].reshape(groups, mbs, cp).sum(axis=1)
    return float(sums.max(axis=1).mean() / (sums.sum(axis=1).mean() / cp))
