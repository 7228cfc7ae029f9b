"""The zero-bubble backward split (runtime/pipeline/backward_split.py, compiler/pipeline/backward_graphs.py), in one process.

Counted with torch's FlopCounterMode: on a real stage graph (GPT-2's last stage at pp=2, with dp=2's gradient
buckets and with ZeRO-3's gathers), the FLOPs of I and W sum exactly to a plain backward's, and every matmul W
runs produces a weight gradient (a parameter's shape), never an activation gradient. The gradients equal
B's bit for bit (the same kernels on the same operands) and reach `.grad` through autograd as in B.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import meshc
from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.driver import run_passes
from meshc.compiler.pipeline.stages import stage_graphs
from meshc.compiler.trace.export import trace
from meshc.compiler.pipeline.backward_graphs import private_weight_uses
from meshc.runtime.pipeline.backward_split import backward_input, backward_weight
from tests import zoo

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}
BATCH = 3  # 48 rows of activations: no activation gradient has a parameter's shape


class _Matmuls(compat.dispatch_mode_base()):
    """Records the output shape of every matmul run while active."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            self.shapes.append(tuple(out.shape))
        return out


def _flops(fn):
    with FlopCounterMode(display=False) as counter:
        result = fn()
    return counter.get_total_flops(), result


def _last_stage(mesh, **plan):
    traced, _ = trace(zoo.gpt2(), (zoo.batches(1, BATCH)[0][0],), mesh=mesh,
                      plan=meshc.Plan(trace="non-strict", **plan))
    program = run_passes(traced)
    stage = stage_graphs(program, 2)[-1]
    shapes = {tuple(program.params[f].shape) for f in stage.params if len(program.params[f].shape) == 2}
    return stage, shapes | {s[::-1] for s in shapes}  # a weight's gradient, or its transpose's


