"""Zero-bubble's backward halves for a stage Inductor compiled (runtime/pipeline/compiled_split.py), in one process.

On GPT-2's last stage at pp=2: AOTAutograd's backward graph cut in two puts each of its ops in exactly one half
(nothing computed twice), every matmul of W produces a weight's gradient and none of I does; run, I gives the
received activation's gradient and touches no parameter, W then gives the parameters' gradients, and both equal the
whole compiled backward's (B) to a few fp32 ulps: the same ops, fused into other kernels.
"""
from __future__ import annotations

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.runtime.inductor import InductorPrograms
from meshc.runtime.pipeline.backward_split import backward_input, backward_weight
from meshc.runtime.pipeline.compiled_split import split_graph
from tests.runtime.test_backward_split import MATMULS, _last_stage, _values


def _loss(out):
    return (out[0] if isinstance(out, (tuple, list)) else out).float().pow(2).mean()


def test_the_two_halves_hold_each_op_once_and_w_only_weight_matmuls(fake_mesh):
    stage, weights = _last_stage(fake_mesh(pp=2))
    values = _values(stage)
    graphs = []
    fn = compat.inductor_compile(stage.gm, values, on_graph=lambda g, bw, *_: graphs.append(g) if bw else None)
    _loss(fn(*values)).backward()
    backward, = graphs
    width = len(backward.graph.output_node().args[0])
    halves = split_graph(backward, frozenset(range(width - len(stage.recv), width)))

    def ops(gm):
        return [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(ops(halves.input_half)) + len(ops(halves.weight_half)) == len(ops(backward))
    shapes = {half: [tuple(n.meta["val"].shape) for n in ops(gm) if n.target in MATMULS]
              for half, gm in (("I", halves.input_half), ("W", halves.weight_half))}
    assert shapes["I"] and shapes["W"], shapes
    assert all(s in weights for s in shapes["W"]) and not any(s in weights for s in shapes["I"]), (shapes, weights)
    assert halves.input_outputs == list(range(width - len(stage.recv), width)) and halves.carried


def test_compiled_i_then_w_gives_the_whole_backwards_gradients(fake_mesh):
    stage, _ = _last_stage(fake_mesh(pp=2))
    values = _values(stage)
    programs = InductorPrograms()
    run = programs.runner(stage.gm, "stage 1", activations=len(stage.recv))
    n = len(stage.recv)

    def leaves():
        return [v.detach().requires_grad_(v.requires_grad) for v in values]
    whole = leaves()
    _loss(run(*whole)).backward()  # nobody deferred: I, then W at once
    split = leaves()
    got, work = backward_input([_loss(run(*split))], [None], split[-n:])
    assert all(t.grad is None for t in split[:-n]) and work.compiled  # I touched no parameter
    backward_weight(work)
    assert programs.stats.forward == 1 and programs.stats.backward == 2  # one forward, the two halves
    # the same ops fused into other kernels: a few fp32 ulps (measured <= 3e-7 relative)
    for a, b in zip([t.grad for t in whole], [t.grad for t in split[:-n]] + list(got)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=2e-6, atol=1e-7)
    assert any(t.grad is not None and t.grad.abs().sum() > 0 for t in split[:-n])
