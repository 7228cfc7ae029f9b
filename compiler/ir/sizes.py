"""Sizes as the placement rules read them: ints, and a RunTimeSize for a dim torch.export left symbolic (rows picked by
nonzero or split by counts read with `.tolist()`: tokens routed to an expert). A rule that reads only the other dims
decides as usual; one that uses such a size raises RunTimeSizes, and the op is decided with its inputs whole.

    static_sizes(node) -> (RunTimeSize(u0), 32)
"""
from __future__ import annotations

import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat


class RunTimeSizes(Exception):
    """A rule read a size torch.export left symbolic (rows routed to an expert: known only at run time); the table
    then decides the op with its inputs whole (tp_table.infer)."""


class RunTimeSize:
    """A dim whose size is known only at run time, in the shapes rules read: any use of its value (arithmetic,
    comparison, int()) raises RunTimeSizes, so a rule that reads only the other dims (the hidden dim of routed rows)
    decides as usual, and one that needs this size gives up rather than guess."""

    def __init__(self, symbol) -> None:
        self.symbol = symbol

    def _unknown(self, *args):
        raise RunTimeSizes(str(self.symbol))

    __int__ = __index__ = __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _unknown
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _unknown
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _unknown
    __hash__ = None

    def __repr__(self) -> str:
        return f"RunTimeSize({self.symbol})"


def static_sizes(node: fx.Node) -> tuple:
    """`node`'s shape: ints, and a RunTimeSize for each dim that is a symbol."""
    return sizes_of(node.meta["meshc.shape"])


def sizes_of(shape) -> tuple:
    """A "meshc.shape" entry as ints, and a RunTimeSize for each dim that is a symbol."""
    out = []
    for s in shape:
        try:
            out.append(int(s))
        except TypeError:  # sympy's int() of a free symbol
            out.append(RunTimeSize(s))
    return tuple(out)


def bounded_sizes(node: fx.Node) -> list[int]:
    """`node`'s shape as ints for costs and byte counts: a dim known only at run time at the largest size its trace
    allows (rows picked by nonzero: all the rows it picks from), 1 where unbounded."""
    return [compat.size_bound(s, node.meta.get("val")) or 1 for s in node.meta["meshc.shape"]]
