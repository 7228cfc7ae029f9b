"""Plan.inductor (compiler/cost/inductor.py, runtime/inductor.py): the decision per device and plan, the errors
where a plan's run-time state keeps Inductor out, and a job that really runs Inductor's code (or really does not).
Parity of compiled plans on several ranks: tests/models/test_inductor_parity.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshc
from meshc.compiler.cost import hardware
from meshc.compiler.cost.inductor import decide_inductor, yield_to_inductor
from meshc.compiler.ir.errors import MeshcTypeError
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.trace.export import trace
from tests import zoo

CPU = hardware.PROFILES["cpu-default"]


@pytest.fixture(scope="module")
def traced():
    model = zoo.build("llama")
    x, _ = zoo.batches(1, 4)[0]
    program, _ = trace(model, (x,), {}, mesh=MeshSpec({"dp": 1}), plan=meshc.Plan(trace="non-strict"), rank=0)
    return program


def _decide(program, sizes: dict, device: str = "cpu", **plan):
    mesh = MeshSpec(sizes, device_type=device)
    return decide_inductor(program.replace(plan=meshc.Plan(**plan), mesh=mesh), CPU)


def test_default_is_off_on_cpu_and_on_on_cuda(traced):
    cpu = _decide(traced, {"dp": 2})
    assert cpu.value is False and "CPU" in cpu.why and "Plan(inductor=True)" in cpu.why
    assert _decide(traced, {"dp": 2}, device="cuda").value is True
    assert _decide(traced, {"dp": 2}, inductor=True).value is True
    assert _decide(traced, {"dp": 2}, device="cuda", inductor=False).value is False


def test_offloaded_parameter_shards_compile(traced):
    """offload_params' page drops are an op of the graph (runtime/ops/pages.py): the plan decides like any other."""
    offload = {"zero": 3, "offload": "nvme", "offload_dir": "/tmp", "offload_params": True}
    assert _decide(traced, {"dp": 2}, device="cuda", **offload).value is True
    assert _decide(traced, {"dp": 2}, inductor=True, **offload).value is True
    assert _decide(traced, {"dp": 2}, **offload).value is False  # CPU's default


def test_rings_routing_and_pipelines_compile(traced):
    """What once kept Inductor out now compiles: ep's routing, ring attention and collective matmul as FX code
    between compiled regions (runtime/regions.py), the zero-bubble schedules as two backward graphs per stage."""
    assert _decide(traced, {"tp": 2}, device="cuda", sequence_parallel=True, collective_matmul=True).value is True
    assert _decide(traced, {"dp": 2, "ep": 2}, device="cuda").value is True
    assert _decide(traced, {"dp": 2, "cp": 2}, device="cuda", cp_attention="ring").value is True
    for schedule in ("gpipe", "1f1b", "zb-h1", "zbv"):
        assert _decide(traced, {"pp": 2}, inductor=True, microbatches=4, schedule=schedule).value is True


def test_the_cost_models_collective_matmul_gives_way_to_inductor(traced):
    """A ring the cost model chose (Plan.collective_matmul None) is turned off where Inductor is to compile, saying
    why; one the user asked for stays, and is refused beside inductor=True; without Inductor nothing changes."""
    ring = {"collective_matmul": meshc.compiler.ir.plan.Decision(True, "cost model: rings predicted faster")}

    def resolved(device, **plan):
        program = traced.replace(plan=meshc.Plan(sequence_parallel=True, **plan),
                                 mesh=MeshSpec({"tp": 2}, device_type=device))
        return yield_to_inductor(program, ring)["collective_matmul"]

    for device, plan in (("cuda", {}), ("cpu", {"inductor": True})):
        kept = resolved(device, **plan)
        assert kept.value is False and "Inductor compiles" in kept.why and "rings predicted faster" in kept.why
    assert resolved("cpu").value is True  # the CPU default runs FX code: the ring stays
    assert resolved("cuda", inductor=False).value is True
    assert resolved("cuda", collective_matmul=True).value is True  # the user's: decide_inductor refuses it if forced


def test_inductor_field_is_validated():
    with pytest.raises(MeshcTypeError, match="Plan.inductor"):
        meshc.Plan(inductor="yes")


def test_a_job_runs_inductors_code_only_where_decided(single_mesh):
    """World 1: the default on this CPU compiles nothing; inductor=True compiles the forward at the first call and
    the backward at the first backward, once for a given signature, again for a new grad mode; explain() says so;
    the compiled step gives the FX program's loss and gradients."""
    x, y = zoo.batches(1, 4)[0]
    results = {}
    for forced in (None, True):
        job = meshc.compile(zoo.build("llama"), single_mesh, example_inputs=(x,),
                            plan=meshc.Plan(trace="non-strict", inductor=forced))
        losses = [job.step(x, y, zoo.lm_loss).item() for _ in range(2)]
        grads = {n: p.grad.clone() for n, p in job.named_parameters()}
        results[forced] = (losses, grads, dataclasses.replace(job.inductor.stats))
        report = str(job.explain())
        if forced:
            assert "inductor: on (Plan.inductor=True)" in report and "program(s) compiled" in report
            with torch.no_grad():  # inference: its own forward-only program, no backward
                job(x)
    assert results[None][2].programs == 0 and results[None][2].forward == 0
    compiled = results[True][2]
    assert (compiled.programs, compiled.forward, compiled.backward) == (1, 1, 1)  # two steps, compiled once
    assert job.inductor.stats.programs == 2 and job.inductor.stats.backward == 1  # + the no-grad forward
    # the same ops in Inductor's fused loops: reductions in another order, a few fp32 ulps (measured <= 5e-7)
    for a, b in zip(results[None][0], results[True][0]):
        assert abs(a - b) <= 1e-5
    for name, g in results[None][1].items():
        assert torch.allclose(g, results[True][1][name], rtol=1e-4, atol=1e-6), name
