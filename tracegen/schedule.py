"""Pipeline schedules: the order in which one stage runs its forward and backward passes.

Each entry is ``(phase, microbatch, chunk)`` with phase ``"F"``, ``"B"`` or (ZB-H1, ZB-V)
``"W"``, and chunk the virtual stage index on this rank (0 unless interleaved or ZB-V).

* GPipe: all forwards, then all backwards (Huang et al. 2019).
* 1F1B (PipeDream-Flush): stage ``i`` of ``p`` runs ``min(p - i - 1, m)`` warm-up forwards, then
  alternates one forward and one backward, then drains (Narayanan et al. 2021, §2.2.1, Fig. 4).
* Interleaved 1F1B: Megatron-LM's ``forward_backward_pipelining_with_interleaving``
  (``megatron/core/pipeline_parallel/schedules.py``): warm-up ``(p - i - 1)·2 + (v - 1)·p`` virtual
  micro-batches; virtual micro-batch ``k`` runs chunk ``(k // p) % v`` forward and chunk
  ``v - 1 - (k // p) % v`` backward, on micro-batch ``(k // (p·v))·p + k % p``
  (Narayanan et al. 2021, §2.2.2), at most every virtual micro-batch. (Megatron-LM before
  Megatron-Core's tunable group ran every forward first where m = p; the current code does not,
  and neither do we.)
* ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, §3.1, its handcrafted
  schedules; the order of the authors' ``ZeroBubbleH1Pipeline`` in
  sail-sg/zero-bubble-pipeline-parallelism): each backward split into B (the input
  gradients, which the previous stage waits for) and W (the weight gradients, which nothing
  waits for). Stage ``i`` runs 1F1B's ``p - i - 1`` warm-up forwards, then ``i`` pairs F B
  whose W it defers, then F B W while forwards remain, then B W, then the ``i`` deferred W
  (oldest first): at most p micro-batches started and not yet through W on any stage (stage
  0's 1F1B peak), and the cooldown's waits for gradients filled with W passes.
* ZB-V (Qi et al. 2024 §6, its handcrafted V schedule; the order of PyTorch's
  ``ScheduleZBVZeroBubble``, torch.distributed.pipelining): two model chunks a stage placed in
  a V — stage i runs global chunks i and 2p − 1 − i, so the last stage turns each micro-batch
  round and stage 0 holds the embedding and the loss. Stage i runs 2(p − i) − 1 forwards of
  chunk 0, then i pairs (F chunk 1, F chunk 0), then p − i triples F B W of chunk 1, then
  while forwards remain F B W of chunk 0 and of chunk 1, then i pairs (B chunk 0, B chunk 1)
  whose W's wait, p − i pairs (B, W) of chunk 0, and the waiting W's, chunk 1's first. Runs
  of m < 2p − 1 micro-batches keep the order of those they have.
* DualPipe-V (PyTorch's ``ScheduleDualPipeV``, torch.distributed.pipelining, after
  DeepSeek-AI's DualPipe, DeepSeek-V3 technical report §3.2.1, and its "cut-in-half" V
  variant in deepseek-ai/DualPipe; ``dualpipe_v``): ZB-V's placement, m ≥ 2p micro-batches.
  Stage i runs 2(p − i − 1) forwards of chunk 0, i + 1 pairs (F chunk 0, F chunk 1), p − i − 1
  triples (B chunk 1, its W, F chunk 1), then m − 2p + i + 1 rounds of (F chunk 0 with a full
  backward of chunk 1, F chunk 1 with a full backward of chunk 0) — PyTorch's OVERLAP_F_B
  actions, which its runtime runs one after the other unless a custom function is
  registered for them — then p − i − 1 of (full B chunk 1, F chunk 1 with a full B chunk 0),
  i + 1 pairs (B chunk 1, B chunk 0) whose second half defers its W's to a queue, p − i − 1
  pairs (the oldest waiting W, B chunk 0 deferring its W), and the i + 1 W's left. A full
  backward is a B followed at once by its W. With the pairs merged (torchtitan's DualPipeV
  overlap; ``dualpipe_v_units``, an ``+a2a`` order id) each runs as one merged pass, as
  combined 1F1B's do, its backward a full one.
* Interleaved zero bubble (PyTorch's ``ScheduleInterleavedZeroBubble``; ``interleaved_zb``):
  ZB-H1's B/W split on interleaved chunks, micro-batches in rounds of N = m // max(1, m // p),
  (v − 1)·N + p − 1 − i warm-up forwards on stage i, then F with B, then the cool-down's B's,
  each B from stage i's (i + 1)-th on followed by the oldest waiting W.
* Interleaved 1F1B with a micro-batch group of N (Megatron-Core's
  ``microbatch_group_size_per_vp_stage``, ``get_schedule_table`` and
  ``get_pp_rank_microbatches``; the tunable schedule Llama 3 used, Dubey et al. 2024 §3.3.2):
  virtual micro-batches run group by group, each group's N micro-batches through chunk 0, then
  chunk 1, …; the last group holds what is left (0 or ≥ p). Warm-up ``(p - i - 1)·2 +
  (v - 1)·N``, at most every virtual micro-batch. N = p is the order above.
* Combined 1F1B (Megatron-Core's ``--overlap-moe-expert-parallel-comm``; ``combined``): a
  forward and a backward of different micro-batches side by side in the order run as one
  merged pass. Without a pipeline, 1F1B's F0, then B(j) with F(j + 1), then the last B
  (``combined_1f1b_schedule_for_no_pipelining``); interleaved, one warm-up forward more
  (``get_pp_rank_microbatches``: "one extra micro-batch forward step before the 1f1b stages
  ... needed to ensure the forward and backward computations are independent in all 1f1b
  steps"), then each steady forward merged with the backward after it
  (``combined_1f1b_schedule_for_interleaved_pipelining``). ``Strategy.order_id`` ends in
  ``+a2a`` for the interleaved one.
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["F", "B", "W"]
Step = tuple[Phase, int, int]
# What a stage runs as one pass: one step, or (F, B) merged (combined 1F1B, ``combined``)
Unit = tuple[Step, ...]


def gpipe(m: int) -> list[Step]:
    return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]


def one_f_one_b(m: int, p: int, stage: int) -> list[Step]:
    warmup = min(p - stage - 1, m)
    out: list[Step] = [("F", j, 0) for j in range(warmup)]
    f, b = warmup, 0
    while f < m:
        out.append(("F", f, 0))
        out.append(("B", b, 0))
        f, b = f + 1, b + 1
    out += [("B", j, 0) for j in range(b, m)]
    return out


def zb_h1(m: int, p: int, stage: int) -> list[Step]:
    warmup = min(p - stage - 1, m)
    out: list[Step] = [("F", j, 0) for j in range(warmup)]
    f, b, w = warmup, 0, 0
    while f < m:  # F B, their W deferred on the first ``stage`` of them; then F B W
        out += [("F", f, 0), ("B", b, 0)]
        if b >= stage:
            out.append(("W", w, 0))
            w += 1
        f, b = f + 1, b + 1
    for j in range(b, m):
        out += [("B", j, 0), ("W", w, 0)]
        w += 1
    return out + [("W", j, 0) for j in range(w, m)]


def _table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each virtual micro-batch (Megatron-Core's ``get_schedule_table``):
    groups of ``group`` micro-batches (the last holds the rest), each through chunk 0, 1, … in
    turn. A backward runs the mirrored chunk, v − 1 − chunk, of the same micro-batch."""
    return [(mb, ch) for lo in range(0, m, group) for ch in range(v)
            for mb in range(lo, min(lo + group, m))]


