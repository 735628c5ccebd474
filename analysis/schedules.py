"""Which pipeline schedule? One strategy's layout under every schedule trainsim models
(``trainsim estimate --schedules``): 1F1B, GPipe, interleaved 1F1B and interleaved zero
bubble at a few chunk counts, ZB-H1, ZB-V and DualPipe-V, and for a MoE model with expert
parallelism the merged passes (combined 1F1B on the interleaved chunks, DualPipe-V's pairs
merged) — each costed by the fast path with everything else of the strategy kept, or named
with the reason it cannot run there.

What changes with the schedule: the chunks a stage holds (``vpp``: one, two in a V, or the
interleaved counts), the micro-batch group (interleaved only), the W passes' regathering
(zero-bubble schedules only) and the merge; a field the new schedule refuses beside it (TP
overlap under the zero-bubble schedules, say) is left as the user set it, so that the row says
why it is refused rather than estimating another strategy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from analysis.compare import strategy_label
from analysis.fastpath import FastEstimate, estimate
from replay.hardware import SystemSpec
from tracegen.errors import ConfigError
from tracegen.model import ModelSpec
from tracegen.strategy import Strategy

# interleaved chunk counts tried beside the strategy's own (Megatron's usual ones)
INTERLEAVED_VPPS = (2, 3, 4)


@dataclasses.dataclass(frozen=True, slots=True)
class Alternative:
    """One schedule for the strategy's layout: its estimate, or why it cannot run."""

    name: str  # "interleaved_1f1b vpp 4", "dualpipe_v merged", …
    strategy: Strategy | None  # None where refused
    step_time_s: float = 0.0
    peak_memory_GiB: float = 0.0
    fits: bool = False
    refused: str = ""  # the first reason ``Strategy`` (or the model) gives
    current: bool = False  # the strategy as given

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.name, "step_time_s": self.step_time_s or None,
                "peak_memory_GiB": self.peak_memory_GiB or None,
                "fits": self.fits if not self.refused else None,
                "refused": self.refused or None, "current": self.current,
                "strategy": strategy_label(self.strategy) if self.strategy else None}


def _candidates(s: Strategy, moe: bool) -> list[tuple[str, dict[str, Any]]]:
    """(name, fields changed) of every schedule tried for ``s``'s layout."""
    plain = {"microbatch_group_size": 0, "zb_w_regather": False, "overlap_moe_ep_comm": False,
             "delay_wgrad_compute": False}
    out: list[tuple[str, dict[str, Any]]] = [
        ("1f1b", {**plain, "schedule": "1f1b", "vpp": 1}),
        ("gpipe", {**plain, "schedule": "gpipe", "vpp": 1})]
    group = s.microbatch_group_size if s.schedule == "interleaved_1f1b" else 0
    vpps = sorted({*INTERLEAVED_VPPS, s.vpp} - {1})
    regather = s.zb_w_regather if s.split_w else False
    for v in vpps:
        kw = {**plain, "schedule": "interleaved_1f1b", "vpp": v, "microbatch_group_size": group}
        out.append((f"interleaved_1f1b vpp {v}", kw))
        out.append((f"interleaved_zb vpp {v}", {**plain, "schedule": "interleaved_zb", "vpp": v,
                                                "zb_w_regather": regather}))
        if moe:
            out.append((f"interleaved_1f1b vpp {v} merged",
                        {**kw, "overlap_moe_ep_comm": True,
                         "delay_wgrad_compute": s.delay_wgrad_compute}))
    out += [("zb_h1", {**plain, "schedule": "zb_h1", "vpp": 1, "zb_w_regather": regather}),
            ("zb_v", {**plain, "schedule": "zb_v", "vpp": 2, "zb_w_regather": regather}),
            ("dualpipe_v", {**plain, "schedule": "dualpipe_v", "vpp": 2,
                            "zb_w_regather": regather})]
    if moe:
        out.append(("dualpipe_v merged", {**plain, "schedule": "dualpipe_v", "vpp": 2,
                                          "zb_w_regather": regather,
                                          "overlap_moe_ep_comm": True}))
    return out


def estimate_changed(model: ModelSpec, s: Strategy, changes: dict[str, Any],
                     system: SystemSpec) -> tuple[Strategy, FastEstimate] | str:
    """``s`` with ``changes`` and its fast-path estimate, or the first problem ``Strategy``
    (or the model) gives for it — a row of a what-if table names that."""
    try:
        alt = dataclasses.replace(s, **changes)
        return alt, estimate(model, alt, system)
    except ConfigError as exc:
        return exc.problems[0]


def schedule_alternatives(model: ModelSpec, s: Strategy, system: SystemSpec
                          ) -> list[Alternative]:
    """Every schedule for ``s``'s layout (tp, pp, dp, the batch, everything but the schedule's
    own fields), fastest first, the refused ones after with their reasons. Needs a pipeline
    (pp ≥ 2): at pp 1 there is no schedule to choose."""
    if s.pp < 2:
        raise ConfigError("--schedules compares pipeline schedules: it needs pp ≥ 2, got pp 1",
                          what="schedules")
    moe = model.is_moe and s.ep > 1
    ran: list[Alternative] = []
    refused: list[Alternative] = []
    seen: set[Strategy] = set()
    for name, changes in _candidates(s, moe):
        done = estimate_changed(model, s, changes, system)
        if isinstance(done, str):
            refused.append(Alternative(name, None, refused=done))
            continue
        alt, got = done
        if alt in seen:
            continue
        seen.add(alt)
        ran.append(Alternative(name, alt, got.step_time_s, got.peak_memory_GiB, got.fits,
                               current=alt == s))
    return sorted(ran, key=lambda a: a.step_time_s) + refused
