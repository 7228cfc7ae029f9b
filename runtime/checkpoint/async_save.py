"""Asynchronous saves: the step continues while the checkpoint's files are written.

    handle = job.save("ckpt/step_100", step=100, async_=True)  # every rank; returns once the state is staged
    ...                                                         # training goes on and mutates parameters, states
    handle.wait()                 # the folder's path once it is complete (or job.wait_for_save(), on every rank)
    handle.blocked_s              # seconds the call held the caller: waiting for the previous save + staging

Semantics. The call does what a synchronous save does first, on the caller's thread and the world's process
group (the target checked on every rank, PATH.partial made afresh by rank 0), then *stages*: every piece this rank
writes is copied into a private contiguous CPU tensor (the live ones may be views into ZeRO's flat shards, or on a
GPU), and the RNG states and manifest fields are taken. From then on training may change anything. A background
thread writes the staged copies into PATH.partial through DCP, exactly as `save` does, then rank 0 writes the
manifest and renames the folder to PATH once every rank has written: atomicity is the synchronous save's, so a
rank killed during an async save leaves the previous checkpoint at PATH as it was (and PATH.partial unfinished).
At most one save of a job is in flight: `job.save` (async or not) and `job.load` first wait for the previous one.
Staging costs host memory for one copy of what this rank writes (its shards of parameters and states, once).

Why meshc's thread and not `dcp.async_save`. torch 2.13's async_save stages the *state_dict* it is given (its
DefaultStager, or the writer as a BlockingAsyncStager) and runs `dcp.save` in an executor thread. meshc hands DCP
an empty state_dict and its tensors through PieceSavePlanner (boxes of ZeRO's flat shards and tp slices,
format.py), which that stager never sees: async_save would write the live tensors while training mutates them.
And its future ends with DCP's write, while a meshc save ends with a collective step on the same ranks (every
rank's tensor list gathered, rank 0's manifest and rename, rank 0's status broadcast): a done-callback would run it
in DCP's executor thread with its errors only logged. So meshc stages the pieces itself and runs the same
`begin_save`/`finish_save` as a synchronous save, the second half in one thread of its own.

Why a process group of its own. The background thread's collectives (DCP's plan and result exchange, the gather
and broadcast of the publish step) run while the training thread issues its own on the mesh's groups; gloo and
NCCL do not support collectives on one group from two threads. So the first async save of a job creates, on every
rank and collectively, a gloo group over the whole world (CPU tensors only: what DCP's object collectives need,
on NCCL meshes too) with the mesh's timeout, used by that job's background saves and by nothing else; the job holds
it (no process group in a module global).

Errors are never swallowed: a background failure is logged at once (naming the rank and path) and raised by the
next `handle.wait()`, `job.wait_for_save()`, `job.save` or `job.load` on that rank: a MeshcRuntimeError naming the
rank and path, or for a dead or stalled peer a RankFailure naming it (runtime/monitor/failures.py's diagnosis).
Every wait is bounded: the background's collectives time out with the mesh's timeout.

Exit. `mesh.close()` waits for every pending save of the process, then closes, then raises a failed save's error.
At interpreter exit (atexit, before failures.py's handler) a pending save is waited for, up to
EXIT_WAIT_TIMEOUTS x the mesh's timeout; one still running then, or one that failed unseen, is reported on stderr
with its rank and path; PATH keeps the previous checkpoint.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import types
import weakref

import torch
import torch.distributed as dist

from meshc.compiler.ir.errors import MeshcRuntimeError
from meshc.runtime.checkpoint.format import Piece
from meshc.runtime.checkpoint.save_load import SaveWork, begin_save, finish_save, save
from meshc.runtime.monitor import failures

log = logging.getLogger("meshc.checkpoint")
EXIT_WAIT_TIMEOUTS = 3  # at exit, how many mesh timeouts a pending save is waited for
_PENDING: weakref.WeakSet = weakref.WeakSet()  # this process's unfinished async saves (handles, no group): for exit


class SaveHandle:
    """An async save in flight on this rank. `wait()` returns its path or raises its error; `done()` polls.

    `blocked_s`: seconds `job.save` held the caller (of which `waited_s` waiting for the previous save, the rest the
    checks and staging `staged_bytes`); `write_s`: seconds the background took, None until done."""

    def __init__(self, path: str, step: int, rank: int, mesh):
        self.path, self.step, self.rank = path, step, rank
        self.blocked_s = self.waited_s = 0.0
        self.staged_bytes = 0
        self.write_s: float | None = None
        self._mesh, self._done = mesh, threading.Event()
        self._error: BaseException | None = None
        self._surfaced = False  # raised once to the caller: a later save does not raise it again

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the save is complete and visible at `path` (returned), or raise its error."""
        if not self._done.wait(timeout):
            raise MeshcRuntimeError(f"job.save(async_=True) to {self.path}: expected it written within {timeout} s, "
                                    f"got it still writing on rank {self.rank}; wait longer (its collectives time out "
                                    "with the mesh's timeout)")
        if self._error is not None:
            self._surfaced = True
            _raise(self)
        return self.path

    def __repr__(self) -> str:
        state = "failed" if self._error else "written" if self.done() else "writing"
        return f"SaveHandle({self.path!r}, step={self.step}, {state}, blocked_s={self.blocked_s:.3f})"


