"""Megatron-Core's custom pipeline layout (``--pipeline-model-parallel-layout``; NVIDIA's
Megatron-Core user guide, "Custom Pipeline Model Parallel Layout"): a string that says what each
model chunk holds. Stages (chunks) are split by ``|``, in Megatron's chunk order — every pipeline
stage's first chunk, then every stage's second, … (trainsim's global chunk index, chunk·pp +
stage). Symbols: ``E`` the embedding, ``t`` a transformer layer, ``m`` a multi-token-prediction
module, ``L`` the loss (the output head). ``x*N`` repeats a symbol, ``(…)*N`` a piece; commas
are cosmetic. DeepSeek-V3 on pp 16 × vpp 2: ``Et*3|(tt|)*29,m|L``.

trainsim takes the layouts Megatron runs for today's models: the embedding first in the first
chunk, the loss last in the last, the MTP modules together after every layer, and no chunk
empty (Megatron allows ``E||t|L``; such a chunk only forwards activations, and trainsim's
pipeline walk needs work in each)."""

from __future__ import annotations

import functools
from typing import NamedTuple

from tracegen.errors import ConfigError

SYMBOLS = "EtmL"
# An expanded layout longer than this is no pipeline (a million layers): refused before it is
# built, so that a mistyped count cannot exhaust memory.
MAX_SYMBOLS = 1 << 20
MAX_NESTING = 32


class Chunk(NamedTuple):
    """What one model chunk holds."""

    layers: int
    embedding: bool = False
    mtp: int = 0
    loss: bool = False


@functools.lru_cache(maxsize=256)
def parse_layout(text: str) -> tuple[Chunk, ...]:
    """The chunks of a layout string, or ConfigError naming what is wrong where."""
    expanded, pos = _sequence(text, 0)
    if pos < len(text):  # a ')' with no '(' before it
        raise _error(text, pos, "a ')' closes no '('")
    pieces = expanded.split("|")
    chunks = tuple(_chunk(piece) for piece in pieces)
    problems = _order_problems(expanded, pieces, chunks)
    if problems:
        raise ConfigError([f"pipeline_layout {_shown(text)}: {p}" for p in problems],
                          what="pipeline layout")
    return chunks


def _shown(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _error(text: str, pos: int, what: str) -> ConfigError:
    return ConfigError(f"pipeline_layout {_shown(text)}: {what} at position {pos} (symbols "
                       "E t m L, stages split by '|', x*N and (…)*N repeat, commas ignored)",
                       what="pipeline layout")


def _sequence(text: str, pos: int, depth: int = 0) -> tuple[str, int]:
    """Expand from ``pos`` to the end or to the ')' that closes this piece."""
    if depth > MAX_NESTING:
        raise _error(text, pos, f"parentheses nest deeper than {MAX_NESTING}")
    out: list[str] = []
    size = 0
    while pos < len(text) and text[pos] != ")":
        c = text[pos]
        if c in ", \t":
            pos += 1
            continue
        if c == "(":
            piece, pos = _sequence(text, pos + 1, depth + 1)
            if pos >= len(text):
                raise _error(text, pos, "a '(' is never closed")
            pos += 1
        elif c in SYMBOLS or c == "|":
            piece, pos = c, pos + 1
        else:
            raise _error(text, pos, f"unknown symbol {c!r}")
        times, pos = _repeat(text, pos)
        size += len(piece) * times
        if size > MAX_SYMBOLS:
            raise _error(text, pos, f"the layout expands past {MAX_SYMBOLS:,} symbols")
        out.append(piece * times)
    return "".join(out), pos


def _repeat(text: str, pos: int) -> tuple[int, int]:
    """A ``*N`` after a symbol or piece: (N, position after it); (1, pos) without one."""
    if pos >= len(text) or text[pos] != "*":
        return 1, pos
    end = pos + 1
    while end < len(text) and text[end].isdigit():
        end += 1
    if end == pos + 1:
        raise _error(text, pos, "'*' needs a count after it")
    return int(text[pos + 1:end]), end


def _chunk(piece: str) -> Chunk:
    return Chunk(piece.count("t"), "E" in piece, piece.count("m"), "L" in piece)


def _order_problems(expanded: str, pieces: list[str], chunks: tuple[Chunk, ...]) -> list[str]:
    out = []
    if expanded.count("E") != 1 or not expanded.startswith("E"):
        out.append("the embedding (E) comes once, first in the first chunk")
    if expanded.count("L") != 1 or not expanded.endswith("L"):
        out.append("the loss (L) comes once, last in the last chunk")
    holders = [i for i, c in enumerate(chunks) if c.mtp]
    if len(holders) > 1 or (holders and (
            any(c.layers for c in chunks[holders[0] + 1:])
            or pieces[holders[0]].rfind("t") > pieces[holders[0]].find("m"))):
        out.append("the MTP modules (m) come together in one chunk, after every layer (t)")
    empty = [i for i, c in enumerate(chunks) if c == Chunk(0)]
    if empty:
        out.append(f"chunk(s) {', '.join(map(str, empty))} hold nothing; trainsim needs each "
                   "chunk to hold a layer, the embedding, an MTP module or the loss")
    return out


def chunk_count_problem(chunks: tuple[Chunk, ...], pp: int, vpp: int) -> str | None:
    """A layout lists pp·vpp chunks (Megatron derives vpp from it; trainsim states both)."""
    if len(chunks) == pp * vpp:
        return None
    return (f"pipeline_layout lists {len(chunks)} chunks, pp · vpp = {pp} · {vpp} = {pp * vpp}; "
            f"set vpp = chunks / pp" + (f" = {len(chunks) // pp}" if len(chunks) % pp == 0
                                        else " (the chunk count must be a multiple of pp)"))
