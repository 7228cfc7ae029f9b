"""The vocabulary of placement rules on one mesh axis: a rule's Decision, the RuleCtx it reads, and `handles`, which
marks a rule with the ops it decides (passes/tp_rules.py describes the rules; tp_table builds their one table)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from meshc.compiler.ir.placement import Placement, R, Shard


@dataclass
class Decision:
    inputs: dict[tuple, Placement]  # arg path -> the placement that input must have
    out: Any  # a Placement, a tuple of them, or None for ops without a tensor output
    rewrite: Callable[[fx.Node], None] | None = None  # the node made local, applied after redistribution
    note: str | None = None  # why a shard was given up (explain shows it)
    indivisible: tuple[str, int] | None = None  # (what, size) when a shard could follow only on a smaller axis


@dataclass
class RuleCtx:
    n: int  # axis size
    placements: dict[fx.Node, Any]
    sp_dim: Callable[[fx.Node], Shard | None] = lambda node: None  # sequence-parallel target, if on
    fallbacks: list[str] = field(default_factory=list)
    axis: str = "tp"  # the mesh axis, for the CommRecords a rewrite adds
    index: int = 0  # this rank's coordinate on the axis (the rows or vocabulary a rewrite keeps)
    group: str | None = None  # the axis' process group name, for collectives a rewrite calls

    def pl(self, x: Any) -> Any:
        return self.placements.get(x, R) if isinstance(x, fx.Node) else R


def handles(*targets):
    """Mark a rule with the ops it decides (tp_table reads them; nothing is registered)."""
    def wrap(fn):
        fn.targets = targets
        return fn
    return wrap
