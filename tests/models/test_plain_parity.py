"""A Llama 3 written in plain PyTorch (tests/plain_models.py: complex rotary embeddings, its own init, a view valid
only at the traced layout) against one process: same weights, same global batches, 3 AdamW steps, on the meshes a
Megatron or torchtitan user would try first; the shards asserted from each rank's local shapes.

Tolerances: the shared ones (tests/parity.py: losses 2e-5, gradients 2e-6 relative, parameters 5e-5), for the
reasons test_tp_parity and test_zero_parity give (sums in another order over shards and ranks: fp32 ulps; measured
here, every case: losses <= 4.8e-7, step-1 gradients <= 3.1e-7 relative, parameters <= 3.2e-7); a missing
all-reduce or a wrong slice moves gradients by more than 1e-3.
"""
from __future__ import annotations

import math

import pytest

from tests import effects, parity, zoo
from tests.harness import run_ranks
from tests.models.test_pp_parity import assert_pipelined

STEPS, BATCH = 3, 8
MODEL = "llama3_plain"
CASES = [
    ({"tp": 2}, {}),  # q, k, v column-parallel through complex rotary; wo, w2 row-parallel
    ({"tp": 2}, {"sequence_parallel": True}),
    ({"tp": 2}, {"tp": {"*.wq": "replicate"}}),  # q sliced per rank: the attention output's view becomes a reshape
    ({"dp": 2, "tp": 2}, {"zero": 3}),
    ({"tp": 2, "pp": 2}, {"microbatches": 2}),
]


def _id(case):
    mesh, plan = case
    return "-".join(["x".join(f"{k}{v}" for k, v in mesh.items()), *(k for k in plan)])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_plain_pytorch_llama_matches_single_process(case):
    mesh, plan = case
    ref = parity.reference(MODEL, STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, math.prod(mesh.values()), MODEL, STEPS, BATCH, mesh,
                        {"trace": "non-strict", **plan}, timeout=300)
    built = zoo.build(MODEL)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
        if "zero" in plan:  # flat shards over dp of tp shards: measured 0.30 of the model's elements per rank (the
            # blocks' 1/4, embedding and head 1/2: replicated on tp); 0.4 fails a lost dp or tp split (>= 0.5)
            share = effects.held_share(out, built)
            assert share <= 0.4, (rank, share)
        elif "pp" not in mesh:  # the blocks' weights split on tp: all of them, or all but the replicated q projections
            floor = 0.85 if "tp" in plan else 1.0  # measured 8/9 with q whole (its 1/9 of the blocks' bytes), else 1
            covered = parity.block_coverage(out["local_shapes"], built, mesh["tp"])
            assert covered >= floor - 1e-9, (rank, covered, out["report"])
    if "pp" in mesh:
        assert_pipelined(results, MODEL, mesh, plan)
    moved, _ = parity.max_diff(ref["params"], built.state_dict())
    assert moved > 20 * 5e-5
