"""Offloaded optimizer states (Plan.offload): kept in a store (runtime/zero/offload_store.py), streamed through a
bounded pool of buffers by the optimizer's step, bucket by bucket.

    opt = job.optimizer(torch.optim.AdamW, lr=3e-4)   # an AdamW whose step streams its states
    opt.step()                                        # for each bucket: read (prefetched), update, write back

Layout. When the optimizer is made, its class is probed on a two-element parameter with the user's
arguments: which states it keeps shaped like a parameter ("exp_avg", "exp_avg_sq", ...) and in which dtype.
Each trainable parameter's states get one contiguous place each in the store, and `opt.state[p][name]` is a
view of the store's mapping from then on, between steps and during them: checkpoints, opt.state_dict() and
the user read the real values. The store is allocated then (a full disk fails before the first step).

The step. The optimizer is the user's class (same name, so checkpoints do not change), with its step
replaced by one that runs torch's hooks once (the ZeRO-1/2 reduce and gather among them) and the class's
own update once per bucket. Parameters are cut into pieces of consecutive elements, so that no piece's
states exceed a third of the pool however large the parameter (a 50k-row embedding is most of a GPT's
states); buckets are runs of pieces. Three buffers rotate: bucket k updates in one while bucket k+1 is
read into the next and bucket k-1 is written from the third; one worker thread does the I/O in submission
order. For the update, each piece is a temporary parameter viewing its slice of the master (and of its
gradient) whose states are views of the buffer; param_groups are narrowed to the bucket's pieces. ZeRO's
masters are flat shards, so meshc's optimizers are element-wise already; an element-wise update of a slice
reads only that slice, which makes the result bitwise the step without offload
(tests/runtime/test_offload.py). Scalars (Adam's "step") start each piece from the parameter's value and are
copied back once; plain values likewise.

A state entry that is not a view of the store when the step starts (one a load or the user put there) is
the truth: it is written into the store first.

An optimizer without such states (SGD without momentum) has nothing to offload: its parameters step in memory,
in one call, and job.optimizer says so with a MeshcWarning (with offload_params the parameters are still
offloaded and streamed).

Parameters (offload_params, ZeRO-3): each master shard gets a place too; its .data is a view of the mapping
from the optimizer's creation on, and its pieces update in the buffers like its states. ZeRO-3's gathers
read the shards through the page cache; after packing a bucket the job drops those pages from the process
(meshc_offload::pack_dropping, runtime/ops/pages.py, in the graph whether it runs as FX code or compiled), as release()
does for every page of the mapping at the start of each step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from meshc.compiler.ir.errors import MeshcValueError

from meshc.runtime.ops import pages
from meshc.runtime.zero.offload_store import FileStore, HostStore

PARAM = "<parameter>"  # the place of an offloaded parameter's own values (offload_params)
NBUF = 3  # buffers in the pool: one updating, one being read, one being written
ALIGN = pages.PAGE  # bytes: every place starts on a page (any dtype's view is aligned; pages release cleanly)
MIN_POOL_MB, MAX_POOL_MB, POOL_FRACTION = 1.0, 64.0, 32  # the default pool: 1/32 of the store, 1 to 64 MiB


@dataclass
class _Place:
    name: str
    offset: int  # in the store
    dtype: torch.dtype


@dataclass
class _Piece:
    param: torch.nn.Parameter
    start: int  # elements [start, stop) of the flattened parameter
    stop: int
    offset: int  # in the bucket's buffer: this piece's places, one after another


@dataclass
class _Bucket:
    pieces: list[_Piece]
    nbytes: int


@dataclass
class OffloadStats:
    """What the last step moved, and the memory it used."""

    buckets: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    pool_bytes: int = 0
    store_bytes: int = 0


def probe_states(cls: type, kwargs: dict, device="cpu") -> dict[str, torch.dtype | None]:
    """The states `cls(**kwargs)` keeps shaped like a parameter, by name: their dtype, or None for the
    parameter's own dtype (probed on the parameters' device: options such as capturable need theirs). An
    optimizer whose states are not element-wise cannot be offloaded."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float32, device=device))
    try:
        opt = cls([p], **kwargs)
        p.grad = torch.zeros_like(p)
        opt.step()
    except Exception as e:  # noqa: BLE001 - any failure of the user's class is reported with its name
        raise MeshcValueError(f"Plan.offload: expected {cls.__name__}(**{kwargs}) to step a float32 parameter on "
                              f"{device} (meshc probes its states to lay them out), got {type(e).__name__}: {e}") from None
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
    """One optimizer's element-wise states (and, with `params`, its parameters) in a store, streamed by its
    step (see the module docstring)."""

    def __init__(self, opt: torch.optim.Optimizer, states: dict[str, torch.dtype | None], names: dict[int, str],
                 *, kind: str, folder=None, rank: int = 0, pool_mb: float | None = None, params: bool = False):
        self.opt, self.names, self.with_params = opt, names, params
        self.states = {PARAM: None, **states} if params else dict(states)
        plist = [p for g in opt.param_groups for p in g["params"]]
        per_element = {id(p): sum((d or p.dtype).itemsize for d in self.states.values()) for p in plist}
        self.places: dict[int, list[_Place]] = {}
        total = 0
        for p in plist:  # widest dtype first: a piece's views stay aligned however long it is
            self.places[id(p)] = []
            for name, dtype in sorted(self.states.items(), key=lambda kv: -(kv[1] or p.dtype).itemsize):
                self.places[id(p)].append(_Place(name, total, dtype or p.dtype))
                total = _round(total + p.numel() * (dtype or p.dtype).itemsize)
        if pool_mb is None:  # a few percent of what it streams: buckets of MiBs keep the disk busy all the same
            pool_mb = max(MIN_POOL_MB, min(MAX_POOL_MB, total / POOL_FRACTION / 2**20))
        self.buckets = _buckets(plist, per_element, int(pool_mb * 2**20) // NBUF, self.names)
        # parameters with nothing to offload (a stateless optimizer: SGD without momentum, and not offload_params)
        # step in memory, once per step, as the optimizer would without offload
        self.resident = [p for p in plist if per_element[id(p)] == 0]
        device = plist[0].device if plist else torch.device("cpu")
        self.store = FileStore(folder, rank, total, "optimizer_states") if kind == "nvme" else \
            HostStore(total, pin=device.type == "cuda")
        biggest = max((b.nbytes for b in self.buckets), default=0)
        self.pool = [torch.empty(biggest, dtype=torch.uint8, device=device)
                     for _ in range(min(NBUF, len(self.buckets)))]
        self.stats = OffloadStats(pool_bytes=sum(b.numel() for b in self.pool), store_bytes=total)
        self._map = self.store.mapping()
        if kind == "nvme":
            pages.register(self._map)  # its pages may be dropped: by release(), and by ZeRO-3's reads (ops/pages.py)
        if params:
            with torch.no_grad():
                for p in plist:
                    view = self._mapped(p, self.places[id(p)][0])
                    view.copy_(p.detach())
                    p.data = view
            self.release([self._map])

    # ------------------------------------------------------------------------------ the step
    def step(self, update) -> None:
        """`update()` once per bucket, with that bucket's pieces and their states in a pool buffer."""
        self._absorb()
        self.release([self._map])  # pages a reader faulted in since the last step (a checkpoint, the user)
        # every piece of a parameter starts from its state as it was before this step: scalars and plain values
        self._before = {id(p): {name: _copy(v) for name, v in st.items() if name not in self.states}
                        for p, st in self.opt.state.items() if st}
        self.stats = OffloadStats(buckets=len(self.buckets), pool_bytes=self.stats.pool_bytes,
                                  store_bytes=self.stats.store_bytes)
        if self.resident:
            with _only(self.opt, {id(p): [(p, None, None)] for p in self.resident}):
                update()
        reads, writes = {}, []
        for k in range(min(NBUF - 1, len(self.buckets))):
            reads[k] = self._io("read", k)
        try:
            for k, bucket in enumerate(self.buckets):
                buf = self._wait(reads.pop(k), "read", k)
                if k + NBUF - 1 < len(self.buckets):  # into bucket k-1's buffer, after its write (one worker, in order)
                    reads[k + NBUF - 1] = self._io("read", k + NBUF - 1)
                self._update(bucket, buf, update)
                writes.append((k, self._io("write", k)))
        finally:
            for k, future in writes:
                self._wait(future, "write", k)
            for future in reads.values():
                future.exception()  # let pending reads finish before the buffers can be reused

    def _io(self, what: str, k: int):
        """Submit bucket k's transfer between its buffer and the store: one call per piece and place."""
        buf = self.pool[k % len(self.pool)]
        parts = []
        for piece in self.buckets[k].pieces:
            at = piece.offset
            for place in self.places[id(piece.param)]:
                n = (piece.stop - piece.start) * place.dtype.itemsize
                parts.append((buf[at: at + n], place.offset + piece.start * place.dtype.itemsize))
                at += n
        nbytes = sum(b.numel() for b, _ in parts)
        if what == "read":
            self.stats.read_bytes += nbytes
        else:
            self.stats.written_bytes += nbytes
        return self.store.submit(what, parts)

    def _wait(self, future, what: str, k: int) -> torch.Tensor:
        self.store.wait(future, f"{what} of bucket {k}")
        return self.pool[k % len(self.pool)]

    def _update(self, bucket: _Bucket, buf: torch.Tensor, update) -> None:
        """The optimizer's own update on temporary parameters, one per piece, whose data (offloaded parameters),
        states and gradients are the piece's slices."""
        temps = {}
        for piece in bucket.pieces:
            p, a, b = piece.param, piece.start, piece.stop
            views = dict(self._views(piece, buf))
            data = views.pop(PARAM) if self.with_params else p.detach().view(-1)[a:b]
            q = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            q.grad = None if p.grad is None else p.grad.detach().view(-1)[a:b]
            if id(p) in self._before:
                self.opt.state[q] = {**{name: _copy(v) for name, v in self._before[id(p)].items()},
                                     **{name: v for name, v in views.items() if name != PARAM}}
            temps[id(p)] = temps.get(id(p), []) + [(q, piece, views)]
        try:
            with _only(self.opt, temps):
                update()
        finally:
            for pieces in temps.values():
                for q, piece, views in pieces:
                    self._keep(piece.param, self.opt.state.pop(q, None), views)

    def _keep(self, p: torch.nn.Parameter, state: dict | None, views: dict) -> None:
        """A piece's states after its update: created ones copied into the buffer, scalars back to `p`'s state."""
        if not state:
            return
        own = self.opt.state[p]
        for name, value in state.items():
            if name in views:
                if value.data_ptr() != views[name].data_ptr():  # created by this update
                    views[name].copy_(value)
                if name not in own:
                    own[name] = self._mapped(p, self._place(p, name))
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                raise MeshcValueError(f"Plan.offload: {self.names.get(id(p), '?')}: expected the optimizer's states "
                                      f"{sorted(n for n in self.states if n != PARAM)} (probed when it was made), got "
                                      f"a new one {name!r}; make the optimizer with the arguments it will step with")
            else:
                own[name] = value

    def _views(self, piece: _Piece, buf: torch.Tensor):
        at = piece.offset
        n = piece.stop - piece.start
        for place in self.places[id(piece.param)]:
            yield place.name, buf[at: at + n * place.dtype.itemsize].view(place.dtype)
            at += n * place.dtype.itemsize

    def _absorb(self) -> None:
        """State entries (and offloaded parameters) that are not the store's views become so, their values
        written into the store first: what a checkpoint load, opt.load_state_dict or the user put there."""
        with torch.no_grad():
            for group in self.opt.param_groups:
                for p in group["params"]:
                    state = self.opt.state.get(p) or {}
                    for place in self.places[id(p)]:
                        current = p.data if place.name == PARAM else state.get(place.name)
                        if current is None:
                            continue
                        view = self._mapped(p, place)
                        if current.data_ptr() != view.data_ptr():
                            view.copy_(current)
                            if place.name == PARAM:
                                p.data = view
                            else:
                                state[place.name] = view

    # ------------------------------------------------------------------------------ between steps
    def release(self, tensors) -> None:
        """Drop the pages of `tensors` that lie in the store's mapping from this process (they stay in the file
        and the page cache; the next read faults them in again)."""
        pages.drop(tensors)

    def destination(self, p: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """Where a load should write state `name` of `p`: its view of the store (None if it has no place there)."""
        place = self._place(p, name)
        return self._mapped(p, place) if place is not None and place.dtype == dtype else None

    def is_offloaded(self, t: torch.Tensor) -> bool:
        """Whether `t` lives in the store (its bytes are not in the device's memory: in the file, or in host memory
        for "cpu" on a GPU)."""
        return self._map.numel() > 0 and t.untyped_storage().data_ptr() == self._map.untyped_storage().data_ptr()

    def close(self) -> None:
        pages.unregister(self._map)
        self.store.close()

    def _place(self, p, name: str) -> _Place | None:
        return next((place for place in self.places.get(id(p), ()) if place.name == name), None)

    def _mapped(self, p: torch.Tensor, place: _Place) -> torch.Tensor:
        n = p.numel() * place.dtype.itemsize
        return self._map[place.offset: place.offset + n].view(place.dtype).view(p.shape)


@contextlib.contextmanager
def _only(opt: torch.optim.Optimizer, temps: dict):
    """The optimizer's param_groups holding the temporary pieces of their parameters, restored after."""
    saved = [g["params"] for g in opt.param_groups]
    try:
        for g in opt.param_groups:
            g["params"] = [q for p in g["params"] for q, _, _ in temps.get(id(p), ())]
        yield
    finally:
        for g, ps in zip(opt.param_groups, saved):
            g["params"] = ps


def _buckets(params: list, per_element: dict, cap: int, names: dict) -> list[_Bucket]:
    """Pieces of consecutive elements, packed in order into buckets of at most `cap` bytes (each piece's
    places one after another, starting on 8 bytes)."""
    out: list[_Bucket] = []
    for p in params:
        each = per_element[id(p)]
        if each == 0:
            continue  # nothing of it offloaded: it steps in memory
        if each + 8 > cap:
            raise MeshcValueError(f"Plan.offload_buffer_mb: expected room for one element's offloaded bytes of "
                                  f"{names.get(id(p), '?')} in a third of the pool, got a pool of {NBUF * cap} bytes")
        start, numel = 0, p.numel()
        while start < numel:
            if not out or out[-1].nbytes + each + 8 > cap:
                out.append(_Bucket([], 0))
            bucket = out[-1]
            stop = min(numel, start + (cap - bucket.nbytes - 8) // each)
            bucket.pieces.append(_Piece(p, start, stop, bucket.nbytes))
            bucket.nbytes = _round(bucket.nbytes + (stop - start) * each, 8)  # the next piece starts aligned
            start = stop
    return out


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _round(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to
