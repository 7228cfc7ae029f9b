"""Models written in plain PyTorch (tests/plain_models.py: a Llama 3 with complex rotary embeddings, its own init and
a view valid only at the traced layout; a language model on torch's nn.TransformerEncoder) against one process: same weights, same global batches, 3 AdamW steps, on the meshes a
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
MESHES = [
    ({"tp": 2}, {}),  # Llama: q, k, v column-parallel through complex rotary; wo, w2 row-parallel
    ({"tp": 2}, {"sequence_parallel": True}),
    ({"dp": 2, "tp": 2}, {"zero": 3}),
    ({"tp": 2, "pp": 2}, {"microbatches": 2}),
]
# llama3_plain: a Llama 3 in a reference trainer's style; encoder_lm: nn.TransformerEncoder (nn.MultiheadAttention's
# packed in_proj_weight sharded as q|k|v blocks, out_proj row-parallel)
CASES = [(model, mesh, plan) for model in ("llama3_plain", "encoder_lm") for mesh, plan in MESHES] + [
    ("llama3_plain", {"tp": 2}, {"tp": {"*.wq": "replicate"}}),  # q sliced per rank: the output's view a reshape
    ("encoder_lm_seq_first", {"tp": 2}, {}),  # batch_first=False: the heads merged with the batch, (seq, b*h, d)
]


def _id(case):
    model, mesh, plan = case
    return "-".join([model, "x".join(f"{k}{v}" for k, v in mesh.items()), *(k for k in plan)])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_plain_pytorch_models_match_single_process(case):
    model, mesh, plan = case
    # nn.MultiheadAttention's key bias has a zero gradient in exact arithmetic (softmax ignores a shift of a row's
    # scores): fp32 leaves ~5e-10 of noise, in another order on each side, which AdamW scales into +-lr steps
    # (measured 8.8e-5 apart after 3 steps, the other parts 2e-9); SGD keeps that noise at noise
    optimizer = "sgd" if model.startswith("encoder_lm") else "adamw"
    ref = parity.reference(model, STEPS, BATCH, optimizer)
    results = run_ranks(parity.meshc_rank, math.prod(mesh.values()), model, STEPS, BATCH, mesh,
                        {"trace": "non-strict", **plan}, optimizer, timeout=300)
    built = zoo.build(model)
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
        assert_pipelined(results, model, mesh, plan)
    moved, _ = parity.max_diff(ref["params"], built.state_dict())
    assert moved > 20 * 5e-5
