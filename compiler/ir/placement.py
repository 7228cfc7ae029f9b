"""Placements of a tensor on one mesh axis: R (replicate), S(d) (shard tensor dim d), P (partial sum).

They live only in `node.meta["meshc.placement"]` (a dict axis -> placement) and in ParamSpec; never as
attributes on nodes (DESIGN.md §4).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Tensor dim `dim` split evenly over the axis. With chunks=c the dim is c equal blocks, each split
    evenly, and a rank holds its part of every block (a fused qkv projection's output is 3 blocks)."""

    dim: int
    chunks: int = 1

    def __str__(self) -> str:
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


Placement = Replicate | Shard | Partial | FlatShard
R = Replicate()
P = Partial()


def S(dim: int, chunks: int = 1) -> Shard:
    return Shard(dim, chunks)


def in_parts(p) -> bool:
    """Does no rank hold the whole value: S(d) (pieces) or P (summands)? `p` is a placement, None (no tensor),
    or a tuple with one per output of a multi-output op (then: any of them)."""
    return any(isinstance(x, (Shard, Partial)) for x in (p if isinstance(p, tuple) else (p,)))


def format_placements(placements: dict[str, Placement]) -> str:
    """`{"dp": R, "tp": S(0)}` -> "dp:R tp:S(0)"."""
    return " ".join(f"{axis}:{p}" for axis, p in placements.items())
