"""Study files (TOML): what to train, on what, how, and what can go wrong.

::

    model = "llama3-70b"            # preset, a TOML/JSON model file or a Hugging Face config.json
    seq_len = 32768                 # tokens a sequence (default: the model's own; a Hugging
                                    # Face config has none: give it)
    documents = "2000~1.0"          # a document mask: mean document length in tokens ~ the
                                    # σ of their logarithm (tracegen/documents.py; default none)
    system = "dgx-h100"             # preset or path to a TOML system file
    gpus = 1024
    global_batch_size = 512
    tokens = 1.5e12                 # token budget (time-to-train)
    deadline_days = 60              # `trainsim scale`: the fewest GPUs done by then in nine
                                    # runs of ten (needs tokens; --deadline overrides)
    stack = "megatron-bridge"       # a framework's settings (analysis/stacks.py: overlaps,
                                    # FP8 gathers, fused loss, attention kernel…) on each
                                    # strategy that leaves the field and can use it

    [[strategies]]                  # compare: a list of strategies (dp follows from gpus)
    tp = 8
    pp = 4
    micro_batch_size = 1
    sequence_parallel = true

    [search]                        # sweep: the space to enumerate (lists of values)
    tp = [1, 2, 4, 8]               # also pp, vpp, micro_batch_size, recompute, zero_stage,
                                    # sequence_parallel; optional cp, ep, expert_tp,
                                    # schedule (e.g. ["1f1b", "zb_h1"]; "zb_v" and
                                    # "dualpipe_v" with vpp 2, "interleaved_zb" with
                                    # vpp ≥ 2), tp_comm_overlap,
                                    # overlap_param_gather,
                                    # zero3_prefetch, recompute_num_layers (with "full"),
                                    # dist_opt_instances (ZeRO ≥ 1, dense models),
                                    # outer_dp_sharding_strategy ("optim": HFSDP),
                                    # grad_reduce_per_microbatch (ZeRO 0-2: DeepSpeed's
                                    # ZeRO-2, FSDP's SHARD_GRAD_OP), cross_entropy_fusion
                                    # ("none", "native", "te"), cp_comm_type ("p2p",
                                    # "all_gather"), cp_balance ("document", "sequence":
                                    # under a document mask)

    [failures]                      # a preset, or rate_per_gpu_hour (+ weibull_shape)
    preset = "llama3-16k-h100"

    [checkpoint]                    # storage and checkpoint mode
    mode = "async"                  # sync | async | in_memory
    storage_GBps = 200.0            # aggregate storage write/read bandwidth (10^9 B/s)
    host_copy_GBps = 55.0           # per GPU, device → host snapshot (async, in_memory);
                                    # left out: the system's host link (host_link_GBps)

    [restart]                       # seconds
    scheduling_s = 300.0
    init_s = 60.0
    warmup_s = 60.0

    [policies.replica_local]        # per-policy overrides (see analysis/resilience.py)
    stall_s = 180.0

    [fail_slow]                     # stragglers over the run (analysis/fail_slow.py); needs
    rate_per_gpu_hour = 2e-5        # [failures]: episodes per GPU-hour, their mean length,
    mean_duration_s = 3600          # how slow the GPU runs, and (optional) how long until
    slowdown = 2.0                  # it is evicted (a restart)
    detect_s = 600

    [mixed]                         # part of the cluster on another system's GPUs, as whole
    system = "dgx-a100-80gb"        # pipeline stages (analysis/mixed.py, ``place``): compare and
    gpus = 512                      # sweep cost each strategy so, layers split by the stages'
    balance = true                  # speeds (false: evenly) and replay it with [[gpu]] on them
    failure_rate_factor = 1.5       # optional: its GPUs fail 1.5× as often as [failures] says
    fail_slow_rate_factor = 2.0     # optional: and run slow twice as often as [fail_slow] says
    slow_links_rate_factor = 1.0    # optional: their NICs slow as often as [slow_links] says

    [slow_links]                    # slow NICs over the run (analysis/slow_links.py); needs
    rate_per_gpu_hour = 1e-5        # [failures]: episodes per GPU's NIC per hour, their mean
    mean_duration_s = 1800          # length, the share of its bandwidth the NIC keeps, and
    bandwidth_factor = 0.25         # (optional detect_s) how long until its node is evicted

    [gpu_spread]                    # identical GPUs are not equally fast (analysis/
    sd = 0.02                       # gpu_spread.py); needs [failures]: the relative standard
                                    # deviation of a GPU's compute time across the fleet

    [site_links]                    # degraded links between sites (analysis/site_links.py);
    rate_per_hour = 0.002           # needs [failures] and a system of several sites: episodes
    mean_duration_s = 7200          # an hour on the links between the sites, their mean length,
    bandwidth_factor = 0.5          # the share of their bandwidth left, and (optional
    latency_us = 600                # latency_us) the one-way latency meanwhile
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from analysis.resilience import failure_model, recovery_inputs
from analysis.stacks import Stack, get_stack, stack_model, stack_system, with_stack_strategy
from replay.hardware import SystemSpec, resolve_system
from tracegen import ConfigError, ModelSpec, Strategy, resolve_model
from tracegen._config import is_finite_number, load_mapping
from tracegen.catalog import DOC_SUFFIX, SEQ_SUFFIX
from tracegen.errors import unknown_key
from tracegen.fit import check_fits_model

KNOWN_KEYS = {"model", "seq_len", "documents", "system", "gpus", "global_batch_size", "tokens",
              "strategies", "search", "failures", "checkpoint", "restart", "policies", "name",
              "rank_by", "fail_slow", "slow_links", "site_links", "mixed", "gpu_spread",
              "deadline_days", "stack"}


# each table whose events the other system's GPUs may have at their own rate: its [mixed] key
RATE_KEYS = {"failures": "failure_rate_factor", "fail_slow": "fail_slow_rate_factor",
             "slow_links": "slow_links_rate_factor"}
MIXED_KEYS = {"system", "gpus", "balance", *RATE_KEYS.values()}


@dataclasses.dataclass(frozen=True, slots=True)
class MixedCluster:
    """A study's ``[mixed]`` table: ``gpus`` of the study's GPUs are ``system``'s, as whole
    pipeline stages; ``balance``: split the layers by the stages' speeds."""

    system: SystemSpec
    gpus: int
    balance: bool = True
    ref: str = ""  # the system as the study names it (``--stage-system`` takes it)
    failure_rate_factor: float = 1.0  # its GPUs' failure rate over the [failures] one
    fail_slow_rate_factor: float = 1.0  # its GPUs' fail-slow episode rate over [fail_slow]'s
    slow_links_rate_factor: float = 1.0  # its NICs' slow-link episode rate over [slow_links]'

    def job_rate_factor(self, gpus: int, table: str = "failures") -> float:
        """The job's rate of ``table``'s events (failures, fail-slow or slow-link episodes)
        over that of ``gpus`` GPUs all at the table's rate: Poisson processes add,
        (n − k + f·k) / n for k of them at f times the rate."""
        return 1 + (self.rate_factor(table) - 1) * self.gpus / gpus

    def rate_factor(self, table: str) -> float:
        """This system's GPUs' rate of ``table``'s events over the table's own rate."""
        return float(getattr(self, RATE_KEYS[table]))


