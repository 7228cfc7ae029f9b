"""PipelinePlan: the compile-time facts of a pipelined program for one rank.

A program is pipelined when the mesh has pp > 1 or the plan asks for micro-batches. It is traced on one
micro-batch; compiler/pipeline/stages.py cuts it into pp × virtual stage graphs, and the rank keeps the ones it runs
(the schedule's placement: stage s on pp rank s % pp, or in a V for zbv and dualpipev) with only those stages' parameters. The schedule (ir/schedule.py) is built and
simulated here, with each stage's forward FLOPs as its cost, before anything runs. A parameter held by
stages on several pp ranks (a tied embedding and LM head) is listed in `tied`: the runtime sums its
gradient over those ranks after each step (runtime/pipeline/step.py runs the step). Under a schedule that splits
backward into I and W, the rank's stages give each parameter use a node of its own (compiler/pipeline/backward_graphs.py).
"""
from __future__ import annotations

from meshc.compiler.ir.program import Program
from meshc.compiler.ir.named_schedule import schedule as make_schedule
from meshc.compiler.ir.schedule_sim import simulate
from meshc.compiler.pipeline.stages import Stage, stage_graphs
from meshc.compiler.pipeline.backward_graphs import private_weight_uses

COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # relative cost of an action, times the stage's FLOPs


class PipelinePlan:
    """Stages, schedule and parameter ownership of `program`'s rank (its pp coordinate)."""

    def __init__(self, program: Program, plan):
        mesh = program.mesh
        self.program, self.plan = program, plan
        pp, v, m = mesh.size("pp"), plan.virtual, plan.microbatches
        count = pp * v
        stages = stage_graphs(program, count) if count > 1 else [whole_stage(program)]
        self.pp = pp
        self.all_stages = stages
        self.coord = mesh.coord("pp", program.rank)
        self.schedule = make_schedule(plan.schedule, pp, m, v)
        split = any(a.kind == "W" for row in self.schedule.actions for a in row)  # backward in I and W halves
        rank_of = self.schedule.rank_of
        self.local = {s.index: private_weight_uses(s) if split else s for s in stages if rank_of(s.index) == self.coord}
        self.params = {f for s in self.local.values() for f in s.params}
        self.buffers = {f for s in self.local.values() for f in s.buffers}
        holders: dict[str, set[int]] = {}
        for s in stages:
            for f in s.params:
                holders.setdefault(f, set()).add(rank_of(s.index))
        # parameters and buffers no stage reads (a head the loss never uses): kept by stage 0's rank, untrained, so
        # that state_dict and checkpoints still hold their values
        first = rank_of(stages[0].index)
        for f in program.params:
            if f not in holders:
                holders[f] = {first}
                if first == self.coord:
                    self.params.add(f)
        used = {f for s in stages for f in s.buffers}
        if first == self.coord:
            self.buffers |= {f for f in program.buffers if f not in used}
        self.holders = holders
        self.tied = sorted(f for f, ranks in holders.items() if len(ranks) > 1)
        self.simulated = simulate(self.schedule, cost=self._cost)

    def messages(self, stage: Stage) -> tuple[int, int]:
        """(bytes of activations, bytes of input gradients) `stage` sends another pp rank per micro-batch: none
        to a neighbour stage on its own rank (the bottom of a V, or pp = 1), which gets them handed over."""
        here, rank_of, count = self.schedule.rank_of(stage.index), self.schedule.rank_of, len(self.all_stages)
        forward = stage.sent_bytes if stage.index + 1 < count and rank_of(stage.index + 1) != here else 0
        backward = stage.grad_bytes if stage.index > 0 and rank_of(stage.index - 1) != here else 0
        return forward, backward

    def owner(self, fqn: str) -> int:
        """The first pp rank holding a parameter or buffer (buffers: the first stage using it)."""
        if fqn in self.holders:
            return min(self.holders[fqn])
        users = [self.schedule.rank_of(s.index) for s in self.all_stages if fqn in s.buffers]
        return min(users) if users else 0

    def tied_copies(self) -> set[str]:
        """Tied parameters this rank holds but another (lower) pp rank counts."""
        return {f for f in self.tied if self.owner(f) != self.coord and self.coord in self.holders[f]}

    def _cost(self, action) -> float:
        info = self.program.stage_info
        flops = info[action.stage].flops if info else 1.0
        kind = action.kind
        if action.stage == 0 and kind in ("I", "W"):  # the first stage's inputs need no gradient: I is empty, W is B
            kind = "B" if kind == "W" else None
        return (COST[kind] if kind else 0.0) * max(flops, 1.0)


def whole_stage(program: Program) -> Stage:
    """One stage holding the whole program (micro-batches without pipeline parallelism)."""
    inputs = program.placeholders("input")
    return Stage(index=0, gm=program.gm, params=list(program.params), buffers=list(program.buffers),
                 inputs=list(range(len(inputs))), last=True)
