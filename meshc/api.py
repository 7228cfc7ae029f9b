"""meshc.compile: the main door."""
from __future__ import annotations

from typing import Any

import torch

from meshc.compiler.ir.torch_compat import tree_flatten
from meshc.compiler.ir.errors import MeshcTypeError
from meshc.job import Job
from meshc.runtime.mesh import Mesh

from meshc.compiler.ir.plan import Plan


def compile(model: torch.nn.Module, mesh: Mesh, *, example_inputs: Any, example_kwargs: dict | None = None,
            plan: Plan | str | None = None) -> Job:
    """Compile `model` for this rank of `mesh` and return the Job that trains it.

    `example_inputs` is this rank's dp-local batch (a tensor or a tuple of positional inputs), as the
    job will be called; `example_kwargs` holds keyword inputs if the model takes any. `plan="auto"` lets
    the planner choose ZeRO stage, micro-batches, schedule and remat for this mesh by predicted step time
    (compiler/planner/compiled.auto_plan, on the hardware profile of this device or the calibrated CPU).
    """
    if not isinstance(model, torch.nn.Module):
        raise MeshcTypeError(f"meshc.compile: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise MeshcTypeError(f"meshc.compile: expected a meshc Mesh (from meshc.mesh(...)), got {type(mesh).__name__}")
    plan = Plan() if plan is None else plan
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if not any(isinstance(x, torch.Tensor) for x in tree_flatten((args, example_kwargs or {}))[0]):
        raise MeshcTypeError("meshc.compile: expected example_inputs holding this rank's input tensors (their shapes "
                             f"and dtypes are what is compiled), got {type(example_inputs).__name__}; pass a batch "
                             "as the job will be called, e.g. example_inputs=(tokens,)")
    if isinstance(plan, str) and plan == "auto":  # the planner chooses, for this model on this mesh
        from meshc.compiler.planner.compiled import auto_plan

        plan, _ = auto_plan(model, mesh, args, dict(example_kwargs or {}))
    if not isinstance(plan, Plan):
        raise MeshcTypeError(f"meshc.compile: expected plan to be a meshc.Plan or \"auto\", got {type(plan).__name__}")
    return Job(model, mesh, plan, args, dict(example_kwargs or {}))
