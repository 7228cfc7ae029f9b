"""The device mesh at run time: a MeshSpec (compiler/ir/mesh_spec.py) and the process groups behind it.

Ranks are laid out as the MeshSpec says (tp innermost, then dp, then pp). The Mesh creates one process
group per group of every axis, on every rank, so that it knows each rank's group names: graphs compiled
for any rank name the exact groups that rank will use. No process group lives in a module global: the
Mesh is passed explicitly wherever a group is needed (the one module-level slot below only remembers, by
weak reference, which mesh `meshc.mesh()` built last, for the torch.compile door's default).
"""
from __future__ import annotations

import os
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.mesh_spec import AXES, MeshSpec, label, spec_sizes

from meshc.runtime.monitor.failures import elastic_store
from meshc.runtime.host_malloc import tune as host_malloc_tune
from meshc.runtime.ops.sequence import zigzag_slice


class Mesh:
    """Named axes over an initialized process group. Build it with `meshc.mesh(...)`.

    `spec` is its topology (what the compiler sees); the methods below answer for this rank by default.
    `host_malloc`: whether meshc.mesh() set this process's allocator for training (runtime/host_malloc.py).
    """

    host_malloc: bool = False

    def __init__(self, sizes: dict[str, int], *, device: torch.device, timeout: timedelta):
        if not dist.is_initialized():
            raise MeshcValueError("Mesh: expected an initialized torch.distributed world; use meshc.mesh(...)")
        shape = MeshSpec(sizes)
        self.sizes = dict(shape.sizes)
        self.world_size = dist.get_world_size()
        if shape.world_size != self.world_size:
            raise MeshcValueError(f"Mesh: expected sizes whose product is the world size {self.world_size}, "
                                  f"got {shape.describe()}")
        self.rank = dist.get_rank()
        self.device = device
        self.backend = dist.get_backend()
        self.timeout = timeout
        self._groups: dict[str, dist.ProcessGroup] = self._new_groups(shape, shape.group_axes)
        self._gradient_group: dist.ProcessGroup | None = None
        if self.sizes.get("pp", 1) > 1:  # a second group over each pp group's ranks: see pipeline_group
            for row in shape.all_groups("pp"):
                group = dist.new_group(list(row), timeout=timeout)
                if self.rank in row:
                    self._gradient_group = group
        self.spec = MeshSpec(self.sizes, self._exchange_group_names(shape), device_type=device.type,
                             backend=self.backend)
        self.aliases = self._register_aliases(self._groups)
        self._device_mesh = None
        self._hybrids: dict[int, Mesh] = {1: self}  # by Plan.replicas, shared by the meshes hybrid() returns

    def hybrid(self, replicas: int) -> "Mesh":
        """This mesh with hybrid sharding's groups (Plan.replicas; MeshSpec.hybrid): dps, the ranks that hold one
        copy of ZeRO's shards, and dpr, one rank of each replica group. Collective on the first call for a given
        `replicas` (every rank creates every group, in the same order: meshc.compile calls it on every rank);
        the mesh returned shares this one's groups and process group."""
        if replicas not in self._hybrids:
            import copy

            shape = self.spec.hybrid(replicas)
            out = copy.copy(self)
            out._groups = {**{a: g for a, g in self._groups.items() if a not in ("dps", "dpr")},
                           **self._new_groups(shape, ("dps", "dpr"))}
            out.sizes = dict(shape.sizes)
            out.spec = MeshSpec(out.sizes, out._exchange_group_names(shape), device_type=self.device.type,
                                backend=self.backend)
            out.aliases = {**self.aliases, **out._register_aliases({a: out._groups[a] for a in ("dps", "dpr")
                                                                     if a in out._groups})}
            out._device_mesh, out._hybrids = None, self._hybrids
            self._hybrids[replicas] = out
        return self._hybrids[replicas]

    def _new_groups(self, shape: MeshSpec, axes) -> dict[str, dist.ProcessGroup]:
        """This rank's process group on each of `axes`; every rank creates every group, in the same order."""
        mine = {}
        for axis in axes:
            for row in shape.all_groups(axis):
                group = dist.new_group(list(row), timeout=self.timeout)
                if self.rank in row:
                    mine[axis] = group
        return mine

    # ----------------------------------------------------------------------------- coordinates
    def size(self, axis: str) -> int:
        return self.spec.size(axis)

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """This rank's (or `rank`'s) index along every axis."""
        return self.spec.coords(self.rank if rank is None else rank)

    def rank_at(self, coords: dict[str, int]) -> int:
        """The rank at the given index along every axis."""
        return self.spec.rank_at(coords)

    def all_groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis` (each a tuple of ranks in axis order), in a fixed order."""
        return self.spec.all_groups(axis)

    def coord(self, axis: str, rank: int | None = None) -> int:
        return self.spec.coord(axis, self.rank if rank is None else rank)

    def group_ranks(self, axis: str, rank: int | None = None) -> tuple[int, ...]:
        """The ranks that share `rank`'s group along `axis`, in axis order."""
        return self.spec.group_ranks(axis, self.rank if rank is None else rank)

    def group_name(self, axis: str, rank: int | None = None) -> str:
        """The registered name of `rank`'s process group along `axis` (what functional collectives take)."""
        return self.spec.group_name(axis, self.rank if rank is None else rank)

    def axis_of_groups(self) -> dict[str, str]:
        """The axis of every group by name, its alias (Mesh.aliases) included: what a collective's group_name says."""
        out: dict[str, str] = {}
        for axis in self.sizes:
            for row in self.all_groups(axis):
                out.setdefault(self.group_name(axis, row[0]), axis)
        for name, alias in self.aliases.items():
            out.setdefault(alias, out.get(name, alias))
        return out

    def group(self, axis: str) -> dist.ProcessGroup:
        """This rank's process group along `axis`."""
        self.spec.size(axis)  # checks the axis
        return self._groups[axis]

    def pipeline_group(self, kind: str) -> dist.ProcessGroup:
        """The group a pipeline message of `kind` travels on: activations ("F") on the pp group, input gradients
        ("B") on a second group over the same ranks. A backend without tags (NCCL) matches a pair's point-to-point
        messages first in, first out; a V schedule sends a pair of ranks activations and gradients in another order
        than the peer awaits them, each kind in the same order (schedule_sim proves it): one stream per kind."""
        if kind == "F" or self._gradient_group is None:
            return self.group("pp")
        return self._gradient_group

    def close(self) -> None:
        """End this process's part of the mesh cleanly, on every rank at the end of training: wait for the
        others, stop the heartbeat thread, destroy the process groups (no communication thread outlives the
        interpreter: at exit, C++ threads still running abort the process)."""
        from meshc.runtime.monitor.failures import stop_monitors

        if dist.is_initialized() and self.world_size > 1 and self.backend != "fake":
            dist.barrier()
        stop_monitors()
        self._groups.clear()
        self._device_mesh = None
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def device_mesh(self):
        """The equivalent torch DeviceMesh (built on first use, from the groups above)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_mesh = DeviceMesh.from_group(
                [self._groups[a] for a in AXES], self.device.type,
                mesh=torch.arange(self.world_size).view(*(self.sizes[a] for a in AXES)), mesh_dim_names=AXES,
            )
        return self._device_mesh

    # ----------------------------------------------------------------------------- data
    def shard_batch(self, batch: Any, dim: int = 0) -> Any:
        """This rank's slice of a global batch (any pytree of tensors), moved to the mesh's device.

        Every tp and pp rank of one dp group gets the same slice, as DDP and FSDP expect. With context
        parallelism (cp > 1) the cp ranks of a group share one batch slice (dim `dim` split over dp) and
        split its sequences: dim 1 of every tensor of two or more dims is cut into 2·cp chunks and rank c of
        the cp group takes chunks c and 2·cp−1−c (so that under causal attention every rank does the same
        work); `unshard_sequence` puts such shards back in order.
        """
        cp = self.sizes.get("cp", 1)
        n, i = self.sizes["dp"] // cp, self.coord("dp") // cp

        def take(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.shape[dim] % n:
                over = f"dp={n}" + (f" (each batch slice shared by cp={cp} ranks)" if cp > 1 else "")
                raise MeshcValueError(f"shard_batch: expected dim {dim} divisible by {over}, got a tensor of shape "
                                      f"{tuple(t.shape)}; make the global batch a multiple of {n}")
            out = t.chunk(n, dim)[i]
            if cp > 1 and out.dim() >= 2:
                out = sequence_shard(out, self.coord("cp"), cp)
            return out.to(self.device)

        return compat.tree_map(take, batch)

    def unshard_sequence(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequences from the cp ranks' shards (each `shard_batch`'s zigzag layout), given in cp
        order (for example gathered with torch.distributed.all_gather over `mesh.group("cp")`)."""
        cp = self.sizes.get("cp", 1)
        if len(shards) != cp:
            raise MeshcValueError(f"unshard_sequence: expected {cp} shards (one per cp rank), got {len(shards)}")
        return sequence_unshard(shards, dim)

    @property
    def axes(self) -> dict[str, int]:
        """The sizes as meshc.mesh(...) takes them (world = dp × cp × tp × pp), cp and ep only when > 1."""
        return self.spec.axes

    def describe(self) -> str:
        return self.spec.describe()

    def __repr__(self) -> str:
        return f"Mesh({self.describe()}, rank={self.rank})"

    def _exchange_group_names(self, shape: MeshSpec) -> dict[tuple[str, tuple[int, ...]], str]:
        """Every group's registered name, keyed by (axis, member ranks), known on every rank.

        A rank only gets a handle (and so a name) for the groups it belongs to; one all_gather_object
        shares them. On torch's "fake" backend (simulated compiles) nothing can be exchanged, and other
        ranks' groups get a readable label instead.
        """
        mine = {axis: (_members(g), g.group_name) for axis, g in self._groups.items()}
        if dist.get_backend() == "fake":
            everyone = [mine]
        else:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine)
        names = {(axis, row): label(axis, row) for axis in shape.group_axes for row in shape.all_groups(axis)}
        for theirs in everyone:
            for axis, (members, name) in theirs.items():
                names[(axis, members)] = name
        return names

    def _register_aliases(self, groups: dict[str, dist.ProcessGroup]) -> dict[str, str]:
        """A second name for this rank's group on each axis, the same on every rank ("dp@5": the axis, then the
        first name of those axes' groups, known to all): {group name: alias}. Compiled programs call collectives by alias,
        so that ranks whose programs differ only in which group of an axis they use hand Inductor one graph, which
        its FX graph cache compiles once for all of them (runtime/inductor.py)."""
        first = min((n for (axis, _), n in self.spec.group_names.items() if axis in groups), key=lambda n: (len(n), n))
        out = {}
        for axis, group in groups.items():
            alias = f"{axis}@{first}"
            compat.register_group_alias(alias, group)
            out[group.group_name] = alias
        return out


def _members(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def mesh(*, dp: int | None = None, ep: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, timeout_s: float = 300.0,
         host_malloc: bool = False, **unknown_axes: int) -> Mesh:
    """The mesh of this process's world: `meshc.mesh(dp=2, tp=2, pp=2)`, `meshc.mesh(dp=4, ep=2)` or
    `meshc.mesh(dp=2, cp=2)`. The world is dp × cp × tp × pp, as Megatron-Core and torchtitan count it.

    Reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and initializes torch.distributed
    if nothing has yet: NCCL when CUDA is available, else gloo. Without torchrun the world is this one
    process. `dp` left unset takes what cp × tp × pp leave of the world. `cp` (context parallelism): cp ranks
    share each batch and split its sequences; the gradients are reduced and the ZeRO shards spread over all
    dp × cp ranks (the mesh's "dp" group; `mesh.size("dp")` is its size, `mesh.axes` the sizes given here).
    `ep` (expert parallelism) is a sub-group of those ranks, not a factor of the world: experts are sharded
    over ep consecutive ones (MeshSpec). `timeout_s` bounds every collective (gloo's own default is 30 minutes).
    On a CPU world, `host_malloc=True` keeps a training step's large blocks on this process's heap
    (runtime/host_malloc.py: without it each step page-faults its gradients and activations in afresh, up to 10-15%
    of a small model's step on the 2-core machine) at the price of resident memory: the heap keeps what a step
    freed, fragmented, and a ZeRO-3 run's peak RSS measured 1.2-1.4x glibc's (docs/memory.md). The default, False,
    leaves the C library's settings as they are: meshc, whose purpose is fitting big models, does not trade memory
    for speed unless asked (a process an earlier meshc.mesh(host_malloc=True) tuned stays tuned).
    """
    if unknown_axes:
        name = next(iter(unknown_axes))
        raise MeshcValueError(f"mesh: unknown axis {name!r}: expected axes among dp, ep, cp, tp, pp")
    for name, value in (("ep", ep), ("cp", cp), ("tp", tp), ("pp", pp)) + ((("dp", dp),) if dp is not None else ()):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MeshcValueError(f"mesh: expected {name} to be a positive int, got {value!r}")
    timeout = timedelta(seconds=timeout_s)
    device = _init_world(timeout)
    dp = world_axes(dist.get_world_size(), dp=dp, cp=cp, tp=tp, pp=pp)
    built = Mesh(spec_sizes(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep), device=device, timeout=timeout)
    built.host_malloc = host_malloc and device.type == "cpu" and host_malloc_tune()
    _LAST.clear()
    _LAST.append(weakref.ref(built))
    return built


_LAST: list = []  # the mesh meshc.mesh() built last in this process (a weak reference), for meshc.backend()


def world_axes(world: int, *, dp: int | None, cp: int, tp: int, pp: int) -> int:
    """dp of a mesh over `world` ranks (what cp × tp × pp leave when None), checked: world = dp × cp × tp × pp. A
    mesh written the old way (dp counting the cp ranks too) gets an error that says what to write."""
    if dp is None:
        if world % (cp * tp * pp):
            raise MeshcValueError(
                f"mesh: cp×tp×pp = {cp}×{tp}×{pp} = {cp * tp * pp} does not divide the world of {world} ranks; "
                f"choose cp, tp and pp whose product divides {world}"
            )
        return world // (cp * tp * pp)
    if dp * cp * tp * pp != world:
        old = (f"; cp is an axis of its own, as in Megatron-Core and torchtitan: dp no longer counts the cp ranks, "
               f"write dp={dp // cp}, cp={cp}") if cp > 1 and dp % cp == 0 and dp * tp * pp == world else ""
        raise MeshcValueError(
            f"mesh: expected dp×cp×tp×pp to equal the world size {world}, got {dp}×{cp}×{tp}×{pp} = "
            f"{dp * cp * tp * pp}{old or f'; choose sizes whose product is {world}, or leave dp unset'}"
        )
    return dp


def last_mesh() -> Mesh | None:
    """The mesh meshc.mesh() built last in this process, if it is still alive."""
    return _LAST[0]() if _LAST else None


def _init_world(timeout: timedelta) -> torch.device:
    """Initialize torch.distributed from torchrun's environment, or as a world of one; return the device."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if use_cuda:
                torch.cuda.set_device(local_rank)
            dist.init_process_group(backend, timeout=timeout, **elastic_store(timeout))  # restarts: a fresh rendezvous
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if dist.get_backend() == "gloo":
        compat.safe_cpu_all_gather()  # torch's functional all-gather corrupts gloo's heap with several in flight
    return torch.device("cpu")


def simulated_mesh(*, dp: int = 1, ep: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, rank: int = 0) -> Mesh:
    """A mesh for compiling one rank of a large world in this process, on torch's "fake" backend.

    Nothing is sent: collectives return garbage, so use it to inspect plans and graphs, never to train.
    It initializes torch.distributed in this process; call `dist.destroy_process_group()` when done.
    """
    world = dp * cp * tp * pp
    if dist.is_initialized():
        raise MeshcValueError("simulated_mesh: expected no initialized torch.distributed world in this process, "
                              "got one; destroy it first (torch.distributed.destroy_process_group())")
    dist.init_process_group("fake", store=compat.fake_store(), rank=rank, world_size=world)
    return Mesh(spec_sizes(dp=dp, cp=cp, tp=tp, pp=pp, ep=ep), device=torch.device("cpu"), timeout=timedelta(minutes=5))


def sequence_shard(t: torch.Tensor, index: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank `index`'s part of dim `dim` under context parallelism: chunks index and 2·cp−1−index of 2·cp."""
    if t.shape[dim] % (2 * cp):
        raise MeshcValueError(f"shard_batch: expected the sequence (dim {dim}) divisible by 2·cp = {2 * cp} (each cp "
                              f"rank takes two chunks, for causal load balance), got a tensor of shape "
                              f"{tuple(t.shape)}; pad the sequences to a multiple of {2 * cp}")
    return zigzag_slice(t, dim, 1, cp, index)


def sequence_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of sequence_shard over all cp ranks' shards, given in cp order."""
    halves = [s.chunk(2, dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)