def _values(stage):
    """Random leaves for the stage's placeholders: parameters and the received activation require grad."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(n for n in stage.gm.graph.nodes if n.op == "placeholder"):
        v = n.meta["val"]
        if not v.dtype.is_floating_point:
            out.append(torch.randint(0, zoo.VOCAB, v.shape, generator=g, dtype=v.dtype))
        else:
            grad = i < len(stage.params) or n.name.startswith("recv_")
            out.append(torch.randn(v.shape, generator=g, dtype=v.dtype).requires_grad_(grad))
    return out


def _run(stage, values):
    leaves = [v.detach().requires_grad_(v.requires_grad) for v in values]
    out = stage.gm(*leaves)
    loss = (out[0] if isinstance(out, (tuple, list)) else out).float().pow(2).mean()
    return leaves, loss


def _split_vs_plain(stage, values):
    """(B's FLOPs, I's, W's, the matmul shapes W ran, B's gradients, the split's gradients)."""
    leaves, loss = _run(stage, values)
    b, _ = _flops(lambda: torch.autograd.backward([loss]))
    plain = [t.grad for t in leaves]
    leaves, loss = _run(stage, values)
    recv = leaves[len(leaves) - len(stage.recv):]
    i, (got, work) = _flops(lambda: backward_input([loss], [None], recv))
    with _Matmuls() as seen:
        w, _ = _flops(lambda: backward_weight(work))
    split = [t.grad for t in leaves[:len(leaves) - len(recv)]] + list(got)
    return b, i, w, seen.shapes, plain, split


@pytest.mark.parametrize("plan", [{}, {"zero": 3}], ids=["buckets", "zero3"])
def test_i_plus_w_is_b_and_w_computes_no_activation_gradient(fake_mesh, plan):
    stage, weights = _last_stage(fake_mesh(dp=2, pp=2), **plan)  # ZeRO-3: parameters as flat shards
    values = _values(stage)
    b, i, w, shapes, plain, split = _split_vs_plain(private_weight_uses(stage), values)
    assert i + w == b and i > 0 and w > 0, (b, i, w)
    assert shapes and all(s in weights for s in shapes), (shapes, weights)
    assert len(plain) == len(split) and all(
        (p is None) == (s is None) and (p is None or torch.equal(p, s)) for p, s in zip(plain, split))
    # without a node per parameter use, the buckets' shared nodes make W recompute activation gradients
    b0, i0, w0, shapes0, _, _ = _split_vs_plain(stage, values)
    assert b0 == b and i0 + w0 > b and any(s not in weights for s in shapes0), (b0, i0, w0)


def test_split_accumulates_through_autograd_like_b():
    """Two micro-batches: `.grad` sums as B's, and post-accumulate hooks fire in W, once per parameter
    per micro-batch, as in B; I touches no parameter; the first layer (no input gradient) works too."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                              torch.nn.Linear(8, 4))
    fired: list[str] = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))
    xs, gs = torch.randn(2, 5, 8), torch.randn(2, 5, 4)
    for x, g in zip(xs, gs):
        torch.autograd.backward([net(x.requires_grad_())], [g])
    plain, plain_fired = [p.grad.clone() for p in net.parameters()], sorted(fired)
    net.zero_grad(set_to_none=True)
    fired.clear()
    for k, grad_input in enumerate((True, False)):  # the second as a first stage's: no input gradient
        x = xs[k].detach().requires_grad_(grad_input)
        got, work = backward_input([net(x)], [gs[k]], [x])
        assert (got[0] is not None) == grad_input
        assert len(fired) == k * len(plain)  # I accumulated into no parameter
        backward_weight(work)
        assert len(fired) == (k + 1) * len(plain)
    assert sorted(fired) == plain_fired
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, net.parameters()))


class _Calls(compat.dispatch_mode_base()):
    """Records the arguments of every call of one op while active."""

    def __init__(self, op):
        super().__init__()
        self.op, self.args = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.args.append(args)
        return func(*args, **(kwargs or {}))


def test_an_op_autograd_cannot_split_runs_in_i_and_in_w_and_is_priced(fake_mesh):
    """Mixtral's expert matmuls on CPU are transformers' grouped_mm_fallback, a torch.library op whose backward is
    one call computing the input's and the weights' gradients: I runs it for the input's, W again for the
    weights'. Counted from that call's arguments (2·rows·in·out FLOPs per gradient), the work the split adds over
    B is twice those ops' forward FLOPs: what the cost model adds to each of the stage's W (GraphCost.unsplit_*),
    and the simulated zero-bubble step carries it (as recompute) where 1F1B does not."""
    from meshc.compiler.cost.compiled import compiled_estimate, graph_cost, stage_times
    from meshc.compiler.cost.hardware import load
    from meshc.compiler.pipeline.rank_plan import PipelinePlan

    traced, _ = trace(zoo.mixtral(), (zoo.batches(1, BATCH)[0][0],), mesh=fake_mesh(pp=2),
                      plan=meshc.Plan(trace="non-strict", microbatches=2, schedule="zb-h1"))
    backward = torch.ops.transformers.grouped_mm_fallback_backward.default  # defined once transformers' MoE loads
    program = run_passes(traced)
    stage = private_weight_uses(stage_graphs(program, 2)[-1])
    cost = graph_cost(stage.gm)
    assert cost.unsplit_ops == 2 and cost.unsplit_flops > 0  # the last block's gate-up and down projections

    def flops(calls):  # dX and dW: 2 · rows · in · out each
        return sum(2 * 2 * x.shape[0] * w.shape[1] * w.shape[2] for x, w, *_ in calls)
    values = _values(stage)
    leaves, loss = _run(stage, values)
    with _Calls(backward) as plain:
        torch.autograd.backward([loss])
    leaves, loss = _run(stage, values)
    with _Calls(backward) as split:
        _, work = backward_input([loss], [None], leaves[len(leaves) - len(stage.recv):])
        backward_weight(work)
    assert len(plain.args) == 2 and len(split.args) == 4
    assert flops(split.args) - flops(plain.args) == 2 * cost.unsplit_flops

    hw = load("cpu-default")
    assert stage_times(cost, {"pp": 2}, hw).unsplit == cost.unsplit_time(hw) > 0
    estimates = {}
    for schedule in ("zb-h1", "1f1b"):
        plan = meshc.Plan(trace="non-strict", microbatches=2, schedule=schedule)
        estimates[schedule] = compiled_estimate(program, hw, PipelinePlan(program.replace(plan=plan), plan))
    twice = estimates["zb-h1"].time["recompute"] - estimates["1f1b"].time["recompute"]
    assert twice == pytest.approx(2 * cost.unsplit_time(hw))  # m = 2 micro-batches of the last stage
