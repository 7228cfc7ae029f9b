"""Coverage: how much of the blocks' weight bytes a plan holds sharded on each mesh axis, and why the rest is not.

A block weight is a parameter of two or more dims (of sizes other than 1) inside a block, the innermost module path
ending in a list index ("model.layers.3.self_attn.q_proj.weight"); norms' scales, biases and other per-channel
vectors (RWKV's (1, 1, C) mixing coefficients) are left out (Megatron replicates them too). A model with no indexed
module counts every such parameter. Parity alone does not show coverage: a run that shards nothing matches the
single process too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from meshc.compiler.ir.placement import FlatShard, Owned, Shard, Whole, block_sizes

_INDEXED = re.compile(r"(^|\.)\d+(\.|$)")


@dataclass
class Coverage:
    """Per mesh axis (size > 1), the fraction of the block weights' bytes sharded on it; `replicated` lists the
    block modules whose weights stay whole on tp, with the plan's reason."""

    fractions: dict[str, float]
    total_bytes: int
    replicated: list[tuple[str, str]] = field(default_factory=list)  # (module, reason)

    def lines(self) -> list[str]:
        if not self.fractions:
            return []
        mib = self.total_bytes / 2**20
        out = [f"block weights {mib:.2f} MiB; sharded: " +
               (", ".join(f"{axis} {frac:.2f}" for axis, frac in self.fractions.items()) or "(no axis > 1)")]
        out += [f"replicated on tp: {module}: {reason}" for module, reason in self.replicated]
        return out


def is_weight_shape(shape) -> bool:
    """Two or more dims of sizes other than 1: a matrix (or a stack of them), not a per-channel vector however it
    is shaped ((1, 1, C))."""
    return sum(int(d) != 1 for d in shape) >= 2


def block_weights(params: dict) -> list:
    """The ParamSpecs that coverage counts (see the module docstring)."""
    weights = [s for s in params.values() if is_weight_shape(s.shape) and s.kind == "param"]
    inside = [s for s in weights if _INDEXED.search(s.fqn)]
    return inside or weights


def coverage(params: dict, sizes: dict[str, int], reasons: dict[str, str] | None = None) -> Coverage:
    """Coverage of `params` (FQN -> ParamSpec) over a mesh of `sizes`; `reasons` maps a module to why the plan
    replicated it on tp (the tp_placement pass's Program.tp_why)."""
    weights = block_weights(params)
    total = sum(_bytes(s) for s in weights)
    fractions = {}
    for axis, n in sizes.items():
        if n > 1:
            held = sum(_sharded_bytes(s, s.placements.get(axis)) for s in weights)
            fractions[axis] = held / total if total else 1.0
    replicated: dict[str, str] = {}
    if sizes.get("tp", 1) > 1:
        for s in weights:
            if not isinstance(s.placements.get("tp"), (Shard, Owned)):
                module = s.fqn.rsplit(".", 1)[0]
                replicated.setdefault(module, (reasons or {}).get(module, "no rule of the plan tried it"))
    return Coverage(fractions, total, sorted(replicated.items()))


def _sharded_bytes(spec, placement) -> int:
    """The bytes of `spec` held in parts under `placement`: all of them when sharded, but the blocks every
    rank holds whole (Whole chunks: multi-query k and v beside q's shard)."""
    if isinstance(placement, (FlatShard, Owned)):  # a flat shard; whole heads each on its own rank
        return _bytes(spec)
    if not isinstance(placement, Shard):
        return 0
    size = int(spec.shape[placement.dim])
    whole = sum(int(b) for b in block_sizes(placement.chunks, size) if isinstance(b, Whole))
    return _bytes(spec) * (size - whole) // size


def _bytes(spec) -> int:
    n = spec.dtype.itemsize
    for d in spec.shape:
        n *= int(d)
    return n
