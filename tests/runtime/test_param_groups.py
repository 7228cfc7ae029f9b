"""Optimizer parameter groups named by the model's parameter names (meshc/param_groups.py) against one process
holding the same groups: weight decay on the matrices only, and the 1-D parameters (LayerNorms, biases) at their own
learning rate, under ZeRO-1 (flat shards: a filter on the local tensors' dims would put every weight in the 1-D
group), ZeRO-3, tp and a pipeline whose stages each hold some of the names (GPT-2: the head tied to the embedding,
named by either key).

The groups are chosen so that a wrong assignment cannot pass: the 1-D group's learning rate is 10× the other's, so a
LayerNorm weight stepped at the wrong rate moves ~3e-2 over 3 steps (AdamW's steps are ~lr each), far above the
parameters' bound; and decay 0.5 on a LayerNorm weight (value 1) would move it 1.5e-3. Tolerances: those of the
plans' own parity tests (tests/parity.py assert_matches: parameters within 5e-5 after the steps).
"""
from __future__ import annotations

import pytest
import torch

import meshc
from meshc.compiler.ir.errors import MeshcValueError
from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH, MODEL = 3, 8, "gpt2"
PLANS = [({"dp": 2}, {"zero": 1}), ({"dp": 2}, {"zero": 3}), ({"tp": 2}, {}), ({"pp": 2}, {"microbatches": 2})]


def _groups(model: torch.nn.Module, names: bool = True) -> list[dict]:
    named = list(model.named_parameters())
    pick = (lambda n, p: n) if names else (lambda n, p: p)
    return [{"params": [pick(n, p) for n, p in named if p.dim() >= 2], "weight_decay": 0.5},
            {"params": [pick(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 10 * parity.LR}]


def _reference() -> dict:
    m = zoo.build(MODEL)
    return parity.train_one_process(m, torch.optim.AdamW(_groups(m, names=False), lr=parity.LR),
                                    zoo.batches(STEPS, BATCH), lambda m, b: zoo.lm_loss(m(b[0]), b[1]))


def _groups_rank() -> list[dict]:
    outs = []
    for sizes, plan in PLANS:
        mesh = meshc.mesh(timeout_s=90, **sizes)
        model = zoo.build(MODEL)
        data = zoo.batches(STEPS, BATCH)
        job = meshc.compile(model, mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                            plan=meshc.Plan(trace="non-strict", **plan))
        groups = _groups(model)
        groups[0]["params"].append("lm_head.weight")  # the head's own key for the embedding it is tied to: no error
        groups[0]["params"].remove("transformer.wte.weight")
        opt = job.optimizer(torch.optim.AdamW, groups, lr=parity.LR)
        losses = parity.train_job(job, opt, data, lambda job, b: job.step(mesh.shard_batch(b[0]), mesh.shard_batch(b[1]),
                                                                          zoo.lm_loss))
        whole = {n: p.numel() for n, p in model.named_parameters()}
        outs.append({"losses": losses, "params": job.state_dict(), "group_sizes": [len(g["params"]) for g in opt.param_groups],
                     "local": {f: p.numel() for f, p in job.named_parameters()}, "whole": whole})
    return outs


def test_named_groups_train_as_one_process_does_under_every_plan():
    ref = _reference()
    results = run_ranks(_groups_rank, 2, timeout=300)
    for (sizes, plan), outs in zip(PLANS, zip(*results)):
        for rank, out in enumerate(outs):
            parity.assert_run_matches(f"{sizes} {plan} rank {rank}", out, ref)
            assert len(out["group_sizes"]) == 2 and min(out["group_sizes"]) > 0, out["group_sizes"]
        held = [sum(o["local"].values()) for o in outs]
        whole = sum(outs[0]["whole"].values())
        # what was split: every rank holds well under the whole model (ZeRO's shards, tp's halves of the blocks, a
        # pipeline stage's share), so the groups were resolved on local shards, not on whole copies
        assert max(held) < 0.8 * whole, (sizes, plan, held, whole)


@pytest.fixture(scope="module")
def one_rank_job():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    model = zoo.build(MODEL)
    x, _ = zoo.batches(1, 2)[0]
    job = meshc.compile(model, meshc.mesh(), example_inputs=(x,), plan=meshc.Plan(trace="non-strict"))
    yield model, job
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("groups, says", [
    ([{"params": ["transformer.h.0.attn.c_attn.wieght"]}], "names 'transformer.h.0.attn.c_attn.wieght', not a parameter"),
    ([{"params": ["transformer.h.0.ln_1.weight"]}, {"params": ["transformer.h.0.ln_1.weight"]}], "is in groups 0 and 1"),
    ([{"params": ["lm_head.weight"]}, {"params": ["transformer.wte.weight"]}], "is in groups 0 and 1"),  # one tensor, two names
    ([{"lr": 1.0}], "to be a dict with 'params'"),
    ([], "at least one parameter group"),
])
def test_bad_groups_are_named(one_rank_job, groups, says):
    _, job = one_rank_job
    with pytest.raises(MeshcValueError, match=says):
        job.optimizer(torch.optim.AdamW, groups, lr=1e-3)


def test_the_models_own_tensors_are_refused_and_the_jobs_are_taken(one_rank_job):
    model, job = one_rank_job
    with pytest.raises(MeshcValueError, match="not one of the job's local parameters"):
        job.optimizer(torch.optim.SGD, [{"params": list(model.parameters())}], lr=1e-3)
    opt = job.optimizer(torch.optim.SGD, job.parameters(), lr=1e-3)  # one flat list of the job's own, as torch takes it
    assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == len(list(job.parameters()))


def test_a_model_with_nothing_to_train_is_refused(single_mesh):
    model = zoo.build(MODEL).requires_grad_(False)
    x, _ = zoo.batches(1, 2)[0]
    job = meshc.compile(model, single_mesh, example_inputs=(x,), plan=meshc.Plan(trace="non-strict"))
    with pytest.raises(MeshcValueError, match="every parameter of the model has requires_grad=False"):
        job.optimizer(torch.optim.AdamW, lr=1e-3)
