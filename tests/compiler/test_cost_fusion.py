"""The choices a Plan leaves to the cost model (compiler/cost/fusion.py): fusion kernel by kernel and the
collective matmul, decided per hardware profile, the user's explicit values winning, explain() saying why."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

import meshc
from meshc.compiler.cost import hardware
from meshc.compiler.cost.fusion import TRAFFIC, fusion_speedup, ring_times
from meshc.compiler.driver import run_passes
from meshc.compiler.report.explain import explain
from meshc.compiler.trace.export import trace
from tests import zoo

CPU = hardware.PROFILES["cpu-default"]
UNMEASURED_CPU = dataclasses.replace(CPU, fused_speedup=())


_TRACED = {}


def _compiled(mesh, hw, **plan):
    """llama at tp=2 with sequence parallelism, traced once (a Program holds no process group), compiled with
    `plan` for the profile `hw`."""
    plan = meshc.Plan(trace="non-strict", sequence_parallel=True, **plan)
    if "llama" not in _TRACED:
        _TRACED["llama"] = trace(zoo.build("llama"), (zoo.batches(1, 2)[0][0],), mesh=mesh, plan=plan)[0]
    return run_passes(_TRACED["llama"].replace(plan=plan, hardware=hw))


def _kernels(program) -> Counter:
    return Counter(n.target.__name__ for n in program.gm.graph.nodes
                   if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("meshc.kernels"))


def test_predicted_speedups_follow_the_device():
    """Triton kernels move fewer bytes in fewer launches than their chains; the CPU implementations are the
    chains in torch behind a custom op: predicted slower at every size, so an unmeasured CPU fuses nothing."""
    for kernel in TRAFFIC:
        for act in (2**12, 2**20, 2**30):
            assert fusion_speedup(hardware.PROFILES["h100"], kernel, "cuda", act)[0] > 1, (kernel, act)
            assert fusion_speedup(UNMEASURED_CPU, kernel, "cpu", act)[0] < 1, (kernel, act)
    speedup, how = fusion_speedup(CPU, "bias_gelu", "cpu", 2**20)
    assert speedup == dict(CPU.fused_speedup)["bias_gelu"] and "measured" in how


def test_default_plan_on_cpu_fuses_nothing_and_says_why(fake_mesh):
    program = _compiled(fake_mesh(tp=2), CPU)
    assert not _kernels(program)
    assert program.fusion["bias_dropout_add_norm"].fused == 0 and program.fusion["bias_dropout_add_norm"].eligible == 4
    report = str(explain(program))
    assert "fusion.bias_dropout_add_norm: off (cpu-default profile: fused bias_dropout_add_norm 10.0x slower than " \
           "the chain, measured" in report
    assert "collective_matmul: off (cpu-default profile: the rings predicted" in report


def test_each_kernel_is_decided_on_its_own_and_explicit_values_win(fake_mesh):
    mesh = fake_mesh(tp=2)
    one_faster = dataclasses.replace(CPU, fused_speedup={**dict(CPU.fused_speedup), "bias_swiglu": 1.3})
    assert _kernels(_compiled(mesh, one_faster)) == Counter({"bias_swiglu": 2})
    assert _kernels(_compiled(mesh, CPU, fusion=True)) == Counter({"bias_dropout_add_norm": 4, "bias_swiglu": 2})
    assert not _kernels(_compiled(mesh, one_faster, fusion=False))
    decisions = _compiled(mesh, CPU, require_fusion=True).decisions
    assert decisions["fusion.bias_gelu"] == meshc.compiler.ir.plan.Decision(True, "Plan.require_fusion=True")


def test_collective_matmul_where_overlap_pays(fake_mesh):
    """Where transfers take longer than the ring's extra ops and compute can hide them, the rings pay: on;
    without overlap, sends as fast as the collectives and the ring's extra ops on top: off (the tiny model's
    latency-bound transfers on the CPU profile too); True forces it."""
    link = hardware.Link(bandwidth=1e6, latency=5e-5)
    overlapping = dataclasses.replace(CPU, overlap=1.0, flops=1e8, intra=link)
    plain, ring = ring_times(overlapping, 2, 2**16, 1e-1, link)
    assert ring < plain
    plain, ring = ring_times(dataclasses.replace(overlapping, overlap=0.0), 2, 2**16, 1e-1, link)
    assert ring > plain
    mesh = fake_mesh(tp=2)
    unfused = _compiled(mesh, overlapping, fusion=False)
    assert unfused.decisions["collective_matmul"].value is False  # fusion=False: no pass to make them
    on = _compiled(mesh, overlapping)
    assert on.decisions["collective_matmul"].value is True
    assert on.fusion["matmul_reduce_scatter"].fused == 4  # llama's o_proj and down_proj, 2 layers
    assert _compiled(mesh, CPU).decisions["collective_matmul"].value is False
    forced = _compiled(mesh, CPU, collective_matmul=True)
    assert forced.decisions["collective_matmul"].why == "Plan.collective_matmul=True"
    assert forced.fusion["matmul_reduce_scatter"].fused == 4


@pytest.mark.parametrize("field", ["fusion", "collective_matmul"])
def test_plan_fields_are_true_false_or_none(field):
    with pytest.raises(TypeError, match=f"Plan.{field}: expected True, False or None"):
        meshc.Plan(**{field: "yes"}, sequence_parallel=True)
    meshc.Plan(collective_matmul=True, sequence_parallel=True)  # fusion None: the pass still runs


def test_calibrated_profiles_carry_the_measured_ratios():
    back = hardware.Hardware.from_dict(CPU.to_dict())
    assert back == CPU and dict(back.fused_speedup)["bias_dropout_add_norm"] < 1
    with pytest.raises(ValueError, match="Hardware.fused_speedup: expected positive ratios"):
        dataclasses.replace(CPU, fused_speedup={"bias_gelu": 0.0})
