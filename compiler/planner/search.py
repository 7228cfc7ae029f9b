"""The automatic planner: enumerate plans, keep those that fit in memory, rank them by predicted step time.

A candidate is a factorization of the world into dp × tp × pp, the sub-axes of dp (ep for a model with experts,
cp for one without), and a meshc Plan: ZeRO stage, micro-batches, schedule (and virtual stages), remat, sequence
and vocabulary parallelism, and context parallelism's attention (Plan.cp_attention). Each is scored by the cost
model (compiler/cost/formulas.py): by its formulas from the model's sizes for any number of ranks
(`plan_model`), or by compiling the real graph for a simulated rank of each mesh (`plan_compiled`), or,
inside a running job, for the job's own mesh (`auto_plan`, behind `meshc.compile(..., plan="auto")`); those
two live in compiler/planner/compiled.py.

Nothing here encodes a rule such as "tensor parallelism inside a node": a tp group that spans nodes is
slow because the cost model gives it the inter-node link's bandwidth, so plans with it rank lower.

Internally (as MeshSpec counts, compiler/ir/mesh_spec.py) a candidate's dp is the gradient group, every rank
that trains on its own slice of data or of a sequence: dp × cp of the mesh as a user writes it (Candidate.axes,
what the planner prints). Context parallelism (cp ranks of that group split each sequence) leaves every rank's tokens, FLOPs and memory what dp
alone gives them on the same mesh (b = B/(N·m)) and adds attention traffic; what it buys is the freedom to
have fewer sequences than dp × m: the batch need only divide by dp/cp × m. So for each mesh and micro-batch
count the planner offers only the smallest cp that allows it (cp = 1 where the batch divides by dp × m; a
larger cp costs more traffic and nothing else), with a sequence divisible by 2·cp; and since ring and
all_to_all attention differ only in that traffic, it keeps the faster of the two (all_to_all where the heads
of a tp rank divide by cp). Not with experts: ep and cp together are refused.

Terms: fits = predicted per-rank memory (the fullest rank) <= the memory given; rank = position by
predicted step time among the plans that fit (ties: less memory first); reason = why a plan ranks where
it does: for the best, what its step time is made of; for the others, the part of the step time by which
they lose most against the best.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

from meshc.compiler.cost.formulas import Estimate, ModelShape, formula_estimate, formula_functions, formula_values, precision_for
from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.cost.offload import KINDS, with_offload
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.plan import SPLIT_BACKWARD, V_SHAPED, Plan
from meshc.compiler.ir.show import human_bytes

log = logging.getLogger("meshc.planner")
WHY = {"compute": "compute per rank", "recompute": "recomputation ({remat} remat)",
       "bubble": "pipeline bubble (pp={pp}, m={m}, {schedule})", "tp": "tensor-parallel collectives{tp_nodes}",
       "ep": "expert all-to-alls (ep={ep})", "cp": "context-parallel attention (cp={cp}, {cp_attention})",
       "dp": "data-parallel traffic not hidden (ZeRO-{zero}){dp_nodes}", "pp": "pipeline messages",
       "step": "optimizer-step collectives", "optimizer": "optimizer update",
       "overhead": "runtime overhead (m={m} micro-batches)", "offload": "offload I/O ({offload})"}


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One plan to score: mesh sizes and the Plan."""

    dp: int
    tp: int
    pp: int
    plan: Plan
    ep: int = 1  # experts sharded over ep of the dp ranks (a MoE model's; 1: replicated)
    cp: int = 1  # sequences split over cp of the dp ranks (Plan.cp_attention says how attention sees them)

    @property
    def sizes(self) -> dict[str, int]:
        """MeshSpec's sizes (its dp: the gradient group, `dp` here)."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, **({"ep": self.ep} if self.ep > 1 else {}),
                **({"cp": self.cp} if self.cp > 1 else {})}

    @property
    def axes(self) -> dict[str, int]:
        """The mesh as meshc.mesh(...) takes it: world = dp × cp × tp × pp, dp without the cp ranks."""
        return MeshSpec(self.sizes).axes

    def describe_mesh(self) -> str:
        axes = self.axes
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        ep += f" cp={self.cp}({self.plan.cp_attention})" if self.cp > 1 else ""
        return f"dp={axes['dp']}{ep} tp={self.tp} pp={self.pp}"

    def describe(self) -> str:
        p = self.plan
        parts = [self.describe_mesh(), f"zero={p.zero}" + (f" replicas={p.replicas}" if p.replicas > 1 else ""),
                 f"m={p.microbatches}"]
        if self.pp > 1:
            parts.append(p.schedule + (f"x{p.virtual}" if p.virtual > 1 else ""))
        parts.append(f"remat={p.remat}")
        parts += [x for x, on in (("sp", p.sequence_parallel), ("vocab", p.vocab_parallel)) if on]
        if p.offload:
            parts.append(f"offload={p.offload}" + ("+params" if p.offload_params else ""))
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Ranked:
    """A scored plan; `reason` is made when read (most of a long list never is): against `versus`, the best plan's
    estimate, or, for the best itself, of what its step time is made among `of` plans that fit."""

    candidate: Candidate
    estimate: Estimate
    fits: bool
    rank: int = 0
    versus: Estimate | None = field(default=None, repr=False)
    of: int = 0
    hardware: Hardware | None = field(default=None, repr=False, compare=False)

    @property
    def reason(self) -> str:
        if not self.fits:
            return ""
        if self.rank == 1:
            return _best_reason(self.estimate, self.of)
        return _reason(self.candidate, self.estimate, self.versus, self.hardware)


@dataclass(frozen=True, kw_only=True)
class Search:
    """The choices enumerated (defaults: all that meshc implements)."""

    zero: tuple[int, ...] = (0, 1, 2, 3)
    remat: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "zb-h1", "interleaved", "zbv", "dualpipev")
    microbatches: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to max_microbatches
    max_microbatches: int = 64
    sequence_parallel: tuple[bool, ...] = (False, True)
    vocab_parallel: tuple[bool, ...] = (False, True)
    meshes: tuple[tuple[int, int, int], ...] | None = None  # (dp, tp, pp) to consider; None: every factorization
    context: bool = True  # offer context parallelism (cp of dp) to models without experts
    cp_attention: tuple[str, ...] = ("ring", "all_to_all")  # the faster of ring and all_to_all is kept; all_gather
    # (more memory: the whole K, V saved) is scored as a plan of its own when listed
    virtual: int = 2
    # hybrid sharding (Plan.replicas) offered with ZeRO where dp spans nodes: one replica group per node_ranks ranks
    # (tp × dp/replicas = a node's); node_ranks 0: not offered (plan_model sets it from the hardware profile)
    hybrid: bool = True
    node_ranks: int = 0
    param_dtype: Any = None
    base: Plan = field(default_factory=lambda: Plan(trace="non-strict"))
    offload: bool = True  # when no plan fits, try them again with Plan.offload (compiler/cost/offload.py)

    def __post_init__(self) -> None:
        if self.param_dtype is not None and 0 in self.zero:
            object.__setattr__(self, "zero", tuple(z for z in self.zero if z))  # mixed precision needs ZeRO
        if not self.zero or not self.remat or not self.schedules:
            raise MeshcValueError("Search: expected at least one ZeRO stage, remat policy and schedule, got an empty "
                                  "choice")


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    """Plans that fit, best first; how many did not; the hardware and memory they were judged on. For the
    report (meshc plan --html): the scored plans that did not fit (`rejected_plans`, `rejected` counts these and
    those set aside unscored), the plans that did not compile (`failed`: candidate, error) and the meshes the
    model refuses (`excluded`: (dp, tp, pp), why)."""

    ranked: tuple[Ranked, ...]
    rejected: int
    smallest_rejected: Ranked | None
    memory: float
    hardware: Hardware
    rejected_plans: tuple[Ranked, ...] = field(default=(), repr=False, compare=False)
    failed: tuple[tuple[Candidate, str], ...] = field(default=(), repr=False, compare=False)
    excluded: tuple[tuple[tuple[int, int, int], str], ...] = field(default=(), repr=False, compare=False)

    @property
    def best(self) -> Ranked:
        if not self.ranked:
            need = f"; the smallest needs {human_bytes(self.smallest_rejected.estimate.total_memory)} " \
                   f"({self.smallest_rejected.candidate.describe()})" if self.smallest_rejected else ""
            raise MeshcValueError(f"planner: expected a plan that fits in {human_bytes(self.memory)} per rank, got "
                                  f"none of {self.rejected}{need}; use more ranks, a smaller batch, or allow "
                                  "remat/ZeRO-3")
        return self.ranked[0]

    def table(self, top: int = 10) -> str:
        lines = [f"{'#':>3}  {'plan':<52}{'memory':>10}{'step':>11}  why"]
        for r in self.ranked[:top]:
            lines.append(f"{r.rank:>3}  {r.candidate.describe():<52}{human_bytes(r.estimate.total_memory):>10}"
                         f"{_ms(r.estimate.step_time):>11}  {r.reason}")
        lines.append(f"{len(self.ranked)} plans fit in {human_bytes(self.memory)} per rank on {self.hardware.name}; "
                     f"{self.rejected} did not")
        if self.smallest_rejected is not None and self.rejected:
            r = self.smallest_rejected
            lines.append(f"  the leanest plan that did not fit needs {human_bytes(r.estimate.total_memory)}: "
                         f"{r.candidate.describe()}")
        return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


# ---------------------------------------------------------------------------------------------- search
def divisors(n: int) -> list[int]:
    return list(_divisors(n))


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def meshes(world: int, *, heads: int | None = None, layers: int | None = None, batch: int | None = None,
           search: Search = Search(), seq: int | None = None) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp·tp·pp = world that the model allows (tp divides the heads, pp at most the
    layers, dp divides the batch; with `seq`, a model that may use context parallelism, dp/cp divides it for
    some cp of dp with 2·cp dividing seq)."""
    if search.meshes is not None:
        return [tuple(x) for x in search.meshes]
    return [sizes for sizes, why in mesh_verdicts(world, heads=heads, layers=layers, batch=batch, seq=seq) if not why]


