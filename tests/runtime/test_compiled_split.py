"""Zero-bubble's backward halves for a stage Inductor compiled (runtime/compiled_split.py), in one process.

On GPT-2's last stage at pp=2: AOTAutograd's backward graph cut in two puts each of its ops in exactly one half
(nothing computed twice), every matmul of W produces a weight's gradient and none of I does; run, I gives the
received activation's gradient and touches no parameter, W then gives the parameters' gradients, and both equal the
whole compiled backward's (B) to a few fp32 ulps: the same ops, fused into other kernels.
"""
from __future__ import annotations

import pytest
import torch

from meshc.runtime import inductor
from meshc.runtime.inductor import InductorPrograms
from meshc.runtime import compiled_split
from meshc.runtime.pipeline.backward_split import backward_input, backward_weight
from meshc.runtime.compiled_split import split_graph
from tests.runtime.test_backward_split import MATMULS, _last_stage, _values


def _loss(out):
    return (out[0] if isinstance(out, (tuple, list)) else out).float().pow(2).mean()


def test_compiled_i_then_w_holds_each_op_once_and_gives_the_whole_backwards_gradients(fake_mesh):
    stage, weights = _last_stage(fake_mesh(pp=2))
    values = _values(stage)
    n = len(stage.recv)
    graphs = []  # the backward graph the split was handed (AOTAutograd's, after the partitioner)
    real_split = compiled_split.split_backward

    def recording(deferred):
        def build(gm, *rest):
            graphs.append(gm)
            return real_split(deferred)(gm, *rest)
        return build
    programs = InductorPrograms()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inductor, "split_backward", recording)
        run = programs.runner(stage.gm, "stage 1", weights=len(stage.params) + len(stage.buffers))

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

    backward, = graphs  # each op in exactly one half; W's matmuls weight gradients, I's none
    width = len(backward.graph.output_node().args[0])
    halves = split_graph(backward, frozenset(range(width - n, width)))

    def ops(gm):
        return [node for node in gm.graph.nodes if node.op == "call_function"]
    assert len(ops(halves.input_half)) + len(ops(halves.weight_half)) == len(ops(backward))
    shapes = {half: [tuple(node.meta["val"].shape) for node in ops(gm) if node.target in MATMULS]
              for half, gm in (("I", halves.input_half), ("W", halves.weight_half))}
    assert shapes["I"] and shapes["W"], shapes
    assert all(s in weights for s in shapes["W"]) and not any(s in weights for s in shapes["I"]), (shapes, weights)
    assert halves.input_outputs == list(range(width - n, width)) and halves.carried
