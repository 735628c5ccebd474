"""Where a MoE layer's tokens go: how many distinct GPUs and nodes one token's top-k experts
fall on, for a dispatcher that sends each token once per destination rather than once per
expert (DeepEP; replay/network.py costs it).

Experts are placed as Megatron-Core places them: ``num_experts / ep`` consecutive experts per
rank of the expert-parallel group, the group's ranks in order, so a node of the group holds a
consecutive block of experts. Routing is taken as balanced (every expert equally likely, the
load-balanced limit trainsim assumes throughout, tracegen/ops.py ``_moe_fwd``), and group-limited
routing as DeepSeek-V3 runs it (Liu et al. 2024, DeepSeek-V3 §2.1.2, "node-limited routing";
Megatron-Core ``--moe-router-num-groups`` / ``--moe-router-group-topk``): each token first picks
``group_topk`` of ``groups`` equal groups of consecutive experts, then its top-k experts among
theirs.
"""

from __future__ import annotations

import dataclasses
import functools
from math import comb


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """A MoE layer's routing: top-``topk`` of ``experts``, within ``group_topk`` of ``groups``
    expert groups (0, 0 = no group limit)."""

    topk: int
    experts: int
    groups: int = 0
    group_topk: int = 0


def _miss(pool: int, held: int, k: int) -> float:
    """Probability that k distinct picks from ``pool`` avoid ``held`` of them:
    C(pool − held, k) / C(pool, k) as a product (no big integers)."""
    p = 1.0
    for i in range(k):
        if pool - held - i <= 0:
            return 0.0
        p *= (pool - held - i) / (pool - i)
    return p


def _hypergeom(total: int, marked: int, draws: int, c: int) -> float:
    """P(c marked among ``draws`` picks without replacement from ``total`` with ``marked``)."""
    return comb(marked, c) * comb(total - marked, draws - c) / comb(total, draws)


@functools.lru_cache(maxsize=1024)
def expected_units(route: Route, units: int) -> float:
    """Expected number of ``units`` (equal consecutive blocks of the experts: the ranks or the
    nodes of the expert-parallel group) that one token's top-k experts fall in.

    Without a group limit the k experts are k distinct picks of ``experts``: a unit holding
    e = experts / units of them is missed with probability C(E − e, k) / C(E, k). With one, the
    token's groups are ``group_topk`` distinct picks of ``groups`` and its experts k picks of the
    T = group_topk · E / groups experts they hold: a unit of q whole groups is missed with
    Σ_c P(c of its groups picked) · C(T − c · E/groups, k) / C(T, k), and a unit inside one
    group is hit only if its group is picked (group_topk / groups), then missed with
    C(T − e, k) / C(T, k). Where units and groups do not nest, or the units hold unequal
    shares of the experts, the group limit is left out (more destinations: an upper bound on
    the traffic)."""
    e_total, k = route.experts, route.topk
    if units <= 1:
        return float(units)
    if e_total % units:
        return _spread(e_total, k, units)
    e = e_total // units
    g, m = route.groups, route.group_topk
    if not g or m >= g or (g % units and units % g):
        return units * (1 - _miss(e_total, e, k))
    per_group = e_total // g
    pool = m * per_group
    if g % units == 0:  # a unit holds q whole groups
        q = g // units
        hit = sum(_hypergeom(g, q, m, c) * (1 - _miss(pool, c * per_group, k))
                  for c in range(1, min(q, m) + 1))
        return units * hit
    return units * (m / g) * (1 - _miss(pool, e, k))  # units inside groups


def _spread(experts: int, k: int, units: int) -> float:
    """Units hit when they hold unequal expert counts (experts not divisible by units): each
    unit's own share, ⌊E/u⌋ or ⌈E/u⌉ of them."""
    base, extra = divmod(experts, units)
    return ((units - extra) * (1 - _miss(experts, base, k))
            + extra * (1 - _miss(experts, base + 1, k)))


# The Chakra attributes a dispatch or combine node carries when its dispatcher deduplicates
# (trainsim's own names; other tools read the node as the flat all-to-all it also is).
ROUTE_ATTRS: tuple[str, ...] = ("moe_topk", "moe_experts", "moe_router_groups",
                                "moe_router_group_topk")


def route_attrs(route: Route) -> list[tuple[str, str, int]]:
    """``route`` as (name, kind, value) node attributes."""
    return [(name, "int64", v) for name, v in zip(
        ROUTE_ATTRS, (route.topk, route.experts, route.groups, route.group_topk), strict=True)]


def route_of(attrs: dict[str, object]) -> Route | None:
    """The route a collective node's attributes carry, or None (a flat collective)."""
    k = attrs.get("moe_topk")
    if k is None:
        return None
    e, g, m = (attrs.get(name, 0) for name in ROUTE_ATTRS[1:])
    return Route(int(k), int(e), int(g), int(m))  # type: ignore[call-overload]


def route_problems(route: Route) -> list[str]:
    """What makes ``route`` impossible, in words (empty if nothing)."""
    k, e, g, m = route.topk, route.experts, route.groups, route.group_topk
    if not 1 <= k <= e:
        return [f"top-k {k} must be in 1..experts ({e})"]
    if (g == 0) != (m == 0):
        return [f"router groups {g} and group top-k {m}: set both or neither"]
    if g and (e % g or not 1 <= m <= g):
        return [f"router groups {g} must divide the experts ({e}) and group top-k {m} be in "
                f"1..{g}"]
    if g and k > m * (e // g):
        return [f"top-k {k} exceeds the {m * (e // g)} experts of the {m} groups a token may "
                "use"]
    return []
