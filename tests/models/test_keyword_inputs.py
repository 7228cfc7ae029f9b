"""Keyword inputs, as transformers batches come: `job.step({"input_ids": x, "attention_mask": m}, labels, loss_fn)`
calls the model as `model(**batch)`, under ZeRO-1 (the FX program), tp with the vocabulary sharded (the loss traced
into the graph with the model) and a pipeline (the mask cut into micro-batches and carried to the stage that reads
it), against one process calling `model(**batch)` on the global batch.

The batch is left-padded (row r has r % 4 padding tokens, masked out, their labels -100), so a mask that were
dropped or misaligned would change every padded row's attention: measured, training without the mask moves the
3 steps' losses by 4e-4, 1.4e-3 and 4.2e-3 (the test checks > 1e-3). The padding is the same on each dp half and
micro-batch, so every rank's mean over its counted tokens averages to the global one (meshc averages per-rank
means, as DDP does). Tolerances: the parity tests'
(tests/parity.py assert_matches: losses 2e-5, parameters 5e-5 after the steps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import meshc
from meshc.compiler.ir.errors import MeshcValueError
from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH, MODEL = 3, 8, "llama"
PLANS = [({"dp": 2}, {"zero": 1}), ({"tp": 2}, {"vocab_parallel": True}), ({"pp": 2}, {"microbatches": 2})]


def _batches() -> list[tuple[dict, torch.Tensor]]:
    out = []
    for x, y in zoo.batches(STEPS, BATCH):
        mask = torch.ones_like(x)
        for r in range(x.shape[0]):
            mask[r, : r % 4] = 0
        out.append(({"input_ids": x, "attention_mask": mask}, y.masked_fill(mask == 0, -100)))
    return out


def _loss(outputs, labels):
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


def _reference(with_mask: bool = True) -> dict:
    m = zoo.build(MODEL)
    return parity.train_one_process(m, torch.optim.AdamW(m.parameters(), lr=parity.LR), _batches(), lambda m, b: _loss(
        m(**(b[0] if with_mask else {"input_ids": b[0]["input_ids"]})), b[1]))


def _keyword_rank() -> list[dict]:
    outs = []
    for sizes, plan in PLANS:
        mesh = meshc.mesh(timeout_s=90, **sizes)
        data = [({k: mesh.shard_batch(v) for k, v in batch.items()}, mesh.shard_batch(labels)) for batch, labels in _batches()]
        job = meshc.compile(zoo.build(MODEL), mesh, example_inputs=(), example_kwargs=data[0][0],
                            plan=meshc.Plan(trace="non-strict", **plan))
        losses = parity.train_job(job, job.optimizer(torch.optim.AdamW, lr=parity.LR), data,
                                  lambda job, b: job.step(b[0], b[1], _loss))
        refused = ""
        if mesh.size("pp") > 1:  # the keywords in another order would feed each input to the other's place
            swapped = {"attention_mask": data[0][0]["attention_mask"], "input_ids": data[0][0]["input_ids"]}
            try:
                job.step(swapped, data[0][1], _loss)
            except MeshcValueError as e:
                refused = str(e)
        outs.append({"losses": losses, "params": job.state_dict(), "refused": refused,
                     "local": sum(p.numel() for _, p in job.named_parameters())})
    return outs


def test_keyword_batches_train_as_one_process_does():
    ref = _reference()
    unmasked = _reference(with_mask=False)
    assert max(abs(a - b) for a, b in zip(ref["losses"], unmasked["losses"])) > 1e-3  # the mask matters here
    whole = sum(p.numel() for p in zoo.build(MODEL).parameters())
    results = run_ranks(_keyword_rank, 2, timeout=300)
    for (sizes, plan), outs in zip(PLANS, zip(*results)):
        for rank, out in enumerate(outs):
            parity.assert_run_matches(f"{sizes} {plan} rank {rank}", out, ref)
            assert out["local"] < 0.8 * whole, (sizes, plan, out["local"], whole)  # ZeRO shards, tp halves, a stage
    # under a pipeline the inputs are fed by position: keywords in another order are refused, not swapped
    assert all("expected the inputs' structure" in per_rank[-1]["refused"] for per_rank in results), results[0][-1]["refused"]
