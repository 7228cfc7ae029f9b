"""Offloaded optimizer states (Plan.offload): kept in a store (runtime/offload_store.py), streamed through a
bounded pool of buffers by the optimizer's step, bucket by bucket.

    opt = job.optimizer(torch.optim.AdamW, lr=3e-4)   # an AdamW whose step streams its states
    opt.step()                                        # for each bucket: read (prefetched), update, write back

Layout. When the optimizer is made, its class is probed on a two-element parameter with the user's
arguments: which states it keeps shaped like a parameter ("exp_avg", "exp_avg_sq", ...) and in which dtype.
Each trainable parameter's states get a fixed place in the store; consecutive parameters form buckets of
at most a third of the pool. The store is allocated then (a full disk fails before the first step).

The step. The optimizer is the user's class (same name, so checkpoints do not change), with its step
replaced by one that runs torch's hooks once (the ZeRO-1/2 reduce and gather among them) and the class's
own update once per bucket, on param_groups narrowed to that bucket. Three buffers rotate: bucket k
updates in one while bucket k+1 is read into the next and bucket k-1 is written from the third; one worker
thread does the I/O in submission order. Between steps a state entry is a view of the store's mapping, so
checkpoints and opt.state_dict() read real values; an entry that is anything else when the step starts
(a state just created, or one a load put there) is taken as the truth and copied in. Element-wise updates
make this exact: a bucket's update reads only its own parameters, gradients and states, so the result is
bitwise the step without offload (tests/runtime/test_offload.py).

Scalars (Adam's "step") and plain values stay in memory.

Parameters (offload_params, ZeRO-3): each master shard takes one more place, before its states; from the
optimizer's creation on, its .data is a view of the store's mapping (ZeRO-3's gathers read it through the
page cache), swapped for the bucket's buffer during its update. The job remaps after forward, backward and
the step, so the pages the gathers faulted in leave the process (job.py, _offload_remap).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from meshc.compiler.ir.errors import MeshcValueError

from .offload_store import FileStore, HostStore

PARAM = "<parameter>"  # the place of an offloaded parameter's own values (offload_params)
NBUF = 3  # buffers in the pool: one updating, one being read, one being written
ALIGN = 64  # bytes: every state's place starts on it (any dtype's view is aligned)
MIN_POOL_MB = 64.0


@dataclass
class _Place:
    name: str
    offset: int  # in the bucket
    dtype: torch.dtype
    shape: tuple


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    places: dict[int, list[_Place]]  # id(param) -> its states' places
    start: int  # in the store
    nbytes: int


@dataclass
class OffloadStats:
    """What the last step moved, and the memory it used."""

    buckets: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    pool_bytes: int = 0
    store_bytes: int = 0


def probe_states(cls: type, kwargs: dict) -> dict[str, torch.dtype | None]:
    """The states `cls(**kwargs)` keeps shaped like a parameter, by name: their dtype, or None for the
    parameter's own dtype. An optimizer whose states are not element-wise cannot be offloaded."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32))
    try:
        opt = cls([p], **kwargs)
        p.grad = torch.zeros_like(p)
        opt.step()
    except Exception as e:  # noqa: BLE001 - any failure of the user's class is reported with its name
        raise MeshcValueError(f"Plan.offload: expected {cls.__name__}(**{kwargs}) to step a float32 parameter on the "
                              f"CPU (meshc probes its states to lay them out), got {type(e).__name__}: {e}") from None
    out: dict[str, torch.dtype | None] = {}
    for name, value in opt.state[p].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if tuple(value.shape) != tuple(p.shape):
                raise MeshcValueError(f"Plan.offload: expected {cls.__name__}'s state {name!r} to be shaped like its "
                                      f"parameter, got {tuple(value.shape)}; offload works for element-wise optimizers "
                                      "(Adam, AdamW, SGD, ...)")
            out[name] = None if value.dtype == p.dtype else value.dtype
    return out


def of(opt: torch.optim.Optimizer) -> StateOffload | None:
    """The offload of an optimizer made by job.optimizer under Plan.offload (None otherwise)."""
    return getattr(opt, "_meshc_offload", None)