@dataclasses.dataclass(frozen=True, slots=True)
class Study:
    name: str
    model: ModelSpec
    system: SystemSpec
    gpus: int
    global_batch_size: int
    tokens: float
    strategies: tuple[Strategy, ...]
    search: dict[str, list[Any]]
    failures: dict[str, Any]
    checkpoint: dict[str, Any]
    restart: dict[str, Any]
    policies: dict[str, dict[str, Any]]
    rank_by: str
    fail_slow: dict[str, Any] = dataclasses.field(default_factory=dict)
    slow_links: dict[str, Any] = dataclasses.field(default_factory=dict)
    site_links: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the model and system as the command line names them (a preset, NAME@seqN, or a file's
    # path), for the commands that take a result further (``strategy_row.estimate_command``)
    model_ref: str = ""
    system_ref: str = ""
    mixed: MixedCluster | None = None
    gpu_spread: dict[str, Any] = dataclasses.field(default_factory=dict)
    deadline_days: float | None = None  # (``analysis.scaling``: the fewest GPUs done by then)
    # a framework's settings (``analysis.stacks``): on the model and system here, on each
    # strategy where its table or the search space leaves a field and the layout can use it
    stack: str = ""

    @property
    def has_failures(self) -> bool:
        return bool(self.failures)


# What a study can rank by: the step, the expected time to train, or the day nine runs in ten
# end by (``rank_key``).
RANK_BY = ("step_time", "time_to_train", "time_to_train_p90")


def rank_key(rank_by: str) -> str:
    """The result column a ranking sorts on. For ``time_to_train_p90`` a sweep's screened
    rows, which carry no spread (it is worked out for the replayed ones), sort on the expected
    time (``analysis.compare.rank``)."""
    return {"time_to_train": "time_to_train_s",
            "time_to_train_p90": "time_to_train_p90_s"}.get(rank_by, "step_time_s")


def _rank_by(data: dict[str, Any], name: str) -> str:
    rank_by = str(data.get("rank_by", "time_to_train" if data.get("failures") else "step_time"))
    what = f"study {name!r}"
    if rank_by not in RANK_BY:
        raise ConfigError(f"rank_by must be one of {', '.join(map(repr, RANK_BY))}, got "
                          f"{rank_by!r}", what=what)
    if rank_by == "time_to_train_p90" and not data.get("failures"):
        raise ConfigError("rank_by = 'time_to_train_p90' needs [failures]: the spread of the "
                          "end date is the failure process's; without failures rank by "
                          "time_to_train", what=what)
    if data.get("rank_by") == "time_to_train" and not data.get("tokens") and not data.get(
            "failures"):  # no time to train to rank by: the order had been arbitrary
        raise ConfigError("rank_by = 'time_to_train' needs tokens (the token budget to train "
                          "on); set tokens or rank by step_time", what=what)
    return rank_by


def load_study(path: str | Path) -> Study:
    p = Path(path)
    data = load_mapping(p, what="study file")
    return study_from_dict(data, name=data.get("name", p.stem), base=p.parent)


def study_from_dict(data: dict[str, Any], *, name: str = "study", base: Path | None = None
                    ) -> Study:
    unknown = sorted(set(data) - KNOWN_KEYS)
    problems = [unknown_key(k, KNOWN_KEYS) for k in unknown]
    for key in ("model", "system", "gpus", "global_batch_size"):
        if key not in data:
            problems.append(f"missing required key {key!r}")
    problems += _type_problems(data)
    if problems:
        raise ConfigError(problems, what=f"study {name!r}")
    model_ref, system_ref = _rel(data["model"], base), _rel(data["system"], base)
    model = resolve_model(model_ref, data.get("seq_len", 0), data.get("documents", ""))
    model_ref = _model_ref(model_ref, model)
    system = resolve_system(system_ref)
    stack = _stack(data, name)
    if stack is not None:
        model = stack_model(stack, model)
        system, _ = stack_system(stack, system, kernel_given="@" in system_ref)
    gpus, gbs = data["gpus"], data["global_batch_size"]
    strategies = _strategies(data.get("strategies", []), gpus, gbs, model, stack)
    mixed = _mixed(data, base, name)
    if mixed is not None:
        problems = []
        for i, s in enumerate(strategies):
            try:
                mixed_stages(s, mixed.gpus, mixed.system.name)
            except ConfigError as exc:
                problems += [f"strategy #{i + 1}: {p}" for p in exc.problems]
        if problems:
            raise ConfigError(problems, what=f"study {name!r}")
    _check_resilience_tables(data, system)
    rank_by = _rank_by(data, name)
    deadline = data.get("deadline_days")
    if deadline is not None and not data.get("tokens"):
        raise ConfigError("deadline_days needs tokens (the token budget the run must finish "
                          "by then): set tokens, or leave the deadline out",
                          what=f"study {name!r}")
    return Study(name, model, system, gpus, gbs, float(data.get("tokens", 0.0)), strategies,
                 dict(data.get("search", {})), dict(data.get("failures", {})),
                 dict(data.get("checkpoint", {})), dict(data.get("restart", {})),
                 dict(data.get("policies", {})), rank_by, dict(data.get("fail_slow", {})),
                 dict(data.get("slow_links", {})), dict(data.get("site_links", {})),
                 model_ref, system_ref, mixed, dict(data.get("gpu_spread", {})),
                 None if deadline is None else float(deadline),
                 stack.name if stack is not None else "")


def _stack(data: dict[str, Any], name: str) -> Stack | None:
    """The study's ``stack``, or None; a ConfigError naming the known ones otherwise."""
    if "stack" not in data:
        return None
    if not isinstance(data["stack"], str):
        raise ConfigError(f"stack must be a stack's name (e.g. \"megatron-bridge\"), got "
                          f"{data['stack']!r}", what=f"study {name!r}")
    return get_stack(data["stack"], what=f"study {name!r}")


TABLE_KEYS = ("search", "failures", "checkpoint", "restart", "policies", "fail_slow",
              "slow_links", "site_links", "mixed", "gpu_spread")


def _model_ref(ref: str, model: ModelSpec) -> str:
    """``ref`` with the study's seq_len and documents appended as --model takes them: the
    suffixes the model's name ends with, ``@seqN`` then ``@docMEAN~SIGMA``."""
    name, at_doc, docs = model.name.rpartition(DOC_SUFFIX)
    if not (at_doc and name and model.document_mean_tokens):
        name, at_doc, docs = model.name, "", ""
    base = ref.rpartition(DOC_SUFFIX)[0] if at_doc and DOC_SUFFIX in ref else ref
    _, at, length = name.rpartition(SEQ_SUFFIX)
    if at and not base.endswith(at + length):  # the study's seq_len
        base += at + length
    return base + at_doc + docs


def _type_problems(data: dict[str, Any]) -> list[str]:
    """What is of the wrong type or out of range among the study's own values (the model,
    system and strategies are checked where they are read; the resilience tables by
    ``_check_resilience_tables``)."""
    out = []
    for key in ("gpus", "global_batch_size", "seq_len"):
        v = data.get(key)
        if key in data and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            out.append(f"{key} must be a whole number ≥ 1, got {v!r}")
    tokens = data.get("tokens", 0.0)
    if not is_finite_number(tokens) or tokens < 0:
        out.append(f"tokens must be a number ≥ 0 (tokens to train on), got {tokens!r}")
    deadline = data.get("deadline_days")
    if "deadline_days" in data and (not is_finite_number(deadline) or deadline <= 0):
        out.append(f"deadline_days must be a number of days > 0, got {deadline!r}")
    if "documents" in data and not isinstance(data["documents"], str):
        out.append(f"documents must be a string MEAN~SIGMA (e.g. \"2000~1.0\"), got "
                   f"{data['documents']!r}")
    for key in ("model", "system"):
        if key in data and not isinstance(data[key], str):
            out.append(f"{key} must be a preset name or a file path, got {data[key]!r}")
    out += [f"{key} must be a table ([{key}] in TOML), got {data[key]!r}"
            for key in TABLE_KEYS if key in data and not isinstance(data[key], dict)]
    if "strategies" in data and not (isinstance(data["strategies"], list)
                                     and all(isinstance(s, dict) for s in data["strategies"])):
        out.append("strategies must be a list of tables ([[strategies]] in TOML)")
    return out


def _check_resilience_tables(data: dict[str, Any], system: SystemSpec) -> None:
    """[failures], [checkpoint], [restart] and [policies] checked as the study is read: they
    are costed only after each strategy's step (and a failure model only for one that fits),
    so a typo found there would cost a sweep's screening and replays first, or pass unseen."""
    if data.get("failures"):
        failure_model(dict(data["failures"]), gpus_per_host=system.node.host_gpus)
    recovery_inputs(dict(data.get("checkpoint", {})), dict(data.get("restart", {})),
                    dict(data.get("policies", {})))
    from analysis.fail_slow import fail_slow_from
    from analysis.slow_links import slow_links_from

    for table, check in (("fail_slow", fail_slow_from), ("slow_links", slow_links_from)):
        if not data.get(table):
            continue
        check(dict(data[table]))
        if not data.get("failures"):  # its evictions are restarts, costed as failures are
            raise ConfigError(f"[{table}] needs a [failures] table (the recovery policies "
                              "its episodes are costed under): add preset = NAME or "
                              "rate_per_gpu_hour", what="study")
    _check_site_links(data, system)
    _check_gpu_spread(data)


def _check_gpu_spread(data: dict[str, Any]) -> None:
    """[gpu_spread] checked as the study is read: its one key, its range, a [failures] table
    (the goodput it is costed in)."""
    table = data.get("gpu_spread")
    if not table:
        return
    from analysis.gpu_spread import check_sd

    extra = sorted(set(table) - {"sd"})
    if extra or "sd" not in table:
        raise ConfigError(f"[gpu_spread] takes sd (a GPU's compute time's relative standard "
                          f"deviation across the fleet); unknown keys: {extra}", what="study")
    check_sd(table["sd"], what="study [gpu_spread]")
    if not data.get("failures"):
        raise ConfigError("[gpu_spread] needs a [failures] table (its wait is costed in the "
                          "goodput of each recovery policy): add preset = NAME or "
                          "rate_per_gpu_hour", what="study")


def _check_site_links(data: dict[str, Any], system: SystemSpec) -> None:
    """[site_links] checked as the study is read: its keys, a system of several sites, a
    [failures] table (the policies its goodput is costed under)."""
    if not data.get("site_links"):
        return
    from analysis.site_links import check_system, site_links_from

    site_links_from(dict(data["site_links"]))
    check_system(system)
    if not data.get("failures"):
        raise ConfigError("[site_links] needs a [failures] table (the recovery policies its "
                          "episodes are costed under): add preset = NAME or rate_per_gpu_hour",
                          what="study")


def mixed_stages(s: Strategy, gpus: int, system: str) -> int:
    """How many of ``s``'s pipeline stages ``gpus`` GPUs of another system fill, or the
    ConfigError that says they do not fill whole stages short of all of them."""
    per_stage = s.world_size // s.pp
    k, rest = divmod(gpus, per_stage)
    if rest or not 0 < k < s.pp:
        raise ConfigError(
            f"{gpus:,} {system} GPUs are not whole pipeline stages of {s.label()} short of "
            f"all of them ({per_stage:,} GPUs a stage, pp {s.pp}); a mixed cluster takes a "
            "pipeline whose stages the other GPUs fill whole", what="mixed cluster")
    return k


def _mixed(data: dict[str, Any], base: Path | None, name: str) -> MixedCluster | None:
    """The ``[mixed]`` table, checked as the study is read (every problem at once)."""
    table = data.get("mixed")
    if not table:
        return None
    problems = [unknown_key(k, MIXED_KEYS, label="[mixed]: unknown key")
                for k in sorted(set(table) - MIXED_KEYS)]
    gpus, ref = table.get("gpus"), table.get("system")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 < gpus < data["gpus"]:
        problems.append(f"[mixed] gpus is how many of the study's {data['gpus']} GPUs are the "
                        f"other system's: a whole number between 1 and {data['gpus'] - 1}, got "
                        f"{gpus!r}")
    if not isinstance(ref, str):
        problems.append(f"[mixed] system must be a preset name or a file path, got {ref!r}")
    if not isinstance(table.get("balance", True), bool):
        problems.append(f"[mixed] balance is true or false, got {table['balance']!r}")
    factors = {key: table.get(key, 1.0) for key in RATE_KEYS.values()}
    problems += [p for events, key in RATE_KEYS.items()
                 for p in _rate_problems(key, factors[key], events, data)]
    if problems:
        raise ConfigError(problems, what=f"study {name!r}")
    ref = _rel(ref, base)
    return MixedCluster(resolve_system(ref), gpus, table.get("balance", True), ref,
                        **{k: float(v) for k, v in factors.items()})


_EVENTS = {"failures": "fail", "fail_slow": "run slow (fail-slow episodes)",
           "slow_links": "have slow NICs (slow-link episodes)"}


def _rate_problems(key: str, factor: Any, events: str, data: dict[str, Any]) -> list[str]:
    """What is wrong with a ``[mixed]`` rate factor: it scales the rate of ``events`` (a
    study table's name), which must then be there."""
    if not is_finite_number(factor) or factor <= 0:
        return [f"[mixed] {key} is how many times as often its GPUs {_EVENTS[events]} as the "
                f"[{events}] rate says (1.5: half again as often), a positive number, got "
                f"{factor!r}"]
    if factor != 1.0 and not data.get(events):
        return [f"[mixed] {key} scales the [{events}] rate: add a [{events}] table"]
    return []


def _rel(value: str, base: Path | None) -> str:
    if base is not None and str(value).endswith((".toml", ".json")):
        candidate = base / value
        if candidate.exists():
            return str(candidate)
    return str(value)


def _strategies(listed: list[dict[str, Any]], gpus: int, gbs: int, model: ModelSpec,
                stack: Stack | None = None) -> tuple[Strategy, ...]:
    """Every listed strategy (with the stack's values where its table leaves a field the
    layout can use), checked against the model too, or one error naming each strategy's
    problems (not the first alone, and not only when its replay comes up)."""
    out, problems = [], []
    for i, d in enumerate(listed):
        try:
            s = _strategy(d, gpus, gbs)
            if stack is not None:
                s = with_stack_strategy(stack, s, model, given=set(d))
            check_fits_model(s, model)
            out.append(s)
        except ConfigError as exc:
            problems += [f"strategy #{i + 1}: {p}" for p in exc.problems]
    if problems:
        raise ConfigError(problems, what="study")
    return tuple(out)


def _strategy(d: dict[str, Any], gpus: int, gbs: int) -> Strategy:
    d = dict(d)
    degrees = {k: d.get(k, 1) for k in ("tp", "pp", "cp", "vpp")}  # what dp and schedule follow
    bad = [f"{k} must be a whole number ≥ 1, got {v!r}" for k, v in degrees.items()
           if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ConfigError(bad, what="study")
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees["cp"]
    if gpus % (tp * pp * cp):
        raise ConfigError(f"gpus {gpus} is not divisible by tp·pp·cp = {tp * pp * cp}",
                          what="study")
    d.setdefault("dp", gpus // (tp * pp * cp))
    d.setdefault("global_batch_size", gbs)
    if degrees["vpp"] > 1:
        d.setdefault("schedule", "interleaved_1f1b")
    return Strategy.from_dict(d)
