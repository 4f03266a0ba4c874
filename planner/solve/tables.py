"""The numbers one solver model needs for one choice of degrees and schedule (a ``Config``).

Everything here comes from the cost model the estimate uses (``planner.costs``) and from the
schedule's op order (``planner.schedules``), so the solver states the estimate's own
formulas over these numbers:

- per block kind (dense layer, MoE layer, embedding, each MTP module, head) and recompute
  choice: its ``BlockRow`` of times, saved and rebuilt activation bytes, state bytes;
- per stage: its transfers (``costs.quantities.StageComm``): the pipeline sends, the expert
  all-to-alls per MoE layer, and the rates of its gradient reduction and ZeRO collectives
  (a collective of x bytes takes a x + c seconds, c only when x > 0), each with the share
  it keeps each link busy;
- per rank: how many tasks of each kind its op order runs and the activation levels its
  order passes through.

How those numbers combine into a step time is not stated here: the solver takes the chains
of tasks ``planner.timeline`` reports (``Timeline.forms``) and states them over its variables.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planner.costs.activations import activation_levels
from planner.costs.blocks import BlockCost, Param, Shard, block_cost, block_names
from planner.costs.comm import Network, Transfer
from planner.costs.compute import Rates
from planner.costs.memory import (
    held_bytes,
    reduce_bucket_bytes,
    ring_buffer_bytes,
    shard_of,
)
from planner.costs.overlap import overlap_of
from planner.costs.quantities import Bytes, StageComm
from planner.costs.state import shards, state_bytes
from planner.costs.timing import (
    BlockRow,
    StepRates,
    TpComm,
    block_row,
    first_rank,
    position_comm,
    stage_bytes,
    stage_comm,
    stage_sends,
)
from planner.frameworks import Overlap
from planner.layout import Layout, parse_recompute
from planner.memo import Memo
from planner.schedules import Schedule, ep_overlap_forbids, op_order, schedule_of
from planner.specs import DTYPE_BYTES, ClusterSpec, ModelSpec, TrainingJob

GiB = float(2**30)


@dataclass(frozen=True)
class Config:
    """The outer decisions: degrees, ZeRO stage, micro-batch, schedule, EMA placement."""

    tp: int
    pp: int
    dp: int
    ep: int
    zero: int
    micro_batch: int
    schedule: str
    virtual_stages: int
    ema: str
    num_microbatches: int
    fp8_cache: bool = False
    cp: int = 1
    sequence_parallel: bool = True
    etp: int = 1
    optimizer_offload: float = 0.0
    # Recompute choices the search space lists: the bound tables (which price each block's
    # whole menu) price these too, so a bound covers every choice a layout may take.
    recompute_extra: frozenset[str] = frozenset()
    cp_comm_type: str = "p2p"  # Layout.cp_comm_type (p2p wherever cp is 1)
    cp_a2a_size: int | None = None  # Layout.cp_a2a_size (a2a+p2p only)
    zero_hpz: int = 1  # Layout.zero_hpz (ZeRO-3 only)
    param_offload: bool = False  # Layout.param_offload (ZeRO-3 only)

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def key(self, *, ignoring: frozenset[str] = frozenset()) -> tuple[object, ...]:
        """This configuration as (part of) a cache key: every field but those named in
        ``ignoring`` (what a cached piece does not depend on; ``planner.memo``)."""
        return _fields_but(ignoring)(self)  # type: ignore[no-any-return]

    @property
    def pipeline(self) -> Schedule:
        """The schedule's registry entry."""
        return schedule_of(self.schedule)

    @property
    def copies(self) -> int:
        """Ranks that hold each stage (DualPipe keeps two copies of the model)."""
        return self.pipeline.copies

    @classmethod
    def of(cls, layout: Layout, num_microbatches: int) -> Config:
        """The outer decisions of ``layout``."""
        return cls(
            layout.tp,
            layout.pp,
            layout.dp,
            layout.ep,
            layout.zero,
            layout.micro_batch,
            layout.schedule,
            layout.virtual_stages,
            layout.ema,
            num_microbatches,
            layout.fp8_cache,
            layout.cp,
            layout.sequence_parallel,
            layout.etp,
            layout.optimizer_offload,
            cp_comm_type=layout.cp_comm_type if layout.cp > 1 else "p2p",
            cp_a2a_size=layout.cp_a2a_size if layout.cp > 1 else None,
            zero_hpz=layout.zero_hpz,
            param_offload=layout.param_offload,
        )

    def layout(self, model: ModelSpec, counts: list[int], recompute: dict[str, str]) -> Layout:
        return Layout.from_counts(
            model,
            counts=counts,
            pp=self.pp,
            tp=self.tp,
            cp=self.cp,
            cp_comm_type=self.cp_comm_type,
            cp_a2a_size=self.cp_a2a_size,
            zero_hpz=self.zero_hpz,
            param_offload=self.param_offload,
            dp=self.dp,
            ep=self.ep,
            etp=self.etp,
            zero=self.zero,
            micro_batch=self.micro_batch,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            recompute=recompute,
            ema=self.ema,
            fp8_cache=self.fp8_cache,
            sequence_parallel=self.sequence_parallel,
            optimizer_offload=self.optimizer_offload,
        )