def mesh_verdicts(world: int, *, heads: int | None = None, layers: int | None = None, batch: int | None = None,
                  seq: int | None = None) -> list[tuple[tuple[int, int, int], str]]:
    """Every (dp, tp, pp) with dp·tp·pp = world and why meshes() refuses it ("" where it allows it)."""
    out = []
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp, why = world // (tp * pp), []
            if heads is not None and heads % tp:
                why.append(f"tp={tp} does not divide the {heads} heads")
            if layers is not None and pp > layers:
                why.append(f"pp={pp} is more than the {layers} layers")
            if batch is not None and not _context_sizes(dp, batch, seq):
                why.append(f"the batch of {batch} does not divide by dp={dp}" + (" (nor by dp/cp)" if seq else ""))
            out.append(((dp, tp, pp), "; ".join(why)))
    return out


@functools.lru_cache(maxsize=4096)
def _context_sizes(dp: int, batch: int, seq: int | None, micro: int = 1) -> list[int]:
    """The cp of dp (1 alone without `seq`) for which dp/cp × micro divides the batch and 2·cp the sequence."""
    return [cp for cp in (_divisors(dp) if seq else (1,)) if batch % (dp // cp * micro) == 0 and
            (cp == 1 or seq % (2 * cp) == 0)]


def with_sub_axes(all_meshes: list[tuple[int, int, int]], shape: ModelShape, batch: int,
                  search: Search = Search()) -> list[tuple[int, ...]]:
    """Each mesh as (dp, tp, pp, ep, cp): with every ep the model's experts allow (ep divides dp and the number
    of experts; the batch divides by dp), or, without experts, every cp that lets dp/cp divide the batch
    (2·cp dividing the sequence; only cp = 1 unless search.context)."""
    out = []
    for dp, tp, pp in all_meshes:
        if shape.experts > 1:
            out += [(dp, tp, pp, ep, 1) for ep in divisors(dp) if shape.experts % ep == 0 and batch % dp == 0]
        else:
            out += [(dp, tp, pp, 1, cp) for cp in _context_sizes(dp, batch, shape.seq if search.context else None)]
    return out


def plans_for(sizes: tuple[int, ...], batch: int, search: Search, layers: int | None = None,
              shape: ModelShape | None = None) -> Iterator[Plan]:
    """Every Plan the search allows on one mesh, (dp, tp, pp[, ep, cp]), for a global batch of `batch` sequences."""
    for choice in choices_for(sizes, batch, search, layers, shape):
        yield plan_of(choice, search)


def choices_for(sizes: tuple[int, ...], batch: int, search: Search, layers: int | None = None,
                shape: ModelShape | None = None) -> Iterator[tuple]:
    """plans_for's plans as (microbatches, schedule, virtual, zero, remat, sequence_parallel, vocab_parallel,
    cp_attention), in the same order, without building them (cost.formula_values reads this tuple).

    With cp > 1, each micro-batch count needs the batch divisible by dp/cp × m; given the model's `shape` (the
    planner choosing the mesh), only the counts for which cp is the smallest cp that allows them (module
    docstring), and all_to_all only where the heads of a tp rank divide by cp."""
    dp, tp, pp = sizes[:3]
    cp = sizes[4] if len(sizes) > 4 else 1
    local = batch // (dp // cp)
    ms = search.microbatches or tuple(2**i for i in range(8) if 2**i <= search.max_microbatches)
    ms = [m for m in ms if local % m == 0]
    if shape is not None:
        ms = [m for m in ms if _context_sizes(dp, batch, shape.seq if cp > 1 else None, m)[:1] == [cp]]
    methods = [search.base.cp_attention]
    if cp > 1:
        methods = [x for x in search.cp_attention if x != "all_to_all" or shape is None or (shape.heads // tp) % cp == 0]
    zeros = [z for z in search.zero if dp > 1 or z == 0] or [min(search.zero)]
    sps = search.sequence_parallel if tp > 1 else (False,)
    vps = search.vocab_parallel if tp > 1 else (False,)
    ep = sizes[3] if len(sizes) > 3 else 1
    for m, zero, remat, sp, vp, method, r in itertools.product(ms, zeros, search.remat, sps, vps, methods,
                                                               _replica_counts(dp, tp, ep, search)):
        if r > 1 and zero == 0:
            continue
        for schedule, virtual in _schedules(pp, m, search, layers):
            if remat == "selective" and schedule in SPLIT_BACKWARD:  # Plan refuses it: two backward halves per block
                continue
            yield (m, schedule, virtual, zero, remat, sp, vp, method) + ((r,) if r > 1 else ())


def _replica_counts(dp: int, tp: int, ep: int, search: Search) -> tuple[int, ...]:
    """1, and the hybrid sharding whose replica groups are one node each where dp (dp × cp) spans nodes."""
    n = search.node_ranks
    if not search.hybrid or not n or ep > 1 or dp * tp <= n or n % tp or (dp * tp) % n:
        return (1,)
    r = dp * tp // n
    return (1, r) if r > 1 and dp % r == 0 else (1,)


def plan_of(choice: tuple, search: Search) -> Plan:
    """The Plan of one of choices_for's tuples."""
    m, schedule, virtual, zero, remat, sp, vp, method, *rest = choice
    return dataclasses.replace(search.base, zero=zero, microbatches=m, schedule=schedule, virtual=virtual,
                               remat=remat, sequence_parallel=sp, vocab_parallel=vp, param_dtype=search.param_dtype,
                               cp_attention=method, replicas=rest[0] if rest else 1)


def _schedules(pp: int, m: int, search: Search, layers: int | None) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for name in search.schedules:
        if m == 1 and name == "gpipe" and "1f1b" in search.schedules:
            continue  # one micro-batch: GPipe's actions are 1F1B's (each rank's F, then its B), the same plan
        if name in V_SHAPED:
            if (layers is None or layers >= 2 * pp) and (name == "zbv" or m >= 2 * pp):  # two stages per rank
                out.append((name, 2))
        elif name != "interleaved":
            out.append((name, 1))
        elif m % pp == 0 and (layers is None or layers >= pp * search.virtual):
            out.append((name, search.virtual))
    return out


def rank(scored: list[tuple[Candidate, Estimate]], memory: float, hw: Hardware, unscored: int = 0,
         offload: bool = True, failed: tuple = ()) -> PlanResult:
    """Keep what fits, order by step time (then memory), and say why each plan is where it is. `unscored`:
    plans the caller set aside without scoring because they cannot fit (counted as not fitting). When none
    fits and `offload`, each is tried again with its states offloaded (to host memory on GPUs, to disk)."""
    fitting, rejected = [], []
    for ce in scored:
        (fitting if ce[1].total_memory <= memory else rejected).append(ce)
    if not fitting and offload:
        fitting = [(dataclasses.replace(c, plan=v[0]), v[1]) for c, e in rejected for kind in KINDS
                   if (v := with_offload(c.plan, e, hw, kind)) is not None and v[1].total_memory <= memory]
    fitting = _by_time(fitting)
    ranked = []
    for i, (c, e) in enumerate(fitting):
        ranked.append(Ranked(candidate=c, estimate=e, fits=True, rank=i + 1, versus=fitting[0][1], of=len(fitting),
                             hardware=hw))
    smallest = min(rejected, key=lambda ce: ce[1].total_memory, default=None)
    return PlanResult(ranked=tuple(ranked), rejected=len(rejected) + unscored, memory=memory, hardware=hw,
                      smallest_rejected=Ranked(candidate=smallest[0], estimate=smallest[1], fits=False)
                      if smallest else None, failed=tuple(failed),
                      rejected_plans=tuple(Ranked(candidate=c, estimate=e, fits=False) for c, e in rejected))


def _by_time(plans: list[tuple[Candidate, Estimate]]) -> list[tuple[Candidate, Estimate]]:
    """Sorted by (step time, memory, description): the description, slow to make, only among equal times."""
    keyed = sorted(((round(e.step_time, 12), e.total_memory), i) for i, (_, e) in enumerate(plans))
    out = []
    for _, group in itertools.groupby(keyed, key=lambda x: x[0]):
        items = [plans[i] for _, i in group]
        out += sorted(items, key=lambda ce: ce[0].describe()) if len(items) > 1 else items
    return out


def _best_reason(e: Estimate, n: int) -> str:
    parts = sorted(((v, k) for k, v in e.time.items() if v > 0), reverse=True)[:3]
    return f"fastest of {n} that fit: " + ", ".join(f"{k} {v / e.step_time:.0%}" for v, k in parts)


def _reason(c: Candidate, e: Estimate, best: Estimate, hw: Hardware) -> str:
    was, key, delta = best.time, "", -math.inf
    for k, v in e.time.items():  # the part that lost most (the first of equals)
        if v - was.get(k, 0.0) > delta:
            key, delta = k, v - was.get(k, 0.0)
    p = c.plan
    what = WHY[key].format(remat=p.remat, pp=c.pp, ep=c.ep, cp=c.cp, cp_attention=p.cp_attention, m=p.microbatches,
                           schedule=p.schedule, zero=p.zero, offload=p.offload,
                           tp_nodes=" across nodes" if key == "tp" and hw.spans_nodes(1, c.tp) else "",
                           dp_nodes=" across nodes" if key == "dp" and hw.spans_nodes(c.tp, c.dp) else "")
    slower = e.step_time / best.step_time - 1 if best.step_time else 0.0
    return f"+{slower:.0%}: {what} +{_ms(max(delta, 0.0)).strip()}"


USABLE = 0.9  # share of a device's memory a plan may fill by default: the rest is the allocator's and the runtime's


def usable_memory(hardware: Hardware, memory: float | None) -> float:
    """The per-rank memory plans must fit in: `memory` if given, else USABLE of the device's."""
    return hardware.memory * USABLE if memory is None else memory


def plan_model(shape: ModelShape, world: int, batch: int, hardware: Hardware, memory: float | None = None,
               search: Search = Search(), prune: bool = True) -> PlanResult:
    """The formula path: every plan for `world` ranks of a model of this shape, scored from its sizes.

    `prune` (the result is the same either way): each plan's memory, from the memory formulas alone (a few
    times cheaper), is checked before its step time is estimated; a plan that cannot fit is counted as not
    fitting without being scored, unless it may be the leanest that did not fit (which the table names).
    """
    memory = usable_memory(hardware, memory)
    if search.hybrid and not search.node_ranks:  # replica groups of one node each, where dp spans nodes
        search = dataclasses.replace(search, node_ranks=hardware.ranks_per_node)
    precision = precision_for(search.param_dtype, search.base.reduce_dtype)
    estimate_of = formula_functions(hardware, shape.flags())[1]
    plans: dict[tuple, Plan] = {}  # one Plan per choice, shared by the meshes (building one is not free)

    def candidate(sizes: tuple, choice: tuple) -> Candidate:
        return _candidate(sizes, plans.get(choice) or plans.setdefault(choice, plan_of(choice, search)))
    enumerated = _enumerate(shape, world, batch, hardware, search, precision, memory)
    if not prune:
        scored = [(c, formula_estimate(shape, c.sizes, c.plan, batch, hardware))
                  for c in (candidate(sizes, choice) for sizes, choice, *_ in enumerated)]
        return _with_excluded(rank(scored, memory, hardware, offload=search.offload), shape, world, batch, search)
    over = memory * (1 + 1e-9)  # the memory formulas alone may round apart from the full estimate: a margin
    kept: list[tuple[int, Candidate, Estimate]] = []  # (position in the enumeration, candidate, estimate)
    cannot_fit: list[tuple[float, int, tuple, tuple, tuple]] = []  # (memory, position, sizes, choice, values)

    def score(i: int, sizes: tuple, choice: tuple, values: tuple) -> Estimate:
        estimate = estimate_of(values)
        kept.append((i, candidate(sizes, choice), estimate))
        return estimate

    for i, (sizes, choice, values, need) in enumerate(enumerated):
        if need > over:
            cannot_fit.append((need, i, sizes, choice, values))
        else:
            score(i, sizes, choice, values)
    if search.offload and not any(e.total_memory <= memory for _, _, e in kept):
        for _, *plan in cannot_fit:  # nothing fits: every plan is scored, to be tried with offload
            score(*plan)
        cannot_fit = []
    # score the plans set aside that may be the leanest that did not fit, least memory first, until none may
    leanest = min((e.total_memory for _, _, e in kept if e.total_memory > memory), default=float("inf"))
    cannot_fit.sort(key=lambda x: (x[0], x[1]))
    rescored = 0
    for need, *plan in cannot_fit:
        if need > leanest * (1 + 1e-9):
            break
        leanest = min(leanest, score(*plan).total_memory)
        rescored += 1
    kept.sort(key=lambda x: x[0])  # enumeration order, as rank() breaks ties by it
    return _with_excluded(rank([(c, e) for _, c, e in kept], memory, hardware, unscored=len(cannot_fit) - rescored,
                               offload=search.offload), shape, world, batch, search)


def _with_excluded(result: PlanResult, shape: ModelShape, world: int, batch: int, search: Search) -> PlanResult:
    """The result with the meshes the model refuses and why (none where search.meshes fixes them)."""
    if search.meshes is not None:
        return result
    seq = shape.seq if search.context and shape.experts == 1 else None
    refused = [(m, why) for m, why in mesh_verdicts(world, heads=shape.heads, layers=shape.layers, batch=batch,
                                                    seq=seq) if why]
    return dataclasses.replace(result, excluded=tuple(refused))


def _enumerate(shape: ModelShape, world: int, batch: int, hw: Hardware, search: Search, precision,
               memory: float) -> Iterator[tuple[tuple, tuple, tuple, float]]:
    """(sizes, choice, formula values, memory from the memory formulas) of every plan plan_model scores, in order:
    each mesh (dp, tp, pp, ep, cp) and its choices, leaving out the slower of ring and all_to_all attention and,
    without pipeline stages, a cp plan whose variant with fewer micro-batches fits (it is slower: more
    micro-batches only add to the step there, as _score_pruned assumes; cp = 1 plans are all kept)."""
    seq = shape.seq if search.context and shape.experts == 1 else None
    all_meshes = with_sub_axes(meshes(world, heads=shape.heads, layers=shape.layers, batch=batch, search=search,
                                      seq=seq), shape, batch, search)
    faster = _attention_picker(shape, batch, hw, precision, search)
    memory_of = formula_functions(hw, shape.flags())[0]
    fitted: set[tuple] = set()  # (dp, tp, zero, remat, sp, vp) of pp = 1 plans that fit, any m
    for sizes in all_meshes:
        for choice in choices_for(sizes, batch, search, shape.layers, shape):
            rest = (sizes[:2], *choice[3:7], *choice[8:]) if sizes[2] == 1 else None
            if not faster(sizes, choice) or (sizes[4] > 1 and rest in fitted):
                continue
            values = formula_values(shape, sizes, choice, batch, hw, precision)
            need = memory_of(values)
            if rest is not None and need <= memory:
                fitted.add(rest)
            yield sizes, choice, values, need


def _candidate(sizes: tuple, plan: Plan) -> Candidate:
    return Candidate(dp=sizes[0], tp=sizes[1], pp=sizes[2], ep=sizes[3], cp=sizes[4], plan=plan)


def _attention_picker(shape: ModelShape, batch: int, hw: Hardware, precision, search: Search):
    """keep(sizes, choice): False for a ring or all_to_all choice whose other method is faster on that mesh and
    micro-batch count. The two differ only in their cp traffic (the same memory, compute, everything else), which
    depends on the mesh, m and full recompute alone: timed once per such key, ties to the method listed first."""
    best: dict[tuple, str] = {}
    timed = [x for x in search.cp_attention if x != "all_gather"]

    def keep(sizes: tuple, choice: tuple) -> bool:
        method = choice[7]
        if sizes[4] == 1 or method == "all_gather" or len(timed) < 2:
            return True
        key = (sizes, choice[0], choice[4] == "full")
        if key not in best:
            allowed = [x for x in timed if x != "all_to_all" or (shape.heads // sizes[1]) % sizes[4] == 0]
            cand = {x: formula_estimate(shape, _candidate(sizes, plan_of(choice, search)).sizes,
                                        plan_of(choice[:7] + (x,) + choice[8:], search), batch, hw,
                                        precision).time["cp"]
                    for x in allowed}
            best[key] = min(allowed, key=lambda x: (cand[x], allowed.index(x)))
        return best[key] == method
    return keep
