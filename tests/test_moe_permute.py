"""The token permutations of a MoE layer (Megatron-Core's token dispatchers): where they run
around the dispatch and combine, the bytes each moves, and their backward."""

from __future__ import annotations

import pytest

from tests.test_deepep import MOE
from tracegen import Strategy
from tracegen.ops import PERMUTATIONS, layer_bwd, layer_fwd
from tracegen.routing import Route, expected_units

H, K = MOE.hidden_size, MOE.experts_per_token
TOKENS = MOE.seq_len  # micro-batch 1, tp 1


def _moe_names(items: list) -> list[str]:
    names = [it.name for it in items]
    return names[names.index("router") + 1:names.index("resid2")]


def test_the_all_to_all_dispatcher_permutes_sorts_and_undoes_both() -> None:
    """Permutation 1 before the all-to-all, the sort by local expert after it (8 experts per
    rank at ep 8), both undone around the combine."""
    names = _moe_names(layer_fwd(MOE, Strategy(dp=8, ep=8, global_batch_size=8)))
    assert names == ["moe_permute", "moe_dispatch", "moe_sort", "expert_fc1", "expert_act",
                     "expert_fc2", "moe_unsort", "moe_combine", "moe_unpermute"]


def test_one_expert_per_rank_needs_no_sort() -> None:
    names = _moe_names(layer_fwd(MOE, Strategy(dp=64, ep=64, global_batch_size=64)))
    assert "moe_sort" not in names and "moe_unsort" not in names
    assert names[0] == "moe_permute" and names[-1] == "moe_unpermute"


def test_deepep_permutes_on_the_expert_side() -> None:
    """The flex dispatcher hands DeepEP the tokens as they are, permutes what arrived into
    per-expert copies and sums them back before the combine."""
    names = _moe_names(layer_fwd(MOE, Strategy(dp=8, ep=8, global_batch_size=8,
                                               moe_dispatcher="deepep")))
    assert names == ["moe_dispatch", "moe_permute", "expert_fc1", "expert_act", "expert_fc2",
                     "moe_unpermute", "moe_combine"]


@pytest.mark.parametrize("disp", ["alltoall", "deepep"])
def test_each_pass_moves_its_rows(disp: str) -> None:
    """A permutation reads and writes the k copies of every token (2 bytes an element); the
    weighted sum reads the copies and writes a row per token (all-to-all) or per token and
    destination GPU (DeepEP); the backward moves the same bytes back."""
    s = Strategy(dp=8, ep=8, global_batch_size=8, moe_dispatcher=disp)  # type: ignore[arg-type]
    fwd = {it.name: it for it in layer_fwd(MOE, s)}
    copies = TOKENS * K * H * 2
    assert fwd["moe_permute"].bytes == 2 * copies
    rows = TOKENS * (expected_units(Route(8, 64, 8, 4), 8) if disp == "deepep" else 1)
    assert fwd["moe_unpermute"].bytes == pytest.approx(copies + rows * H * 2, abs=H * 2)
    bwd = {it.name: it for it in layer_bwd(MOE, s)}
    for name in PERMUTATIONS & set(fwd):
        assert bwd[f"{name}_bwd"].bytes == fwd[name].bytes
