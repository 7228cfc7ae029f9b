"""ATen ops that are another op's alias, traced under their own names, rewritten to the op the passes know.

`torch.concatenate(xs, dim)` and `torch.concat` trace as aten::concatenate and aten::concat, the same op as
aten::cat with the same schema (tensors, dim): the sharding rules and the loop finder know `cat` alone, so a
model that wrote the alias (xLSTM's blocks) kept its layers whole ("no tensor-parallel rule or DTensor strategy
for aten::concatenate").
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_ALIASES = {aten.concatenate.default: aten.cat.default, aten.concat.default: aten.cat.default}


def canonical_aliases(gm: fx.GraphModule) -> int:
    """Rewrite every alias node of `gm` to its canonical op in place; returns how many were."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _ALIASES:
            node.target = _ALIASES[node.target]
            count += 1
    if count:
        gm.recompile()
    return count
