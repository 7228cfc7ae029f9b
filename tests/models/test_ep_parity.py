"""Expert parallelism against one process: transformers MoE models (Mixtral, DeepSeek-V3, OLMoE) from configs.

Every case trains 5 AdamW steps on the same global batches as the single-process reference and checks losses,
step-1 gradients and final parameters (tests/parity.py), and that each rank holds E/ep experts, each expert's
matrices split over tp (column-parallel gate/up, row-parallel down).

Tolerances: those of data parallelism (tests/models/test_dp_parity.py): the experts compute the same rows
with the same weights, only on another rank (a grouped matmul over fewer rows may block its sums
differently), and the all-to-all moves values without arithmetic. Measured here (every case below): losses
<= 4.8e-7, step-1 gradients <= 3e-8, parameters <= 7.1e-6 after 5 steps (the tp case; 1.5e-6 without tp).
Bounds: losses 2e-5, gradients 2e-6, parameters 5e-5.
"""
from __future__ import annotations

import math

import pytest

from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH = 5, 8
FAST = {"trace": "non-strict"}
EXPERTS = {"mixtral": 4, "mixtral4": 4, "deepseek_v3": 4, "olmoe": 8}
CASES = [
    ("mixtral", {"dp": 2, "ep": 2}, {}),
    ("deepseek_v3", {"dp": 2, "ep": 2}, {}),  # a dense first layer, a shared expert beside the routed ones
    ("olmoe", {"dp": 2, "ep": 2}, {"remat": "full"}),  # recompute runs the dispatch again in backward
    ("mixtral", {"dp": 2, "ep": 2, "tp": 2}, {}),
    ("mixtral", {"dp": 4, "ep": 2}, {"zero": 3}),  # experts over ep, replicas over edp; the rest ZeRO-3 over dp
    ("mixtral4", {"dp": 2, "ep": 2, "pp": 2}, {"microbatches": 2}),
]


def _id(case):
    model, mesh, plan = case
    return "-".join([model, "x".join(f"{k}{v}" for k, v in mesh.items()), *(f"{k}{v}" for k, v in plan.items())])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_expert_parallel_matches_single_process(case):
    model, mesh, plan = case
    world = mesh["dp"] * mesh.get("tp", 1) * mesh.get("pp", 1)
    ref = parity.reference(model, STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, world, model, STEPS, BATCH, mesh, {**FAST, **plan}, timeout=300)
    experts = EXPERTS[model]
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
        held = {f: s for f, s in out["local_shapes"].items() if ".experts." in f}
        whole = {f: tuple(p.shape) for f, p in zoo.build(model).named_parameters() if ".experts." in f}
        assert held, f"rank {rank}: holds no expert parameter (a pipeline stage without MoE layers?)"
        for fqn, shape in held.items():  # exactly E/ep experts, each split over tp (Megatron inside every expert)
            assert shape[0] == experts // mesh["ep"], (rank, fqn, shape)
            assert math.prod(shape) * mesh["ep"] * mesh.get("tp", 1) == math.prod(whole[fqn]), (rank, fqn, shape)
        assert "ep:S(0)" in out["report"] and "all_to_all" in out["report"]
