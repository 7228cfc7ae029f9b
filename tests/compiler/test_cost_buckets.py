"""Gradient bucket size left to the cost model (compiler/cost/buckets.py): latency against what backward hides,
decided per hardware profile, the user's Plan.bucket_mb winning, explain() saying why, grad_sync following it."""
from __future__ import annotations

import dataclasses
import math

import pytest

import meshc
from meshc.compiler.cost import hardware
from meshc.compiler.cost.buckets import choose_bucket_mb, exposed
from meshc.compiler.driver import run_passes
from meshc.compiler.report.explain import explain
from meshc.compiler.cost.hardware import Link
from meshc.compiler.trace.export import trace
from tests import zoo

MiB = 2**20
# gloo on this machine's loopback (FACTS.md's order of magnitude): 2.2 ms per all-reduce, 0.63 GB/s
GLOO = Link(bandwidth=0.63e9, latency=2.2e-3)


def test_without_overlap_one_bucket_holds_everything():
    """With nothing hidden behind backward (gloo on CPU: overlap 0), every extra bucket only adds a latency:
    3 MiB of gradients go in one bucket, the smallest candidate holding them (4 MiB, not 1024)."""
    cpu = dataclasses.replace(hardware.PROFILES["cpu-default"], overlap=0.0)
    decision = choose_bucket_mb(cpu, GLOO, 2, 3 * MiB, backward_s=1.0)
    assert decision.value == 4.0 and "one bucket holds them all" in decision.why
    # the model behind it: two buckets pay one more latency than one
    assert exposed(GLOO, 2, 3 * MiB, 2 * MiB, 0.0) == pytest.approx(exposed(GLOO, 2, 3 * MiB, 4 * MiB, 0.0)
                                                                      + GLOO.latency * 2, rel=1e-6)


def test_overlap_makes_buckets_smaller_as_backward_grows():
    """With overlap, buckets are hidden behind backward but the last one never is: the longer the backward, the
    smaller the chosen bucket (never larger), and what is left exposed is about one bucket's all-reduce."""
    h100 = hardware.PROFILES["h100"]
    link = h100.link(1, 8)
    grads = 2048 * MiB  # a 1B-parameter model's bf16 gradients
    chosen = [choose_bucket_mb(h100, link, 8, grads, backward_s).value for backward_s in (0.0, 0.01, 0.1, 1.0)]
    assert chosen == sorted(chosen, reverse=True) and chosen[-1] < chosen[0], chosen
    mb = chosen[-1]
    assert math.ceil(grads / (mb * MiB)) > 1  # several buckets
    assert exposed(link, 8, grads, mb * MiB, 1.0) <= 1.05 * link.time("all_reduce", 8, mb * MiB) + 1e-12
    assert exposed(link, 8, grads, grads, 1.0) > 10 * exposed(link, 8, grads, mb * MiB, 1.0)  # one bucket: nothing hidden


_TRACED = {}


def _compiled(mesh, hw, **plan):
    plan = meshc.Plan(trace="non-strict", **plan)
    if "llama" not in _TRACED:
        _TRACED["llama"] = trace(zoo.build("llama"), (zoo.batches(1, 2)[0][0],), mesh=mesh, plan=plan)[0]
    return run_passes(_TRACED["llama"].replace(plan=plan, hardware=hw))


def _buckets(program) -> list:
    return [n.meta["meshc.bucket"] for n in program.gm.graph.nodes if "meshc.bucket" in n.meta]


def test_compile_decides_the_bucket_size_and_explains_it(fake_mesh):
    """dp=2: the driver decides bucket_mb for the profile, grad_sync groups by it, explain() says why; the
    user's Plan.bucket_mb wins (tiny buckets: several); ZeRO-2 has its own buckets, nothing to decide."""
    mesh = fake_mesh(dp=2)
    cpu = hardware.PROFILES["cpu-default"]
    program = _compiled(mesh, cpu)
    decision = program.decisions["bucket_mb"]
    grads = sum(s.local_bytes(program.mesh.sizes) for s in program.params.values() if s.requires_grad)
    assert decision.value >= grads / MiB and program.bucket_mb() == decision.value  # overlap 0: one bucket
    assert len(_buckets(program)) == 1
    assert f"bucket_mb: {decision.value} (cpu-default profile: " in str(explain(program))
    chosen = _compiled(mesh, cpu, bucket_mb=grads / 4 / MiB)
    assert chosen.decisions["bucket_mb"].why.startswith("Plan.bucket_mb=") and len(_buckets(chosen)) >= 4
    zero = _compiled(mesh, cpu, zero=2)
    assert "ZeRO-2" in zero.decisions["bucket_mb"].why


def test_plan_bucket_mb_is_checked():
    for bad in (0, -1.0, True, "25"):
        with pytest.raises(ValueError, match="Plan.bucket_mb"):
            meshc.Plan(bucket_mb=bad)
    assert meshc.Plan().bucket_mb is None and meshc.Plan(bucket_mb=8).bucket_mb == 8
