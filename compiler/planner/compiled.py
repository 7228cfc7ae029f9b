"""The planner's compiled path: each candidate plan scored on the real graph of a simulated rank
(`plan_compiled`, over every mesh of a world size), or of a running job's own rank (`auto_plan`, behind
`meshc.compile(..., plan="auto")`). Enumeration, ranking and the formula path: compiler/planner/search.py.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from meshc.compiler.cost.formulas import Estimate
from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.coverage import coverage
from meshc.compiler.ir.plan import Plan
from meshc.compiler.planner.search import Candidate, PlanResult, Search, _candidate, meshes, plans_for, rank, usable_memory

log = logging.getLogger("meshc.planner")


def estimate_plan(traced, plan: Plan, hardware: Hardware) -> Estimate:
    """Run the passes of `plan` on a traced program and estimate the result (its pipeline too)."""
    from meshc.compiler.cost.compiled import compiled_estimate
    from meshc.compiler.driver import run_passes
    from meshc.compiler.pipeline.rank_plan import PipelinePlan

    program = run_passes(traced.replace(plan=plan, stage_rates=hardware.rates(traced.mesh.sizes), hardware=hardware,
                                        decisions={}))
    pipelined = program.mesh.size("pp") > 1 or plan.microbatches > 1
    estimate = compiled_estimate(program, hardware, PipelinePlan(program, plan) if pipelined else None)
    tp = program.mesh.size("tp")
    if tp > 1:  # priced with the placements the plan really found: say how much of the blocks they shard
        share = coverage(program.params, {"tp": tp}, program.tp_why).fractions["tp"]
        estimate = dataclasses.replace(estimate, notes=(*estimate.notes, f"tp coverage {share:.2f} of the blocks' "
                                                                          f"weight bytes (priced as compiled)"))
    return estimate


def _traced(model, mesh, rank: int, args: tuple, kwargs: dict, plan: Plan, cache: dict):
    """The model traced for `rank` on one micro-batch of its local inputs (cached per micro-batch count and
    dtype), as a Job traces a pipelined plan."""
    from meshc.compiler.compile import one_microbatch
    from meshc.compiler.trace.export import trace

    key = (plan.microbatches, plan.param_dtype)
    if key not in cache:
        cut_args, cut_kwargs = one_microbatch((args, kwargs), plan.microbatches)
        cache[key] = trace(model, tuple(cut_args), dict(cut_kwargs), mesh=mesh, plan=plan, rank=rank)[0]
    return cache[key]


def _score_pruned(plans, score: Callable[[Plan], Estimate], memory: float, pp: int,
                  failed: list | None = None) -> list[tuple[Plan, Estimate]]:
    """Score plans, skipping those the cost model says cannot win: recomputation (and, without pipeline
    stages, more micro-batches) only adds time, so they are tried only while the cheaper variant does not fit.
    Plans that do not compile are left out (and, given `failed`, appended to it with their error)."""
    groups: dict = {}
    for plan in plans:
        key = dataclasses.replace(plan, remat="none", microbatches=1 if pp == 1 else plan.microbatches)
        groups.setdefault(key, []).append(plan)
    order = {"none": 0, "selective": 1, "full": 2}
    out = []
    for group in groups.values():
        for plan in sorted(group, key=lambda q: (q.microbatches, order[q.remat])):
            try:
                estimate = score(plan)
            except Exception as error:  # noqa: BLE001 - a plan that does not compile is not a candidate
                log.info("planner: %s does not compile: %s", plan.describe(), error)
                if failed is not None:
                    failed.append((plan, f"{type(error).__name__}: {error}"))
                continue
            out.append((plan, estimate))
            if estimate.total_memory <= memory:
                break
    return out


def plan_compiled(build: Callable[[], Any], inputs: Callable[[int], tuple], world: int, hardware: Hardware,
                  memory: float | None = None, search: Search = Search(), layers: int | None = None) -> PlanResult:
    """The compiled path over every mesh of `world` ranks: each scored on the real graph of its rank 0.

    `build()` returns the model; `inputs(dp)` the example inputs of one dp rank. Every mesh is a MeshSpec:
    no process group, fake or real, is created.
    """
    from meshc.compiler.ir.mesh_spec import MeshSpec

    memory = usable_memory(hardware, memory)
    scored, failed = [], []
    for sizes in meshes(world, search=search):
        mesh = MeshSpec({"dp": sizes[0], "tp": sizes[1], "pp": sizes[2]})
        model, args, cache = build(), inputs(sizes[0]), {}
        batch = args[0].shape[0] * sizes[0]

        def score(plan: Plan) -> Estimate:
            return estimate_plan(_traced(model, mesh, 0, args, {}, plan, cache), plan, hardware)
        broken: list = []
        for plan, est in _score_pruned(plans_for(sizes, batch, search, layers), score, memory, sizes[2], broken):
            scored.append((Candidate(dp=sizes[0], tp=sizes[1], pp=sizes[2], plan=plan), est))
        failed += [(Candidate(dp=sizes[0], tp=sizes[1], pp=sizes[2], plan=plan), why) for plan, why in broken]
    return rank(scored, memory, hardware, offload=search.offload, failed=tuple(failed))


def auto_plan(model, mesh, args: tuple, kwargs: dict, *, hardware: Hardware | str | None = None,
              memory: float | None = None, search: Search | None = None) -> tuple[Plan, PlanResult]:
    """The best plan for this model on this mesh (the mesh's sizes are given; everything else is chosen).

    Deterministic: every rank scores the same candidates on the same graphs and picks the same plan.
    """
    from meshc.compiler.cost.hardware import detect, load

    hw = detect() if hardware is None else load(hardware)
    search = search or Search()
    memory = usable_memory(hw, memory)
    sizes = (mesh.size("dp"), mesh.size("tp"), mesh.size("pp"), mesh.size("ep"), mesh.size("cp"))
    batch = args[0].shape[0] * sizes[0] // sizes[4]  # cp ranks share their rows
    cache: dict = {}

    def score(plan: Plan) -> Estimate:
        return estimate_plan(_traced(model, mesh, mesh.rank, args, kwargs, plan, cache), plan, hw)
    scored = [(_candidate(sizes, plan), est)
              for plan, est in _score_pruned(plans_for(sizes, batch, search), score, memory, sizes[2])]
    result = rank(scored, memory, hw, offload=False)  # a job's plan="auto" has no offload_dir to offer
    return result.best.candidate.plan, result
