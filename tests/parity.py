"""Parity runs: meshc on N ranks against one process training the same weights on the global batch.

`reference(...)` trains in this process; `meshc_rank(...)` is the rank function handed to run_ranks.
Both return {"losses": [...], "grads0": {fqn: grad after step 1}, "params": {fqn: final value}}.
"""
from __future__ import annotations

import functools

import torch

import meshc
from tests import effects, zoo

LR = 1e-3


def _optimizer(name: str, params):
    cls, kwargs = optimizer_args(name)
    return cls(params, **kwargs)


@functools.lru_cache(maxsize=16)
def reference(model: str, steps: int, batch: int, optimizer: str = "adamw", seq: int = zoo.SEQ) -> dict:
    """One process training `model` on the global batches (the same for every mesh: cached, read-only)."""
    m = zoo.build(model)
    opt = _optimizer(optimizer, m.parameters())
    losses, grads0 = [], {}
    for i, (x, y) in enumerate(zoo.batches_for(model, steps, batch, seq=seq)):
        loss = zoo.model_loss(model, m, x, y)
        loss.backward()
        if i == 0:
            grads0 = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}  # frozen: none
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads0": grads0, "params": {k: v.clone() for k, v in m.state_dict().items()}}


def meshc_rank(model: str, steps: int, batch: int, mesh_sizes: dict | None = None, plan: dict | None = None,
               optimizer: str = "adamw") -> dict:
    """One rank of a parity run. `plan` may set trace="non-strict" to halve compile time in tests."""
    mesh = meshc.mesh(timeout_s=90, **(mesh_sizes or {}))
    m = zoo.build(model)
    data = zoo.batches_for(model, steps, batch)
    inside = model in zoo.LOSS_INSIDE  # forward(tokens, targets) -> (logits, loss): the model's own loss
    example = (mesh.shard_batch(data[0][0]),) + ((mesh.shard_batch(data[0][1]),) if inside else ())
    job = meshc.compile(m, mesh, example_inputs=example, plan=meshc.Plan(verify=True, **(plan or {})))
    cls, kwargs = optimizer_args(optimizer)
    opt = job.optimizer(cls, **kwargs)
    losses, grads0, held0 = [], {}, {}
    for i, (x, y) in enumerate(data):
        x, y = mesh.shard_batch(x), mesh.shard_batch(y)
        loss = job.step((x, y), None, lambda out, _: out[1]) if inside else job.step(x, y, zoo.lm_loss)
        if i == 0:  # whole gradients, gathered from the shards; what the rank holds after a backward
            grads0, held0 = job.grad_state_dict(), job.held_bytes()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = job.state_dict()
    return {"losses": losses, "grads0": grads0, "params": params, "report": str(job.explain()), "held0": held0,
            **effects.record(job, mesh)}  # what this rank holds and ran: local shapes, held bytes, actions, ...


def optimizer_args(name: str):
    if name == "sgd":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": LR}


def assert_matches(rank: int, out: dict, ref: dict, steps: int, params_tol: float = 5e-5) -> None:
    """One rank's run against the single-process reference: the same gradient and parameter names first (a
    missing one would otherwise pass unseen), then losses within 2e-5, step-1 gradients within 2e-6 (of the
    tensor's largest element where that exceeds 1: fp32 rounding grows with the values summed; RWKV's embedding
    gradient reaches 71),
    parameters after `steps` within `params_tol` (the tests say why)."""
    assert set(out["grads0"]) == set(ref["grads0"]), \
        f"rank {rank}: gradients of {sorted(set(out['grads0']) ^ set(ref['grads0']))} on one side only"
    assert set(out["params"]) == set(ref["params"]), \
        f"rank {rank}: parameters {sorted(set(out['params']) ^ set(ref['params']))} on one side only"
    worst = max(abs(a - b) for a, b in zip(out["losses"], ref["losses"]))
    assert worst < 2e-5, (rank, out["losses"], ref["losses"])
    diff, where = max_diff(out["grads0"], ref["grads0"], scaled=True)
    if diff >= 2e-6:
        raw = (out["grads0"][where].float() - ref["grads0"][where].float()).abs().max().item()
        raise AssertionError(f"rank {rank}: step-1 gradient of {where} off by {raw} ({diff} of its largest element, "
                             f"or of 1)")
    diff, where = max_diff(out["params"], ref["params"])
    assert diff < params_tol, f"rank {rank}: parameter {where} off by {diff} after {steps} steps"


def block_coverage(local_shapes: dict, model: torch.nn.Module, n: int, held_only: bool = False) -> float:
    """The share of the blocks' weight bytes (parameters of 2+ dims, of sizes other than 1, under an indexed module,
    as compiler/ir/coverage.py counts them) a rank holds in
    part over n ranks, from its local shapes: what the plan really sharded, whatever it reports. A parameter
    with g elements of which the rank holds l has (g - l) * n / (n - 1) of them sharded: all of a split one,
    none of a replicated one, q's rows only of a fused q|k|v whose k and v every rank holds whole. `held_only`:
    over the blocks' parameters this rank holds (a pipeline stage's), not the whole model's."""
    import math
    import re

    from meshc.compiler.ir.coverage import is_weight_shape

    whole = {k: p for k, p in model.named_parameters() if is_weight_shape(p.shape)
             and re.search(r"\.\d+\.", k) and (k in local_shapes or not held_only)}
    total = sum(p.numel() for p in whole.values())
    sharded = sum((p.numel() - math.prod(local_shapes[k])) * n / (n - 1) for k, p in whole.items() if k in local_shapes)
    return sharded / total


