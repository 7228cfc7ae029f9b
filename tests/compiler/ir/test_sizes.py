"""Sizes known only at run time, as the rules and the byte counts read them (compiler/ir/sizes.py, compat.size_bound)."""
from __future__ import annotations

from torch.fx.experimental.symbolic_shapes import ShapeEnv

from meshc.compiler.ir import torch_compat as compat


def test_an_unbounded_size_has_no_bound():
    """A count read with `.tolist()` (rows per expert) has no upper bound in its trace: torch bounds it by its own
    integer infinity, which calls itself finite and has no int(); the bound is None, and byte counts take 1 (JetMoE's
    default config once failed inside tp_placement here)."""
    env = ShapeEnv()
    rows = env.create_unbacked_symint()
    assert compat.size_bound(rows) is None and compat.size_bound(rows * 4) is None
    assert compat.number_bound(rows * 4) == 0
    env.constrain_symbol_range(rows.node.expr, compiler_min=0, compiler_max=64)
    assert compat.size_bound(rows * 4) == 256
