"""The tensors a job holds for its parameters.

    masters   what the optimizer updates: flat dp shards under ZeRO (fp32 with mixed precision), the
              tp-local tensors otherwise; `job.parameters()` returns these.
    compute   ZeRO-1/2 only: the whole (tp-local) parameters the graph reads, in the compute dtype; after
              each optimizer step they are all-gathered from the updated masters. In fp32 a master is a
              view into its compute copy's padded buffer, so nothing is stored twice.

A model built on the meta device gives meta tensors here: each local tensor is allocated (uninitialized)
at its local shape and its FQN stays in `pending` until `load_full` writes it (job.init_weights,
job.load_pretrained), so that no rank ever holds more than its own shards.

The optimizer-step collectives of ZeRO-1/2 run as hooks on the user's optimizer: before the step,
ZeRO-1 reduce-scatters the whole gradients into the masters' .grad; after it, the updated slices are
all-gathered into the compute copies.
"""
from __future__ import annotations

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.placement import FlatShard, Replicate, Shard, Whole, has_whole, local_blocks, split_over
from meshc.compiler.ir.program import Program

from meshc.runtime.zero import offload
from meshc.runtime.sharding import allocate_local, read_local, take
from meshc.runtime.ops.zero import flat_shard, pack, shard_size, unpack

DP = "dp"