@functools.cache
def _fields_but(ignoring: frozenset[str]) -> Callable[[Config], Any]:
    """A getter of every ``Config`` field but ``ignoring``, as a tuple."""
    names = [f.name for f in dataclasses.fields(Config)]
    unknown = ignoring - set(names)
    assert not unknown, f"not fields of Config: {sorted(unknown)}"
    return operator.attrgetter(*(n for n in names if n not in ignoring))


def tie_break(c: Config) -> tuple[object, ...]:
    """Deterministic tie-break between configurations."""
    return (
        c.pp,
        c.tp,
        c.cp,
        c.cp_comm_type,
        c.cp_a2a_size or 0,
        c.zero_hpz,
        c.param_offload,
        c.ep,
        c.etp,
        c.zero,
        c.micro_batch,
        c.schedule,
        c.virtual_stages,
        c.ema,
        c.fp8_cache,
        c.sequence_parallel,
        c.optimizer_offload,
    )


def choice_name(choice: frozenset[str] | str) -> str:
    """The recompute string of a choice (``Layout`` and the exporters read these)."""
    if isinstance(choice, str):
        return choice
    return "+".join(sorted(choice)) if choice else "none"


@dataclass(frozen=True)
class Option:
    """One recompute choice of one block kind, with everything it costs."""

    name: str
    row: BlockRow
    saved: float  # activation bytes kept per micro-batch
    rebuilt: float  # bytes rebuilt while its backward runs
    time: float  # fwd + bwd (for dominance)


@dataclass
class Kind:
    """A block kind: every block of it costs the same (layers of one type, or one block)."""

    name: str
    cost: BlockCost
    options: list[Option]
    state: dict[str, float]  # weights, grads, optimizer, ema, host bytes of one block
    nbytes: dict[Bytes, float]  # what its collectives move (``costs.timing.stage_bytes``)
    shard_weight: float  # its weights on one rank before ZeRO-3 sharding (the gather buffer)


@dataclass
class RankOrder:
    """What a rank's op order implies, independent of the stage contents."""

    chunks: list[int]
    tasks: Counter[tuple[Any, ...]]  # ("F"|"B"|"W"|"BW", stage) or ("pair", f, b, kind)
    levels: list[tuple[tuple[int, ...], int | None]]  # per-chunk counts, rebuilding chunk


@dataclass
class Tables:
    config: Config
    layer_kinds: list[str]  # kind name of each transformer layer, in order
    kinds: dict[str, Kind]
    first_fixed: list[str]  # fixed blocks of stage 0 (embedding)
    last_fixed: list[str]  # fixed blocks of the last stage (MTP modules, head)
    comm: list[StageComm]  # each stage's transfers
    ranks: list[RankOrder]
    fixed_state: list[dict[str, float]]  # per rank: state bytes of its fixed blocks (deduped)
    fixed_bytes: list[dict[Bytes, float]]  # per stage: what its fixed blocks' collectives move
    buffers: float  # communication buffers and pipeline send/receive tensors per rank
    step: StepRates  # the optimizer step's rates
    overlap: Overlap  # what runs beside compute (the framework's, on these GPUs)


