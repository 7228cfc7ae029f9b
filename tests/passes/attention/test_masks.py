"""The masks pass: constant causal masks become SDPA's flag on any mesh; other masks stay."""
from __future__ import annotations

import torch

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.mesh_spec import MeshSpec
from tests import zoo

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _attention(model, seq: int = 32):
    x = torch.randint(0, zoo.VOCAB, (2, seq))
    program = compile_program(model, (x,), {}, mesh=MeshSpec({"dp": 1}), plan=meshc.Plan(trace="non-strict"),
                              rank=0)[1]
    return program, [n for n in program.gm.graph.nodes if n.target is SDPA]


def test_transformers_causal_mask_becomes_the_flag_and_its_nodes_go():
    program, attn = _attention(zoo.llama(layers=2))
    assert len(attn) == 2 and all(n.args[3] is None and n.args[5] is True for n in attn)
    assert not [n for n in program.gm.graph.nodes if n.target is torch.ops.aten.le.Tensor]  # the mask's nodes
    # the same values: the flagged program's logits equal the model's own (eager transformers uses is_causal too)
    model = zoo.llama(layers=2)
    x = torch.randint(0, zoo.VOCAB, (2, 32))
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    out = program.gm(*[params[n.meta["meshc.fqn"]] if n.meta.get("meshc.fqn") else x
                       for n in program.placeholders()])
    assert torch.allclose(out[0] if isinstance(out, (tuple, list)) else out, model(x).logits, atol=1e-5)


def test_a_sliding_window_mask_stays():
    _, attn = _attention(zoo.build("mistral"))
    assert len(attn) == 2 and all(n.args[3] is not None for n in attn)
