"""Hybrid sharding (Plan(zero=..., replicas=R), issue 44) against one process: same weights, same global batches.

ZeRO's shards lie within replica groups of dp/R consecutive data-parallel ranks, and every group holds one copy:
each rank must hold 1/(dp/R) of every parameter (ZeRO-3) or of the optimizer's states (ZeRO-1/2), not 1/dp, and
its copy must equal the other group's. Tolerances as tests/models/test_zero_parity.py (the same sums, one more
all-reduce of the shards over the groups: fp32 reassociation only): losses 2e-5, step-1 gradients 2e-6,
parameters after the steps 5e-5 (tests/parity.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH = 4, 8
CASES = [  # (model, mesh, plan, replica groups' size dps)
    ("reference", {"dp": 4}, {"zero": 3, "replicas": 2}, 2),
    ("uneven", {"dp": 4}, {"zero": 1, "replicas": 2}, 2),
    ("uneven", {"dp": 4}, {"zero": 2, "replicas": 4}, 1),  # one rank per group: plain data parallelism's sums
    ("gpt2", {"dp": 2, "tp": 2}, {"zero": 3, "replicas": 2}, 1),
]


def _id(case):
    model, mesh, plan, _ = case
    return "-".join([model, "x".join(f"{k}{v}" for k, v in mesh.items()), *(f"{k}{v}" for k, v in plan.items())])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_hybrid_sharding_matches_single_process_and_shards_within_a_group(case):
    model, mesh, plan, dps = case
    world = mesh["dp"] * mesh.get("tp", 1)
    ref = parity.reference(model, STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, world, model, STEPS, BATCH, mesh, {"trace": "non-strict", **plan},
                        timeout=240)
    whole = {f: p.numel() for f, p in zoo.build(model).named_parameters()}
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
        assert "dps:F" in out["report"] and "replica groups" in out["report"], out["report"][:2000]
        local = {f: math.prod(s) for f, s in out["local_shapes"].items()}  # the masters: flat shards over dps
        tp = mesh.get("tp", 1)
        if tp == 1:
            assert local == {f: -(-n // dps) for f, n in whole.items()}, rank
        else:  # tp-local first (some split over tp, some whole), then flat over dps
            assert all(-(-n // (tp * dps)) <= local[f] <= -(-n // dps) for f, n in whole.items()), rank
        if dps < mesh["dp"]:  # more than the 1/dp plain ZeRO would hold: one copy per replica group
            assert sum(local.values()) > sum(whole.values()) / (mesh["dp"] * tp), rank
        if plan["zero"] < 3:  # AdamW's exp_avg and exp_avg_sq in fp32, shaped like the master shards
            assert out["held"]["optimizer"] == 2 * 4 * sum(local.values()), (rank, out["held"])
    # ranks at the same place in two groups hold the same copy: their state_dicts are the whole model anyway,
    # so compare the local master shards instead (the dpr peers of rank 0 hold what it holds)
    assert results[0]["local_shapes"] == results[world // 2]["local_shapes"]


def _save_and_load(plan_save: dict, plan_load: dict, path: str) -> dict:
    import meshc

    mesh = meshc.mesh(timeout_s=90)
    data = zoo.batches(2, BATCH)
    jobs = {}
    for name, plan in (("save", plan_save), ("load", plan_load)):
        job = meshc.compile(zoo.build("reference"), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                            plan=meshc.Plan(trace="non-strict", **plan))
        opt = job.optimizer(torch.optim.AdamW, lr=parity.LR)
        if name == "save":
            job.step(mesh.shard_batch(data[0][0]), mesh.shard_batch(data[0][1]), zoo.lm_loss)
            opt.step()
            job.save(path, step=1)
        else:
            job.load(path)
        jobs[name] = (job, opt)
    from meshc.runtime.checkpoint.save_load import full_optimizer_state

    return {name: {"params": {k: v.clone() for k, v in job.state_dict().items()},
                   "optim": full_optimizer_state(job, opt), "held": sum(p.numel() for p in job.parameters())}
            for name, (job, opt) in jobs.items()}


@pytest.mark.parametrize("direction", ["hsdp-to-zero3", "zero3-to-hsdp"])
def test_a_checkpoint_moves_between_hybrid_and_plain_zero3_bitwise(direction, tmp_path):
    hsdp, plain = {"zero": 3, "replicas": 2}, {"zero": 3}
    save, load = (hsdp, plain) if direction == "hsdp-to-zero3" else (plain, hsdp)
    results = run_ranks(_save_and_load, 4, save, load, str(tmp_path / "ckpt"), timeout=240)
    whole = sum(p.numel() for p in zoo.build("reference").parameters())
    for rank, out in enumerate(results):
        held = {name: out[name]["held"] for name in ("save", "load")}
        hybrid, zero3 = (held["save"], held["load"]) if direction == "hsdp-to-zero3" else (held["load"], held["save"])
        assert hybrid < whole / 2 * 1.1 and zero3 < whole / 4 * 1.1 and hybrid > zero3, (rank, held, whole)
        assert out["save"]["params"].keys() == out["load"]["params"].keys()
        for k, v in out["save"]["params"].items():
            assert torch.equal(v, out["load"]["params"][k]), (rank, k)
        assert out["save"]["optim"].keys() == out["load"]["optim"].keys()
        for fqn, states in out["save"]["optim"].items():
            for name, value in states.items():
                got = out["load"]["optim"][fqn][name]
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(got)), (rank, fqn, name)
