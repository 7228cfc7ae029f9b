"""Multi-process test harness: run a function on N ranks over gloo on 127.0.0.1, with a deadline.

    results = run_ranks(fn, 4, arg1, arg2, timeout=120)   # [fn's return value on rank 0, 1, 2, 3]

Each rank is a process with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, ...),
so `meshc.mesh()` inside `fn` initializes exactly as it does under torchrun; the rendezvous store is
served by this process, as torchrun's agent serves it. Children come from a forkserver that has
already imported torch, meshc (all of it) and transformers and traced once (tests/rank_warmup.py), so a rank
starts in a fraction of a second.

Every rank is bounded by `timeout`: if any rank raises, the others get a short grace to fail too, then
all are killed, and RankFailure reports each failed rank with its traceback. `fn` must be importable
(a module-level function) and its return value is passed back through torch.save.
"""
from __future__ import annotations

import gc
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

PRELOAD = ["torch", "torch.distributed", "meshc", "meshc.passes.tensor_parallel", "tests.zoo", "tests.parity",
           "torch.testing._internal.distributed._tensor.common_dtensor", "transformers",
           *(f"transformers.models.{m}.modeling_{m}"
             for m in ("gpt2", "llama", "bert", "mixtral", "t5", "bloom", "falcon")), "tests.rank_warmup"]
_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(PRELOAD)


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds each failed rank's error."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              grace: float = 20.0, env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    results: queue.Queue = _ctx.Queue()
    procs = [
        _ctx.Process(target=_child, args=(fn, rank, world_size, store.port, args, kwargs, env or {}, results),
                     name=f"rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=min(max(deadline - time.monotonic(), 0.01), 1.0))
                outcome[rank] = (ok, payload)
            except queue.Empty:
                for r, p in enumerate(procs):  # died without reporting: killed, segfault, os._exit
                    if r not in outcome and p.exitcode not in (None, 0):
                        outcome[r] = (False, f"exited with code {p.exitcode} without reporting")
            if any(not ok for ok, _ in outcome.values()):  # the others get a grace to fail too
                deadline = min(deadline, time.monotonic() + grace)
    finally:
        _stop(procs)
    failures = {r: msg for r, (ok, msg) in outcome.items() if not ok}
    missing = [r for r in range(world_size) if r not in outcome]
    for r in missing:
        failures[r] = f"no result within {timeout:.0f} s (killed)"
    if failures:
        for ok, payload in outcome.values():
            if ok and isinstance(payload, str):  # a result left in a file, never to be read
                os.unlink(payload)
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise RankFailure(f"{len(failures)} of {world_size} ranks failed:\n{text}")
    return [_result(outcome[r][1]) for r in range(world_size)]


_INLINE = 16 << 20  # bytes of a rank's result sent through the queue itself


def _result(payload: bytes | str) -> Any:
    """A rank's result: its bytes, or the file it wrote them to (removed once read)."""
    if isinstance(payload, str):
        try:
            return torch.load(payload, weights_only=False)
        finally:
            os.unlink(payload)
    return torch.load(io.BytesIO(payload), weights_only=False)


def _stop(procs) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():  # finished its work but hangs at exit, or never finished: end it
            p.kill()
            p.join(timeout=5)


def _child(fn, rank, world_size, port, args, kwargs, env, results) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "lo",
    })
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        value = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(value, buf)
        if buf.tell() > _INLINE:  # a large result goes through a file: pickled into the queue's pipe by its feeder
            fd, path = tempfile.mkstemp(prefix=f"meshc-rank{rank}-", suffix=".pt",  # thread, a failure there (out of
                                        dir=os.environ.get("TMPDIR") or None)
            with os.fdopen(fd, "wb") as f:  # memory) would never reach the parent, which would wait out its timeout
                f.write(buf.getbuffer())
            results.put((rank, True, path))
        else:
            results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure is reported with its rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
