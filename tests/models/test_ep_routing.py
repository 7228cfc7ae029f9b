"""Expert parallelism where routing matters: every byte the all-to-all moves, experts that receive nothing,
optimizer states of E/ep experts, and checkpoints that leave ep behind.

Mixtral (4 experts, top-2) on dp=2 × ep=2: rank 0 holds experts 0-1, rank 1 experts 2-3. With the router
biased away from experts 2 and 3, rank 1 receives no row in any step: its grouped matmuls run on zero rows,
its experts' gradients are exactly zero, and nothing hangs. Parity tolerances as in test_ep_parity.py.
Under AdamW a gradient's scale hardly shows in losses and parameters (a gradient 10% too large, from a wrong
average over dp, passed them), so the step-1 gradients are compared with the reference's too: within 2e-6
as in tests/parity.py (measured <= 1.5e-8). A gradient off by a factor 1 + e is off by e times the largest
gradient (0.06): the 10% error by 6e-3, 3e3 times the bound.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH, TOP_K, HIDDEN, EXPERTS = 3, 8, 2, 32, 4
GRAD_TOL = 2e-6  # step-1 gradients, against the reference's (the docstring says why)


def _biased_forward(self, hidden_states):
    """Mixtral's router with experts 2 and 3 pushed out of every top-2 (their probabilities become 0)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    logits = torch.cat([logits[:, :2], logits[:, 2:] - 1e4], dim=-1)
    probs = F.softmax(logits.float(), dim=-1)
    top, index = torch.topk(probs, self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), index


def _model(biased: bool) -> torch.nn.Module:
    model = zoo.mixtral()
    if biased:
        for layer in model.model.layers:
            gate = layer.mlp.gate
            gate.__class__ = type("BiasedRouter", (type(gate),), {"forward": _biased_forward})
    return model