def build(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    config: Config,
    network: Network,
    *,
    choices: list[str] | None = None,
    light: bool = False,
) -> Tables:
    """The tables of ``config`` (see the module docstring). ``choices`` limits the recompute
    options to those names (a ``SearchSpace.recompute``), else each block's whole menu.
    ``light`` leaves out the rank orders (bounds do not need them)."""
    proto = prototype(model, config)
    shard = shard_of(job, proto)
    layer_kinds = [layer_kind(model, i) for i in range(model.num_layers)]
    fixed = [n for n in block_names(model) if not n.startswith("layer.")]
    kinds = _KINDS.get(
        (
            model,
            job,
            cluster.model_dump_json(),
            None if choices is None else frozenset(choices),
            config.key(ignoring=_KINDS_IGNORE),
            config.pipeline.ep_overlap,
        ),
        lambda: _kinds(
            model,
            cluster,
            job,
            network,
            proto,
            shard,
            layer_kinds,
            fixed,
            choices,
            config.recompute_extra,
            forbid=config.pipeline.ep_overlap,
        ),
    )
    first_fixed = ["embedding"]
    last_fixed = [n for n in fixed if n != "embedding"]
    act = shard.sp_tokens * model.hidden_size * shard.act_bytes
    stages = config.stages
    sends = _SENDS.get(
        (model, job, network, config.key(ignoring=_SENDS_IGNORE)),
        lambda: stage_sends(model, proto, network, shard),
    )
    plane = proto.plane  # ranks of one pipeline position
    # Every position's groups sit on NVLink domains the same way when a domain holds whole
    # positions or a position whole domains: then one position's collective costs serve all.
    domain = network.gpus_per_node  # GPUs of one NVLink domain (ClusterSpec.domain_gpus)
    same = domain % plane == 0 or plane % domain == 0
    comm = []
    comm_key = config.key(ignoring=_COMM_IGNORE)
    if config.zero_hpz > 1:  # its gathers' mix depends on the micro-batches (_hpz_gather)
        comm_key += (config.num_microbatches,)
    pcie = Rates.of(cluster, job).pcie_Bps if config.param_offload else math.inf
    comm_key += (pcie,)
    for s in range(stages):
        rank = 0 if same else first_rank(proto, s)
        position = _STAGE_COMM.get(
            (model, job, network, rank, config.copies, comm_key),
            functools.partial(position_comm, model, job, proto, network, shard, rank, pcie),
        )
        comm.append(stage_comm(position, *sends[s]))
    ranks = (
        []
        if light
        else rank_orders(config.schedule, config.pp, config.num_microbatches, config.virtual_stages)
    )
    fixed_state, fixed_bytes = _fixed_tables(model, job, config, proto, shard)
    buffers = held_bytes(model, job, tp=config.tp, cp=config.cp, micro_batch=config.micro_batch)
    buffers += 2 * act if config.pp > 1 else 0.0
    buffers += reduce_bucket_bytes(model, job, proto)
    if config.cp > 1:  # the context ring's buffers, as ``costs.memory.stage_memory`` counts
        kinds_at = [f"layer.{layer_kinds.index(k)}" for k in dict.fromkeys(layer_kinds)]
        blocks = [block_cost(model, n, shard) for n in (*kinds_at, *fixed)]
        buffers += ring_buffer_bytes(config.cp, blocks)
    return Tables(
        config=config,
        layer_kinds=layer_kinds,
        kinds=kinds,
        first_fixed=first_fixed,
        last_fixed=last_fixed,
        comm=comm,
        ranks=ranks,
        fixed_state=fixed_state,
        fixed_bytes=fixed_bytes,
        buffers=buffers,
        step=StepRates.of(cluster),
        overlap=overlap_of(job, cluster, config.schedule),
    )


# -- pieces ---------------------------------------------------------------------------------

