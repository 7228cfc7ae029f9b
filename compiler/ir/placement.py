"""Placements of a tensor on one mesh axis: R (replicate), S(d) (shard tensor dim d), P (partial sum).

They live only in `node.meta["meshc.placement"]` (a dict axis -> placement) and in ParamSpec; never as
attributes on nodes (DESIGN.md §4).
"""
from __future__ import annotations

from dataclasses import dataclass

from meshc.compiler.ir import torch_compat as compat


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Tensor dim `dim` split evenly over the axis. With chunks=c the dim is c equal blocks, each split
    evenly, and a rank holds its part of every block (a fused qkv projection's output is 3 blocks). Blocks of
    unequal sizes (q|k|v under grouped-query attention) are given as their global sizes, chunks=(64, 32, 32):
    the local tensor is then this rank's 1/n of each block, in block order. A block given as Whole(size) is
    held whole by every rank (Megatron's rule for kv heads fewer than the axis: k and v replicated, q sharded,
    inside one fused projection): chunks=(64, Whole(16), Whole(16)) holds 64/n + 16 + 16 rows per rank."""

    dim: int
    chunks: int | tuple[int, ...] = 1

    def __str__(self) -> str:
        if isinstance(self.chunks, tuple):
            return f"S({self.dim})x({'+'.join(map(str, self.chunks))})"
        return f"S({self.dim})" if self.chunks == 1 else f"S({self.dim})x{self.chunks}"


@dataclass(frozen=True)
class FlatShard:
    """ZeRO's flat shard: the tensor (as other axes leave it) flattened, zero-padded to a multiple of the
    axis size, and split evenly: a rank holds ceil(numel / n) contiguous elements. Sizes that do not
    divide are padded, never refused (as FSDP does)."""

    def __str__(self) -> str:
        return "F"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Owned:
    """The whole tensor on the rank at coordinate `coord` of the axis; the others hold none of it (an empty tensor,
    0 rows). A ModuleList of per-head modules dealt out over tp: each rank holds and runs its own heads whole
    (passes/sharding/branches.py); its program is then its own, not every rank's."""

    coord: int

    def __str__(self) -> str:
        return f"O({self.coord})"


Placement = Replicate | Shard | Partial | FlatShard | Owned
R = Replicate()
P = Partial()


def S(dim: int, chunks: int | tuple[int, ...] = 1) -> Shard:
    return Shard(dim, chunks)


class Whole(int):
    """A block of a shard's `chunks` that every rank of the axis holds whole (see Shard). An int (its global
    size, so sums of chunks stay the dim's length) that compares unequal to a plain int of the same size, so
    that S(0)x(64+16+16) and S(0)x(64+R16+R16) are different placements; `Shard(d, p.chunks)` carries it
    along through the rules that move a shard between dims. Local sizes: local_blocks."""

    def __eq__(self, other) -> bool:
        return isinstance(other, Whole) and int(self) == int(other)

    def __ne__(self, other) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("whole", int(self)))

    def __str__(self) -> str:
        return f"R{int(self)}"

    def __repr__(self) -> str:  # what generated FX code writes for it (a redistribution's chunks): a valid call
        return f"Whole({int(self)})"


# a redistribution of a shard with Whole blocks carries them in its node's arguments: generated code writes Whole(16)
compat.fx_code_name("Whole", "from meshc.compiler.ir.placement import Whole", Whole)


def has_whole(chunks) -> bool:
    """Does a shard's `chunks` hold any block whole?"""
    return isinstance(chunks, tuple) and any(isinstance(b, Whole) for b in chunks)


def local_blocks(chunks: int | tuple[int, ...], length: int, n: int) -> tuple[int, ...]:
    """A rank's part of each block of a dim of `length` sharded with `chunks` over n ranks: 1/n of each,
    the whole of a Whole block."""
    return tuple(int(b) if isinstance(b, Whole) else b // n for b in block_sizes(chunks, length))


def local_length(placement, length, n: int):
    """The local length of the dim `placement` shards (`length` may be a sympy expression without Whole blocks)."""
    if has_whole(placement.chunks):
        return sum(local_blocks(placement.chunks, length, n))
    return length // n if isinstance(length, int) else length / n


def local_shape(shape, placement, n: int) -> tuple:
    """The local sizes of a value of global `shape` under `placement` on an axis of n ranks (ints or sympy)."""
    if not isinstance(placement, Shard):
        return tuple(shape)
    return tuple(local_length(placement, s, n) if d == placement.dim else s for d, s in enumerate(shape))


def block_sizes(chunks: int | tuple[int, ...], length: int) -> tuple[int, ...]:
    """The sizes of the blocks a shard's `chunks` cuts a dim of `length` into (whole-tensor sizes)."""
    if isinstance(chunks, tuple):
        return chunks
    return (length // chunks,) * chunks


def as_chunks(sizes) -> int | tuple[int, ...]:
    """The `chunks` of a shard with blocks of these (whole-tensor) sizes: a count when they are equal."""
    sizes = tuple(s if isinstance(s, Whole) else int(s) for s in sizes)
    return len(sizes) if len(set(sizes)) <= 1 and not has_whole(sizes) else sizes


def blocks_placement(dim: int, blocks):
    """The placement of a part made of these blocks of a shard on `dim`: R when every rank holds them all
    whole (Whole blocks only: multi-query k or v), else the shard of those blocks."""
    return Replicate() if all(isinstance(b, Whole) for b in blocks) else Shard(dim, as_chunks(blocks))


def data_axis(placements: dict) -> str:
    """The axis a tensor's data-parallel replicas (or ZeRO shards) lie on: dp, edp for an expert's (sharded over ep,
    the other part of dp; compiler/ir/mesh_spec.py), or dps for a ZeRO shard under hybrid sharding (its copies on
    dpr)."""
    if isinstance(placements.get("ep"), Shard):
        return "edp"
    return "dps" if isinstance(placements.get("dps"), FlatShard) else "dp"


def owned_elsewhere(p, coord: int) -> bool:
    """Is `p` another rank's whole (Owned by a coordinate of the axis other than `coord`): none of it held here?"""
    return isinstance(p, Owned) and p.coord != coord


def split_over(p) -> bool:
    """Does `p` split the tensor's elements between the axis' ranks (each holds part: S(d), a flat shard, an owner's
    whole)? What a gradient norm sums and a checkpoint writes once per rank, not once per axis."""
    return isinstance(p, (Shard, FlatShard, Owned))


def in_parts(p) -> bool:
    """Does no rank hold the whole value: S(d) (pieces) or P (summands)? `p` is a placement, None (no tensor),
    or a tuple with one per output of a multi-output op (then: any of them)."""
    return any(isinstance(x, (Shard, Partial)) for x in (p if isinstance(p, tuple) else (p,)))


def format_placements(placements: dict[str, Placement]) -> str:
    """`{"dp": R, "tp": S(0)}` -> "dp:R tp:S(0)"."""
    return " ".join(f"{axis}:{p}" for axis, p in placements.items())
