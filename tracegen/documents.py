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
import math

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
