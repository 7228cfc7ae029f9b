"""compile_program: trace a model and run the passes its Plan calls for, for one rank."""
from __future__ import annotations

import torch

from .driver import run_passes
from .program import Program
from .trace import trace


def compile_program(model: torch.nn.Module, args: tuple, kwargs: dict, *, mesh, plan, rank: int | None = None,
                    prefix: str = "", fixed: dict | None = None) -> tuple[Program, Program, dict[str, torch.Tensor]]:
    """(traced program, transformed program, full tensors by FQN) for `rank` (default: this process's).

    `fixed` gives placements decided by an earlier program of the same job, so that every program of a
    job shards each parameter the same way.
    """
    traced, tensors = trace(model, args, kwargs, mesh=mesh, plan=plan, rank=rank, prefix=prefix)
    if fixed is not None:
        traced = traced.replace(fixed_placements=fixed)
    return traced, run_passes(traced), tensors


def passes_for_rank(traced: Program, rank: int) -> Program:
    """The transformed program another rank runs, from the same trace (inspection only)."""
    return run_passes(traced.replace(rank=rank))