class ParamStore:
    def __init__(self, program: Program, tensors: dict[str, torch.Tensor], mesh, keep: set[str] | None = None):
        self.mesh, self.plan = mesh, program.plan
        self.specs = program.params
        self.masters: dict[str, torch.nn.Parameter] = {}
        self.compute: dict[str, torch.Tensor] = {}
        self.pending: set[str] = set()
        self._weights: dict[str, torch.Tensor | None] = {}  # grad_norm's per-parameter weights (_whole_weights)
        for fqn, spec in program.params.items():
            if keep is not None and fqn not in keep:  # a pipeline stage on another rank holds it
                continue
            full = tensors[fqn]
            if full.device.type == "meta":
                self.pending.add(fqn)
            if spec.zero not in (1, 2):
                self.masters[fqn] = _parameter(allocate_local(full, spec, mesh), spec.requires_grad)
                continue
            whole = allocate_local(full, _without_flat(spec), mesh)  # tp-local, whole on dp
            axis = flat_axis(spec)
            n, index = mesh.size(axis), mesh.coord(axis)
            dtype = self.plan.param_dtype or spec.dtype
            s = shard_size(whole.numel(), n)
            if dtype == spec.dtype:  # one padded buffer: the compute copy and (a view of it) the master
                buffer = torch.zeros(s * n, dtype=dtype, device=mesh.device)
                buffer[: whole.numel()] = whole.reshape(-1)
                compute = buffer[: whole.numel()].view(whole.shape)
                master = buffer[index * s: (index + 1) * s]
            else:
                compute = whole.to(dtype)
                master = allocate_local(full, spec, mesh)
            self.compute[fqn] = compute.requires_grad_(spec.requires_grad)
            self.masters[fqn] = _parameter(master, spec.requires_grad)

    def load_full(self, fqn: str, full: torch.Tensor) -> None:
        """Write this rank's part of the whole tensor `full` into parameter `fqn` (see load_part)."""
        spec = self.specs[fqn]
        if tuple(full.shape) != tuple(spec.shape):
            raise MeshcValueError(f"{fqn}: expected a tensor of shape {tuple(spec.shape)}, got {tuple(full.shape)}")
        self.load_part(fqn, lambda indices: take(full, indices))

    @torch.no_grad()
    def load_part(self, fqn: str, read) -> None:
        """Write parameter `fqn`'s master and, under ZeRO-1/2, its compute copy from `read` (sharding.read_local:
        per-dim global indices -> that part of the whole tensor), cast to the stored dtypes."""
        spec = self.specs[fqn]
        if fqn in self.compute:
            self.compute[fqn].copy_(read_local(read, _without_flat(spec), self.mesh))
            if self.masters[fqn].untyped_storage().data_ptr() == self.compute[fqn].untyped_storage().data_ptr():
                self.pending.discard(fqn)  # the master is a view of the compute copy's buffer
                return
        self.masters[fqn].copy_(read_local(read, spec, self.mesh))
        self.pending.discard(fqn)

    def graph_inputs(self, program: Program) -> list[torch.Tensor]:
        """What each parameter placeholder receives, in order."""
        return [self.compute[f] if f in self.compute else self.masters[f] for f in program.params]

    # ------------------------------------------------------------------------------ ZeRO-1/2 step
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook the ZeRO-1/2 collectives onto the user's optimizer (torch's public step hooks)."""
        if not self.compute:
            return
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.reduce_pending())
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.gather_updated())

    def reduce_pending(self) -> None:
        """ZeRO-1: reduce-scatter the whole gradients backward left on the compute copies into the masters."""
        pending = [f for f, t in self.compute.items() if t.grad is not None]
        if not pending:
            return
        for fqns in self._buckets(pending):
            grads = [self.compute[f].grad for f in fqns]
            dtype = self.plan.reduce_dtype or grads[0].dtype
            axis = flat_axis(self.specs[fqns[0]])  # dp, or edp for experts: averaged over dp either way
            n = self.mesh.size(axis)
            if n == 1:  # one rank on the axis: each master's gradient is its compute copy's, nothing packed
                self._take_whole_grads(fqns)
                continue
            sizes = [shard_size(g.numel(), n) for g in grads]
            flat = pack(grads, sizes, dtype, n).div_(self.mesh.size(DP))
            local = self._over_replicas(compat.reduce_scatter_sum(flat, n, self.mesh.group_name(axis)), axis)
            for f, g in zip(fqns, local.split(sizes)):
                master = self.masters[f]
                master.grad = g.to(master.dtype) if master.grad is None else master.grad.add_(g.to(master.dtype))
                self.compute[f].grad = None

    def _take_whole_grads(self, fqns: list[str]) -> None:
        """ZeRO-1 over an axis of one rank: the master (the whole flat parameter) takes its compute copy's gradient,
        a view where the dtypes agree (no copy), averaged over dp where dp > 1 (experts on edp = 1)."""
        dp = self.mesh.size(DP)
        for f in fqns:
            master, compute = self.masters[f], self.compute[f]
            g = compute.grad.reshape(-1)
            g = self._over_replicas(g / dp, flat_axis(self.specs[f])) if dp > 1 else g
            g = g.to(master.dtype)
            master.grad = g if master.grad is None else master.grad.add_(g)
            compute.grad = None

    def _over_replicas(self, shard: torch.Tensor, axis: str) -> torch.Tensor:
        """Hybrid sharding: a gradient shard reduced within its replica group, summed over the groups (dpr)."""
        if axis != "dps" or self.mesh.size("dpr") == 1:
            return shard
        return compat.all_reduce_sum(shard, self.mesh.group_name("dpr"))

    @torch.no_grad()
    def gather_updated(self) -> None:
        """After the step: every rank's updated master slices, all-gathered into the compute copies (over an axis
        of one rank: copied, cast, where the master is not a view of its compute copy; nothing otherwise)."""
        trainable = [f for f in self.compute if self.masters[f].requires_grad]
        for fqns in self._buckets(trainable):
            dtype = self.compute[fqns[0]].dtype
            axis = flat_axis(self.specs[fqns[0]])
            n = self.mesh.size(axis)
            if n == 1:
                for f in fqns:
                    master, compute = self.masters[f], self.compute[f]
                    if master.untyped_storage().data_ptr() != compute.untyped_storage().data_ptr():
                        compute.copy_(master.view(compute.shape))
                continue
            local = torch.cat([self.masters[f].reshape(-1).to(dtype) for f in fqns])
            whole = compat.all_gather(local, n, self.mesh.group_name(axis)) if n > 1 else local
            numels = [self.compute[f].numel() for f in fqns]
            sizes = [shard_size(k, n) for k in numels]
            shapes = [tuple(self.compute[f].shape) for f in fqns]
            for f, t in zip(fqns, unpack(whole, sizes, numels, shapes, n)):
                self.compute[f].copy_(t)

    def _buckets(self, fqns: list[str]) -> list[list[str]]:
        cap = self.plan.zero_bucket_mb * 2**20
        out: list[list[str]] = []
        used = 0.0
        for f in fqns:
            t = self.compute[f]
            nbytes = t.numel() * t.element_size()
            first = out[-1][0] if out else None
            if not out or used + nbytes > cap or t.dtype != self.compute[first].dtype \
                    or flat_axis(self.specs[f]) != flat_axis(self.specs[first]):
                out.append([])
                used = 0.0
            out[-1].append(f)
            used += nbytes
        return out

    # ------------------------------------------------------------------------------ norms and memory
    def grad_norm(self, norm_type: float = 2.0, skip: set[str] = frozenset()) -> torch.Tensor:
        """The global gradient norm over all ranks: shards summed over the axes that split them, replicas
        counted once. With pipeline stages, every pp rank adds its own parameters (`skip`: the copies of
        tied ones that another rank counts)."""
        if norm_type != 2.0:
            raise MeshcValueError(f"clip_grad_norm_: expected norm_type 2.0, got {norm_type}")
        sums = {}
        for fqn, p in self.masters.items():
            if p.grad is None or fqn in skip:
                continue
            axes = tuple(a for a, pl in self.specs[fqn].placements.items() if split_over(pl) and self.mesh.size(a) > 1)
            square = p.grad.detach().double().pow(2)
            if fqn not in self._weights:
                self._weights[fqn] = self._whole_weights(fqn)
            weight = self._weights[fqn]
            sums[axes] = sums.get(axes, 0.0) + (square * weight if weight is not None else square).sum()
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for axes, value in sums.items():
            for a in axes:
                value = compat.all_reduce_sum(torch.as_tensor(value, device=self.mesh.device), self.mesh.group_name(a))
            total = total + value
        if self.mesh.size("pp") > 1:
            total = compat.all_reduce_sum(total, self.mesh.group_name("pp"))
        return total.sqrt()

    def _whole_weights(self, fqn: str) -> torch.Tensor | None:
        """Per element of the parameter's local gradient (as this rank holds it, a ZeRO flat shard included): 1,
        or 1/n in a block every rank of an axis of n holds whole (Whole chunks), which the all-reduce over that
        axis would otherwise count n times; None when the parameter has no such block."""
        spec = self.specs[fqn]
        shards = [(a, p) for a, p in spec.placements.items()
                  if isinstance(p, Shard) and has_whole(p.chunks) and self.mesh.size(a) > 1]
        if not shards:
            return None
        weight = torch.ones(spec.unflat_shape(self.mesh.sizes), dtype=torch.float64, device=self.mesh.device)
        for axis, p in shards:
            n, start = self.mesh.size(axis), 0
            for block, size in zip(p.chunks, local_blocks(p.chunks, sum(p.chunks), n)):
                if isinstance(block, Whole):
                    weight.narrow(p.dim, start, size).fill_(1.0 / n)
                start += size
        for axis, p in spec.placements.items():
            if isinstance(p, FlatShard) and self.mesh.size(axis) > 1:
                weight = flat_shard(weight, self.mesh.size(axis), self.mesh.coord(axis))
        return weight

    def held_bytes(self, optimizers=()) -> dict[str, int]:
        """Bytes of the tensors this rank really holds, each storage counted once; what an offload keeps in its
        store (runtime/zero/offload.py) is reported apart, as "offloaded", with the pool that streams it."""
        seen: set[int] = set()
        offloads = [o for o in (offload.of(opt) for opt in optimizers) if o is not None]
        away: list[torch.Tensor] = []

        def count(tensors) -> int:
            total = 0
            for t in tensors:
                if any(o.is_offloaded(t) for o in offloads):
                    away.append(t)
                    continue
                key = t.untyped_storage().data_ptr()
                if key in seen:
                    continue
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return total
        params = count(list(self.compute.values()) + list(self.masters.values()))
        grads = count([t.grad for t in list(self.masters.values()) + list(self.compute.values()) if t.grad is not None])
        states = count([v for opt in optimizers for st in opt.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0])
        out = {"params": params, "grads": grads, "optimizer": states}
        if offloads:
            out["offloaded"] = sum(t.numel() * t.element_size() for t in away)
            out["offload_pool"] = sum(o.stats.pool_bytes for o in offloads)
        return out


def flat_axis(spec) -> str:
    """The axis of a parameter's ZeRO shards: dp, or edp for an expert's (passes/zero.py)."""
    return next((a for a, p in spec.placements.items() if isinstance(p, FlatShard)), DP)


def _parameter(t: torch.Tensor, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=requires_grad)


def _without_flat(spec):
    import dataclasses

    return dataclasses.replace(spec, placements={a: (Replicate() if isinstance(p, FlatShard) else p)
                                                 for a, p in spec.placements.items()})