# Many configurations share a piece (every schedule of the same degrees, say): each piece is
# kept under its inputs and the configuration's fields but those it does not depend on.
_NOT_SHAPE = frozenset({"schedule", "virtual_stages", "num_microbatches"})
# Blocks' costs and state: the pipeline's schedule and micro-batch count aside.
_KINDS_IGNORE = _NOT_SHAPE
_KINDS: Memo[dict[str, Kind]] = Memo("tables.kinds")
# The sends: the holders of each stage and a micro-batch's hidden states, not the state.
_STATE = frozenset({"zero", "ema", "fp8_cache", "optimizer_offload", "recompute_extra"})
_SENDS_IGNORE = _STATE | {"ep", "etp", "num_microbatches"}
_SENDS: Memo[list[tuple[Transfer, Transfer]]] = Memo("tables.sends")
# A position's all-to-alls and collectives: its groups (the schedule only through the copies
# of each stage it keeps, a key of its own) and the ZeRO stage, not the rest of the state.
_COMM_IGNORE = _NOT_SHAPE | (_STATE - {"zero"})
_STAGE_COMM: Memo[StageComm] = Memo("tables.position_comm")
# The fixed blocks' state and bytes: not the micro-batches or the recompute choices.
_FIXED_IGNORE = frozenset({"micro_batch", "num_microbatches", "recompute_extra"})
FixedTables = tuple[list[dict[str, float]], list[dict[Bytes, float]]]
_FIXED: Memo[FixedTables] = Memo("tables.fixed")
_PROTO: Memo[Layout] = Memo("tables.prototype")


def _fixed_tables(
    model: ModelSpec, job: TrainingJob, config: Config, proto: Layout, shard: Any
) -> FixedTables:
    """``_fixed`` for ``config``, memoised on what it depends on."""
    fixed = [n for n in block_names(model) if not n.startswith("layer.")]
    first, last = ["embedding"], [n for n in fixed if n != "embedding"]
    return _FIXED.get(
        (model, job, config.key(ignoring=_FIXED_IGNORE)),
        lambda: _fixed(model, shard, job, proto, first, last, config.stages),
    )


