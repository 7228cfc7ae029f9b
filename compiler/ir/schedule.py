"""Pipeline schedules as data: per-rank orders of compute actions, and the point-to-point messages
they imply. Nothing here talks to torch.distributed; `meshc.compiler.ir.schedule_sim` proves a schedule
valid and deadlock-free, and times it, before an executor runs it.

Terms:
  pp          ranks on the pipeline axis.
  stage       a slice of the model's layers; there are `pp * virtual` stages. Placement "loop" puts
              stage s on rank `s % pp` (Megatron-LM's and torch.distributed.pipelining's interleaved
              placement); placement "v" runs the stages down the ranks and back up, zig-zag: stage s
              on rank `s % pp` when `s // pp` is even, on `pp - 1 - s % pp` when odd (with v = 2, rank r
              holds stages r and 2pp-1-r, so the first and the last stage share rank 0).
  virtual     stages per rank (v); v > 1 for the interleaved schedule and the V schedules (zbv, dualpipev).
  microbatch  one of the m = `microbatches` slices of a batch, numbered 0..m-1.
  action      one unit of compute, `Action(stage, kind, microbatch)`, printed `2F0` like torch's
              `_Action`. Kinds:
                F  forward of a stage on a micro-batch;
                B  full backward (input and weight gradients together);
                I  backward for the input gradient only (what the previous stage waits for);
                W  backward for the weight gradients only (deferrable: nobody waits for it).
              Every (stage, microbatch) gets exactly one F and either one B or one I and one W.
  message     a `P2P` send or receive, printed like torch's `0SEND_F3` / `1RECV_F3` (activation of
              micro-batch 3 from stage 0 to stage 1) and `1SEND_B3` / `0RECV_B3` (its gradient back).
  program     a rank's ordered ops: compute actions with their messages around them; each receive
              blocks until its message arrives, each send is buffered and never blocks.

Schedules (each rank's compute order; the orders of gpipe, 1f1b and interleaved equal the compute
orders torch.distributed.pipelining runs for ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B, and
zb-h1 equals ScheduleInterleavedZeroBubble's order with one stage per rank; Schedule1F1B's
`_get_pipeline_order`, a display only, is off by one micro-batch on the last rank in torch 2.13):
  gpipe        all forwards, then all backwards, micro-batches in order.                    GPipe
  1f1b         min(pp-1-r, m) warm-up forwards on rank r, then F,B pairs, then the last Bs.  PipeDream-Flush
  interleaved  Megatron-LM's interleaved 1F1B over v stages per rank (m a multiple of pp).  Narayanan et al. 2021
  zb-h1        1F1B with B split into I and W; rank r defers its Ws by r steady steps so Ws fill the
               warm-up and cool-down bubbles at 1F1B's peak memory (pp micro-batches).   Qi et al. 2023
  zbv          two stages per rank in a V (placement "v"), B split into I and W: the stage handed over
               at the V's bottom stays on one rank, so the last rank turns a micro-batch round without
               waiting; equals torch's ScheduleZBVZeroBubble order.                      Qi et al. 2024
  dualpipev    zbv's V with each rank's steady state pairing one stage's F with the other's B (the pair
               a runtime can overlap), I and W split at both ends; m >= 2pp; equals torch's
               ScheduleDualPipeV order (pairs written F then B).                     DeepSeek-V3, 2024
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from meshc.compiler.ir.errors import MeshcTypeError, MeshcValueError

KINDS = ("F", "B", "I", "W")


class ScheduleError(MeshcValueError):
    """A schedule that would compute wrongly or hang: the message names the first offending action."""


def _check_int(rule: str, value, lowest: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise MeshcValueError(f"{rule}: expected an int >= {lowest}, got {value!r}")


@dataclass(frozen=True, order=True)
class Action:
    """One compute action: `kind` ("F", "B", "I" or "W") of `stage` on `microbatch`. Prints `2F0`."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self):
        _check_int("Action.stage", self.stage, 0)
        _check_int("Action.microbatch", self.microbatch, 0)
        if self.kind not in KINDS:
            raise MeshcValueError(f"Action.kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    @staticmethod
    def parse(text: str) -> Action:
        """`Action.parse("2F0") == Action(2, "F", 0)`."""
        match = re.fullmatch(r"(\d+)([FBIW])(\d+)", text.strip())
        if match is None:
            raise MeshcValueError(f"Action.parse: expected '<stage><F|B|I|W><microbatch>' like '2F0', got {text!r}")
        return Action(int(match[1]), match[2], int(match[3]))


def actions(text: str) -> tuple[Action, ...]:
    """`actions("0F0 0F1 0B0")`: a rank's order written the way it prints."""
    return tuple(Action.parse(word) for word in text.split())


@dataclass(frozen=True, kw_only=True)
class P2P:
    """A message op in a rank's program.

    op:         "send" or "recv".
    kind:       "F" for an activation (stage s to s+1) or "B" for an input gradient (stage s to s-1).
    stage:      the stage on this rank: the producer for a send, the consumer for a receive.
    microbatch: the micro-batch the tensor belongs to.
    peer:       the rank on the other end.
    """

    op: str
    kind: str
    stage: int
    microbatch: int
    peer: int

    def __post_init__(self):
        if self.op not in ("send", "recv"):
            raise MeshcValueError(f"P2P.op: expected 'send' or 'recv', got {self.op!r}")
        if self.kind not in ("F", "B"):
            raise MeshcValueError(f"P2P.kind: expected 'F' (activation) or 'B' (gradient), got {self.kind!r}")
        _check_int("P2P.stage", self.stage, 0)
        _check_int("P2P.microbatch", self.microbatch, 0)
        _check_int("P2P.peer", self.peer, 0)

    def __str__(self) -> str:
        return f"{self.stage}{self.op.upper()}_{self.kind}{self.microbatch}"

    def __repr__(self) -> str:
        return f"{self}@{self.peer}"

    @property
    def peer_stage(self) -> int:
        """The stage on the other end: activations flow to s+1, gradients to s-1."""
        step = 1 if self.kind == "F" else -1
        return self.stage + step if self.op == "send" else self.stage - step

    @property
    def key(self) -> tuple[str, int, int, int]:
        """(kind, source stage, destination stage, microbatch): equal for a send and its receive."""
        src, dst = (self.stage, self.peer_stage) if self.op == "send" else (self.peer_stage, self.stage)
        return (self.kind, src, dst, self.microbatch)


Op = Action | P2P


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Which compute actions each rank runs, in order.

    name:         the generator's name ("gpipe", "1f1b", "interleaved", "zb-h1", or anything for a
                  hand-made schedule).
    pp:           ranks on the pipeline axis.
    microbatches: m, micro-batches per step.
    virtual:      v, stages per rank; there are pp * v stages.
    placement:    "loop" (stage s on rank s % pp) or "v" (down the ranks and back up; see the module doc).
    actions:      actions[r] is rank r's compute order (Actions only; messages are derived).

    Only the layout is checked here; `schedule_sim.check` proves the orders complete, matched and
    deadlock-free.
    """

    name: str
    pp: int
    microbatches: int
    virtual: int = 1
    placement: str = "loop"
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise MeshcTypeError(f"Schedule.name: expected a str, got {self.name!r}")
        if self.placement not in PLACEMENTS:
            raise MeshcValueError(f"Schedule.placement: expected one of {', '.join(PLACEMENTS)}, got "
                                  f"{self.placement!r}")
        _check_int("Schedule.pp", self.pp, 1)
        _check_int("Schedule.microbatches", self.microbatches, 1)
        _check_int("Schedule.virtual", self.virtual, 1)
        rows = tuple(tuple(row) for row in self.actions)
        object.__setattr__(self, "actions", rows)
        if len(rows) != self.pp:
            raise ScheduleError(f"Schedule.actions: expected one order per rank ({self.pp}), got {len(rows)}")
        for rank, row in enumerate(rows):
            for a in row:
                if not isinstance(a, Action):
                    raise ScheduleError(f"Schedule.actions[{rank}]: expected Actions, got {a!r}")
                if a.stage >= self.num_stages or a.microbatch >= self.microbatches:
                    raise ScheduleError(
                        f"range: expected stage < {self.num_stages} and microbatch < {self.microbatches}, "
                        f"got {a} on rank {rank}")
                if self.rank_of(a.stage) != rank:
                    raise ScheduleError(
                        f"placement: expected {a} on rank {self.rank_of(a.stage)} (stage {a.stage} lives "
                        f"there), got it on rank {rank}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        return tuple(self.rank_of(s) for s in range(self.num_stages))

    def rank_of(self, stage: int) -> int:
        return rank_of(stage, self.pp, self.placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)

    def program(self, rank: int) -> tuple[Op, ...]:
        """Rank `rank`'s ops: each compute action preceded by the receive it blocks on and followed
        by the send it produces (activation of F to stage s+1, input gradient of B or I to stage s-1).
        Neighbouring stages on the same rank (pp == 1, the bottom of a V) hand over locally, with no message."""
        if not 0 <= rank < self.pp:
            raise MeshcValueError(f"Schedule.program: expected a rank in [0, {self.pp}), got {rank}")
        out: list[Op] = []
        for a in self.actions[rank]:
            src = a.stage - 1 if a.kind == "F" else a.stage + 1
            if a.kind in ("F", "B", "I") and 0 <= src < self.num_stages and self.rank_of(src) != rank:
                out.append(P2P(op="recv", kind=_msg_kind(a), stage=a.stage, microbatch=a.microbatch,
                               peer=self.rank_of(src)))
            out.append(a)
            dst = a.stage + 1 if a.kind == "F" else a.stage - 1
            if a.kind in ("F", "B", "I") and 0 <= dst < self.num_stages and self.rank_of(dst) != rank:
                out.append(P2P(op="send", kind=_msg_kind(a), stage=a.stage, microbatch=a.microbatch,
                               peer=self.rank_of(dst)))
        return tuple(out)

    def programs(self) -> tuple[tuple[Op, ...], ...]:
        return tuple(self.program(r) for r in range(self.pp))

    def __str__(self) -> str:
        head = f"{self.name}: pp={self.pp} microbatches={self.microbatches} virtual={self.virtual}"
        head += f" placement={self.placement}" if self.placement != "loop" else ""
        return "\n".join([head] + [f"  rank {r}: " + " ".join(map(str, row)) for r, row in enumerate(self.actions)])


PLACEMENTS = ("loop", "v")


def rank_of(stage: int, pp: int, placement: str = "loop") -> int:
    """The pipeline rank that runs `stage` under `placement` ("loop" or "v", see the module doc)."""
    chunk, pos = divmod(stage, pp)
    return pp - 1 - pos if placement == "v" and chunk % 2 else pos


def _msg_kind(a: Action) -> str:
    return "F" if a.kind == "F" else "B"


# ------------------------------------------------------------------------------------ generators
def check_sizes(name: str, pp: int, m: int, virtual: int, *, allowed_virtual: int | None = 1) -> None:
    _check_int(f"{name} pp", pp, 1)
    _check_int(f"{name} microbatches", m, 1)
    _check_int(f"{name} virtual", virtual, 1)
    if allowed_virtual is not None and virtual != allowed_virtual:
        if allowed_virtual == 1:
            raise MeshcValueError(f"{name} runs one stage per rank: expected virtual=1, got {virtual}; "
                                  "use 'interleaved' for virtual stages")
        raise MeshcValueError(f"{name} runs {allowed_virtual} stages per rank: expected virtual={allowed_virtual}, "
                              f"got {virtual}; leave virtual out (the schedule's own), or use 'interleaved' for more")


def gpipe(pp: int, m: int) -> Schedule:
    """GPipe: every rank runs F0..F(m-1), then B0..B(m-1). Holds all m micro-batches' activations."""
    check_sizes("gpipe", pp, m, 1)
    rows = [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(pp)]
    return Schedule(name="gpipe", pp=pp, microbatches=m, actions=rows)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Megatron-LM's default): rank r runs min(pp-1-r, m) warm-up forwards, then
    alternates one F and one B, then finishes the Bs. Rank r holds at most pp-r micro-batches."""
    check_sizes("1f1b", pp, m, 1)
    rows = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        row = [Action(r, "F", i) for i in range(warmup)]
        for k in range(m - warmup):
            row += [Action(r, "F", warmup + k), Action(r, "B", k)]
        row += [Action(r, "B", i) for i in range(m - warmup, m)]
        rows.append(row)
    return Schedule(name="1f1b", pp=pp, microbatches=m, actions=rows)


def interleaved_1f1b(pp: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: v stages per rank (stage s on rank s % pp), depth first.

    Forwards go in groups of pp micro-batches through the rank's stages in turn (the k-th forward of a
    rank is stage rank + pp*((k // pp) % v) on micro-batch pp*(k // (pp*v)) + k % pp); backwards visit the
    stages in reverse. Rank r runs min((v-1)*pp + 2*(pp-1-r), m*v) warm-up forwards, then F,B pairs, then
    the remaining Bs. Needs m to be a multiple of pp, as Megatron-LM does (torch relaxes this).
    """
    check_sizes("interleaved", pp, m, v, allowed_virtual=None)
    if v < 2:
        raise MeshcValueError(f"interleaved needs several stages per rank: expected virtual >= 2, got {v}; "
                              "use '1f1b' for one stage per rank")
    if m % pp:
        raise MeshcValueError(f"interleaved needs microbatches to be a multiple of pp: expected a multiple of "
                              f"{pp}, got {m}; use microbatches={pp * -(-m // pp)}, or the 1f1b schedule")
    total = m * v

    def nth(k: int, backward: bool) -> tuple[int, int]:  # (local stage index, microbatch) of k-th op
        chunk = (k // pp) % v
        return (v - 1 - chunk if backward else chunk), pp * (k // (pp * v)) + k % pp

    rows = []
    for r in range(pp):
        def op(k: int, kind: str) -> Action:
            chunk, mb = nth(k, kind == "B")
            return Action(r + pp * chunk, kind, mb)

        warmup = min((v - 1) * pp + 2 * (pp - 1 - r), total)
        row = [op(k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            row += [op(warmup + k, "F"), op(k, "B")]
        row += [op(k, "B") for k in range(total - warmup, total)]
        rows.append(row)
    return Schedule(name="interleaved", pp=pp, microbatches=m, virtual=v, actions=rows)


def zb_h1(pp: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", the handcrafted schedule at 1F1B's
    memory): 1F1B's order with each B split into I (input gradient, on the critical path) and W (weight
    gradient, deferrable). Rank r runs min(pp-1-r, m) warm-up forwards, then F,I pairs, appending a W
    after each pair once r pairs are done; then I,W pairs; then its last r Ws. Deferring Ws lets them
    fill the bubbles: with F = I = W the idle time is a third of 1F1B's (B = I + W), and every rank holds at
    most pp micro-batches (activations live from F until W), as rank 0 does in 1F1B.
    This is the order torch's ScheduleInterleavedZeroBubble gives for one stage per rank.
    """
    check_sizes("zb-h1", pp, m, 1)
    rows = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        row = [Action(r, "F", i) for i in range(warmup)]
        next_w = 0
        for k in range(m):
            if warmup + k < m:
                row.append(Action(r, "F", warmup + k))
            row.append(Action(r, "I", k))
            if k >= r:  # each W trails its I by r steps
                row.append(Action(r, "W", next_w))
                next_w += 1
        row += [Action(r, "W", i) for i in range(next_w, m)]
        rows.append(row)
    return Schedule(name="zb-h1", pp=pp, microbatches=m, actions=rows)


def zbv(pp: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory": the V-shaped zero-bubble
    schedule). Two stages per rank in a V: rank r runs stage r on the way down and stage 2pp-1-r on the way
    back up, each B split into I and W. Rank r runs
      warm-up    2(pp-r)-1 forwards of its down stage; r times (F up, F down); then pp-r times the up stage's
                 F, I and W (at the bottom of the V, rank pp-1 turns each micro-batch round by itself);
      steady     F down (while forwards are left), I and W down, then F, I and W up, until the up stage has
                 run as many forwards as the down stage and the down stage all of them;
      cool-down  r times (I down, I up), their Ws deferred; pp-r times (I down, the oldest deferred W down);
                 then the up stage's deferred Ws, then the down stage's.
    The order is built for max(m, 2pp-1) micro-batches (what fills the V) and the actions of micro-batches m
    and above are dropped, which keeps it valid (every dependency of a kept action is kept). With F = I = W
    and m >= 2pp-1 the only idle time is the ramp at both ends. Rank 0 holds at most 2pp stage-sets of
    activations at once, each of half a rank's layers: 1F1B's pp micro-batches of a whole rank.
    The same order as torch's ScheduleZBVZeroBubble.
    """
    check_sizes("zbv", pp, m, 2, allowed_virtual=2)
    filled, top = max(m, 2 * pp - 1), 2 * pp - 1
    rows = []
    for r in range(pp):
        down, up = r, top - r
        done = {(stage, kind): 0 for stage in (down, up) for kind in "FIW"}  # actions of each kind so far
        row: list[Action] = []

        def run(stage: int, *kinds: str) -> None:
            for kind in kinds:
                row.append(Action(stage, kind, done[stage, kind]))
                done[stage, kind] += 1
        for _ in range(2 * (pp - r) - 1):
            run(down, "F")
        for _ in range(r):
            run(up, "F")
            run(down, "F")
        for _ in range(pp - r):
            run(up, "F", "I", "W")
        while done[up, "F"] < done[down, "F"] or done[down, "F"] < filled:
            if done[down, "F"] < filled:
                run(down, "F")
            run(down, "I", "W")
            run(up, "F", "I", "W")
        for _ in range(r):
            run(down, "I")
            run(up, "I")
        for _ in range(pp - r):
            run(down, "I", "W")
        while done[up, "W"] < done[up, "I"]:
            run(up, "W")
        while done[down, "W"] < done[down, "I"]:
            run(down, "W")
        rows.append([a for a in row if a.microbatch < m])
    return Schedule(name="zbv", pp=pp, microbatches=m, virtual=2, placement="v", actions=rows)


def dualpipev(pp: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto a V: Liu et al. 2024, and its open "DualPipeV" cut-in-half
    variant). The stages of zbv's V (rank r: stage r down, 2pp-1-r up); in the middle of the step each rank pairs
    the forward of one of its stages with the full backward (B) of the other, so that an implementation running
    the pair at once hides one's communication behind the other's compute (meshc's executor runs the pair one
    after the other: the order is kept, the overlap is not); the backwards at both ends are split into I and W,
    the Ws run in the order their Is did. Needs m >= 2pp. Rank r runs
      warm-up    2(pp-r-1) forwards down; r+1 times (F down, F up); pp-r-1 times (I up, the oldest W, F up);
      steady     m-2pp+r+1 times (F down, B up, F up, B down);
      drain      pp-r-1 times (B up, F up, B down); r+1 times a backward up and one down, B until half way
                 through, I after (at the half-way pair, odd ranks switch before its up stage, even ranks between
                 its up and down stages); pp-r-1 times (the oldest W, I down); then its last r+1 Ws.
    The same order as torch's ScheduleDualPipeV, each overlapped pair written as its forward and then its
    backward.
    """
    check_sizes("dualpipev", pp, m, 2, allowed_virtual=2)
    if m < 2 * pp:
        raise MeshcValueError(f"dualpipev needs at least as many micro-batches as stages: expected microbatches >= "
                              f"{2 * pp} (2 x pp), got {m}; use microbatches={2 * pp}, or zbv")
    top = 2 * pp - 1
    rows = []
    for r in range(pp):
        down, up = r, top - r
        forwards = {down: 0, up: 0}
        backwards = {down: 0, up: 0}  # B or I so far: the next micro-batch each stage's backward takes
        waiting: list[Action] = []  # Ws of the Is run so far, oldest first
        row: list[Action] = []

        def run(stage: int, kind: str) -> None:
            if kind == "F":
                row.append(Action(stage, "F", forwards[stage]))
                forwards[stage] += 1
                return
            row.append(Action(stage, kind, backwards[stage]))
            if kind == "I":
                waiting.append(Action(stage, "W", backwards[stage]))
            backwards[stage] += 1

        def weight() -> None:
            if waiting:
                row.append(waiting.pop(0))
        for _ in range(2 * (pp - r - 1)):
            run(down, "F")
        for _ in range(r + 1):
            run(down, "F")
            run(up, "F")
        for _ in range(pp - r - 1):
            run(up, "I")
            weight()
            run(up, "F")
        for _ in range(m - 2 * pp + r + 1):
            for stage, other in ((down, up), (up, down)):
                run(stage, "F")
                run(other, "B")
        for _ in range(pp - r - 1):
            run(up, "B")
            run(up, "F")
            run(down, "B")
        split = False
        half = (r + 1) // 2
        for i in range(r + 1):
            split = split or (i == half and r % 2 == 1)
            run(up, "I" if split else "B")
            split = split or (i == half and r % 2 == 0)
            run(down, "I" if split else "B")
        for _ in range(pp - r - 1):
            weight()
            run(down, "I")
        while waiting:
            weight()
        rows.append(row)
    return Schedule(name="dualpipev", pp=pp, microbatches=m, virtual=2, placement="v", actions=rows)


ALIASES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b", "one_f_one_b": "1f1b",
    "interleaved": "interleaved", "interleaved_1f1b": "interleaved", "interleaved-1f1b": "interleaved",
    "zb-h1": "zb-h1", "zbh1": "zb-h1", "zb_h1": "zb-h1",
    "zbv": "zbv", "zb-v": "zbv", "zb_v": "zbv",
    "dualpipev": "dualpipev", "dualpipe-v": "dualpipev", "dualpipe_v": "dualpipev",
}
NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
VIRTUAL = {"zbv": 2, "dualpipev": 2}  # schedules that fix the stages per rank
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank placed in a V