def max_relative(a: dict, b: dict) -> tuple[float, str]:
    """The largest per-tensor relative difference ||a - b|| / ||b|| (L2 over the tensor), and where; the two must
    hold the same keys. For low-precision runs, where single elements may differ in sign but tensors do not."""
    assert a.keys() == b.keys(), f"keys on one side only: {sorted(a.keys() ^ b.keys())}"
    worst, where = 0.0, ""
    for k in a.keys():
        x, y = a[k].float(), b[k].float()
        d = ((x - y).norm() / y.norm().clamp_min(1e-12)).item()
        if d > worst:
            worst, where = d, k
    return worst, where


def max_diff(a: dict, b: dict, scaled: bool = False) -> tuple[float, str]:
    """The largest absolute difference, and where; the two must hold the same keys (a tensor missing on one
    side is a failure, not a pass). `scaled`: each tensor's difference divided by its largest element in `b`
    where that exceeds 1."""
    assert a.keys() == b.keys(), f"keys on one side only: {sorted(a.keys() ^ b.keys())}"
    worst, where = 0.0, ""
    for k in a.keys() & b.keys():
        d = (a[k].float() - b[k].float()).abs().max().item()
        if scaled:
            d /= max(1.0, b[k].float().abs().max().item())
        if d > worst:
            worst, where = d, k
    return worst, where


def max_update_error(params: dict, ref: dict) -> tuple[float, str]:
    """The largest per-tensor relative L2 error of a run's update against the reference's, ||Δ - Δ_ref|| / ||Δ_ref||
    with Δ = final - initial (`ref["initial"]`: the weights both runs started from), and where; `params` must hold
    the reference's keys. For low-precision runs, whose weights may sit a few lr apart element by element (AdamW
    moves each by about lr whatever its gradient's size, so a tiny gradient whose sign bf16 rounding flips moves
    it the other way) while each tensor's update agrees to a few percent: a tensor the optimizer left unchanged is
    100% off, one step lost out of n about 1/n. A tensor the reference leaves exactly where it was (a buffer) must
    stay exactly there (inf otherwise)."""
    initial = ref["initial"]
    assert params.keys() == initial.keys(), f"keys on one side only: {sorted(params.keys() ^ initial.keys())}"
    worst, where = 0.0, ""
    for k, start in initial.items():
        start = start.float()
        want, got = ref["params"][k].float() - start, params[k].float() - start
        scale = want.norm().item()
        d = (got - want).norm().item() / scale if scale > 0 else (0.0 if torch.equal(got, want) else float("inf"))
        if d > worst:
            worst, where = d, k
    return worst, where


def mixed_reference(model: str, steps: int, batch: int, dtype=torch.bfloat16) -> dict:
    """One process in mixed precision as ZeRO runs it: fp32 master weights and AdamW, compute in `dtype`,
    gradients cast to fp32 before the update. Returns the initial weights too, under "initial" (state_dict
    keys, for max_update_error)."""
    m = zoo.build(model)
    initial = {k: v.detach().clone() for k, v in m.state_dict().items()}
    masters = {n: p.detach().clone().requires_grad_(True) for n, p in m.named_parameters()}
    for p in m.parameters():
        p.data = p.data.to(dtype)
    opt = torch.optim.AdamW(masters.values(), lr=LR)
    losses, grads0 = [], {}
    for i, (x, y) in enumerate(zoo.batches(steps, batch)):
        loss = zoo.lm_loss(m(x), y)
        loss.backward()
        for n, p in m.named_parameters():
            masters[n].grad = p.grad.float()
            p.grad = None
        if i == 0:
            grads0 = {n: t.grad.clone() for n, t in masters.items()}
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(masters[n].to(dtype))
        losses.append(loss.item())
    by_id = {id(p): n for n, p in m.named_parameters()}  # state_dict keys (tied aliases too), as job.state_dict
    params = {k: (masters[by_id[id(v)]] if id(v) in by_id else v).detach()
              for k, v in m.state_dict(keep_vars=True).items()}
    return {"losses": losses, "grads0": grads0, "params": params, "initial": initial}


def train_one_process(model: torch.nn.Module, opt, batches: list, loss_of) -> dict:
    """The reference of a training loop: for each batch, `loss_of(model, batch)` backward, then an optimizer step.
    Returns {"losses", "params"} as a rank's run does (state_dict keys)."""
    losses = []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train_job(job, opt, batches: list, step_of) -> list[float]:
    """A rank's side of train_one_process: `step_of(job, batch)` runs job.step; returns the losses."""
    losses = []
    for batch in batches:
        losses.append(step_of(job, batch).item())
        opt.step()
        opt.zero_grad()
    return losses


def assert_run_matches(where: str, out: dict, ref: dict, params_tol: float = 5e-5) -> None:
    """A rank's losses within 2e-5 of the reference's and its final parameters within `params_tol` (assert_matches'
    bounds, for runs that keep no step-1 gradients)."""
    worst = max(abs(a - b) for a, b in zip(out["losses"], ref["losses"]))
    assert worst < 2e-5, (where, out["losses"], ref["losses"])
    diff, name = max_diff(out["params"], ref["params"])
    assert diff < params_tol, f"{where}: {name} off by {diff}"
