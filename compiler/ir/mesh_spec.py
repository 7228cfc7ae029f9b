"""MeshSpec: the topology of a device mesh, with no process group.

Named axes pp × dp × tp over `world_size` ranks, tp innermost (consecutive ranks share a tp group, as
Megatron-LM places tensor parallelism inside a node), then dp, then pp outermost. Here `dp` is the data-parallel
group of the gradients and the ZeRO shards: every rank that trains on a different slice of the data, dp × cp ranks
of a user's mesh (Megatron-Core's dp-cp group). A user writes the axes as Megatron-Core and torchtitan count them,
world = dp × cp × tp × pp (`meshc.mesh(dp=2, cp=2)`); `spec_sizes` turns those into a MeshSpec's sizes and
`MeshSpec.axes` gives them back, for everything a user reads (describe, explain, plans, checkpoints).
Expert parallelism folds into this dp (Megatron's convention): `ep` divides dp, and a rank's dp index d is split
as d = edp·ep + e, so the `ep` group of a rank is ep consecutive dp indices (experts are sharded over it, tokens
exchanged by all-to-all) and the `edp` group ("expert data parallel", dp/ep ranks) holds the same experts (their
gradients are reduced over it). Context parallelism is the same kind of part: d = b·cp + c, and the cp group (cp
consecutive dp indices) shares one batch and splits its sequences (the batch index b, the user's dp, has no group:
nothing is reduced over it alone); dp as a whole reduces the gradients and holds the ZeRO shards, so cp ranks
share both. Hybrid sharding (Plan.replicas = R, `hybrid`) splits dp a third way, d = r·S + s with S = dp/R: the
`dps` group (S consecutive dp indices, a node's) holds ZeRO's shards and reduce-scatters the gradients, the `dpr`
group (R ranks, one per replica group) all-reduces those shards. The sub-axes exist only when ep > 1 (or cp > 1,
or replicas > 1): a mesh without them has exactly the axes pp, dp, tp.
What the compiler needs
of a mesh is here: axis sizes, each rank's coordinates, the ranks of every group and the name each group
is registered under (what torch's functional collectives take). The runtime's Mesh (runtime/mesh.py)
builds one from the process groups it creates, with their registered names; the planner and
`meshc explain` build one from sizes alone, with readable labels ("dp:0,1") as names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from meshc.compiler.ir.errors import MeshcTypeError, MeshcValueError

AXES = ("pp", "dp", "tp")  # outermost first: the axes whose product is the world
SUB_AXES = ("ep", "edp", "cp", "dps", "dpr")  # dp split as edp × ep, as batches × cp (innermost), or as ZeRO's
# hybrid sharding dpr × dps (Plan.replicas; MeshSpec.hybrid); in `sizes` only when > 1


@dataclass(frozen=True)
class MeshSpec:
    """Axis sizes and group names of a mesh; `rank` arguments default to nothing: say whose coordinates."""

    sizes: Mapping[str, int]
    group_names: Mapping[tuple[str, tuple[int, ...]], str] = field(default_factory=dict, compare=False)
    device_type: str = "cpu"
    backend: str = "none"

    def __post_init__(self) -> None:
        unknown = set(self.sizes) - set(AXES) - set(SUB_AXES)
        if unknown:
            raise MeshcValueError(f"mesh: unknown axis {sorted(unknown)[0]!r}: expected axes among dp, ep, cp, tp, pp")
        sizes = {axis: int(self.sizes.get(axis, 1)) for axis in AXES + ("ep", "cp")}
        for axis, n in sizes.items():
            if n < 1:
                raise MeshcValueError(f"mesh: expected {axis} to be a positive int, got {n}")
        ep, cp = sizes.pop("ep"), sizes.pop("cp")
        if "edp" in self.sizes and int(self.sizes["edp"]) * ep != sizes["dp"]:
            raise MeshcValueError(f"mesh: expected edp = dp/ep = {sizes['dp'] // ep}, got edp={self.sizes['edp']}; "
                                  f"give dp and ep (edp follows)")
        if ep > 1:
            if sizes["dp"] % ep:
                raise MeshcValueError(f"mesh: expected ep to divide dp (expert parallelism shards the experts over a "
                                      f"sub-group of the data-parallel ranks), got dp={sizes['dp']}, ep={ep}; "
                                      f"choose dp a multiple of ep")
            sizes.update(ep=ep, edp=sizes["dp"] // ep)
        replicas = int(self.sizes.get("dpr", 1))
        if replicas > 1:
            if ep > 1:
                raise MeshcValueError(f"mesh: hybrid sharding (Plan.replicas={replicas}) with expert parallelism "
                                      f"(ep={ep}) is not supported yet; choose one of them")
            if sizes["dp"] % replicas:
                raise MeshcValueError(f"Plan.replicas={replicas}: expected it to divide the data-parallel ranks "
                                      f"dp × cp = {sizes['dp']} (each replica group holds one copy of the shards)")
            if "dps" in self.sizes and int(self.sizes["dps"]) * replicas != sizes["dp"]:
                raise MeshcValueError(f"mesh: expected dps = dp/dpr = {sizes['dp'] // replicas}, got "
                                      f"dps={self.sizes['dps']}; give dpr (dps follows)")
            sizes.update(dps=sizes["dp"] // replicas, dpr=replicas)
        if cp > 1:
            if ep > 1:
                raise MeshcValueError(f"mesh: expert parallelism (ep={ep}) with context parallelism (cp={cp}) is not "
                                      f"supported yet; choose one of them")
            if sizes["dp"] % cp:
                raise MeshcValueError(f"mesh: expected cp to divide dp (context parallelism splits each sequence over a "
                                      f"sub-group of the data-parallel ranks), got dp={sizes['dp']}, cp={cp}; "
                                      f"a MeshSpec's dp counts every rank that shares the gradients, dp × cp of a user's mesh: "
                                      f"build the sizes with spec_sizes(dp=, cp=, ...)")
            sizes["cp"] = cp
        object.__setattr__(self, "sizes", sizes)

    @property
    def world_size(self) -> int:
        out = 1
        for axis in AXES:
            out *= self.sizes[axis]
        return out

    @property
    def group_axes(self) -> tuple[str, ...]:
        """The axes that have process groups: pp, dp, tp, and ep, edp (experts) or cp when the mesh has them."""
        return tuple(self.sizes)

    @property
    def spec(self) -> "MeshSpec":
        """Itself: compiler entry points accept a MeshSpec or a runtime Mesh and take `.spec` of either."""
        return self

    def size(self, axis: str) -> int:
        _check_axis(axis)
        return self.sizes.get(axis, 1)

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s index along every axis (ep and edp too, when the mesh has them)."""
        if not 0 <= rank < self.world_size:
            raise MeshcValueError(f"mesh coords: expected a rank in [0, {self.world_size}), got {rank}")
        out = {}
        for axis in reversed(AXES):  # tp varies fastest
            rank, out[axis] = divmod(rank, self.sizes[axis])
        if "ep" in self.sizes:
            out["edp"], out["ep"] = divmod(out["dp"], self.sizes["ep"])
        if "cp" in self.sizes:
            out["cp"] = out["dp"] % self.sizes["cp"]
        if "dps" in self.sizes:
            out["dpr"], out["dps"] = divmod(out["dp"], self.sizes["dps"])
        return {axis: out[axis] for axis in self.sizes}

    def coord(self, axis: str, rank: int) -> int:
        _check_axis(axis)
        return self.coords(rank).get(axis, 0)  # ep, edp on a mesh without experts: 0

    def rank_at(self, coords: Mapping[str, int]) -> int:
        """The rank at the given index along every axis (pp, dp, tp; or pp, edp, ep, tp; or pp, dp, cp, tp:
        then cp replaces dp's innermost part)."""
        coords = dict(coords)
        if "dps" in self.sizes and "dps" in coords:
            coords["dp"] = coords["dpr"] * self.sizes["dps"] + coords["dps"]
        if "ep" in self.sizes and "ep" in coords:
            coords["dp"] = coords["edp"] * self.sizes["ep"] + coords["ep"]
        if "cp" in self.sizes and "cp" in coords:
            coords["dp"] = coords["dp"] - coords["dp"] % self.sizes["cp"] + coords["cp"]
        rank = 0
        for axis in AXES:
            rank = rank * self.sizes[axis] + coords[axis]
        return rank

    def group_ranks(self, axis: str, rank: int) -> tuple[int, ...]:
        """The ranks that share `rank`'s group along `axis`, in axis order."""
        _check_axis(axis)
        c = self.coords(rank)
        if axis in SUB_AXES and axis not in self.sizes:
            return (rank,)
        moved = {"dp": ("ep", "edp", "cp", "dps", "dpr"), "cp": ("dps", "dpr"), "dps": ("cp",), "dpr": ("cp",)}
        for part in moved.get(axis, ()):  # the parts of dp that moving along `axis` moves too: recomputed from it
            c.pop(part, None)
        return tuple(self.rank_at({**c, axis: i}) for i in range(self.sizes[axis]))

    def all_groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis` (each a tuple of ranks in axis order), in a fixed order."""
        _check_axis(axis)
        if axis not in self.sizes:
            return [(r,) for r in range(self.world_size)]
        firsts = [r for r in range(self.world_size) if self.coords(r)[axis] == 0]
        return [self.group_ranks(axis, r) for r in firsts]

    def group_name(self, axis: str, rank: int) -> str:
        """The name of `rank`'s group along `axis`: the registered one, else a label such as "tp:0,1"."""
        members = self.group_ranks(axis, rank)
        return self.group_names.get((axis, members)) or label(axis, members)

    @property
    def axes(self) -> dict[str, int]:
        """The mesh as a user writes it (meshc.mesh's arguments, world = dp × cp × tp × pp): dp counts the data's
        replicas, without the cp ranks that share each; cp and ep only when > 1."""
        cp = self.sizes.get("cp", 1)
        out = {"dp": self.sizes["dp"] // cp, **({"cp": cp} if cp > 1 else {}), "tp": self.sizes["tp"],
               "pp": self.sizes["pp"]}
        return {**out, "ep": self.sizes["ep"]} if "ep" in self.sizes else out

    def hybrid(self, replicas: int) -> "MeshSpec":
        """This mesh with hybrid sharding's sub-axes (dps, dpr) for `replicas` groups (1: without them)."""
        sizes = {a: n for a, n in self.sizes.items() if a not in ("dps", "dpr")}
        return MeshSpec({**sizes, **({"dpr": replicas} if replicas > 1 else {})}, self.group_names,
                        self.device_type, self.backend)

    def describe(self) -> str:
        axes = self.axes
        dp = f"dp={axes['dp']}" + (f" (ep={self.sizes['ep']} × edp={self.sizes['edp']})" if "ep" in self.sizes else "")
        if "dps" in self.sizes:
            dp += f" (ZeRO in {self.sizes['dpr']} replica groups of {self.sizes['dps']})"
        text = " × ".join([dp] + [f"{a}={axes[a]}" for a in ("cp", "tp", "pp") if a in axes])
        where = f", {self.backend} on {self.device_type}" if self.backend != "none" else ", no process group"
        return f"{text} ({self.world_size} ranks{where})"


def spec_sizes(*, dp: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1) -> dict[str, int]:
    """A MeshSpec's sizes from the axes as a user writes them (world = dp × cp × tp × pp; ep a sub-group of dp × cp):
    MeshSpec's dp is the gradient group, dp × cp ranks."""
    return {"dp": dp * cp, "cp": cp, "tp": tp, "pp": pp, "ep": ep}

def label(axis: str, members: tuple[int, ...]) -> str:
    """The readable name of a group that no process registered (a simulated compile's)."""
    return f"{axis}:{','.join(map(str, members))}"


def as_spec(mesh) -> MeshSpec:
    """The MeshSpec of a MeshSpec or of a runtime Mesh (its `.spec`)."""
    spec = getattr(mesh, "spec", None)
    if not isinstance(spec, MeshSpec):
        raise MeshcTypeError(f"mesh: expected a meshc Mesh or MeshSpec, got {type(mesh).__name__}")
    return spec


def parse_sizes(text: str) -> dict[str, int]:
    """"dp=2,tp=2" -> {"dp": 2, "tp": 2}, with errors that say what was expected."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise MeshcValueError(f"mesh: expected 'axis=size' pairs such as dp=2,tp=2, got {part!r}")
        if name.strip() not in AXES + ("ep", "cp"):
            raise MeshcValueError(f"mesh: unknown axis {name.strip()!r}: expected axes among dp, ep, cp, tp, pp")
        sizes[name.strip()] = int(value)
    return sizes


def _check_axis(axis: str) -> None:
    if axis not in AXES + SUB_AXES:
        raise MeshcValueError(f"mesh axis: expected one of {', '.join(AXES + SUB_AXES)}, got {axis!r}")
