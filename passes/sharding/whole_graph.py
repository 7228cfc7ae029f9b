"""The tensor-parallel plan chosen over the whole graph, not layer group by layer group in graph order.

tp_placement finds, for each group of column-parallel candidates (linear layers reading one activation), the
row-parallel layers that can consume their output without communication in between: an Option. Taken greedily in
graph order (Megatron's rule, the plan before this module), an early group claims its row layers first, and a
later pairing that would shard more bytes with less traffic is lost: in a chain A -> B -> C of widths h -> 4h ->
16h -> h, greedy pairs (A col, B row) and all-reduces B's 16h-wide output; (B col, C row) shards more weight bytes
and all-reduces an h-wide one. Here every option is scored and a conflict-free set (no weight in two options) is
chosen: most bytes sharded first (tp is there to save memory), then least predicted communication time (the
cost model's α-β time of the forward all-reduces of the row outputs and the backward all-reduces of the column
inputs' gradients), over each connected component of the conflict graph; components that are the same up to
the block index (identical blocks) are solved once. The greedy plan is one candidate assignment: the caller keeps
it unless the whole-graph choice scores strictly better.

    choose(options) -> indices of the options taken
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

_EXHAUSTIVE = 16  # options in one component searched exhaustively; larger components: best-first


@dataclass(frozen=True)
class Option:
    """Shard `keys` (the column members and their row layers) together: `sharded` weight bytes split over tp,
    at `comm_time` seconds (`comm_bytes` bytes) of collectives a step; `shape` is the same for the same option of
    identical blocks (names without the block index, and sizes)."""

    keys: frozenset[str]
    sharded: int
    comm_time: float
    comm_bytes: int
    shape: Hashable = None


def score(options: list[Option]) -> tuple[int, float]:
    """(bytes sharded, minus communication time): larger is better."""
    return sum(o.sharded for o in options), -sum(o.comm_time for o in options)


def choose(options: list[Option]) -> list[int]:
    """Indices of a conflict-free set of `options` with the best score, component by component."""
    chosen: list[int] = []
    solved: dict[tuple, list[int]] = {}  # a component's shape -> positions taken within it
    for component in _components(options):
        shape = tuple(options[i].shape for i in component)
        if None in shape or shape not in solved:
            solved[shape] = _best([options[i] for i in component])
        chosen += [component[j] for j in solved[shape]]
    return sorted(chosen)


def _components(options: list[Option]) -> list[list[int]]:
    """Indices of options grouped by shared keys (transitively), each group in order."""
    parent = list(range(len(options)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    owner: dict[str, int] = {}
    for i, option in enumerate(options):
        for key in option.keys:
            if key in owner:
                parent[find(i)] = find(owner[key])
            else:
                owner[key] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(options)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def _best(options: list[Option]) -> list[int]:
    """Positions of the best conflict-free subset: exhaustive (branch over take / leave) up to _EXHAUSTIVE
    options, else best-first by bytes sharded then communication."""
    if len(options) > _EXHAUSTIVE:
        order = sorted(range(len(options)), key=lambda i: (-options[i].sharded, options[i].comm_time))
        taken: list[int] = []
        used: set[str] = set()
        for i in order:
            if not options[i].keys & used:
                taken.append(i)
                used |= options[i].keys
        return sorted(taken)
    best: tuple[tuple[int, float], list[int]] = ((-1, 0.0), [])

    def search(i: int, taken: list[int], used: frozenset[str]) -> None:
        nonlocal best
        if i == len(options):
            value = score([options[j] for j in taken])
            if value > best[0]:
                best = (value, list(taken))
            return
        if not options[i].keys & used:
            search(i + 1, taken + [i], used | options[i].keys)
        search(i + 1, taken, used)
    search(0, [], frozenset())
    return best[1]
