"""Prove a pipeline schedule right before it runs, and time it: a pure-Python, event-driven simulator
of the per-rank programs of `meshc.compiler.ir.schedule`, with blocking receives and buffered sends.

`check(schedule)` proves, in this order, and raises `ScheduleError` naming the first offending op:
  placement    every op sits on the rank of its stage, and a message's peer is the other stage's rank;
  coverage     every (stage, microbatch) gets exactly one F and either one B or one I and one W;
  matching     every send has exactly one receive on its peer rank, and every receive one send;
  fifo         per pair of ranks and kind (activations, gradients), sends and receives come in the same order
               (a backend without tags, NCCL, pairs them in order: runtime/pipeline/executor.py sends each kind on a
               group of its own);
  order        on each rank: F of stage s on micro-batch i comes after F of s-1 on i; B or I of s comes
               after F of s and after B or I of s+1; W comes after its I; a send comes after the action
               that produces its tensor. A dependency on another rank must be a receive earlier in the
               program (so blocking receives enforce it);
  deadlock     running the programs (receives block, sends never do) finishes on every rank; otherwise
               the error names each stuck rank and the receive it waits on.

`simulate(schedule, cost, comm)` runs the same check and returns a `SimResult` with the timeline:
a rank's clock advances by the cost of each compute action; a send is free for the sender and its
message arrives `comm` later; a receive waits until its message has arrived.

Shared processors (`capacity`): where the ranks share fewer processors than there are ranks (processes on
the cores of one CPU), `capacity` says how many ranks compute at full speed at once: while k ranks compute,
each progresses at min(1, capacity / k) of its speed alone (processor sharing), so an action's cost is its
work alone and its span stretches while others compute. None: every rank has a processor of its own.

Bubble fraction: total idle time over total compute time, summed over ranks,
    bubble = Σ_r (makespan − busy_r) / Σ_r busy_r,
so with uniform stages GPipe and 1F1B give (p−1)/m, interleaved 1F1B (p−1)/(v·m), where the idle time
includes a rank's wait before its first action and after its last.

In flight: the micro-batches whose activations a rank holds, counted per (stage, microbatch) from its
F until its B, or until its W when the backward is split (I keeps what W needs).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import gcd

from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.schedule import Action, Op, P2P, Schedule, ScheduleError

DEFAULT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
MAX_GRID_STEPS = 10_000
Cost = Mapping[str, float] | Callable[[Action], float]


@dataclass(frozen=True, kw_only=True)
class Span:
    """One compute action on the timeline: it runs on `rank` from `start` to `end`."""

    rank: int
    start: float
    end: float
    action: Action


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """What `simulate` measured.

    makespan:  time from 0 (every rank starts then) to the end of the last action on any rank.
    busy:      per rank, the sum of its compute actions' costs.
    bubble:    Σ idle / Σ busy over ranks (see the module docstring).
    peak_in_flight: per rank, the most (stage, microbatch) activation sets held at once.
    timeline:  per rank, its compute actions with start and end times, in program order.
    """

    makespan: float
    busy: tuple[float, ...]
    bubble: float
    peak_in_flight: tuple[int, ...]
    timeline: tuple[tuple[Span, ...], ...]

    def __post_init__(self):
        if self.makespan < 0 or any(b < 0 for b in self.busy):
            raise MeshcValueError(f"SimResult: expected times >= 0, got makespan {self.makespan}, busy {self.busy}")

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)


# ---------------------------------------------------------------------------------------- proof
def check(schedule: Schedule, programs: Sequence[Sequence[Op]] | None = None) -> None:
    """Prove `schedule` (or `programs`, per-rank op lists to check instead of the derived ones, e.g. an
    executor's reordering) complete, well ordered, matched and deadlock-free; raise ScheduleError."""
    _run(schedule, programs, lambda a: 0.0, 0.0)


def _programs(schedule: Schedule, programs) -> tuple[tuple[Op, ...], ...]:
    progs = schedule.programs() if programs is None else tuple(tuple(p) for p in programs)
    if len(progs) != schedule.pp:
        raise ScheduleError(f"programs: expected one per rank ({schedule.pp}), got {len(progs)}")
    return progs


def _check_coverage(schedule: Schedule, progs) -> dict[tuple[int, int], str]:
    """Exactly one F and one backward (B, or I and W) per (stage, microbatch); returns the kind each
    (stage, microbatch) uses to send its input gradient back ("B" or "I")."""
    seen: Counter = Counter()
    for prog in progs:
        for op in prog:
            if isinstance(op, Action):
                seen[op] += 1
                if seen[op] > 1:
                    raise ScheduleError(f"coverage: expected {op} once, got it twice")
    grad_kind = {}
    for s in range(schedule.num_stages):
        for i in range(schedule.microbatches):
            has = {k: seen[Action(s, k, i)] for k in "FBIW"}
            if not has["F"]:
                raise ScheduleError(f"coverage: expected one F for stage {s}, micro-batch {i} "
                                    f"({Action(s, 'F', i)}), got none")
            if has["B"] and (has["I"] or has["W"]):
                raise ScheduleError(f"coverage: expected B or I+W for stage {s}, micro-batch {i}, got both")
            if not has["B"] and not (has["I"] and has["W"]):
                got = "+".join(k for k in "IW" if has[k]) or "none"
                raise ScheduleError(f"coverage: expected B or I+W for stage {s}, micro-batch {i}, got {got}")
            grad_kind[s, i] = "B" if has["B"] else "I"
    return grad_kind


def _deps(schedule: Schedule, a: Action, grad_kind) -> list[Action]:
    """The actions `a` consumes the outputs of."""
    s, i = a.stage, a.microbatch
    if a.kind == "F":
        return [Action(s - 1, "F", i)] if s > 0 else []
    if a.kind == "W":
        return [Action(s, "I", i)]
    deps = [Action(s, "F", i)]
    if s + 1 < schedule.num_stages:
        deps.append(Action(s + 1, grad_kind[s + 1, i], i))
    return deps


def _check_placement(schedule: Schedule, rank: int, op: Op) -> None:
    if not isinstance(op, (Action, P2P)):
        raise ScheduleError(f"placement: expected Actions and P2P messages on rank {rank}, got {op!r}")
    if op.stage >= schedule.num_stages or op.microbatch >= schedule.microbatches:
        raise ScheduleError(f"range: expected stage < {schedule.num_stages} and microbatch < "
                            f"{schedule.microbatches}, got {op} on rank {rank}")
    if isinstance(op, P2P):
        if schedule.rank_of(op.stage) != rank or not 0 <= op.peer_stage < schedule.num_stages \
                or op.peer != schedule.rank_of(op.peer_stage) or op.peer == rank:
            raise ScheduleError(f"placement: expected {op!r} to join stage {op.stage} on rank "
                                f"{schedule.rank_of(op.stage)} with its neighbour stage's rank, got it on rank {rank}")
    elif schedule.rank_of(op.stage) != rank:
        raise ScheduleError(f"placement: expected {op} on rank {schedule.rank_of(op.stage)}, got rank {rank}")


def _check_matching(progs) -> None:
    """Every send has exactly one receive on its peer rank, and every receive one send."""
    found: dict = {}
    for rank, prog in enumerate(progs):
        for op in prog:
            if isinstance(op, P2P):
                found.setdefault(op.key, {"send": 0, "recv": 0, "op": (rank, op)})[op.op] += 1
    for ends in found.values():
        if ends["send"] == 1 and ends["recv"] == 1:
            continue
        rank, op = ends["op"]
        other = P2P(op="recv" if op.op == "send" else "send", kind=op.kind, stage=op.peer_stage,
                    microbatch=op.microbatch, peer=rank)
        send, recv = ((op, rank), (other, op.peer)) if op.op == "send" else ((other, op.peer), (op, rank))
        extra = "send" if ends["send"] > ends["recv"] else "receive"
        raise ScheduleError(
            f"matching: expected one {send[0]} on rank {send[1]} and one {recv[0]} on rank {recv[1]}, "
            f"got {ends['send']} and {ends['recv']} (unmatched {extra})")


def _check_fifo(progs) -> None:
    """Per pair of ranks and kind of message, the sends leave in the order the receives await them: what a
    backend without tags (NCCL) needs to pair them, with activations and gradients on groups of their own."""
    sent: dict = {}
    awaited: dict = {}
    for rank, prog in enumerate(progs):
        for op in prog:
            if isinstance(op, P2P):
                src, dst = (rank, op.peer) if op.op == "send" else (op.peer, rank)
                (sent if op.op == "send" else awaited).setdefault((src, dst, op.kind), []).append((op.key, op))
    for (src, dst, kind), sends in sent.items():
        recvs = awaited.get((src, dst, kind), [])
        for (key, send), (other, recv) in zip(sends, recvs):
            if key != other:
                raise ScheduleError(f"fifo: expected rank {dst} to await {kind} messages from rank {src} in the order "
                                    f"they are sent, got {send} sent when {recv} is awaited")


def _check_order(schedule: Schedule, rank: int, prog, grad_kind) -> None:
    """Walk one rank's program: every input of an op is produced earlier on this rank or received."""
    done: set = set()
    received: set = set()
    for op in prog:
        if isinstance(op, P2P):
            if op.op == "recv":
                received.add(op.key)
                continue
            kind = "F" if op.kind == "F" else grad_kind[op.stage, op.microbatch]
            producer = Action(op.stage, kind, op.microbatch)
            if producer not in done:
                raise ScheduleError(f"order: expected {producer} before {op} on rank {rank}, got {op} first")
            continue
        for dep in _deps(schedule, op, grad_kind):
            if schedule.rank_of(dep.stage) == rank:
                if dep not in done:
                    raise ScheduleError(f"order: expected {dep} before {op} on rank {rank}, got {op} first")
            elif ("F" if dep.kind == "F" else "B", dep.stage, op.stage, op.microbatch) not in received:
                msg = P2P(op="recv", kind="F" if dep.kind == "F" else "B", stage=op.stage,
                          microbatch=op.microbatch, peer=schedule.rank_of(dep.stage))
                raise ScheduleError(f"order: expected {msg} (the output of {dep} on rank {msg.peer}) before "
                                    f"{op} on rank {rank}, got {op} first")
        done.add(op)


def _check_static(schedule: Schedule, progs) -> None:
    for rank, prog in enumerate(progs):
        for op in prog:
            _check_placement(schedule, rank, op)
    grad_kind = _check_coverage(schedule, progs)
    _check_matching(progs)
    _check_fifo(progs)
    for rank, prog in enumerate(progs):
        _check_order(schedule, rank, prog, grad_kind)


# ----------------------------------------------------------------------------------- simulation
def simulate(schedule: Schedule, cost: Cost = DEFAULT_COST, comm: float = 0.0,
             programs: Sequence[Sequence[Op]] | None = None, capacity: float | None = None) -> SimResult:
    """Prove `schedule` right (see `check`), then time its programs.

    cost: seconds (or any unit) per compute action, as {"F": .., "B": .., "I": .., "W": ..} or a
          function of the Action (for stages of unequal cost).
    comm: latency of one message; sends never block the sender.
    capacity: ranks that compute at full speed at once (module docstring); None: all of them. `busy` is
          then each rank's work at full speed, its spans the wall time they took.
    """
    if comm < 0:
        raise MeshcValueError(f"simulate comm: expected a latency >= 0, got {comm}")
    if capacity is not None and not capacity > 0:
        raise MeshcValueError(f"simulate capacity: expected a number of ranks > 0 or None, got {capacity}")
    if capacity is None or capacity >= schedule.pp:
        return _run(schedule, programs, _cost_fn(cost), float(comm))
    _run(schedule, programs, lambda a: 0.0, 0.0)  # the proof, deadlock included
    return _run_shared(_programs(schedule, programs), _cost_fn(cost), float(comm), float(capacity))


def _cost_fn(cost: Cost) -> Callable[[Action], float]:
    if callable(cost):
        return cost
    missing = [k for k in "FBIW" if k not in cost]
    if missing or any(cost[k] < 0 for k in "FBIW"):
        raise MeshcValueError(f"simulate cost: expected costs >= 0 for F, B, I and W, got {dict(cost)}")
    return lambda a: float(cost[a.kind])


def _run(schedule: Schedule, programs, cost: Callable[[Action], float], comm: float) -> SimResult:
    progs = _programs(schedule, programs)
    _check_static(schedule, progs)
    n = len(progs)
    clock, pc, arrival = [0.0] * n, [0] * n, {}
    spans: list[list[Span]] = [[] for _ in range(n)]
    held, peak = [0] * n, [0] * n
    progressed = True
    while progressed:
        progressed = False
        for r in range(n):
            while pc[r] < len(progs[r]):
                op = progs[r][pc[r]]
                if isinstance(op, P2P) and op.op == "recv":
                    if op.key not in arrival:
                        break  # blocks until the peer has sent it
                    clock[r] = max(clock[r], arrival[op.key])
                elif isinstance(op, P2P):
                    arrival[op.key] = clock[r] + comm
                else:
                    took = cost(op)
                    spans[r].append(Span(rank=r, start=clock[r], end=clock[r] + took, action=op))
                    clock[r] += took
                    held[r] += 1 if op.kind == "F" else -1 if op.kind in ("B", "W") else 0
                    peak[r] = max(peak[r], held[r])
                pc[r] += 1
                progressed = True
    stuck = [r for r in range(n) if pc[r] < len(progs[r])]
    if stuck:
        waits = ", ".join(f"rank {r} waits on {progs[r][pc[r]]} from rank {progs[r][pc[r]].peer}" for r in stuck)
        raise ScheduleError(f"deadlock: expected every rank to finish, got ranks {stuck} stuck ({waits})")
    makespan = max(clock) if n else 0.0
    busy = tuple(sum(s.end - s.start for s in row) for row in spans)
    bubble = sum(makespan - b for b in busy) / sum(busy) if sum(busy) > 0 else 0.0
    return SimResult(makespan=makespan, busy=busy, bubble=bubble, peak_in_flight=tuple(peak),
                     timeline=tuple(tuple(row) for row in spans))


def _run_shared(progs, cost: Callable[[Action], float], comm: float, capacity: float) -> SimResult:
    """The programs on `capacity` shared processors: global time, every event in order (programs proven)."""
    n, now = len(progs), 0.0
    pc, arrival, work = [0] * n, {}, [0.0] * n
    running: dict[int, list] = {}  # rank -> [action, work left, start]
    spans: list[list[Span]] = [[] for _ in range(n)]
    held, peak = [0] * n, [0] * n
    while True:
        progressed = True
        while progressed:  # every rank not computing goes as far as it can at `now`
            progressed = False
            for r in range(n):
                while r not in running and pc[r] < len(progs[r]):
                    op = progs[r][pc[r]]
                    if isinstance(op, P2P) and op.op == "recv":
                        if arrival.get(op.key, float("inf")) > now:
                            break
                    elif isinstance(op, P2P):
                        arrival[op.key] = now + comm
                    else:
                        took = cost(op)
                        work[r] += took
                        held[r] += 1 if op.kind == "F" else -1 if op.kind in ("B", "W") else 0
                        peak[r] = max(peak[r], held[r])
                        if took > 0:
                            running[r] = [op, took, now]
                        else:
                            spans[r].append(Span(rank=r, start=now, end=now, action=op))
                    pc[r] += 1
                    progressed = True
        waits = [arrival[progs[r][pc[r]].key] for r in range(n) if r not in running and pc[r] < len(progs[r])
                 and progs[r][pc[r]].key in arrival]
        if not running and not waits:
            break
        rate = min(1.0, capacity / len(running)) if running else 0.0
        step = min([left / rate for _, left, _ in running.values()] + [t - now for t in waits])
        now += step
        for r in list(running):
            op, left, start = running[r]
            left -= rate * step
            if left <= 1e-12 * max(1.0, work[r]):
                spans[r].append(Span(rank=r, start=start, end=now, action=op))
                del running[r]
            else:
                running[r][1] = left
    makespan = max((row[-1].end for row in spans if row), default=0.0)
    busy = tuple(work)
    bubble = sum(makespan - b for b in busy) / sum(busy) if sum(busy) > 0 else 0.0
    return SimResult(makespan=makespan, busy=busy, bubble=bubble, peak_in_flight=tuple(peak),
                     timeline=tuple(tuple(row) for row in spans))


# ----------------------------------------------------------------------------------------- grid
def grid(target: Schedule | SimResult, cost: Cost = DEFAULT_COST, comm: float = 0.0) -> str:
    """A text table of the simulated timeline: one row per time step, one column per rank.

    A time step is the largest unit that divides every start and end time (1 with the default costs;
    the header says when it is not). A cell shows the action that starts there, `"` where that action
    is still running (a ditto mark), and `.` where the rank is idle; an action of cost 0 does not show.
    A Schedule is simulated with `cost` and `comm` first.
    """
    result = target if isinstance(target, SimResult) else simulate(target, cost, comm)
    times = [Fraction(t).limit_denominator(10_000) for row in result.timeline for s in row for t in (s.start, s.end)]
    step = _common_step(times)
    steps = int(round(Fraction(result.makespan).limit_denominator(10_000) / step))
    if steps > MAX_GRID_STEPS:
        raise MeshcValueError(f"grid: expected at most {MAX_GRID_STEPS} time steps, got {steps} (1 step = "
                              f"{float(step):g}); give costs and comm that are multiples of a common unit")
    cells = [["."] * steps for _ in result.timeline]
    for r, row in enumerate(result.timeline):
        for s in row:
            first = int(round(Fraction(s.start).limit_denominator(10_000) / step))
            last = int(round(Fraction(s.end).limit_denominator(10_000) / step))
            for t in range(first, last):
                cells[r][t] = str(s.action) if t == first else '"'
    width = max([len(c) for row in cells for c in row] + [len(f"rank {len(cells) - 1}")])
    unit = "" if step == 1 else f"  (1 step = {float(step):g})"
    lines = ["step  " + "  ".join(f"rank {r}".ljust(width) for r in range(len(cells))).rstrip() + unit]
    for t in range(steps):
        lines.append(f"{t:>4}  " + "  ".join(cells[r][t].ljust(width) for r in range(len(cells))).rstrip())
    return "\n".join(lines)


def _common_step(times: list[Fraction]) -> Fraction:
    nonzero = [t for t in times if t > 0]
    if not nonzero:
        return Fraction(1)
    den = 1
    for t in nonzero:
        den = den * t.denominator // gcd(den, t.denominator)
    num = 0
    for t in nonzero:
        num = gcd(num, int(t * den))
    return Fraction(num, den)