def interleaved(m: int, p: int, v: int, stage: int, group: int = 0, extra: int = 0
                ) -> list[Step]:
    """Micro-batch groups of ``group``, or of p where 0; ``extra`` more warm-up forwards
    (combined 1F1B's one)."""
    total, table = m * v, _table(m, v, group or p)
    fwd: list[Step] = [("F", mb, ch) for mb, ch in table]
    bwd: list[Step] = [("B", mb, v - 1 - ch) for mb, ch in table]
    warmup = interleaved_warmup(m, p, v, stage, group, extra)
    out = fwd[:warmup]
    for i in range(total - warmup):
        out.append(fwd[warmup + i])
        out.append(bwd[i])
    return out + bwd[total - warmup:]


def interleaved_warmup(m: int, p: int, v: int, stage: int, group: int = 0, extra: int = 0
                       ) -> int:
    """The warm-up forwards of ``interleaved``: (p − stage − 1)·2 + (v − 1)·N + ``extra``, at
    most every virtual micro-batch."""
    return min((p - stage - 1) * 2 + (v - 1) * (group or p) + extra, m * v)


def zb_v(m: int, p: int, stage: int) -> list[Step]:
    """ZB-V: chunk 0 is global chunk ``stage``, chunk 1 global chunk 2p − 1 − ``stage``. As
    many micro-batches as the full pattern needs (2p − 1) are laid out and those past m left
    out (a shorter run keeps the order of the ones it has)."""
    n = max(2 * p - 1, m)
    out: list[Step] = []
    done = {(ph, ch): 0 for ph in "FBW" for ch in (0, 1)}

    def run(*steps: tuple[Phase, int]) -> None:
        for ph, ch in steps:
            out.append((ph, done[ph, ch], ch))
            done[ph, ch] += 1

    for _ in range(2 * (p - stage) - 1):  # chunk 0's warm-up
        run(("F", 0))
    for _ in range(stage):
        run(("F", 1), ("F", 0))
    for _ in range(p - stage):  # chunk 1 turns round on this stage
        run(("F", 1), ("B", 1), ("W", 1))
    while done["F", 1] < done["F", 0] or done["F", 0] < n:  # steady: F B W on each chunk
        if done["F", 0] < n:
            run(("F", 0))
        run(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    for _ in range(stage):  # cool-down: B's whose W's wait, then B W on chunk 0
        run(("B", 0), ("B", 1))
    for _ in range(p - stage):
        run(("B", 0), ("W", 0))
    while done["W", 1] < done["B", 1]:  # the deferred W's, chunk 1's first
        run(("W", 1))
    while done["W", 0] < done["B", 0]:
        run(("W", 0))
    return [x for x in out if x[1] < m]


def dualpipe_v(m: int, p: int, stage: int, paired: bool = False) -> list[Step]:
    """DualPipe-V (PyTorch's ``ScheduleDualPipeV._calculate_single_rank_operations``, its
    steps 1-8): chunk 0 is global chunk ``stage``, chunk 1 global chunk 2p − 1 − ``stage``.
    Needs m ≥ 2p (``Strategy`` refuses fewer, as PyTorch does). Each paired forward and full
    backward runs F, B, W; ``paired`` (``dualpipe_v_units``' merged passes, for the memory
    walk) B, W, F instead: its backward frees what its forward then takes."""
    out: list[Step] = []
    for unit in dualpipe_v_units(m, p, stage):
        if len(unit) == 2:
            f, (_, j, ch) = unit
            full: list[Step] = [("B", j, ch), ("W", j, ch)]
            out += [*full, f] if paired else [f, *full]
        else:
            out.append(unit[0])
    return out


def dualpipe_v_units(m: int, p: int, stage: int) -> list[Unit]:
    """``dualpipe_v`` as its passes: PyTorch's OVERLAP_F_B actions as merged units (forward,
    backward) whose backward is a full one (weight gradients included: no W of its own),
    every other step alone."""
    out: list[Unit] = []
    done = {(ph, ch): 0 for ph in "FB" for ch in (0, 1)}
    waiting: list[tuple[int, int]] = []  # (micro-batch, chunk) of B's whose W is deferred

    def step(ph: Phase, ch: int) -> Step:
        got: Step = (ph, done[ph, ch], ch)
        done[ph, ch] += 1
        return got

    def bwd(ch: int, defer: bool) -> None:
        b = step("B", ch)
        out.append((b,))
        if defer:
            waiting.append((b[1], ch))
        else:
            out.append((("W", b[1], ch),))

    def pending_w() -> None:
        if waiting:
            j, ch = waiting.pop(0)
            out.append((("W", j, ch),))

    def pair(f_ch: int, b_ch: int) -> None:  # OVERLAP_F_B: a forward with a full backward
        out.append((step("F", f_ch), step("B", b_ch)))

    rest = p - stage - 1
    for _ in range(2 * rest):  # 1: chunk 0's warm-up
        out.append((step("F", 0),))
    for _ in range(stage + 1):  # 2: F0 F1
        out += [(step("F", 0),), (step("F", 1),)]
    for _ in range(rest):  # 3: B1 W1 F1 (the V turns round below)
        bwd(1, True)
        pending_w()
        out.append((step("F", 1),))
    for i in range(m - 2 * p + stage + 1):  # 4: F0 with B1, F1 with B0
        if i == 0 and stage == p - 1:  # ("we don't overlap these two chunks")
            out.append((step("F", 0),))
            bwd(1, False)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(rest):  # 5: B1, F1 with B0
        bwd(1, False)
        pair(1, 0)
    defer = False
    for i in range(stage + 1):  # 6: B1 B0, the second half's W's deferred
        if i == (stage + 1) // 2 and stage % 2 == 1:
            defer = True
        bwd(1, defer)
        if i == (stage + 1) // 2 and stage % 2 == 0:
            defer = True
        bwd(0, defer)
    for _ in range(rest):  # 7: W, B0
        pending_w()
        bwd(0, True)
    for _ in range(stage + 1):  # 8: the W's left
        pending_w()
    return out


def interleaved_zb(m: int, p: int, v: int, stage: int) -> list[Step]:
    """Interleaved zero bubble (PyTorch's ``ScheduleInterleavedZeroBubble``, the ZB1P schedule
    of Qi et al. 2024 on interleaved chunks; ``_calculate_single_rank_operations`` with
    ``_get_1f1b_rank_ops(..., enable_zero_bubble=True)`` written again): micro-batches run in
    rounds of N = m // max(1, m // p) (``Strategy`` refuses an m the rounds do not divide),
    each round through chunk 0, 1, …; (v − 1)·N + p − 1 − stage warm-up forwards (one per hop,
    where interleaved 1F1B waits two), then each forward with a B pass of the mirrored chunk,
    then the cool-down's B passes; from the stage's (stage + 1)-th B on, each B followed by
    the W of the oldest B still without one, the rest after the last B."""
    group = m // max(1, m // p)
    warmup = min((v - 1) * group + p - 1 - stage, m * v)
    done = {(ph, ch): 0 for ph in "FBW" for ch in range(v)}
    out: list[Step] = []
    waiting: list[int] = []  # the chunks of the B's whose W has not run, oldest first

    def run(ph: Phase, ch: int) -> None:
        out.append((ph, done[ph, ch], ch))
        done[ph, ch] += 1

    def back(op: int) -> None:
        ch = v - 1 - ((op - warmup) // group) % v
        run("B", ch)
        waiting.append(ch)
        if op - warmup >= stage:
            run("W", waiting.pop(0))

    for op in range(m * v):
        run("F", (op // group) % v)
        if op >= warmup:
            back(op)
    for op in range(m * v, m * v + warmup):
        back(op)
    while waiting:
        run("W", waiting.pop(0))
    return out


def stage_order(schedule: str, *, m: int, p: int, v: int, stage: int) -> list[Step]:
    """The op order of ``stage`` for ``m`` micro-batches on ``p`` stages with ``v`` chunks.
    ``schedule``: a schedule's name, or ``Strategy.order_id`` (``interleaved_1f1b/N`` for a
    micro-batch group of N)."""
    if schedule == "gpipe":
        return gpipe(m)
    if schedule == "1f1b":
        return one_f_one_b(m, p, stage)
    if schedule == "zb_h1":
        return zb_h1(m, p, stage)
    if schedule == "zb_v":
        return zb_v(m, p, stage)
    name, merged, _ = schedule.partition("+")
    if name == "dualpipe_v":
        return dualpipe_v(m, p, stage, bool(merged))
    if name == "interleaved_zb":
        return interleaved_zb(m, p, v, stage)
    _, _, group = name.partition("/")
    return interleaved(m, p, v, stage, int(group or 0), 1 if merged else 0)


def combined(schedule: str, *, m: int, p: int, v: int, stage: int) -> list[Unit]:
    """``stage_order`` as combined 1F1B runs it, merged units (forward, backward) and single
    steps. Without a pipeline (1F1B's F0 B0 F1 B1 …): F0, then (F(j + 1), B(j)) for each j
    but the last, then the last B (``combined_1f1b_schedule_for_no_pipelining``).
    Interleaved (an ``+a2a`` order id: one warm-up forward more than the interleaved one's),
    the warm-up forwards alone, each steady (F, B) merged, the cool-down backwards alone;
    nothing merges where the warm-up holds every forward (Megatron-Core's
    ``are_all_microbatches_in_warmup``). DualPipe-V: its OVERLAP_F_B pairs merged
    (``dualpipe_v_units``)."""
    if schedule.startswith("dualpipe_v"):
        return dualpipe_v_units(m, p, stage)
    order = stage_order(schedule, m=m, p=p, v=v, stage=stage)
    if p == 1:
        out: list[Unit] = [(order[0],)]
        out += [(order[i + 1], order[i]) for i in range(1, len(order) - 1, 2)]
        return [*out, (order[-1],)] if len(order) > 1 else out
    group = schedule.partition("+")[0].partition("/")[2]
    warmup = interleaved_warmup(m, p, v, stage, int(group or 0), 1)
    end = warmup + 2 * (m * v - warmup)  # (the steady pairs: F, B, F, B, …)
    units: list[Unit] = [(step,) for step in order[:warmup]]
    units += [(order[i], order[i + 1]) for i in range(warmup, end, 2)]
    return units + [(step,) for step in order[end:]]
