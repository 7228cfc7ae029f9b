"""fuse_comm: the chains next to collectives become meshc kernels (counted), what does not match says
why, require_fusion and fusion=False work, and the collective matmuls equal their unfused pairs."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import meshc
from meshc.compiler.driver import run_passes
from meshc.compiler.trace.export import trace
from tests import zoo
from tests.harness import run_ranks


def _program(mesh, model, **plan):
    plan.setdefault("fusion", True)  # the kernels themselves (the cost model's choice: test_cost_fusion.py)
    traced, _ = trace(model, (zoo.batches(1, 2)[0][0],), mesh=mesh, plan=meshc.Plan(verify=True, trace="non-strict", **plan))
    return run_passes(traced)


def _kernels(program) -> Counter:
    return Counter(n.target.__name__ for n in program.gm.graph.nodes
                   if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("meshc.kernels"))


@pytest.mark.parametrize("name,want", [
    ("reference", {"bias_dropout_add_norm": 4, "bias_gelu": 2}),
    ("gpt2", {"bias_dropout_add_norm": 4, "bias_gelu": 2}),  # GPT-2's tanh GeLU is written out in its code
    ("llama", {"bias_dropout_add_norm": 4, "bias_swiglu": 2}),  # Hugging Face's RMSNorm is written out too
])
def test_fused_graphs_contain_the_kernels(fake_mesh, name, want):
    program = _program(fake_mesh(tp=2), zoo.build(name), sequence_parallel=True)
    assert _kernels(program) == Counter(want)
    for kernel, count in want.items():
        assert (program.fusion[kernel].fused, program.fusion[kernel].eligible) == (count, count)
    norms = [n for n in program.gm.graph.nodes if n.target == torch.ops.aten.layer_norm.default]
    assert len(norms) == (1 if name != "llama" else 0)  # the first block's norm reads the embeddings: no reduction
    assert not [n for n in program.gm.graph.nodes if n.target == torch.ops.aten.gelu.default]


def test_zero_copies_and_gradient_prologue_use_the_kernels(fake_mesh):
    program = _program(fake_mesh(dp=2), zoo.reference_transformer(), zero=3)
    gathers = [n for n in program.gm.graph.nodes if getattr(n.target, "__name__", "") in ("zero_gather", "zero_gather_start")]
    assert gathers and all(n.kwargs["fused"] for n in gathers)
    assert program.fusion["zero_copy"].fused == program.fusion["zero_copy"].eligible == len(gathers) // 2


def test_unmatched_chains_say_why_and_require_fusion_raises(fake_mesh):
    program = _program(fake_mesh(tp=2), zoo.gpt2(), sequence_parallel=True, collective_matmul=True)
    left = program.fusion["all_gather_matmul"].left
    assert len(left) == 4 and all("feeds something other than linears" in x for x in left)
    report = "\n".join(program.notes)
    assert "all_gather_matmul: fused 0 of 4 eligible" in report
    with pytest.raises(ValueError, match="Plan.require_fusion: expected every eligible chain fused, got 8 left"):
        _program(fake_mesh(tp=2), zoo.gpt2(), sequence_parallel=True, collective_matmul=True, require_fusion=True)


def test_fusion_off(fake_mesh):
    program = _program(fake_mesh(tp=2), zoo.reference_transformer(), fusion=False)
    assert not _kernels(program) and not program.fusion


def _collective_matmul_rank() -> dict:
    from meshc.runtime.ops.collective_matmul import all_gather_matmul, matmul_reduce_scatter
    from meshc.runtime.ops.collectives import all_gather_rs, reduce_scatter

    mesh = meshc.mesh(tp=int(__import__("os").environ["WORLD_SIZE"]), timeout_s=60)
    n, index, group = mesh.size("tp"), mesh.coord("tp"), mesh.group_name("tp")
    kw = {"dim": 1, "size": n, "index": index, "group": group}
    g = torch.Generator().manual_seed(0)
    x_full = torch.randn(2, 4 * n, 6, generator=g)  # (B, T, H): every rank knows the whole, keeps its rows
    w1, w2 = torch.randn(5, 6, generator=g), torch.randn(3, 6, generator=g)
    b1 = torch.randn(5, generator=g)
    out = {}
    for fused in (True, False):
        x = x_full.chunk(n, dim=1)[index].clone().requires_grad_(True)
        ws = [w1.clone().requires_grad_(True), b1.clone().requires_grad_(True), w2.clone().requires_grad_(True)]
        if fused:
            y1, y2 = all_gather_matmul(x, ws[0], ws[1], ws[2], None, **kw, ranks=mesh.group_ranks("tp"))
        else:
            whole = all_gather_rs(x, chunks=1, **kw)
            y1, y2 = F.linear(whole, ws[0], ws[1]), F.linear(whole, ws[2])
        (y1.square().sum() + y2.sum()).backward()
        out[fused] = [y1.detach(), y2.detach(), x.grad, *(w.grad for w in ws)]
    for fused in (True, False):  # matmul -> reduce-scatter
        x = x_full.clone().requires_grad_(True)
        w = w1.clone().requires_grad_(True)
        if fused:
            y = matmul_reduce_scatter(x, w, dim=1, size=n, index=index, group=group, ranks=mesh.group_ranks("tp"))
        else:
            y = reduce_scatter(F.linear(x, w), dim=1, chunks=1, size=n, group=group)
        y.square().sum().backward()
        out[("rs", fused)] = [y.detach(), x.grad, w.grad]
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_collective_matmul_equals_the_unfused_pair(tp):
    for out in run_ranks(_collective_matmul_rank, tp, timeout=120):
        for a, b in zip(out[True], out[False]):  # same products, summed in another order: fp32 ulps
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(out[("rs", True)], out[("rs", False)]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
