"""Plan.inductor decided for the device at hand: whether Inductor lowers each per-rank program.

    True    the user forces it;
    False   the programs run as FX code (ATen ops called one by one from Python);
    None    the cost model's choice: on on CUDA (Inductor fuses the element-wise chains between matmuls into
            generated Triton kernels: measured on one H200, torch.compile's step 1.11x eager's tokens/s on a 1.1B
            Llama, docs/gpu.md), off on CPU (its C++ code measured 6-7% faster than eager per step on this
            machine class, docs/compiler.md, for seconds of cold compile per program: a loss for short runs and
            test suites).

Every plan compiles. What once lived at run time outside the graph is graph nodes and partitioner marks: ZeRO-2/3's
gathers and reduce-scatters, remat's recomputation (passes/zero.py, passes/remat.py, runtime/inductor.py), the pages
offload_params drops once a gather has read its shards (an op in the graph, runtime/ops/pages.py); the zero-bubble
schedules' stages get their backward graphs cut into an input and a weight half, each compiled
(runtime/compiled_split.py). Ops no traced graph holds (expert parallelism's dispatch and combine, sized by the
routing; ring attention's and collective matmul's point-to-point rings; a user autograd.Function drawing random
numbers) run as FX code between compiled regions of their program (runtime/regions.py).
"""
from __future__ import annotations

from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.plan import Decision
from meshc.compiler.ir.program import Program


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


def decide_inductor(program: Program, hw: Hardware) -> Decision:
    """Decision for Plan.inductor (module docstring)."""
    plan = program.plan
    if plan.inductor is False:
        return Decision(False, "Plan.inductor=False")
    if plan.inductor is True:
        return Decision(True, "Plan.inductor=True")
    if program.mesh.device_type == "cuda":
        return Decision(True, f"{hw.name} profile: Inductor fuses the element-wise chains between matmuls "
                              "into generated kernels")
    return Decision(False, f"{hw.name} profile: on CPU Inductor's step measured ~6% faster than eager for seconds "
                           "of compile per program (docs/compiler.md): off for short runs; Plan(inductor=True) "
                           "turns it on")
