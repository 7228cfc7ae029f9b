"""shapes: every dim of every value as a sympy expression, and the divisibility proofs sharding needs.

Purpose: give the sharding passes exact global sizes ("meshc.shape") to reason with, and one place that
proves a dim splits evenly over a mesh axis, with an error that says what to change when it does not.

Requires: node.meta["val"] from torch.export (FakeTensors; ints or SymInts as sizes).
Ensures: every tensor-valued node carries "meshc.shape", a tuple of sympy expressions (a tuple of such
    tuples for ops returning several tensors); nothing else changes.
Terms: global size = the size in the single-process program; local size under S(d) on an axis of size n
    is size/n (size/(c*n) per block with chunks c), defined only where provably divisible.

Before:  %linear = aten.linear(%x, %w)                      meta val: FakeTensor(2, 16, 96)
After:   %linear = aten.linear(%x, %w)                      meta meshc.shape: (2, 16, 96)
"""
from __future__ import annotations

import sympy
import torch

from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.placement import Shard, Whole
from meshc.compiler.ir.placement import local_shape as placement_local_shape
from meshc.compiler.ir.program import Program


def shapes_pass(program: Program) -> Program:
    program = program.copy()
    count = 0
    for node in program.gm.graph.nodes:
        shape = shape_of(node.meta.get("val"))
        if shape is not None:
            node.meta["meshc.shape"] = shape
            count += 1
    symbols = sorted({str(s) for n in program.gm.graph.nodes for s in _free(n.meta.get("meshc.shape"))})
    program.notes.append(f"{count} values shaped" + (f"; symbols {', '.join(symbols)}" if symbols else ""))
    return program


def shape_of(val):
    """A FakeTensor's sizes as sympy expressions; tuples of them for tuple values; None otherwise."""
    if isinstance(val, torch.Tensor):
        return tuple(_expr(s) for s in val.shape)
    if isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) or v is None for v in val):
        return tuple(shape_of(v) for v in val)
    return None


def _expr(size) -> sympy.Expr:
    if isinstance(size, int):
        return sympy.Integer(size)
    return sympy.sympify(size.node.expr)  # a SymInt from a dynamic dim


def _free(shape):
    if not shape:
        return set()
    if isinstance(shape[0], tuple) or shape[0] is None:
        return set().union(*(_free(s) for s in shape if s))
    return set().union(*(sympy.sympify(d).free_symbols for d in shape))


def divides(size: sympy.Expr, n: int) -> bool:
    """True when `size` is provably a multiple of n."""
    return sympy.simplify(sympy.Mod(size, n)) == 0


def shard_divides(size: sympy.Expr, placement: Shard, n: int) -> bool:
    """True when every block of `placement` along a dim of `size` splits evenly over n ranks."""
    if isinstance(placement.chunks, tuple):  # a Whole block is not split
        return sum(placement.chunks) == size and all(b % n == 0 for b in placement.chunks if not isinstance(b, Whole))
    return divides(size, n * placement.chunks)


def local_shape(shape: tuple, placement, n: int) -> tuple:
    """The local sizes of a value of global `shape` under `placement` on an axis of size n."""
    if not isinstance(placement, Shard):
        return tuple(shape)
    return tuple(sympy.simplify(s) for s in placement_local_shape(shape, placement, n))


def check_divisible(shape: tuple, placement, n: int, axis: str, what: str, why: str = "") -> None:
    """Raise ValueError unless `placement` splits `shape` evenly over the axis of size n."""
    if not isinstance(placement, Shard):
        return
    size = shape[placement.dim]
    if not shard_divides(size, placement, n):
        if isinstance(placement.chunks, tuple):
            per, unit = f" (blocks of {'+'.join(map(str, placement.chunks))})", "each block"
        else:
            per = f" ({placement.chunks} blocks of {size / placement.chunks})" if placement.chunks > 1 else ""
            unit = size / placement.chunks
        raise MeshcValueError(
            f"{axis} sharding: {what}: dim {placement.dim} of size {size}{per} is not divisible by "
            f"{axis}={n}{why}. Choose {axis} dividing {unit}, or keep the parameter "
            f"replicated on {axis} (Plan(tp={{'<module glob>': 'replicate'}}))."
        )
