"""masks: an attention mask computed from constants only that is exactly causal becomes SDPA's is_causal flag.

Purpose: transformers builds a (B, 1, S, S) mask from aranges inside the traced graph even when it means only
"causal" (eager transformers passes is_causal instead; a trace cannot). SDPA with that mask takes torch's
unfused path and keeps an S×S float copy per layer for backward; with is_causal it runs the fused kernel and keeps
nothing quadratic. Under context parallelism a whole mask per rank would also be the one thing that does not
shrink with cp. The mask is evaluated once, here, at compile time (constant_mask.py: only when no placeholder
feeds it and up to 256 Mi elements) and compared exactly: equal to the causal mask -> is_causal=True; allowing
everything -> no mask; anything else (a sliding window, padding) is left as it is.

Requires: nothing beyond a traced program ("val" on nodes).
Ensures: every scaled_dot_product_attention whose mask is constant-causal (or constant-all) has none; the mask's
    nodes are erased once nothing else reads them. The attention computes the same values (same op, same scale).

Before:  %le = aten.le.Tensor(%index_1, %index) ... %expand_2 = aten.expand(%and_2, [2, -1, 16, 16])
         %sdpa = aten.scaled_dot_product_attention(%q, %k, %v, %expand_2)
After:   %sdpa = aten.scaled_dot_product_attention(%q, %k, %v, None, 0.0, True)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from meshc.compiler.ir.program import Program

from meshc.passes.attention.constant_mask import constant_nodes, mask_form

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
ASSERT = aten._assert_tensor_metadata.default


def masks_pass(program: Program) -> Program:
    program = program.copy()
    graph = program.gm.graph
    forms: dict[fx.Node, tuple[str, int]] = {}  # one mask usually serves every layer: evaluated once
    folded = 0
    for node in list(graph.nodes):
        if node.target is not SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        if not isinstance(mask, fx.Node) or causal:
            continue
        if mask not in forms:
            forms[mask] = mask_form(mask)
        form = forms[mask][0]
        if form not in ("causal", "all"):
            continue
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        node.args = (*node.args[:3], None, dropout, form == "causal")
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")}
        node.meta["meshc.why"] = f"mask %{mask.name} is constant and {'causal' if form == 'causal' else 'all-true'}"
        _erase_unused(graph, mask)
        folded += 1
    if folded:
        graph.lint()
        program.gm.recompile()
    program.notes.append(f"{folded} attention mask(s) computed from constants found "
                         f"{'causal (or all-true) and made a flag' if folded else 'causal: none'}")
    return program


def _erase_unused(graph: fx.Graph, mask: fx.Node) -> None:
    for dead in reversed(constant_nodes(mask) or []):
        if not [u for u in dead.users if u.target is not ASSERT]:
            for check in list(dead.users):
                graph.erase_node(check)
            graph.erase_node(dead)