def states(
    model: ModelSpec, job: TrainingJob, config: Config
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Each transformer layer's state bytes by bucket, in model order, and each rank's fixed
    blocks' (what ``build`` puts in ``Kind.state`` and ``Tables.fixed_state``), without
    pricing a single recompute option: all a check of the model state needs."""
    proto = prototype(model, config)
    shard = shard_of(job, proto)
    ema_on_gpu = proto.ema == "hbm"
    per_kind: dict[str, dict[str, float]] = {}
    layers = []
    for i in range(model.num_layers):
        kind = layer_kind(model, i)
        if kind not in per_kind:
            params = block_cost(model, f"layer.{i}", shard).params
            per_kind[kind] = state_bytes(params, job=job, layout=proto, ema_on_gpu=ema_on_gpu)
        layers.append(per_kind[kind])
    return layers, _fixed_tables(model, job, config, proto, shard)[0]


def prototype(model: ModelSpec, config: Config) -> Layout:
    """A layout of ``config`` with even stages and no recompute: what every layout of the
    configuration shares (degrees, rank order, schedule)."""
    base = dataclasses.replace(
        config,
        zero=1,
        zero_hpz=1,
        param_offload=False,
        micro_batch=1,
        ema="hbm",
        num_microbatches=1,
        fp8_cache=False,
        optimizer_offload=0.0,
    )
    shape = _PROTO.get(
        (model, base.key()), lambda: base.layout(model, even_counts(model, base), {})
    )
    # ZeRO stage, micro-batch, EMA placement and FP8 caching are valid on their own (the
    # enumeration checked them): copy them in without rebuilding every stage.
    return shape.model_copy(
        update={
            "zero": config.zero,
            "zero_hpz": config.zero_hpz,
            "param_offload": config.param_offload,
            "micro_batch": config.micro_batch,
            "ema": config.ema,
            "fp8_cache": config.fp8_cache,
            "optimizer_offload": config.optimizer_offload,
        }
    )


def _kinds(
    model: ModelSpec,
    cluster: ClusterSpec,
    job: TrainingJob,
    network: Network,
    proto: Layout,
    shard: Any,
    layer_kinds: list[str],
    fixed: list[str],
    choices: list[str] | None,
    extra: frozenset[str] = frozenset(),
    *,
    forbid: bool = False,
) -> dict[str, Kind]:
    rates = Rates.of(cluster, job)
    representative: dict[str, str] = {}
    for i, kind in enumerate(layer_kinds):
        representative.setdefault(kind, f"layer.{i}")
    for n in fixed:
        representative[n] = n
    tp = TpComm.of(model, job, proto, network, shard, sm_count=cluster.sm_count)
    allowed = set(choices) if choices is not None else None
    return {
        k: _kind(
            k,
            model,
            n,
            shard,
            rates,
            tp,
            job,
            proto,
            allowed,
            fixed=k in fixed,
            extra=extra if allowed is None else frozenset(),
            forbid=forbid,
        )
        for k, n in representative.items()
    }


def layer_kind(model: ModelSpec, index: int) -> str:
    """The kind of transformer layer ``index``: layers of one kind cost the same (``moe`` or
    ``dense``, with the attention window or chunk where the layer has one and ``nope`` where
    it has no rotary embedding, e.g. ``moe-window128``, ``moe-chunk8192``, ``dense-nope``)."""
    base = "moe" if model.is_moe_layer(index) else "dense"
    window, chunk = model.attention_window(index), model.attention_chunk(index)
    if window is not None:
        base += f"-window{window}"
    if chunk is not None:
        base += f"-chunk{chunk}"
    return base if model.has_rope(index) or model.learned_positions else f"{base}-nope"


def layer_choices(t: Tables) -> list[str]:
    """The recompute choices every layer kind has (in the first kind's order, kinds by
    name): what one choice for every layer may be."""
    names: list[str] | None = None
    for k in sorted(set(t.layer_kinds)):
        own = [o.name for o in t.kinds[k].options]
        names = own if names is None else [n for n in names if n in own]
    return names or []


def even_counts(model: ModelSpec, config: Config) -> list[int]:
    """Layers per stage, as even as can be. With fewer layers than stages the first and
    last stages (which hold the embedding and the head) are the ones left without."""
    n, s = model.num_layers, config.stages
    if n < s and s > 1:
        middle = [1] * (s - 2)
        spare = n - (s - 2)  # 0 or 1 (enumeration keeps stages <= layers + 2)
        return [min(spare, 1), *middle, max(0, spare - 1)]
    return [n // s + (1 if i < n % s else 0) for i in range(s)]


def _kind(
    name: str,
    model: ModelSpec,
    block: str,
    shard: Shard,
    rates: Rates,
    tp: TpComm,
    job: TrainingJob,
    proto: Layout,
    allowed: set[str] | None,
    *,
    fixed: bool,
    extra: frozenset[str] = frozenset(),
    forbid: bool = False,
) -> Kind:
    cost = block_cost(model, block, shard)
    listed = frozenset(allowed) if allowed is not None else None
    options = _OPTIONS.get(
        (model, block, shard, name, rates, tp, listed, fixed, extra, forbid),
        lambda: _options(name, cost, rates, tp, allowed, fixed=fixed, extra=extra, forbid=forbid),
    )
    params = cost.params
    st = state_bytes(params, job=job, layout=proto, ema_on_gpu=proto.ema == "hbm")
    wb = DTYPE_BYTES[job.working_weight_dtype]
    return Kind(
        name=name,
        cost=cost,
        options=options,
        state=st,
        nbytes=stage_bytes({p.key: p for p in params}, job, proto),
        shard_weight=sum(p.numel / shards(p, proto) for p in params) * wb,
    )


# A block's recompute options: under its block_cost inputs, the rates and what is listed.
_OPTIONS: Memo[list[Option]] = Memo("tables.options", limit=50_000)


def _options(
    name: str,
    cost: BlockCost,
    rates: Rates,
    tp: TpComm,
    allowed: set[str] | None,
    *,
    fixed: bool,
    extra: frozenset[str] = frozenset(),
    forbid: bool = False,
) -> list[Option]:
    """A block's undominated recompute options (cached: many configurations share them):
    its menu, with the listed choices (``allowed``) only, or with ``extra`` choices too;
    ``forbid``: without those a schedule that overlaps the expert all-to-alls refuses
    (``schedules.ep_overlap_forbids``)."""
    menu = cost.menu()
    # a listed module set applies to every block, in its menu or not
    named = allowed if allowed is not None else extra
    listed = (parse_recompute(a) for a in sorted(named) if a not in ("op", "offload"))
    menu += [c for c in listed if c not in menu]
    if name in ("embedding", "head"):
        menu = [frozenset()]  # launchers do not recompute them (Megatron-LM has no option)
    options = []
    for choice in menu:
        label = choice_name(choice)
        if forbid and ep_overlap_forbids(choice):
            continue
        # A search space's recompute list binds the layers; the embedding, MTP and head
        # blocks may always stay as they are.
        if allowed is not None and label not in allowed and not (fixed and label == "none"):
            continue
        row = block_row(cost, rates, choice, tp)
        options.append(
            Option(
                name=label,
                row=row,
                saved=float(cost.saved_bytes(choice)),
                rebuilt=float(cost.rebuilt_bytes(choice)),
                time=row.fwd + row.bwd_input + row.bwd_weight,
            )
        )
    return _undominated(options)


def _undominated(options: list[Option]) -> list[Option]:
    """Drop a choice another beats or ties on saved bytes, rebuilt bytes, time and all-to-all
    repeats (the first of equals stays)."""
    keep = []
    for i, o in enumerate(options):
        dominated = False
        for j, other in enumerate(options):
            if i == j:
                continue
            no_worse = (
                other.saved <= o.saved
                and other.rebuilt <= o.rebuilt
                and other.time <= o.time
                and other.row.moe_rerun <= o.row.moe_rerun
                and other.row.bwd_input <= o.row.bwd_input
            )
            strictly = (other.saved, other.rebuilt, other.time, other.row.moe_rerun) != (
                o.saved,
                o.rebuilt,
                o.time,
                o.row.moe_rerun,
            )
            if no_worse and (strictly or j < i):
                dominated = True
                break
        if not dominated:
            keep.append(o)
    return keep


def rank_orders(schedule: str, pp: int, m: int, v: int) -> list[RankOrder]:
    """Every rank's ``RankOrder`` (cached: many configurations share a schedule)."""
    return [_rank_order(schedule, pp, m, v, r) for r in range(pp)]


@functools.lru_cache(maxsize=4096)
def _rank_order(schedule: str, pp: int, m: int, v: int, rank: int) -> RankOrder:
    from planner.timeline import program  # the one place a rank's ops become tasks

    order = op_order(schedule, pp=pp, num_microbatches=m, rank=rank, virtual_stages=v)
    chunks = list(dict.fromkeys(o.stage for o in order))
    prog = program(schedule, pp, m, v)
    tasks = Counter(prog.key[g] for g in prog.by_rank[rank])
    levels = activation_levels(schedule, pp, m, v, rank, chunks)
    return RankOrder(chunks=chunks, tasks=tasks, levels=levels)


def _fixed(
    model: ModelSpec,
    shard: Any,
    job: TrainingJob,
    proto: Layout,
    first: list[str],
    last: list[str],
    stages: int,
) -> FixedTables:
    """State bytes of each rank's fixed blocks (shared tensors once per rank), and the bytes
    each stage's fixed blocks' collectives move (shared tensors once per stage)."""
    params = {n: block_cost(model, n, shard).params for n in first + last}
    ema_on_gpu = proto.ema == "hbm"

    def union(blocks: list[str]) -> dict[str, Param]:
        seen: dict[str, Param] = {}
        for b in blocks:
            for p in params[b]:
                seen.setdefault(p.key, p)
        return seen

    per_stage = {0: list(first), stages - 1: list(last)}
    if stages == 1:
        per_stage = {0: first + last}
    state = []
    for r in range(proto.pp):
        held = dict.fromkeys(proto.chunks_of_rank(r))
        blocks = [b for s in held for b in per_stage.get(s, [])]
        held_params = list(union(blocks).values())
        state.append(state_bytes(held_params, job=job, layout=proto, ema_on_gpu=ema_on_gpu))
    nbytes = [stage_bytes(union(per_stage.get(s, [])), job, proto) for s in range(stages)]
    return state, nbytes
