"""The tensor-parallel rule table: which rule decides each op's placements on one mesh axis.

    RULES[aten.linear.default] is tp_rules.matmul_rule
    infer(node, ctx) -> Decision

Built once, here, from the rules tp_rules (COMPUTE_RULES), tp_views (VIEW_RULES) and tp_vocab (VOCAB_RULES)
list, each marked with the ops it handles; an op claimed by two rules is an internal error. An op not in the
table falls back to tp_rules.grouped_mm_rule for grouped matmuls (by name), to tp_rules.pointwise_rule when
torch tags it pointwise, and otherwise to DTensor's registered strategy for the op (compiler/ir/op_strategies.py,
consulted at compile time), or, where it has none meshc can run, to tp_rules.no_rule (every tensor input
replicated, with a note naming the op); a user
Function's op marked elementwise by the trace goes to tp_rules.elementwise_function_rule. The tp_placement pass (its
trials) and the tensor_parallel pass read the same table; importing a module registers nothing.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from meshc.compiler.ir.errors import MeshcInternalError

from meshc.compiler.ir.fx_ops import GROUPED_MM, op_name, tensor_args
from meshc.compiler.ir.op_strategies import decide
from meshc.compiler.ir.placement import Replicate
from meshc.compiler.ir.program import ELEMENTWISE
from meshc.compiler.ir.sizes import RunTimeSizes

from meshc.passes.tp_rules import COMPUTE_RULES, Decision, RuleCtx, elementwise_function_rule, grouped_mm_rule, no_rule, pointwise_rule
from meshc.passes.tp_views import VIEW_RULES
from meshc.passes.tp_vocab import VOCAB_RULES

Rule = Callable[[fx.Node, RuleCtx], Decision]


def build_table(rules: tuple[Rule, ...]) -> Mapping[Any, Rule]:
    """op -> rule from rules marked by tp_rules.handles; an op claimed twice raises MeshcInternalError."""
    table: dict[Any, Rule] = {}
    for rule in rules:
        for target in rule.targets:
            if target in table:
                raise MeshcInternalError(f"tp rules: {target} is handled by both {table[target].__name__} and "
                                         f"{rule.__name__}; expected one rule per op")
            table[target] = rule
    return MappingProxyType(table)


RULES = build_table(COMPUTE_RULES + VIEW_RULES + VOCAB_RULES)


def rule_for(target: Any) -> Rule:
    """The rule deciding `target`: its entry in RULES, grouped_mm_rule for a grouped matmul (ops found by name:
    transformers registers its own), else pointwise_rule for pointwise ops, else strategy_rule."""
    rule = RULES.get(target)
    if rule is None and hasattr(target, "_schema") and op_name(target).split(".")[0] in GROUPED_MM:
        return grouped_mm_rule
    if rule is None and hasattr(target, "tags") and torch.Tag.pointwise in target.tags:
        return pointwise_rule
    return rule or strategy_rule


def strategy_rule(node: fx.Node, ctx: RuleCtx) -> Decision:
    """An op without a meshc rule: DTensor's registered strategy for it under its inputs' placements, where
    meshc can run it (compiler/ir/op_strategies.py); else no_rule, whose note then names the op as having none."""
    pls = {path: ctx.pl(t) for path, t in tensor_args(node)}
    if all(isinstance(p, Replicate) for p in pls.values()):
        return no_rule(node, ctx)
    found = decide(node, pls, ctx.n)
    if found is None:
        dec = no_rule(node, ctx)
        if dec.note:
            dec.note = dec.note.replace("no tensor-parallel rule", "no tensor-parallel rule or DTensor strategy")
        return dec
    required, out = found
    gathered = [path for path, p in required.items() if isinstance(p, Replicate)]
    note = f"DTensor's strategy for {op_name(node.target)} needs inputs whole" if gathered else None
    return Decision(required, out, note=note)


def infer(node: fx.Node, ctx: RuleCtx) -> Decision:
    """The decision of `node`'s rule under the input placements in `ctx` (a user Function the trace found
    elementwise, compiler/trace/elementwise_functions.py, is decided by elementwise_function_rule)."""
    if node.meta.get(ELEMENTWISE):
        return elementwise_function_rule(node, ctx)
    try:
        return rule_for(node.target)(node, ctx)
    except RunTimeSizes:  # its rule needs a size known only at run time: the op runs on whole inputs
        dec = no_rule(node, ctx)
        if dec.note:
            dec.note = dec.note.replace("no tensor-parallel rule for", "sizes known only at run time in")
        return dec
