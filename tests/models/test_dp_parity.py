"""Data parallelism against one process: same weights, same global batches, 5 AdamW steps.

Tolerances: ranks compute on their slice of the batch and average the gradients, so sums are taken in
another order than one process over the whole batch. In fp32 that moves gradients by a few ulps
(measured ~2e-7 absolute here), losses by ~1e-6 on values near 4 (~4 ulps), and parameters after five
AdamW steps of lr 1e-3 by ~1e-6. The bounds below leave ~10x headroom over what was measured and stay
far below what a real error (a missing average, a wrong slice: >1e-3) produces.
"""
from __future__ import annotations

import pytest

from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH = 5, 8


@pytest.mark.parametrize("model", ["reference", "gpt2"])
@pytest.mark.parametrize("world", [2, 4])
def test_dp_matches_single_process(model, world):
    ref = parity.reference(model, STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, world, model, STEPS, BATCH, timeout=240)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS, params_tol=2e-5)
    moved, _ = parity.max_diff(ref["params"], zoo.build(model).state_dict())
    assert moved > 100 * 2e-5  # training moved the weights far beyond the tolerance