def _routing(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's chosen experts (tokens, top-k) for the batch `x`, from the eager model."""
    seen, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.mlp.gate.register_forward_hook(lambda mod, args, out: seen.append(out[2].clone())))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def _rank(biased: bool, folder: str) -> dict:
    import meshc
    from meshc.runtime.monitor.census import CommCensus

    mesh = meshc.mesh(dp=2, ep=2, timeout_s=90)
    model = _model(biased)
    ref = copy.deepcopy(model)
    data = zoo.batches(STEPS, BATCH)
    routing = _routing(ref, data[0][0])  # step 1's routing of the global batch
    job = meshc.compile(model, mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                        plan=meshc.Plan(verify=True, trace="non-strict"))
    opt = job.optimizer(torch.optim.AdamW, lr=parity.LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=parity.LR)
    losses, ref_losses = [], []
    for step, (x, y) in enumerate(data):
        with CommCensus(mesh) as census:
            losses.append(job.step(mesh.shard_batch(x), mesh.shard_batch(y), zoo.lm_loss).item())
        if step == 0:
            a2a = census.by_kind().get(("all_to_all", "ep"), (0, 0))
            grads0 = job.grad_state_dict()
            local_grads = {f: p.grad.clone() for f, p in job.named_parameters() if ".experts." in f}
            report = str(job.explain())
        opt.step()
        opt.zero_grad()
        loss = zoo.lm_loss(ref(x), y)
        loss.backward()
        if step == 0:
            ref_grads0 = {n: p.grad.clone() for n, p in ref.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    states = {f: {k: tuple(v.shape) for k, v in opt.state[p].items() if v.dim()}
              for f, p in job.named_parameters() if ".experts." in f}
    job.save(folder, step=STEPS)
    return {"losses": losses, "ref_losses": ref_losses, "a2a": a2a, "report": report, "routing": routing, "grads0": grads0,
            "ref_grads0": ref_grads0, "local_grads": local_grads, "states": states, "rank": mesh.rank,
            "local_shapes": {f: tuple(p.shape) for f, p in job.named_parameters()},
            "params": job.state_dict(), "ref_params": {k: v.clone() for k, v in ref.state_dict().items()}}


def _load_rank(folder: str) -> dict:
    import meshc

    mesh = meshc.mesh(timeout_s=90)
    job = meshc.compile(zoo.mixtral(seed=1), mesh, example_inputs=(zoo.batches(1, BATCH)[0][0],),
                        plan=meshc.Plan(trace="non-strict"))
    job.load(folder)
    return job.state_dict()


@pytest.mark.parametrize("biased", [False, True], ids=["routed", "biased-router"])
def test_routing_census_states_and_checkpoint(biased, tmp_path):
    folder = str(tmp_path / "ckpt")
    results = run_ranks(_rank, 2, biased, folder, timeout=240)
    tokens = BATCH // 2 * zoo.SEQ  # per rank
    rows = tokens * TOP_K
    for out in results:
        r = out["rank"]
        assert max(abs(a - b) for a, b in zip(out["losses"], out["ref_losses"])) < 2e-5, out
        diff, where = parity.max_diff(out["params"], out["ref_params"])
        assert diff < 5e-5, f"rank {r}: {where} off by {diff}"
        diff, where = parity.max_diff(out["grads0"], out["ref_grads0"])
        assert diff < GRAD_TOL, f"rank {r}: step-1 gradient of {where} off by {diff}"
        # each rank holds, updates and keeps optimizer states for exactly E/ep experts
        for fqn, shape in out["local_shapes"].items():
            if ".experts." in fqn:
                assert shape[0] == EXPERTS // 2
                assert set(out["states"][fqn].values()) == {shape}, (fqn, out["states"][fqn])
        # census: the all-to-all payloads of step 1 follow from the router's choices, exactly. Per layer:
        # the counts exchange (E int64), the rows out (S) and back in (R) in forward, then both again as gradients
        mine = range(r * EXPERTS // 2, (r + 1) * EXPERTS // 2)
        received = [int(sum((chosen == e).sum() for e in mine)) for chosen in out["routing"]]
        want = sum(2 * (rows + got) * HIDDEN * 4 + EXPERTS * 8 for got in received)
        calls = len(out["routing"]) * 5
        assert out["a2a"] == (calls, want), (out["a2a"], (calls, want), received)
        for layer, got in enumerate(received):  # explain() reports the same load, per local expert
            assert f"expert layer {layer}: {got} rows here" in out["report"], out["report"]
        if biased:
            assert received == ([2 * rows] * 2 if r == 0 else [0, 0])
            for fqn, grad in out["local_grads"].items():  # rank 1's experts saw no row: zero gradient, no hang
                assert r == 0 or not grad.any(), fqn
            for fqn, grad in out["grads0"].items():
                if ".experts." in fqn:
                    assert not grad[2:].any() and grad[:2].any(), fqn
    # the checkpoint, written by two ranks holding two experts each, loads whole into one process without ep
    loaded = run_ranks(_load_rank, 1, folder, timeout=120)[0]
    for key, value in results[0]["params"].items():
        assert torch.equal(loaded[key], value), key


AUX = 0.02


def _aux_loss(out, y):
    """The language-model loss plus the router's load-balancing loss the model returns (Mixtral's recipe)."""
    return zoo.lm_loss(out.logits, y) + AUX * out.aux_loss


def _aux_rank() -> dict:
    import meshc

    mesh = meshc.mesh(dp=2, ep=2, timeout_s=90)
    data = zoo.batches(STEPS, BATCH)
    job = meshc.compile(zoo.mixtral(aux_loss=AUX), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                        plan=meshc.Plan(verify=True, trace="non-strict"))
    opt = job.optimizer(torch.optim.AdamW, lr=parity.LR)
    losses, grads0 = [], {}
    for step, (x, y) in enumerate(data):
        losses.append(job.step(mesh.shard_batch(x), mesh.shard_batch(y), _aux_loss).item())
        if step == 0:
            grads0 = job.grad_state_dict()
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads0": grads0, "params": job.state_dict()}


def test_router_aux_loss_composes():
    """The load-balancing loss, computed by the model from its router logits, trains under ep as under data
    parallelism: each rank's loss is over its own batch (its routing statistics too), averaged over dp. The
    reference does that in one process (the mean of the two halves' losses); same tolerances as above."""
    ref = zoo.mixtral(aux_loss=AUX)
    opt = torch.optim.AdamW(ref.parameters(), lr=parity.LR)
    ref_losses, ref_grads0 = [], {}
    for step, (x, y) in enumerate(zoo.batches(STEPS, BATCH)):
        loss = sum(_aux_loss(ref(xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))) / 2
        loss.backward()
        if step == 0:
            ref_grads0 = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    for out in run_ranks(_aux_rank, 2, timeout=240):
        assert max(abs(a - b) for a, b in zip(out["losses"], ref_losses)) < 2e-5, (out["losses"], ref_losses)
        diff, where = parity.max_diff(out["params"], ref.state_dict())
        assert diff < 5e-5, (where, diff)
        diff, where = parity.max_diff(out["grads0"], ref_grads0)
        assert diff < GRAD_TOL, f"step-1 gradient of {where} off by {diff}"
