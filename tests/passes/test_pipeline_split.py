"""pipeline_split: balanced automatic cuts, explicit split points and pipe_split markers, stage graphs,
and the errors of what cannot be cut."""
from __future__ import annotations

import pytest
import torch

import meshc
from meshc.compiler.driver import run_passes
from meshc.compiler.stages import stage_graphs
from meshc.compiler.trace import trace
from tests import zoo


def _program(mesh, model, batch=2, **plan):
    traced, _ = trace(model, (zoo.batches(1, batch)[0][0],), mesh=mesh,
                      plan=meshc.Plan(verify=True, trace="non-strict", **plan))
    return run_passes(traced)


def test_automatic_split_of_12_layer_gpt2_is_balanced(fake_mesh):
    program = _program(fake_mesh(pp=4), zoo.gpt2(layers=12))
    costs = [s.flops for s in program.stage_info]
    mean = sum(costs) / len(costs)
    assert max(costs) <= 1.10 * mean, costs
    blocks = [s.blocks for s in program.stage_info]
    assert "lm_head" in blocks[-1] and any("transformer.h.0" in b for b in blocks[0])
    # cuts fall where only the residual stream crosses: one (B, T, H) fp32 activation
    for s in program.stage_info[:-1]:
        assert s.boundary_bytes == 2 * zoo.SEQ * 32 * 4


def test_stage_graphs_hold_their_own_parameters(fake_mesh):
    program = _program(fake_mesh(pp=2), zoo.gpt2())
    first, last = stage_graphs(program, 2)
    assert "transformer.h.0.attn.c_attn.weight" in first.params
    assert "transformer.h.1.attn.c_attn.weight" in last.params
    assert "transformer.h.1.attn.c_attn.weight" not in first.params
    assert "transformer.wte.weight" in first.params and "transformer.wte.weight" in last.params  # tied
    assert [b.shape for b in first.send] == [(2, zoo.SEQ, 32)] and first.send == last.recv
    assert last.last and not first.last


def test_split_points_and_markers(fake_mesh):
    program = _program(fake_mesh(pp=2), zoo.reference_transformer(layers=4), split_points=["layers.3"])
    assert program.stage_info[1].blocks[0] == "layers.3"

    class Marked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(zoo.VOCAB, 16)
            self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            h = self.a(self.emb(x))
            meshc.pipe_split()
            return self.c(self.b(h))

    program = _program(fake_mesh(pp=2), Marked())
    assert program.stage_info[0].blocks == ["emb", "a"]


def test_more_stages_than_cuts_is_an_error(fake_mesh):
    with pytest.raises(ValueError, match=r"expected at least 7 places to cut for pp×virtual = 8 stages"):
        _program(fake_mesh(pp=4), zoo.reference_transformer(layers=1), microbatches=4, schedule="interleaved",
                 virtual=2)


def test_split_point_that_names_no_module(fake_mesh):
    with pytest.raises(ValueError, match=r"Plan.split_points: expected 'layers.9' to name a module"):
        _program(fake_mesh(pp=2), zoo.reference_transformer(), split_points=["layers.9"])


def test_plan_errors_for_schedules():
    with pytest.raises(ValueError, match="interleaved schedule and virtual > 1 go together"):
        meshc.Plan(schedule="interleaved")
    with pytest.raises(ValueError, match="Plan.schedule: expected one of"):
        meshc.Plan(schedule="zbv")
    from meshc.compiler.ir.named_schedule import schedule
    with pytest.raises(ValueError, match="multiple of pp"):
        schedule("interleaved", 2, 3, 2)


def test_microbatches_must_divide_the_batch(fake_mesh):
    mesh = fake_mesh(pp=2)
    with pytest.raises(ValueError, match="not divisible by microbatches=3"):
        meshc.compile(zoo.reference_transformer(), mesh, example_inputs=(zoo.batches(1, 4)[0][0],),
                      plan=meshc.Plan(trace="non-strict", microbatches=3))


def test_stage_graphs_keep_higher_order_op_bodies(fake_mesh):
    # a strict export holds a Function's forward as wrap_with_set_grad_enabled(False, %submod_N, ...): a stage
    # must carry the body its op calls (it raised KeyError: submod_5 on BLOOM); check_trace is off because the
    # strict trace drops these Functions' backward (meshc refuses it by default)
    traced, _ = trace(zoo.custom_fn(), (zoo.batches(1, 2)[0][0],), mesh=fake_mesh(pp=2),
                      plan=meshc.Plan(verify=True, trace="strict", check_trace=False))
    stages = stage_graphs(run_passes(traced), 2)
    for stage in stages:
        bodies = [n for n in stage.gm.graph.nodes if n.op == "get_attr"]
        assert bodies and all(hasattr(stage.gm, n.target) for n in bodies)
        stage.gm.graph.lint()
