"""x[..., [c], :] traced as the slice it is (compiler/trace/constant_indices.py): the same values, a clone where an op
writes into the result (index copies, slice is a view)."""
from __future__ import annotations

import torch

from meshc.compiler.trace.constant_indices import slices_for_constant_indices

aten = torch.ops.aten


class _Pick(torch.nn.Module):
    def __init__(self, write: bool):
        super().__init__()
        self.write = write

    def forward(self, x):
        y = x * 1.0
        k = y[..., [-2], :]
        if self.write:
            k.mul_(2)
        return y.sum() + k.sum()


def _rewritten(write: bool):
    """Export (constants lifted to placeholders, as meshc's trace sees them), run, rewrite, run again."""
    x = torch.randn(2, 3, 4, 5)
    ep = torch.export.export(_Pick(write), (x,), strict=False)
    gm = ep.graph_module
    tensors, args = {}, []
    for spec, node in zip(ep.graph_signature.input_specs, gm.graph.find_nodes(op="placeholder")):
        if spec.target is None:  # the user input
            args.append(x)
            continue
        node.meta["meshc.fqn"] = spec.target
        tensors[spec.target] = ep.constants[spec.target]
        args.append(tensors[spec.target])
    want = gm(*args)
    count = slices_for_constant_indices(gm, tensors)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return count, targets, want, gm(*args)


def test_index_by_a_constant_run_becomes_a_slice():
    count, targets, want, got = _rewritten(write=False)
    assert count == 1 and aten.index.Tensor not in targets and aten.slice.Tensor in targets
    assert aten.clone.default not in targets
    torch.testing.assert_close(got, want)


def test_a_written_result_keeps_its_copy():
    count, targets, want, got = _rewritten(write=True)
    assert count == 1 and aten.clone.default in targets
    torch.testing.assert_close(got, want)
