"""The pipeline side of a job: its stages on this rank, their schedule, and one training step.

A job is pipelined when the mesh has pp > 1 or the plan asks for micro-batches. Its program is traced
on one micro-batch; compiler/stages.py cuts it into pp x virtual stage graphs and this rank keeps the
ones it runs (stage s on pp rank s % pp), with only those stages' parameters. The schedule is checked
by the simulator before the first step. A parameter held by stages on several pp ranks (a tied
embedding and LM head) has its gradient summed over those ranks after each step.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from meshc.compiler import _torch_compat as compat
from meshc.compiler.program import Program
from meshc.compiler.stages import Stage, stage_graphs

from .pipeline import PipelineRun
from .schedule import schedule as make_schedule
from .schedule_sim import simulate


class Pipelined:
    def __init__(self, program: Program, mesh, plan):
        self.program, self.mesh, self.plan = program, mesh, plan
        pp, v, m = mesh.size("pp"), plan.virtual, plan.microbatches
        count = pp * v
        stages = stage_graphs(program, count) if count > 1 else [_whole(program)]
        self.all_stages = stages
        coord = mesh.coord("pp")
        self.local = {s.index: s for s in stages if s.index % pp == coord}
        self.schedule = make_schedule(plan.schedule, pp, m, v)
        self.params = {f for s in self.local.values() for f in s.params}
        self.buffers = {f for s in self.local.values() for f in s.buffers}
        holders: dict[str, set[int]] = {}
        for s in stages:
            for f in s.params:
                holders.setdefault(f, set()).add(s.index % pp)
        self.tied = sorted(f for f, ranks in holders.items() if len(ranks) > 1)
        self.holders = holders
        self.coord = coord
        self.simulated = simulate(self.schedule, cost=lambda a: self._cost(a))

    def owner(self, fqn: str) -> int:
        """The first pp rank holding a parameter or buffer (buffers: the first stage using it)."""
        if fqn in self.holders:
            return min(self.holders[fqn])
        users = [s.index % self.mesh.size("pp") for s in self.all_stages if fqn in s.buffers]
        return min(users) if users else 0

    def tied_copies(self) -> set[str]:
        """Tied parameters this rank holds but another (lower) pp rank counts."""
        return {f for f in self.tied if self.owner(f) != self.coord and self.coord in self.holders[f]}

    def _cost(self, action) -> float:
        info = getattr(self.program, "stage_info", None)
        flops = info[action.stage].flops if info else 1.0
        return {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[action.kind] * max(flops, 1.0)

    def step(self, flat: list, targets: Any, loss_fn: Callable, values: Callable[[Stage], list],
             zero_context) -> torch.Tensor:
        m = self.plan.microbatches
        micro = [list(x) for x in zip(*(_chunks(t, m, f"input {i}") for i, t in enumerate(flat)))]
        micro_targets = _chunks_tree(targets, m)
        spec = self.program.out_spec

        def loss_of(outs: tuple, mb: int) -> torch.Tensor:
            loss = loss_fn(compat.tree_unflatten(list(outs), spec), micro_targets[mb])
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("job.step: expected loss_fn to return a scalar tensor; reduce the loss to its "
                                 "mean over the batch")
            return loss
        run = PipelineRun(self.local, self.schedule, self.mesh, values, loss_of, zero_context)
        loss = run.run(micro)
        self.last_busy, self.last_elapsed = run.busy, run.elapsed  # measured bubble: elapsed / busy - 1
        return loss

    def sum_tied(self, grad_holder: Callable[[str], torch.Tensor | None], shape_of: Callable[[str], tuple],
                 dtype_of: Callable[[str], torch.dtype]) -> None:
        """Sum the gradients of parameters held on several pp ranks (zeros from ranks not holding them)."""
        if not self.tied or self.mesh.size("pp") == 1:
            return
        parts = []
        for f in self.tied:
            t = grad_holder(f)
            g = t.grad if t is not None and t.grad is not None else None
            parts.append(g.reshape(-1) if g is not None else torch.zeros(shape_of(f), dtype=dtype_of(f),
                                                                           device=self.mesh.device).reshape(-1))
        total = compat.all_reduce_sum(torch.cat(parts), self.mesh.group_name("pp"))
        offset = 0
        for f, part in zip(self.tied, parts):
            t = grad_holder(f)
            if t is not None:
                t.grad = total[offset: offset + part.numel()].view_as(t).clone()
            offset += part.numel()


def _whole(program: Program) -> Stage:
    """One stage holding the whole program (micro-batches without pipeline parallelism)."""
    inputs = program.placeholders("input")
    return Stage(index=0, gm=program.gm, params=list(program.params), buffers=list(program.buffers),
                 inputs=list(range(len(inputs))), last=True)


def _chunks(t: Any, m: int, what: str) -> list:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return [t] * m
    if t.shape[0] % m:
        raise ValueError(f"job.step: {what} has {t.shape[0]} rows, not divisible by microbatches={m}; make the "
                         f"dp-local batch a multiple of {m} or change Plan.microbatches")
    return list(t.chunk(m))


def _chunks_tree(tree: Any, m: int) -> list:
    flat, spec = compat.tree_flatten(tree)
    parts = [_chunks(t, m, "targets") for t in flat]
    return [compat.tree_unflatten([p[i] for p in parts], spec) for i in range(m)]
