"""passes/layout.py: after a pass changes layouts, a view the trace recorded at a layout that no longer holds becomes a
reshape (the plain-PyTorch Llama's `transpose(1, 2).contiguous().view(...)` once failed every tp plan), and a view
written through in place is an error naming the model's line. Parity of that model on real ranks:
tests/models/test_plain_parity.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import meshc
from meshc.compiler.compile import compile_rank
from meshc.compiler.ir.errors import MeshcValueError
from meshc.runtime.mesh import simulated_mesh
from tests import zoo


# q's projection replicated, k, v and the output projection sharded: q is sliced to this rank's heads (a contiguous
# copy), so attention's output is laid out (batch, heads, seq, dim) and its transpose is no longer viewable, where
# at trace time it was (the whole q came through rotary's transposes). The same happens wherever the layout a
# producer gives its output depends on its inputs' (any op whose output strides follow its input's).
PLAN = {"tp": {"*.wq": "replicate"}}


def _compile(model: torch.nn.Module, check_trace: bool | None = None, **sizes):
    mesh = simulated_mesh(**sizes)
    try:
        x, _ = zoo.batches(1, 4)[0]
        plan = meshc.Plan(trace="non-strict", check_trace=check_trace, **PLAN)
        return compile_rank(model, (x,), {}, mesh=mesh, plan=plan)[0].program
    finally:
        dist.destroy_process_group()


def test_a_view_valid_only_at_the_traced_layout_becomes_a_reshape():
    program = _compile(zoo.build("llama3_plain"), tp=2)
    notes = [n for n in program.notes if "view(s) made reshapes" in n]
    assert notes, program.notes
    reshaped = [n for n in program.gm.graph.nodes if "cannot view" in n.meta.get("meshc.why", "")]
    assert len(reshaped) == 2  # the attention output of each layer, whose heads tp split
    for node in reshaped:
        assert node.target is torch.ops.aten.reshape.default
        assert "contiguous().view" in node.meta["stack_trace"]
    # and the heads really are split: k, v column-parallel, wo row-parallel (q whole, as PLAN asks)
    local = {spec.fqn: spec.local_shape(program.mesh.sizes) for spec in program.params.values()}
    assert local["layers.0.attention.wk.weight"] == (8, 32) and local["layers.0.attention.wo.weight"] == (32, 16)


def test_a_write_through_such_a_view_is_an_error_naming_the_line():
    model = zoo.build("llama3_plain")
    model.layers["0"].attention.scale_in_place = 0.5
    with pytest.raises(MeshcValueError, match="layout: expected a view") as error:
        # (no eager check of the trace: the write also modifies what attention saved for backward, which eager
        # autograd refuses at the first backward; the layout error comes first, at compile time)
        _compile(model, check_trace=False, tp=2)
    message = str(error.value)
    assert "plain_models.py" in message and "mul_" in message and ".reshape()" in message
