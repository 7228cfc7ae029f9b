"""Which block of the model a node belongs to, from the nn_module_stack torch.export keeps.

A block is the innermost module path ending in a list index ("layers.3", "transformer.h.11"); nodes
outside any block belong to their outermost named module ("tok_embeddings", "lm_head").
"""
from __future__ import annotations

import re

import torch.fx as fx

_INDEXED = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    for path, _ in reversed(stack):
        match = _INDEXED.match(path)
        if match:
            return match.group(1)
    named = [path for path, _ in stack if path]
    return named[0].split(".")[0] if named else ""


def stages_using(node: fx.Node) -> frozenset[int]:
    """The pipeline stages whose activations use `node`, directly or through parameter-only values."""
    out: set[int] = set()
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if "meshc.stage" in u.meta:
                out.add(u.meta["meshc.stage"])
            elif u.op in ("call_function", "call_module"):
                stack.append(u)
    return frozenset(out)
