"""Plan.inductor decided for the device at hand: whether Inductor lowers each per-rank program.

    True    the user forces it: an error where the plan's programs hold run-time state a traced graph cannot
            (`blockers`), naming it and what to do instead;
    False   the programs run as FX code (ATen ops called one by one from Python);
    None    the cost model's choice: on on CUDA (Inductor fuses the element-wise chains between matmuls into
            generated Triton kernels: measured on one H200, torch.compile's step 1.11x eager's tokens/s on a 1.1B
            Llama, docs/gpu.md), off on CPU (its C++ code measured 6-7% faster than eager per step on this
            machine class, docs/compiler.md, for seconds of cold compile per program: a loss for short runs and
            test suites); off wherever a blocker stands.

A blocker is a part of the plan whose run-time behaviour lives outside the graph, so that tracing the program
(make_fx under AOTAutograd, on fake tensors) would record something else than what runs: ZeRO-3's offload_params
(pages of parameter shards released as their gathers read them by the run-time ZeRO context). ZeRO-2/3 and remat
compile: their gathers, reduce-scatters and recomputation are graph nodes and partitioner marks (passes/zero.py,
passes/remat.py, runtime/inductor.py); so do the zero-bubble schedules, whose stages' backward graphs are cut into an
input and a weight half, each compiled (runtime/compiled_split.py). Ops no traced graph holds (expert
parallelism's dispatch and combine, sized by the routing; ring attention's and collective matmul's point-to-point
rings) run as FX code between compiled regions of their program (runtime/regions.py).
"""
from __future__ import annotations

from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.plan import Decision
from meshc.compiler.ir.program import Program


def blockers(program: Program, decisions: dict) -> list[str]:
    """What in this program's plan keeps Inductor from compiling it (empty: nothing)."""
    plan = program.plan
    out = []
    if plan.zero == 3 and plan.offload_params:
        out.append("offload_params releases the pages of parameter shards as their gathers read them (run-time "
                   "state); drop offload_params")
    return out


def yield_to_inductor(program: Program, decisions: dict) -> dict:
    """The decisions with the cost model's own choices that would keep Inductor out given way to it where it is to
    compile (Plan.inductor True, or None on CUDA): collective matmul left to the cost model (Plan.collective_matmul
    None) is turned off: its rings' point-to-point transfers would run as FX code between compiled regions, cutting
    each block's graph twice, while sequence parallelism's gathers and reduce-scatters stay functional collectives
    that Inductor's scheduler overlaps. A value the user set stays (its rings then run between regions)."""
    plan = program.plan
    wanted = plan.inductor is True or (plan.inductor is None and program.mesh.device_type == "cuda")
    ring = decisions.get("collective_matmul")
    if not wanted or plan.collective_matmul is not None or ring is None or not ring.value:
        return decisions
    return {**decisions, "collective_matmul": Decision(False, "Inductor compiles this plan's programs: sequence "
                                                              "parallelism's collectives stay graph nodes it schedules "
                                                              "for overlap (the rings' transfers would run as FX code "
                                                              "between compiled regions); "
                                                              f"the cost model had said: {ring.why}")}


def decide_inductor(program: Program, hw: Hardware, decisions: dict) -> Decision:
    """Decision for Plan.inductor (module docstring); raises where True is asked of a plan with a blocker."""
    plan = program.plan
    found = blockers(program, decisions)
    if plan.inductor is False:
        return Decision(False, "Plan.inductor=False")
    if plan.inductor is True:
        if found:
            raise MeshcValueError(f"Plan.inductor: expected a plan whose per-rank programs are graphs Inductor can "
                                  f"trace, got inductor=True where {found[0]}; drop that part of the plan or use "
                                  "Plan(inductor=None), which runs such programs as FX code")
        return Decision(True, "Plan.inductor=True")
    if found:
        return Decision(False, f"not compiled for this plan yet: {found[0]}")
    if program.mesh.device_type == "cuda":
        return Decision(True, f"{hw.name} profile: Inductor fuses the element-wise chains between matmuls "
                              "into generated kernels")
    return Decision(False, f"{hw.name} profile: on CPU Inductor's step measured ~6% faster than eager for seconds "
                           "of compile per program (docs/compiler.md): off for short runs; Plan(inductor=True) "
                           "turns it on")