def offloaded_class(cls: type) -> type:
    """`cls` with the streaming step (same name: a checkpoint of it is one of `cls`)."""
    if getattr(cls, "_meshc_offloaded", False):
        return cls
    cached = _CLASSES.get(cls)
    if cached is not None:
        return cached
    inner = cls.step.__wrapped__ if getattr(cls.step, "hooked", False) else cls.step  # torch's hook wrapper off

    def step(self, closure=None):
        loss = None
        if closure is not None:  # once for the whole step, not once per bucket
            with torch.enable_grad():
                loss = closure()
        self._meshc_offload.step(lambda: inner(self))
        return loss
    sub = type(cls.__name__, (cls,), {"step": step, "_meshc_offloaded": True, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    _CLASSES[cls] = sub
    return sub


_CLASSES: dict[type, type] = {}


class StateOffload:
    """One optimizer's element-wise states in `store`, streamed by its step (see the module docstring)."""

    def __init__(self, opt: torch.optim.Optimizer, states: dict[str, torch.dtype | None], names: dict[int, str],
                 *, kind: str, folder=None, rank: int = 0, pool_mb: float | None = None, params: bool = False):
        self.opt, self.names, self.with_params = opt, names, params
        params = [p for g in opt.param_groups for p in g["params"]]
        if self.with_params:  # the parameter itself is one more place, first, in its own dtype
            states = {PARAM: None, **states}
        sizes = [_state_bytes(p, states) for p in params]
        largest = max(sizes, default=0)
        pool = int((pool_mb if pool_mb is not None else max(MIN_POOL_MB, NBUF * largest / 2**20)) * 2**20)
        cap = pool // NBUF
        if largest > cap:
            big = names[id(params[sizes.index(largest)])]
            raise MeshcValueError(f"Plan.offload_buffer_mb: expected a pool of at least {NBUF} x the largest parameter's "
                                  f"offloaded bytes ({big}: {largest / 2**20:.3g} MiB), got {pool / 2**20:.3g} MiB; raise "
                                  f"it to {NBUF * largest / 2**20:.3g} or leave it None")
        self.buckets = _buckets(params, states, cap)
        total = self.buckets[-1].start + self.buckets[-1].nbytes if self.buckets else 0
        device = params[0].device if params else torch.device("cpu")
        if kind == "nvme":
            self.store = FileStore(folder, rank, total, "optimizer_states")
        else:
            self.store = HostStore(total, pin=device.type == "cuda")
        biggest = max((b.nbytes for b in self.buckets), default=0)
        self.pool = [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(min(NBUF, len(self.buckets)))]
        self.stats = OffloadStats(pool_bytes=sum(b.numel() for b in self.pool), store_bytes=total)
        self._map = self.store.mapping()
        if self.with_params:
            self._move_params_in()

    def _move_params_in(self) -> None:
        """Each parameter's values into its place in the store; from now on its .data is a view of it."""
        with torch.no_grad():
            for bucket in self.buckets:
                for p in bucket.params:
                    view = self._mapped(bucket, bucket.places[id(p)][0])
                    view.copy_(p.detach())
                    p.data = view
        self.remap()  # the pages the copies touched leave the process

    # ------------------------------------------------------------------------------ the step
    def step(self, update) -> None:
        """`update()` once per bucket, with that bucket's states in a pool buffer."""
        self.remap()
        self.stats = OffloadStats(buckets=len(self.buckets), pool_bytes=self.stats.pool_bytes,
                                  store_bytes=self.stats.store_bytes)
        reads, writes = {}, []
        for k in range(min(NBUF - 1, len(self.buckets))):
            reads[k] = self._read(k)
        try:
            for k, bucket in enumerate(self.buckets):
                buf = self._wait(reads.pop(k), "read", k)
                if k + NBUF - 1 < len(self.buckets):  # into bucket k-1's buffer, after its write (one worker, in order)
                    reads[k + NBUF - 1] = self._read(k + NBUF - 1)
                self._enter(bucket, buf)
                with _only(self.opt, bucket.params):
                    update()
                self._leave(bucket, buf)
                writes.append((k, self.store.write(buf[: bucket.nbytes], bucket.start)))
                self.stats.written_bytes += bucket.nbytes
        finally:
            for k, future in writes:
                self._wait(future, "write", k)
            for future, _ in reads.values():
                future.exception()  # let pending reads finish before the buffers can be reused

    def _read(self, k: int):
        bucket = self.buckets[k]
        buf = self.pool[k % len(self.pool)]
        self.stats.read_bytes += bucket.nbytes
        return (self.store.read(buf[: bucket.nbytes], bucket.start), buf)

    def _wait(self, pending, what: str, k: int) -> torch.Tensor:
        future, buf = pending if isinstance(pending, tuple) else (pending, self.pool[k % len(self.pool)])
        bucket = self.buckets[k]
        self.store.wait(future, what, buf[: bucket.nbytes], bucket.start)
        return buf

    def _enter(self, bucket: _Bucket, buf: torch.Tensor) -> None:
        """Point the bucket's state entries (and offloaded parameters) at `buf`; an entry that is not a view of the
        store (created since, or loaded) is the truth: copied into `buf` first."""
        for p in bucket.params:
            state = self.opt.state.get(p) or {}
            for place in bucket.places[id(p)]:
                if place.name == PARAM:
                    current = p.data
                elif place.name in state:
                    current = state[place.name]
                else:
                    continue
                view = _view(buf, place.offset, place)
                if not self._is_mine(current, bucket, place):
                    view.copy_(current)
                if place.name == PARAM:
                    p.data = view
                else:
                    state[place.name] = view
            self._check_known(p, state, bucket)

    def _leave(self, bucket: _Bucket, buf: torch.Tensor) -> None:
        """After the update: states created by it are copied into `buf`; every entry becomes a view of the store."""
        for p in bucket.params:
            state = self.opt.state.get(p) or {}
            self._check_known(p, state, bucket)
            for place in bucket.places[id(p)]:
                if place.name == PARAM:
                    p.data = self._mapped(bucket, place)
                    continue
                if place.name not in state:
                    continue
                view = _view(buf, place.offset, place)
                if state[place.name].data_ptr() != view.data_ptr():
                    view.copy_(state[place.name])
                state[place.name] = self._mapped(bucket, place)

    def _mapped(self, bucket: _Bucket, place: _Place) -> torch.Tensor:
        return _view(self._map, bucket.start + place.offset, place)

    def _check_known(self, p, state: dict, bucket: _Bucket) -> None:
        known = {place.name for place in bucket.places[id(p)] if place.name != PARAM}
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and name not in known:
                raise MeshcValueError(f"Plan.offload: {self.names.get(id(p), '?')}: expected the optimizer's states "
                                      f"{sorted(known)} (probed when it was made), got a new one {name!r}; make the "
                                      "optimizer with the arguments it will step with")

    def _is_mine(self, t, bucket: _Bucket, place: _Place) -> bool:
        return (isinstance(t, torch.Tensor) and self._map.numel() > 0
                and t.untyped_storage().data_ptr() == self._map.untyped_storage().data_ptr()
                and t.data_ptr() == self._map.data_ptr() + bucket.start + place.offset)

    # ------------------------------------------------------------------------------ between steps
    def remap(self) -> None:
        """A fresh mapping of the store for the state entries (and offloaded parameters): pages an earlier reader
        faulted in (a checkpoint, ZeRO-3's gathers, the user) leave the process with the old mapping."""
        if self.store.kind == "cpu":
            return
        old = self._map
        self._map = self.store.mapping()
        for bucket in self.buckets:
            for p in bucket.params:
                state = self.opt.state.get(p) or {}
                for place in bucket.places[id(p)]:
                    t = p.data if place.name == PARAM else state.get(place.name)
                    if (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == old.untyped_storage().data_ptr()
                            and t.data_ptr() == old.data_ptr() + bucket.start + place.offset):
                        if place.name == PARAM:
                            p.data = self._mapped(bucket, place)
                        else:
                            state[place.name] = self._mapped(bucket, place)

    def destination(self, p: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a load should write state `name` of `p`: its view of the store (None if it has no place there)."""
        for bucket in self.buckets:
            for place in bucket.places.get(id(p), ()):
                if place.name == name and place.dtype == dtype:
                    return self._mapped(bucket, place)
        return None

    def is_offloaded(self, t: torch.Tensor) -> bool:
        """Whether `t` lives in the store (its bytes are not resident in the process's memory)."""
        return self.store.kind == "nvme" and self._map.numel() > 0 and \
            t.untyped_storage().data_ptr() == self._map.untyped_storage().data_ptr()

    def close(self) -> None:
        self.store.close()


@contextlib.contextmanager
def _only(opt: torch.optim.Optimizer, params: list):
    """The optimizer's param_groups narrowed to `params` (hyperparameters untouched), restored after."""
    keep = {id(p) for p in params}
    saved = [g["params"] for g in opt.param_groups]
    try:
        for g in opt.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in keep]
        yield
    finally:
        for g, ps in zip(opt.param_groups, saved):
            g["params"] = ps


def _state_bytes(p: torch.Tensor, states: dict) -> int:
    return sum(_round(p.numel() * (dtype or p.dtype).itemsize) for dtype in states.values())


def _buckets(params: list, states: dict, cap: int) -> list[_Bucket]:
    out: list[_Bucket] = []
    start = 0
    for p in params:
        need = _state_bytes(p, states)
        if not out or out[-1].nbytes + need > cap:
            start = _round(start + (out[-1].nbytes if out else 0), 4096)
            out.append(_Bucket([], {}, start, 0))
        bucket, places = out[-1], []
        for name, dtype in states.items():
            dtype = dtype or p.dtype
            places.append(_Place(name, bucket.nbytes, dtype, tuple(p.shape)))
            bucket.nbytes += _round(p.numel() * dtype.itemsize)
        bucket.params.append(p)
        bucket.places[id(p)] = places
    return out


def _view(flat: torch.Tensor, offset: int, place: _Place) -> torch.Tensor:
    n = math.prod(place.shape) * place.dtype.itemsize
    return flat[offset: offset + n].view(place.dtype).view(place.shape)


def _round(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to