class Saver:
    """One job's checkpoint saves: at most one in flight, and the process group its background saves talk over
    (made at the first async save)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.group: dist.ProcessGroup | None = None
        self.pending: SaveHandle | None = None

    def wait(self) -> SaveHandle | None:
        """Wait for the save in flight, if any; raise its error unless the caller has seen it already."""
        handle, self.pending = self.pending, None
        if handle is None:
            return None
        handle._done.wait()  # bounded: the background's collectives time out with the mesh's timeout
        if handle._error is not None and not handle._surfaced:
            handle._surfaced = True
            _raise(handle)
        return handle

    def save(self, job, path, *, step: int, extra, optimizers, async_: bool):
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        if not async_:
            return save(job, path, step=step, extra=extra, optimizers=optimizers)
        with failures.watching(self.mesh, "job.save"):
            if self.group is None:  # every rank, collectively, at its first async save
                self.group = dist.new_group(backend="gloo", timeout=self.mesh.timeout)
                _wait_before_close(self.mesh)
            work = begin_save(job, path, step=step, extra=extra, optimizers=optimizers)
            staged = stage(work)
        handle = SaveHandle(work.path, int(step), work.rank, self.mesh)
        handle.waited_s, handle.staged_bytes = waited, staged
        handle.blocked_s = time.perf_counter() - t0
        _PENDING.add(handle)
        self.pending = handle
        threading.Thread(target=_write, args=(handle, work, self.group), name="meshc-async-save", daemon=True).start()
        log.info("async save of step %d to %s: the step was blocked %.3f s (%.3f s waiting for the previous save, "
                 "%.1f MiB staged); writing in the background", handle.step, work.path, handle.blocked_s, waited,
                 staged / 2**20)
        return handle


def stage(work: SaveWork) -> int:
    """Replace the views of live tensors in `work.items` by private contiguous CPU copies (and the manifest's
    `extra` by a copy of its own); returns the bytes copied."""
    total = 0
    for key, (shape, dtype, parts) in work.items.items():
        copies = []
        for p in parts:
            copy = torch.empty(tuple(p.view.shape), dtype=p.view.dtype, device="cpu")
            copy.copy_(p.view.detach())
            copies.append(Piece(p.offsets, p.sizes, copy))
            total += copy.numel() * copy.element_size()
        work.items[key] = (shape, dtype, copies)
    work.header = dict(work.header, extra=json.loads(json.dumps(work.header["extra"])))
    return total


def _write(handle: SaveHandle, work: SaveWork, group: dist.ProcessGroup) -> None:
    """The background thread: the synchronous save's second half over the checkpoint group."""
    t0 = time.perf_counter()
    try:
        finish_save(work, group=group, staged=True)
    except BaseException as e:  # noqa: BLE001 - kept for the caller's next wait or save, and logged now
        handle._error = e
        log.error("async save to %s failed on rank %d: %s: %s (raised at the next wait, save or load)", work.path,
                  _failed_rank(e, work.rank), type(e).__name__, _first_line(e))
    else:
        handle.write_s = time.perf_counter() - t0
        log.info("async save of step %d to %s: written in %.3f s in the background", handle.step, work.path,
                 handle.write_s)
    finally:
        handle._done.set()


def _raise(handle: SaveHandle) -> None:
    """Raise a background failure on the caller's thread: a RankFailure naming a dead or stalled peer, or a
    MeshcRuntimeError naming the rank that failed; both name the path."""
    e = handle._error
    where = f"job.save(async_=True) to {handle.path}"
    keep = (f"the previous checkpoint at {handle.path}, if any, is intact and {os.path.basename(handle.path)}.partial "
            "is unfinished: save again")
    if failures.is_comm_failure(e):
        try:
            with failures.watching(handle._mesh, "job.save(async_=True)"):
                raise e
        except failures.RankFailure as rf:
            raise failures.RankFailure(f"{where} failed ({keep}): {rf}", rf.dead, rf.stalled, rf.op) from e
    raise MeshcRuntimeError(f"{where}: expected the background write to succeed, got a failure on rank "
                            f"{_failed_rank(e, handle.rank)}: {type(e).__name__}: {_first_line(e)}; {keep}") from e


def _failed_rank(e: BaseException, me: int) -> int:
    failed = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: error}
    return next(iter(failed)) if isinstance(failed, dict) and failed else me


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:400] if text else type(e).__name__


def wait_all() -> None:
    """Wait for every async save of this process; raise the first failure not seen yet."""
    error = None
    for handle in list(_PENDING):
        handle._done.wait()
        if handle._error is not None and not handle._surfaced and error is None:
            error = handle
    if error is not None:
        error._surfaced = True
        _raise(error)


def _wait_before_close(mesh) -> None:
    """Make `mesh.close()` wait for the pending saves first (it destroys the groups they write over), then close,
    then raise a failed save's error. Wrapped on the instance, as failures.guard_optimizer wraps a step."""
    if getattr(mesh, "_meshc_waits_for_saves", False):
        return
    original = mesh.close

    def close(self) -> None:
        try:
            wait_all()
        finally:
            original()
    mesh.close = types.MethodType(close, mesh)
    mesh._meshc_waits_for_saves = True


def _at_exit() -> None:
    for handle in list(_PENDING):
        if not handle.done():
            limit = EXIT_WAIT_TIMEOUTS * handle._mesh.timeout.total_seconds()
            print(f"meshc: rank {handle.rank} waits for its async save to {handle.path} before exiting", file=sys.stderr)
            if not handle._done.wait(limit):
                print(f"meshc: ERROR: rank {handle.rank} exits with its async save to {handle.path} unfinished after "
                      f"{limit:.0f} s; {handle.path} keeps the previous checkpoint", file=sys.stderr)
                continue
        if handle._error is not None and not handle._surfaced:
            e = handle._error
            print(f"meshc: ERROR: the async save to {handle.path} failed on rank {_failed_rank(e, handle.rank)}: "
                  f"{type(e).__name__}: {_first_line(e)}; {handle.path} keeps the previous checkpoint", file=sys.stderr)


atexit.register(_at_exit)  # registered after failures.py's (imported above): runs before it
