"""passes/zero.py in one process: what each parameter's placeholder receives under ZeRO-3."""
from __future__ import annotations

import math

import torch

import meshc
from meshc.compiler.driver import run_passes
from meshc.compiler.trace.export import trace
from tests import zoo


class _WithUnused(torch.nn.Module):
    """A model holding parameters its forward never reads: a cross-attention projection (a decoder used as a causal
    LM without an encoder); beside them, the head's bias registered under a second name (`self.bias = self.head.bias`,
    as transformers' BERT-style heads tie theirs: one placeholder, read)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(zoo.VOCAB, dim)
        self.cross = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, zoo.VOCAB)
        self.bias = self.head.bias

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def test_a_parameter_the_graph_never_reads_is_a_flat_shard_under_zero3(fake_mesh):
    # its placeholder kept the whole shape while the runtime hands every parameter its flat shard: verify refused
    # the program ("cross.weight: placeholder shape (32, 32) != local shape (512,)": BART's decoder at dp=2 ZeRO-3)
    mesh = fake_mesh(dp=2)
    traced, _ = trace(_WithUnused(), (zoo.batches(1, 2)[0][0],), mesh=mesh,
                      plan=meshc.Plan(verify=True, trace="non-strict", zero=3))
    program = run_passes(traced)
    nodes = program.param_nodes()
    assert not nodes["cross.weight"].users
    for fqn, spec in program.params.items():
        assert tuple(nodes[fqn].meta["val"].shape) == spec.local_shape(mesh.spec.sizes) == \
            (-(-math.prod(spec.shape) // 2),), fqn
