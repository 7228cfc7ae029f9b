"""Views in the programs handed to Inductor (runtime/inductor.py, views_as_reshapes): a view that nothing writes through
becomes a reshape, so that a layout Inductor's own decompositions choose (a cat with an empty input: a clone of the
other, in its strides) does not fail the compile; a view whose base is written in place stays a view."""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import meshc
from meshc.runtime.inductor import views_as_reshapes

aten = torch.ops.aten


class _WholeHeadRotary(nn.Module):
    """Heads cut from a fused projection (a permuted layout), a rotary over the whole head (its pass-through part
    empty), cat, then views: GPT-NeoX-Japanese at rotary_pct=1, which plain torch.compile fails on too."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.qkv(x).view(b, s, 4, 24).permute(0, 2, 1, 3)[..., :8]
        rot, rest = q[..., :8], q[..., 8:]
        q = torch.cat([rot * 2.0 + torch.cat([-rot[..., 4:], rot[..., :4]], -1), rest], dim=-1)
        return self.out(q.view(b * 4, s, 8).view(b, 4, s, 8).transpose(1, 2).reshape(b, s, 32))


def test_a_rotary_over_whole_heads_compiles_and_matches_eager(single_mesh):
    torch.manual_seed(0)
    model, x = _WholeHeadRotary(), torch.randn(2, 16, 32)
    want = model(x).square().mean()
    want.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    job = meshc.compile(model, single_mesh, example_inputs=(x,), plan=meshc.Plan(inductor=True, trace="non-strict"))
    got = job(x).square().mean()
    got.backward()
    assert job.inductor.stats.forward == 1 and job.inductor.stats.backward == 1  # compiled, not run as FX code
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (got, want)  # fp32: fused kernels sum in another order
    for k, p in job.named_parameters():
        assert torch.allclose(p.grad, grads[k], rtol=1e-5, atol=1e-7), k


def _graph(write_base: bool) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.cat.default, ([x, x], -1))
    v = g.call_function(aten.view.default, (y, [-1]))
    if write_base:
        g.call_function(aten.add_.Tensor, (y, 1.0))
    g.output((v,))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_view_becomes_a_reshape_unless_its_base_is_written():
    targets = lambda gm: [n.target for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert aten.reshape.default in targets(views_as_reshapes(_graph(write_base=False)))
    kept = targets(views_as_reshapes(_graph(write_base=True)))
    assert aten.view.default in kept and aten.reshape.default not in kept  # the view must see the write
