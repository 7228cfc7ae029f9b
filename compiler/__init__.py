"""meshc.compiler: from a model to per-rank programs, with no process group.

    compile.py, driver.py, verify.py   compile a rank: trace, run the passes in order, check their invariants
    ir/        Program, ParamSpec, placements, Plan, MeshSpec, schedules as data, errors, show, the torch compat shim
    trace/     nn.Module + example inputs -> Program (torch.export), and checks that the trace is faithful
    pipeline/  stage extraction, the per-rank PipelinePlan, stage graphs ready for the zero-bubble split
    cost/      the cost model (formulas and the compiled graphs' estimate), hardware profiles
    planner/   plans enumerated and ranked by the cost model (on the formulas, or on a simulated rank's graphs)
    report/    explain(), the HTML report and its graph, the planner's page
"""
