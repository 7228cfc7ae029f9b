"""`job.step(..., count=...)`: the loss as the mean over every counted token of the global batch, however unevenly
the counted tokens fall on the ranks, against one process taking that mean.

Fine-tuning masks the prompt (labels -100) at the start of each sequence, so context parallelism's first sequence
half holds fewer counted tokens than its second, and rows (dp halves, micro-batches) differ too. Averaging the
ranks' means then weighs tokens unequally; with `count` each mean is weighted by its share of the global count.
Here row r's first 2 + 4r tokens are prompt: on the 3 batches the two sequence halves' means averaged sit 3.2e-3,
1.0e-2 and 8.7e-3 from the global mean (the test checks > 1e-3 on the first), and rows 4-7 count nothing at all: dp=2's
second rank and the pipeline's second micro-batch have a mean of 0/0, which must add 0, not NaN (it did, in the
losses only, before `weighted`). With every weight 1 the test fails (losses 9.3e-3 off, 3 + 4r prompts). Tolerances:
the parity tests' (tests/parity.py: losses 2e-5, parameters 5e-5 after the steps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import meshc
from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH, MODEL = 3, 8, "llama"
PLANS = [({"cp": 2, "dp": 1}, {}), ({"dp": 2}, {"zero": 3}), ({"pp": 2}, {"microbatches": 2})]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for x, y in zoo.batches(STEPS, BATCH):
        y = y.clone()
        for r in range(y.shape[0]):
            y[r, : 2 + 4 * r] = -100  # the prompt: not trained on (rows 4-7 wholly: a dp rank, a micro-batch)
        out.append((x, y))
    return out


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


def _count(labels):
    return (labels != -100).sum()


def _reference() -> dict:
    m = zoo.build(MODEL)
    return parity.train_one_process(m, torch.optim.AdamW(m.parameters(), lr=parity.LR), _batches(),
                                    lambda m, b: _loss(m(b[0]).logits, b[1]))


def _token_rank() -> list[dict]:
    outs = []
    for sizes, plan in PLANS:
        mesh = meshc.mesh(timeout_s=90, **sizes)
        data = [(mesh.shard_batch(x), mesh.shard_batch(y)) for x, y in _batches()]
        job = meshc.compile(zoo.build(MODEL), mesh, example_inputs=(data[0][0],), plan=meshc.Plan(trace="non-strict", **plan))
        losses = parity.train_job(job, job.optimizer(torch.optim.AdamW, lr=parity.LR), data,
                                  lambda job, b: job.step(b[0], b[1], lambda out, t: _loss(out.logits, t), count=_count))
        outs.append({"losses": losses, "params": job.state_dict(), "local": sum(p.numel() for _, p in job.named_parameters()),
                     "report": str(job.explain())})
    return outs


def test_counted_tokens_are_averaged_over_the_global_batch():
    ref = _reference()
    x, y = _batches()[0]
    m = zoo.build(MODEL)
    with torch.no_grad():
        logits = m(x).logits
    halves = [_loss(logits[:, :8], y[:, :8]), _loss(logits[:, 8:], y[:, 8:])]  # what cp=2's ranks average
    assert abs((halves[0] + halves[1]).item() / 2 - _loss(logits, y).item()) > 1e-3  # the weighting matters here
    whole = sum(p.numel() for p in m.parameters())
    results = run_ranks(_token_rank, 2, timeout=300)
    for (sizes, plan), outs in zip(PLANS, zip(*results)):
        for rank, out in enumerate(outs):
            parity.assert_run_matches(f"{sizes} {plan} rank {rank}", out, ref)
        if "cp" in sizes:  # what was split: the sequence (attention over shards, in the report), not the weights
            assert "cp" in outs[0]["report"] and "ring" in outs[0]["report"], outs[0]["report"][:2000]
        else:  # ZeRO's shards, a pipeline stage
            assert max(o["local"] for o in outs) < 0.8 * whole, (sizes, plan, [o["local"] for o in outs], whole)
