"""ZeRO stages 1, 2 and 3 against one process: same weights, same global batches, 5 steps.

Tolerances: as for data parallelism (tests/models/test_dp_parity.py), whose arithmetic ZeRO repeats in
another order: gradients are summed by a reduce-scatter over flat, padded shards instead of an
all-reduce (padding adds exact zeros), and each rank updates its slice with the same optimizer. Measured
here: losses <= 2e-6, step-1 gradients <= 1e-7, parameters after 5 AdamW steps <= 4e-6; with tensor
parallelism as in test_tp_parity. Bounds: losses 2e-5, gradients 2e-6, parameters 5e-5.
"""
from __future__ import annotations

import pytest

from tests import parity
from tests.harness import run_ranks

STEPS, BATCH = 5, 8
FAST = {"trace": "non-strict"}
CASES = [(model, {"dp": dp}, {"zero": z}) for z in (1, 2, 3) for dp in (2, 4) for model in ("reference", "uneven")] + [
    ("gpt2", {"dp": 2, "tp": 2}, {"zero": 3}),
    ("llama", {"dp": 2, "tp": 2}, {"zero": 3, "sequence_parallel": True}),
    ("gpt2", {"dp": 2, "tp": 2}, {"zero": 2, "vocab_parallel": True}),
    ("uneven", {"dp": 2}, {"zero": 3, "optimizer": "sgd"}),
    ("uneven", {"dp": 4}, {"zero": 1, "optimizer": "sgd"}),
]


def _id(case):
    model, mesh, plan = case
    return "-".join([model, "x".join(f"{k}{v}" for k, v in mesh.items()),
                     *(f"{k}{v}" if k != "optimizer" else v for k, v in plan.items())])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_zero_matches_single_process(case):
    model, mesh, plan = case
    plan = dict(plan)
    optimizer = plan.pop("optimizer", "adamw")
    world = mesh.get("dp", 1) * mesh.get("tp", 1)
    ref = parity.reference(model, STEPS, BATCH, optimizer=optimizer)
    results = run_ranks(parity.meshc_rank, world, model, STEPS, BATCH, mesh, {**FAST, **plan}, optimizer=optimizer,
                        timeout=240)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
        assert "dp:F" in out["report"]
