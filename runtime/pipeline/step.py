"""The pipeline side of a job at run time: one training step through this rank's stages.

The stages, their schedule and who holds which parameter are compile-time facts (compiler/pipeline/rank_plan.py);
this runs them: micro-batches through the schedule (runtime/pipeline/executor.py), then the gradients of parameters
held on several pp ranks (tied embeddings) summed over those ranks.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.pipeline.rank_plan import PipelinePlan
from meshc.compiler.pipeline.stages import Stage

from meshc.runtime.pipeline.executor import PipelineRun


class Pipelined:
    """Runs a PipelinePlan's steps on `mesh` (the rank the plan was compiled for)."""

    def __init__(self, layout: PipelinePlan, mesh):
        self.layout, self.mesh, self.plan = layout, mesh, layout.plan
        self.program = layout.program
        self.last_busy = self.last_elapsed = 0.0
        self.last_actions: list = []  # (Action, seconds) of this rank's compute actions in the last step

    def step(self, flat: list, targets: Any, loss_fn: Callable, values: Callable[[Stage], list],
             zero_context, runnable: Callable[[Stage], Callable] | None = None,
             weigh: Callable[[list], list] | None = None) -> torch.Tensor:
        """`weigh(micro_targets)`: each micro-batch's loss weight (job.step's count), else each counts 1 (the
        executor's backward divides by m)."""
        m = self.plan.microbatches
        micro = [list(x) for x in zip(*(_chunks(t, m, f"input {i}") for i, t in enumerate(flat)))]
        micro_targets = _chunks_tree(targets, m)
        weights = weigh(micro_targets) if weigh is not None else None
        spec = self.program.out_spec

        def loss_of(outs: tuple, mb: int) -> torch.Tensor:
            loss = loss_fn(compat.tree_unflatten(list(outs), spec), micro_targets[mb])
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise MeshcValueError("job.step: expected loss_fn to return a scalar tensor; reduce the loss to its "
                                      "mean over the batch")
            return loss if weights is None else weighted(loss, weights[mb])
        run = PipelineRun(self.layout.local, self.layout.schedule, self.mesh, values, loss_of, zero_context, runnable)
        loss = run.run(micro)
        self.last_busy, self.last_elapsed = run.busy, run.elapsed  # measured bubble: elapsed / busy - 1
        self.last_actions = run.actions
        return loss

    def set_tied_aside(self, grad_holder: Callable[[str], torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Take the gradients that earlier steps left on the tied parameters (accumulation: several job.step calls
        before the optimizer's), so that sum_tied sums this step's alone: they are already summed over the stages,
        and summing them again would count them once per stage. Returns them, for sum_tied to add back."""
        earlier = {}
        if self.mesh.size("pp") == 1:
            return earlier
        for f in self.layout.tied:
            t = grad_holder(f)
            if t is not None and t.grad is not None:
                earlier[f], t.grad = t.grad, None
        return earlier

    def sum_tied(self, grad_holder: Callable[[str], torch.Tensor | None], shape_of: Callable[[str], tuple],
                 dtype_of: Callable[[str], torch.dtype], earlier: dict[str, torch.Tensor]) -> None:
        """Sum this step's gradients of parameters held on several pp ranks (zeros from ranks not holding them),
        then add back those of earlier steps (`earlier`, from set_tied_aside)."""
        tied = self.layout.tied
        if not tied or self.mesh.size("pp") == 1:
            return
        parts = []
        for f in tied:
            t = grad_holder(f)
            g = t.grad if t is not None and t.grad is not None else None
            parts.append(g.reshape(-1) if g is not None else torch.zeros(shape_of(f), dtype=dtype_of(f),
                                                                           device=self.mesh.device).reshape(-1))
        total = compat.all_reduce_sum(torch.cat(parts), self.mesh.group_name("pp"))
        offset = 0
        for f, part in zip(tied, parts):
            t = grad_holder(f)
            if t is not None:
                step = total[offset: offset + part.numel()].view_as(t)
                t.grad = earlier[f].add_(step) if f in earlier else step.clone()
            offset += part.numel()


def weighted(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`loss × weight` (job.step's count), exactly 0 where the weight is: a part with nothing counted (a micro-batch
    or rank whose labels are all ignored) has a mean of 0/0, NaN, which must not reach the step's loss."""
    weight = weight.to(loss.device)
    return torch.where(weight == 0, torch.zeros_like(loss), loss * weight)


def _chunks(t: Any, m: int, what: str) -> list:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return [t] * m
    if t.shape[0] % m:
        raise MeshcValueError(f"job.step: {what} has {t.shape[0]} rows, not divisible by microbatches={m}; make the "
                              f"dp-local batch a multiple of {m} or change Plan.microbatches")
    return list(t.chunk(m))


def _chunks_tree(tree: Any, m: int) -> list:
    flat, spec = compat.tree_flatten(tree)
    parts = [_chunks(t, m, "targets") for t in flat]
    return [compat.tree_unflatten([p[i] for p in parts], spec) for i in range(m)]
