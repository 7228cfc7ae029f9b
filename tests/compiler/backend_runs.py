"""Rank functions for the torch.compile door's tests (tests/compiler/test_backend.py): each trains a zoo model
through `torch.compile(model, backend=meshc.backend(mesh, plan))` and, on the same process group, through
`meshc.compile`, and returns both runs' losses and collective censuses."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import meshc
from meshc.compiler.ir import torch_compat as compat
from meshc.runtime.global_param import ShardedParam
from meshc.runtime.monitor.census import CommCensus
from meshc.runtime.sharding import full_tensor
from tests import parity, zoo


def broken(name: str, where: str) -> torch.nn.Module:
    """The reference Transformer with a graph break `where` = "between" its blocks or "inside" each block
    (between attention and MLP). Same weights and arithmetic as zoo.build("reference"). The blocks are
    called one by one, not in a loop: TorchDynamo runs a frame whose loop holds a graph break eagerly,
    which where="loop" does (the reference's own loop over blocks, a break inside each)."""
    model = zoo.build(name)
    if where != "loop":
        model.forward = _unrolled.__get__(model)
    for layer in model.layers:
        layer.forward = (_block if where == "between" else _inside).__get__(layer)
    model.break_after_block = where == "between"
    return model


def _unrolled(self, tokens):
    h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
    h = self.layers[0](h)
    if self.break_after_block:
        compat.graph_break()  # the next block starts a new graph
    h = self.layers[1](h)
    if self.break_after_block:
        compat.graph_break()
    return self.output(self.norm(h)).float()


def _block(self, x):
    h = x + self.attention(self.attention_norm(x))
    return h + self.feed_forward(self.ffn_norm(h))


def _inside(self, x):
    h = x + self.attention(self.attention_norm(x))
    compat.graph_break()  # splits this block's parameters over two graphs
    return h + self.feed_forward(self.ffn_norm(h))


def _dp_mean(loss: torch.Tensor, mesh) -> float:
    out = loss.detach().clone()
    if mesh.size("dp") > 1:
        dist.all_reduce(out, group=mesh.group("dp"))
    return out.item() / mesh.size("dp")


def whole_grads(model: torch.nn.Module, mesh) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, whole, under its named_parameters name (parity.reference's grads0): a sharded
    one gathered from this rank's shard (a collective: every rank calls it). Taken after the first backward,
    when the door has swapped its parameters to shards: AdamW's update hides a gradient's scale (a sum over dp
    instead of the mean trains to the same losses and parameters), the gradient itself does not."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, ShardedParam):
            out[name] = full_tensor(p._local.grad, p._spec, mesh)
        else:
            out[name] = p.grad.detach().clone()
    return out


def backend_rank(model: str, steps: int, batch: int, sizes: dict, plan: dict, graph_break: str | None = None,
                 compare: bool = True) -> dict:
    mesh = meshc.mesh(timeout_s=90, **sizes)
    m = broken(model, graph_break) if graph_break else zoo.build(model)
    opt = torch.optim.AdamW(m.parameters(), lr=parity.LR)  # before the first compiled call (the documented order)
    backend = meshc.backend(mesh, meshc.Plan(trace="non-strict", **plan))
    compiled = torch.compile(m, backend=backend)
    data = zoo.batches(steps, batch)
    losses, census = [], {}
    for i, (x, y) in enumerate(data):
        # counted once the parameters are shards; forward inside the compiled regions (TorchDynamo runs a
        # frame eagerly under an outer dispatch mode such as the census), backward around autograd
        counted = CommCensus(mesh)
        with backend.counting(counted) if i == 2 else contextlib.nullcontext():
            loss = zoo.lm_loss(compiled(mesh.shard_batch(x)), mesh.shard_batch(y))
        with counted if i == 2 else contextlib.nullcontext():
            loss.backward()
        if i == 2:
            census = counted.by_kind()
        if i == 0:
            grads0 = whole_grads(m, mesh)
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(loss, mesh))
    logits = None
    if not plan.get("inductor"):  # (compiled, a second Inductor compile of the whole model: 18 s of a 62 s test)
        short = data[0][0][:, : zoo.SEQ // 2]  # a new input shape: recompiled, the parameters' shards reused
        logits = compiled(short)
        logits = (logits.logits if hasattr(logits, "logits") else logits).detach()
    last = meshc.last_compiled()
    out = {"losses": losses, "grads0": grads0, "census": census, "short_logits": logits, "params": backend.state_dict(m),
           "programs": len(last.programs), "report": str(last.explain()),
           "inductor": {"forward": backend.inductor.stats.forward, "backward": backend.inductor.stats.backward},
           "sharded": sum(type(p).__name__ == "ShardedParam" for p in m.parameters()),
           "shards_in_optimizer": [tuple(p.shape) for g in opt.param_groups for p in g["params"]]}
    if compare:
        job = meshc.compile(zoo.build(model), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                            plan=meshc.Plan(trace="non-strict", **plan))
        jopt = job.optimizer(torch.optim.AdamW, lr=parity.LR)
        out["compile_losses"] = []
        for i, (x, y) in enumerate(data):
            with CommCensus(mesh) as counted:
                loss = job.step(mesh.shard_batch(x), mesh.shard_batch(y), zoo.lm_loss)
            if i == 2:
                out["compile_census"] = counted.by_kind()
            if i == 0:
                out["compile_grads0"] = job.grad_state_dict()
            jopt.step()
            jopt.zero_grad()
            out["compile_losses"].append(loss.item())
    return out


def families_rank(models: list[str], steps: int, batch: int, sizes: dict, optimizers: dict | None = None) -> dict:
    """Each of `models` trained `steps` AdamW steps through the torch.compile door on one mesh, in one process
    per rank (one spawn for every family): {model: {"losses", "grads0", "params", "sharded", "error"}}. A model the
    backend refuses reports the refusal's message under "error" (the test decides whether that is allowed)."""
    mesh = meshc.mesh(timeout_s=90, **sizes)
    out = {}
    for name in models:
        torch.compiler.reset()  # each family compiles afresh: no recompilation limit shared between them
        m = zoo.build(name)
        cls, kwargs = parity.optimizer_args((optimizers or {}).get(name, "adamw"))
        opt = cls(m.parameters(), **kwargs)
        backend = meshc.backend(mesh, meshc.Plan(trace="non-strict"))
        compiled = torch.compile(m, backend=backend)
        losses, grads0 = [], {}
        try:
            for i, (x, y) in enumerate(zoo.batches_for(name, steps, batch)):
                loss = zoo.model_loss(name, compiled, mesh.shard_batch(x), mesh.shard_batch(y))
                loss.backward()
                if i == 0:
                    grads0 = whole_grads(m, mesh)
                opt.step()
                opt.zero_grad()
                losses.append(_dp_mean(loss, mesh))
        except meshc.MeshcError as error:
            out[name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        out[name] = {"losses": losses, "grads0": grads0, "params": backend.state_dict(m), "error": None,
                     "sharded": sum(type(p).__name__ == "ShardedParam" for p in m.parameters())}
    return out
