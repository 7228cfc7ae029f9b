"""passes/attention/gqa.py: key/value heads copied per query head (transformers' repeat_kv) become SDPA's enable_gqa, on each
rank's local heads; where tp slices the copies (fewer kv heads than tp) nothing is folded. Numerics of the folded
plans on several ranks: every Llama parity test (tests/models/)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshc
from meshc.compiler.compile import compile_rank
from meshc.runtime.mesh import simulated_mesh
from tests import zoo

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _attention(sizes: dict, model: torch.nn.Module, **plan) -> list[torch.fx.Node]:
    mesh = simulated_mesh(**sizes)
    try:
        x, _ = zoo.batches(1, 4)[0]
        compiled, _ = compile_rank(model, (x,), {}, mesh=mesh, plan=meshc.Plan(trace="non-strict", **plan))
        return [n for n in compiled.program.gm.graph.nodes if n.target is SDPA]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes,kv_local", [({"dp": 1}, 2), ({"tp": 2}, 1)])
def test_copied_kv_heads_are_read_in_place(sizes, kv_local):
    """Llama (4 query heads, 2 kv heads): each layer's SDPA reads the kv heads this rank holds, enable_gqa on."""
    nodes = _attention(sizes, zoo.build("llama"))
    assert len(nodes) == 2  # one per layer
    for node in nodes:
        q, k, v = (a.meta["val"] for a in node.args[:3])
        assert node.kwargs.get("enable_gqa") is True
        assert k.shape[1] == v.shape[1] == kv_local and q.shape[1] == 2 * kv_local
        assert all(a.target is not torch.ops.aten.reshape.default for a in node.args[1:3])


def test_copies_sliced_by_tp_are_left_as_they_are():
    """2 kv heads over tp=4: tp keeps k and v whole and slices each rank's copies, which the fold must not read as
    this rank's group (query head j of rank r pairs with kv head (4r + j) // 2 of the whole, not j // 2)."""
    nodes = _attention({"tp": 4}, zoo.build("llama"))
    assert nodes and not any(n.kwargs.get("enable_gqa") for n in nodes)


def test_the_fold_trains_like_the_copies_and_saves_less(single_mesh):
    """World 1: the same losses and gradients as the program with the pass off (the same attention, the kv
    gradient summed over a group's heads in another order: fp32 ulps, measured <= 1e-7 relative), and backward
    keeps fewer bytes: the copies are no longer saved."""
    x, y = zoo.batches(1, 4)[0]
    runs = {}
    for disable in ((), ("gqa",)):
        job = meshc.compile(zoo.build("llama"), single_mesh, example_inputs=(x,),
                            plan=meshc.Plan(trace="non-strict", disable=disable))
        saved = []

        def pack(t):
            saved.append(t.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = job.step(x, y, zoo.lm_loss)
        runs[disable] = (loss.item(), {n: p.grad.clone() for n, p in job.named_parameters()}, sum(saved))
    (loss, grads, saved), (loss_off, grads_off, saved_off) = runs[()], runs[("gqa",)]
    assert abs(loss - loss_off) <= 1e-6
    for name, g in grads.items():
        assert torch.allclose(g, grads_off[name], rtol=1e-5, atol=1e-7), name
    assert saved < saved_off, (saved, saved_off)
