"""Pipeline parallelism against one process: every schedule on pp=2 and pp=4, tied weights across stages,
3D (dp x tp x pp with ZeRO-3) on 8 ranks, ZBV's V placement (two stages per rank, also under ZeRO-3), and
activation checkpointing leaving results unchanged.

Tolerances: a pipeline computes the same ops as one process on micro-batches of the batch and sums
their gradients (each micro-batch's loss scaled by 1/m); only the order of the sums changes. Measured
here: losses <= 2e-6, step-1 gradients <= 2.5e-7, parameters after 5 AdamW steps <= 4e-6 (with TP and
ZeRO as in their tests). Bounds as in test_tp_parity: 2e-5, 2e-6, 5e-5.
"""
from __future__ import annotations

import re

import pytest

from tests import parity
from tests.harness import run_ranks

STEPS, BATCH = 5, 8
SCHEDULES = [{"schedule": "gpipe"}, {"schedule": "1f1b"}, {"schedule": "zb-h1"},
             {"schedule": "interleaved", "virtual": 2}]
CASES = ([(m, {"pp": 2}, {**s, "microbatches": 4}) for m in ("reference", "gpt2") for s in SCHEDULES]
         + [(m, {"pp": 4}, {**s, "microbatches": 4}) for m in ("reference4", "gpt2_4") for s in SCHEDULES]
         + [("reference", {"dp": 2, "tp": 2, "pp": 2}, {"zero": 3, "microbatches": 2}),
            ("reference4", {"dp": 2, "pp": 2}, {"schedule": "zbv", "zero": 3, "microbatches": 2}),  # 2 stages' buckets
            ("gpt2", {"pp": 2}, {"microbatches": 2, "remat": "full"}),
            ("gpt2", {"tp": 2}, {"remat": "selective"}),
            ("llama", {"dp": 2}, {"remat": "selective", "zero": 3}),
            ("reference", {"pp": 1}, {"microbatches": 4}),
            # an encoder-decoder cut between stages, and ALiBi with a custom autograd.Function (issue 13)
            ("t5", {"pp": 2}, {"microbatches": 2}),
            ("bloom", {"pp": 2}, {"microbatches": 2})])
# a tied embedding and head; an untied one under full recompute, with fewer micro-batches than the V's 2pp-1
ZBV = [("gpt2_4", 4, {}), ("llama4", 2, {"remat": "full"}), ("gpt2_4", 4, {"schedule": "dualpipev"})]


@pytest.mark.parametrize("model,m,extra", ZBV,
                         ids=[f"{model}-pp2-{extra.get('schedule', 'zbv')}-m{m}" for model, m, extra in ZBV])
def test_zbv_matches_single_process_with_stages_in_a_v(model, m, extra):
    """ZBV (and DualPipeV, the same V) at pp=2: four stages of one block each, rank 0 holding stages 0 and 3 (the
    embedding, block 0, block 3 and the head), rank 1 stages 1 and 2 (blocks 1 and 2); the stage 1 -> 2 hand-over
    stays on rank 1."""
    ref = parity.reference(model, STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, 2, model, STEPS, BATCH, {"pp": 2},
                        {"trace": "non-strict", "schedule": "zbv", "microbatches": m, **extra}, timeout=240)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
    blocks = [{int(k) for fqn in out["local_shapes"] for k in re.findall(r"(?:^|\.)(?:h|layers)\.(\d+)\.", fqn)}
              for out in results]
    assert blocks == [{0, 3}, {1, 2}], blocks
    ends = [{fqn for fqn in out["local_shapes"] if not re.search(r"(?:^|\.)(?:h|layers)\.\d+\.", fqn)}
            for out in results]
    assert ends[0] and not ends[1], ends  # embeddings, final norm and head all on rank 0


def _id(case):
    model, mesh, plan = case
    return "-".join([model, "x".join(f"{k}{v}" for k, v in mesh.items()), *(str(v) for v in plan.values())])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_pipeline_matches_single_process(case):
    model, mesh, plan = case
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
    ref = parity.reference(model, STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, world, model, STEPS, BATCH, mesh, {"trace": "non-strict", **plan},
                        timeout=240)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)


def _untagged_rank(*args) -> dict:
    """A parity rank whose point-to-point messages carry no tags (tag 0), as NCCL pairs them: in order per group."""
    import torch.distributed as dist

    isend, irecv = dist.isend, dist.irecv
    dist.isend = lambda tensor, dst=None, group=None, tag=0, **kw: isend(tensor, dst, group=group, tag=0, **kw)
    dist.irecv = lambda tensor, src=None, group=None, tag=0, **kw: irecv(tensor, src, group=group, tag=0, **kw)
    return parity.meshc_rank(*args)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_need_no_tags(schedule):
    """Under a V, a pair of ranks exchanges activations and gradients interleaved differently on its two ends;
    NCCL ignores tags and pairs messages in order, so each kind travels on a group of its own (Mesh.pipeline_group).
    With every tag 0 on gloo (pairing in order, as NCCL does) the V schedules still match one process; on one group
    the swapped activation and gradient (same shape here) would train silently wrong."""
    ref = parity.reference("reference", STEPS, BATCH)
    results = run_ranks(_untagged_rank, 2, "reference", STEPS, BATCH, {"pp": 2},
                        {"trace": "non-strict", "schedule": schedule, "microbatches": 4}, timeout=240)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
