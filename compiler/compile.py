"""compile_program and compile_rank: trace a model and run the passes its Plan calls for, for one rank.

Nothing here needs a process group: the mesh is a MeshSpec (a runtime Mesh is accepted for its topology),
so the planner and `meshc explain` compile any rank of any mesh in one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from meshc.compiler.trace import check as check_trace
from meshc.compiler.ir.torch_compat import tree_map
from meshc.compiler.driver import reporting, run_passes
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.program import Program
from meshc.compiler.pipeline.rank_plan import PipelinePlan
from meshc.compiler.trace.export import trace


@dataclass
class CompiledRank:
    """What one rank runs, as the compiler made it: the traced program, the transformed one, and its
    pipeline (stages and schedule) when the plan has one. The public view that explain(), the cost model
    and checkpoints read of a job."""

    traced: Program
    program: Program
    pipeline: PipelinePlan | None


def compile_program(model: torch.nn.Module, args: tuple, kwargs: dict, *, mesh, plan, rank: int | None = None,
                    prefix: str = "", fixed: dict | None = None,
                    hardware=None) -> tuple[Program, Program, dict[str, torch.Tensor]]:
    """(traced program, transformed program, full tensors by FQN) for `rank` (default: a runtime Mesh's own).

    `fixed` gives placements decided by an earlier program of the same job, so that every program of a
    job shards each parameter the same way. Plan.check_trace compares the trace with the eager model first.
    `hardware` (a compiler/cost/hardware.Hardware; None: this device's) is the profile the cost model's decisions are
    made for (the stages stay balanced for this device's rates, as a Job's are).
    """
    if mesh.spec.size("cp") > 1:  # traced at the global sequence length; the context pass makes it local again
        args, kwargs = whole_sequences((args, kwargs), mesh.spec.size("cp"))
    traced, tensors = trace(model, args, kwargs, mesh=mesh, plan=plan, rank=rank, prefix=prefix)
    if check_trace.wanted(plan, tensors):
        traced.notes.append(check_trace.check_trace(model, traced, tensors, args, kwargs))
    if fixed is not None:
        traced = traced.replace(fixed_placements=fixed)
    if hardware is not None:
        traced = traced.replace(hardware=hardware)
    if mesh.spec.size("pp") == 1 and plan.microbatches == 1:  # job.step runs the loss in the step's own graph
        traced = traced.replace(step_loss=True)
    if traced.mesh.size("pp") > 1:  # the stages balanced in time (pipeline_split) on the profile the decisions are
        from meshc.compiler.cost.hardware import detect  # made for: `hardware` (meshc explain --hardware), else this device's

        traced = traced.replace(stage_rates=(hardware or detect()).rates(traced.mesh.sizes))
    return traced, run_passes(traced), tensors


def compile_rank(model: torch.nn.Module, args: tuple, kwargs: dict, *, mesh, plan,
                 rank: int | None = None, hardware=None) -> tuple[CompiledRank, dict[str, torch.Tensor]]:
    """Compile `rank` of `mesh` for `model` called on this rank's dp-local `args`/`kwargs`; with pipeline
    stages or micro-batches, the program is traced on one micro-batch and cut into its stages."""
    pipelined = mesh.size("pp") > 1 or plan.microbatches > 1
    if pipelined:
        args, kwargs = one_microbatch((args, kwargs), plan.microbatches)
    traced, program, tensors = compile_program(model, args, kwargs, mesh=mesh, plan=plan, rank=rank, hardware=hardware)
    with reporting("pipeline stage extraction", hint="move the cut (Plan(split_points=...))"):
        pipeline = PipelinePlan(program, plan) if pipelined else None
    return CompiledRank(traced, program, pipeline), tensors


def passes_for_rank(traced: Program, rank: int) -> Program:
    """The transformed program another rank runs, from the same trace (inspection only)."""
    return run_passes(traced.replace(rank=rank))


def whole_sequences(tree: Any, cp: int) -> Any:
    """cp-local example inputs (mesh.shard_batch's) widened to the global sequence length: dim 1 of every
    tensor of two or more dims repeated cp times (the trace needs only shapes and dtypes)."""
    def widen(t):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            return t
        return t.repeat(1, cp, *([1] * (t.dim() - 2)))
    return tree_map(widen, tree)


def one_microbatch(tree: Any, m: int) -> Any:
    """The example inputs cut to one micro-batch (their dim 0 divided by m)."""
    def cut(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or m == 1:
            return t
        if t.shape[0] % m:
            raise MeshcValueError(f"meshc.compile: example input of {t.shape[0]} rows is not divisible by "
                                  f"microbatches={m}; pass this rank's dp-local batch, a multiple of {m}")
        return t[: t.shape[0] // m]
    return tree_map(cut, tree)
