"""Failures that never hang: bounded waits, errors that name the failed rank, and a pre-flight check.

Timeouts. `meshc.mesh(timeout_s=...)` hands its timeout to init_process_group and to every new_group,
and on gloo that bounds every wait: collectives, functional collectives' wait_tensor, and the pipeline's
irecv().wait() alike (measured: a stalled peer makes each raise after exactly the timeout; a killed peer
makes them raise in ~0.05 s with "Connection reset by peer"). On NCCL the same timeout arms torch's
watchdog, which aborts the process; set TORCH_NCCL_TRACE_BUFFER_SIZE to keep its flight recorder.

Naming the rank. gloo's errors name an address or nothing. So each rank runs a heartbeat thread that
writes a counter and its current phase ("job.step 12") to the rendezvous store every 0.25 s, over its
own connection (the store outlives a dead worker: torchrun's agent or the launcher serves it). When a
communication error escapes a watched region (job.step, the optimizer step, job.save, job.load) the
rank finds the op it was waiting in from the traceback (the innermost collective call, its group; the
pipeline message and its peer), publishes its own failure, watches the heartbeats for a second, and
raises RankFailure naming the dead ranks (heartbeat stopped, no failure of their own), the stalled ones
(alive, in the op's group, not failing), their last phase, and its own op. This works where a monitored
barrier cannot: after a peer died, the gloo pairs to it are gone, while the store still answers.

Exit. A thread that needs the GIL after the interpreter began finalizing is ended by CPython with
pthread_exit, whose forced unwind through a noexcept C++ frame calls std::terminate ("terminate called
without an active exception", SIGABRT, exit code 134 after a run that trained correctly). Two threads do:
the heartbeat, when it is inside TCPStore.set (measured: 20 of 20 processes exiting with it there abort),
and gloo's worker threads, which destroy a finished collective's work object after the caller's wait()
returned and decref its tensors' Python objects (core dump: ProcessGroupGloo::runLoop ->
~AsyncAllgatherWork -> decref_pyobject -> take_gil -> pthread_exit; measured: 4 ranks that end with
dist.all_gather_object and exit, plain torch: 8 of 15 runs lose a rank). So at exit (atexit, before
finalization, also without mesh.close()) the heartbeat is joined and the main thread sleeps EXIT_GRACE_S
with the GIL released while those threads finish (same 15 runs: 0 aborts).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import socket
import threading
import time
import types
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from meshc.compiler.ir.errors import MeshcError, MeshcValueError
from meshc.compiler.ir.placement import format_placements

INTERVAL = 0.25  # seconds between heartbeats
STORE_TIMEOUT_S = 10  # the heartbeat's own store connection
PROBE = 1.0  # seconds a failing rank watches the others' heartbeats
COMM_WORDS = ("gloo", "Connection", "connection", "Timed out", "timed out", "NCCL", "Socket", "Broken pipe",
              "reset by peer", "closed by peer")


class RankFailure(MeshcError, RuntimeError):
    """A peer died or stalled while this rank waited for it. `dead` and `stalled` are world ranks."""

    def __init__(self, message: str, dead: list[int], stalled: list[int], op: str):
        super().__init__(message)
        self.dead, self.stalled, self.op = dead, stalled, op


# ---------------------------------------------------------------------------------------- heartbeats
class _Monitor:
    """This process's heartbeat in the rendezvous store, and reads of everyone else's."""

    def __init__(self, store: dist.Store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self.phase, self.count = "started", 0
        self.counts: dict[str, int] = {}
        self._stop, self._lock = threading.Event(), threading.Lock()
        store.set(f"pid/{rank}", f"{socket.gethostname()}|{os.getpid()}")
        self._beat_once()
        self._thread = threading.Thread(target=self._run, name="meshc-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and wait for the thread: nothing of it is left running when the process group goes."""
        self._stop.set()
        if self._thread is not threading.current_thread():  # a beat in progress ends within the store's timeout
            self._thread.join(timeout=STORE_TIMEOUT_S + 5)

    def enter(self, what: str) -> str:
        """Publish the phase this rank enters now (a peer that dies in it is reported there)."""
        self.counts[what] = n = self.counts.get(what, 0) + 1
        self.phase = f"{what} #{n}"
        self._beat_once()
        return self.phase

    def _beat_once(self) -> None:
        with self._lock:  # the main thread publishes phases, the heartbeat thread beats: one at a time
            self.count += 1
            self.store.set(f"beat/{self.rank}", f"{self.count}|{self.phase}")

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL):
            try:
                self._beat_once()
            except Exception:  # noqa: BLE001 - the store is gone (launcher ended): nothing left to tell
                return

    def read(self, prefix: str) -> dict[int, str]:
        keys = [f"{prefix}/{r}" for r in range(self.world)]
        return {r: self.store.get(k).decode() for r, k in enumerate(keys) if self.store.check([k])}


_MONITORS: dict[int, tuple[object, _Monitor]] = {}  # id(world group) -> (the group, kept so its id stays its own)


def _monitor() -> _Monitor | None:
    """The heartbeat of this process's world (started on first use; None without a TCP rendezvous)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or "MASTER_ADDR" not in os.environ:
        return None
    world = dist.group.WORLD
    key = id(world)
    if key not in _MONITORS:
        for _, old in _MONITORS.values():  # an earlier world of this process: its heartbeat has nobody to tell
            old.stop()
        try:
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        except Exception:  # noqa: BLE001 - no store to reach: failures are reported without names
            return None
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"meshc/{run}/{attempt}/{len(_MONITORS)}/", client)
        _MONITORS[key] = (world, _Monitor(store, dist.get_rank(), dist.get_world_size()))
    return _MONITORS[key][1]


def stop_monitors() -> None:
    """Stop every heartbeat of this process (before its process groups are destroyed, and at exit)."""
    while _MONITORS:
        _, (_, monitor) = _MONITORS.popitem()
        monitor.stop()


EXIT_GRACE_S = 0.05


def _at_exit() -> None:
    """Before the interpreter finalizes (module docstring: Exit): join the heartbeat, and give torch's
    communication threads a moment, GIL released, to finish destroying the work of the last collectives."""
    stop_monitors()
    if dist.is_available() and dist.is_initialized():
        time.sleep(EXIT_GRACE_S)


atexit.register(_at_exit)


# ---------------------------------------------------------------------------------------- watching
@contextlib.contextmanager
def watching(mesh, what: str):
    """Run a region whose communication errors become a RankFailure naming the failed rank and the op."""
    monitor = _monitor()
    phase = monitor.enter(what) if monitor else what
    try:
        yield
    except RankFailure:
        raise
    except BaseException as e:
        if not is_comm_failure(e):
            if monitor is not None and isinstance(e, MeshcError):  # peers waiting for this rank will say why
                _publish(monitor, phase, e)
            raise
        message, dead, stalled, op = _diagnose(mesh, monitor, phase, e)
        raise RankFailure(message, dead, stalled, op) from e
    finally:
        if monitor:
            monitor.phase = f"after {phase}"


def guard_optimizer(optimizer: torch.optim.Optimizer, mesh) -> None:
    """Run `optimizer.step` (and the ZeRO collectives its hooks issue) under `watching`. It stays a bound
    method, as torch's LR schedulers expect when they wrap it."""
    original = optimizer.step

    def step(self, *args, **kwargs):
        with watching(mesh, "optimizer.step"):
            return original(*args, **kwargs)
    optimizer.step = types.MethodType(step, optimizer)


def is_comm_failure(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: one error per failed rank
    if isinstance(failures, dict):
        errors = [f[0] if isinstance(f, tuple) else f for f in failures.values()]  # (exception, stack) pairs
        return any(isinstance(f, BaseException) and is_comm_failure(f) for f in errors)
    return isinstance(e, RuntimeError) and any(w in str(e) for w in COMM_WORDS)


def _diagnose(mesh, monitor: _Monitor | None, phase: str, error: BaseException) -> tuple[str, list, list, str]:
    op, members, where = _waiting_in(error, mesh)
    me = dist.get_rank()
    first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    head = f"rank {me} failed in {phase}{f' ({where})' if where else ''} while waiting in {op}"
    if monitor is None:
        return f"{head}: {first_line}. No rendezvous store to tell which rank failed.", [], [], op
    try:
        monitor.store.set(f"failed/{me}", f"{phase}: {op}")
        before = monitor.read("beat")
        time.sleep(PROBE)
        after, failed = monitor.read("beat"), monitor.read("failed")
    except Exception as e:  # noqa: BLE001 - the store itself is gone
        return (f"{head}: {first_line}. The rendezvous store is unreachable too ({e}); the rank hosting it "
                "(rank 0 when launched without torchrun's agent) has probably died.", [], [], op)
    others = [r for r in range(monitor.world) if r != me]
    stopped = [r for r in others if r not in after or before.get(r) == after.get(r)]
    stopped = [r for r in stopped if _process_state(monitor, r) != "alive"]  # a starved heartbeat is no death
    dead = [r for r in stopped if r not in failed]
    timed_out = "imed out" in str(error) or "timeout" in str(error).lower()
    stalled = [r for r in members if r != me and r not in stopped and r not in failed] if timed_out else []
    parts = []
    for r in dead:
        last = after.get(r, "").partition("|")[2] or "never started"
        parts.append(f"rank {r} is dead (no heartbeat for {PROBE:.0f} s; last seen in {last})")
    for r in stalled:
        parts.append(f"rank {r} is alive but never joined the op (stalled in {after[r].partition('|')[2]})")
    for r in sorted(set(stopped) - set(dead)):
        parts.append(f"rank {r} failed too ({failed[r]})")
    for r in sorted(set(failed) - set(stopped) - {me}):
        parts.append(f"rank {r} failed ({failed[r]})")
    if not dead and not stalled and not set(failed) - {me}:
        parts.append("no peer found dead or stalled: the op failed on its own")
    text = (f"{head}: " + "; ".join(parts) + f". Original error: {first_line}. Restart from the last checkpoint "
            "(job.load); under torchrun --max-restarts this happens by itself.")
    return text, dead, stalled, op


def _publish(monitor: _Monitor, phase: str, error: BaseException) -> None:
    """This rank's own error (not a peer's), for the peers that wait for it in the next collective."""
    first = str(error).strip().splitlines()[0][:400] if str(error).strip() else type(error).__name__
    try:
        monitor.store.set(f"failed/{monitor.rank}", f"{phase}: {type(error).__name__}: {first}")
    except Exception:  # noqa: BLE001 - the store is gone: the error still reaches this rank's caller
        pass


def _process_state(monitor: _Monitor, rank: int) -> str:
    """"alive" or "dead" (gone, or a zombie) for a rank on this host; "unknown" elsewhere."""
    key = f"pid/{rank}"
    try:
        if not monitor.store.check([key]):
            return "unknown"
        host, _, pid = monitor.store.get(key).decode().partition("|")
    except Exception:  # noqa: BLE001 - the store is gone: nothing more to learn
        return "unknown"
    if host != socket.gethostname() or not os.path.isdir("/proc"):
        return "unknown"
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError):
        return "dead"
    return "dead" if state in ("Z", "X") else "alive"


def _waiting_in(error: BaseException, mesh) -> tuple[str, list[int], str]:
    """The op this rank was waiting in (from the traceback), the ranks taking part, and forward/backward."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    op, members, where = "an unknown collective", list(range(dist.get_world_size())), ""
    names = {name: (axis, list(ranks)) for (axis, ranks), name in mesh.spec.group_names.items()}
    previous_c10d = False
    for f in frames:
        file, fn, local = f.f_code.co_filename, f.f_code.co_name, f.f_locals
        c10d = file.endswith(os.path.join("distributed", "distributed_c10d.py"))
        if fn in ("backward", "_engine_run_backward"):
            where = "backward"
        if file.endswith("torch_compat.py") and "group_name" in local:
            axis, members = names.get(local["group_name"], ("?", members))
            op = f"{fn} over {axis} (ranks {','.join(map(str, members))})"
        elif file.endswith(os.path.join("runtime", "pipeline", "executor.py")) and fn == "_message" and "op" in local:
            m, peer = local["op"], mesh.group_ranks("pp")[local["op"].peer]
            members = [mesh.rank, peer]
            what = "activations" if m.kind == "F" else "gradients"
            toward = "to" if m.op == "send" else "from"
            op = f"pipeline {m.op} of {what} of micro-batch {m.microbatch} (stage {m.stage}) {toward} rank {peer}"
        elif file.endswith(os.path.join("runtime", "pipeline", "executor.py")) and fn == "_compute" and "a" in local:
            where = "backward" if local["a"].kind in ("B", "I", "W") else "forward"
        elif c10d and not previous_c10d:
            group = local.get("group")
            members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            op = f"torch.distributed.{fn} (ranks {','.join(map(str, members))})"
        previous_c10d = c10d
    if not where and any(f.f_globals.get("__name__") == "meshc.job" for f in frames):  # the Job's forward
        where = "forward"
    return op, list(members), where


# ---------------------------------------------------------------------------------------- elastic restarts
def elastic_store(timeout: timedelta) -> dict:
    """init_process_group arguments for a worker that torchrun may restart: its rendezvous scoped by attempt.

    torchrun keeps one store across restarts, and the previous attempt's gloo addresses are still in it: a
    restarted worker connects to the dead ports and fails ("Connection refused", pytorch/pytorch#167288).
    Empty (torch's own env:// rendezvous) when not launched by torchrun.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)  # else torchrun's agent serves it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=hosted and rank == 0, timeout=timeout)
    return {"store": dist.PrefixStore(f"meshc/attempt_{attempt}/", store), "rank": rank, "world_size": world}


# ---------------------------------------------------------------------------------------- pre-flight
_CHECKED: "weakref.WeakSet" = weakref.WeakSet()


def preflight(job) -> None:
    """Compare every rank's plan fingerprint once, before the job's first step; raise on a mismatch."""
    mesh = job.mesh
    if job in _CHECKED or mesh.world_size == 1 or mesh.backend == "fake":
        return
    everyone = [None] * mesh.world_size
    with watching(mesh, "pre-flight"):
        dist.all_gather_object(everyone, fingerprint(job))
    problem = first_mismatch(everyone, mesh)
    if problem:
        raise MeshcValueError(problem)
    _CHECKED.add(job)


def fingerprint(job) -> dict:
    """What every rank must agree on before a step, and this rank's pipeline messages."""
    program, mesh = job.program, job.mesh
    plan = {f.name: repr(getattr(job.plan, f.name)) for f in dataclasses.fields(job.plan)
            if f.name not in ("debug_dir", "verify", "offload_dir")}  # a rank's own resources, not the plan
    params = [f"{s.fqn} {tuple(s.shape)} {s.dtype} {format_placements(s.placements)}" for s in program.params.values()]
    comms = [f"{r.kind} over {r.axis}, {r.bytes} B, {r.phase}, x{r.count}" for _, r in program.comm_records()]
    messages = []
    pipeline = job.compiled.pipeline
    if pipeline is not None and mesh.size("pp") > 1:
        ranks = mesh.group_ranks("pp")
        for m in pipeline.schedule.program(mesh.coord("pp")):
            if hasattr(m, "peer"):
                producer = m.stage if m.op == "send" else (m.stage - 1 if m.kind == "F" else m.stage + 1)
                messages.append((m.op, ranks[m.peer], f"{m.kind} micro-batch {m.microbatch} from stage {producer}"))
    plan.update({f"decision {k}": repr(d.value) for k, d in program.decisions.items()})  # the cost model's, per rank
    return {"world": mesh.world_size, "mesh": dict(mesh.sizes), "plan": plan, "params": params,
            "collectives": comms, "messages": messages}


def first_mismatch(everyone: list[dict], mesh=None) -> str | None:
    """The first disagreement between ranks' fingerprints, in words with both values; None if none."""
    first = everyone[0]
    for r, fp in enumerate(everyone):
        for section in ("world", "mesh"):
            if fp[section] != first[section]:
                return _differ(section, first[section], fp[section], r)
        for name, value in first["plan"].items():
            if fp["plan"].get(name) != value:
                return _differ(f"Plan.{name}", value, fp["plan"].get(name), r)
        for section in ("params", "collectives"):
            a, b = first[section], fp[section]
            for i in range(max(len(a), len(b))):
                x, y = (a[i] if i < len(a) else "nothing"), (b[i] if i < len(b) else "nothing")
                if x != y:
                    return _differ(f"{section} #{i}", x, y, r)
    return _unmatched_message(everyone)


def _differ(what: str, a, b, r: int) -> str:
    return (f"pre-flight: ranks disagree on {what}: expected the same on every rank, got {a} on rank 0 and {b} on "
            f"rank {r}; give every rank the same model, mesh and Plan")


def _unmatched_message(everyone: list[dict]) -> str | None:
    """Every pipeline send must meet its receive on the peer, in the same order per kind: activations and gradients
    travel on groups of their own (Mesh.pipeline_group), each paired in order by a backend without tags (NCCL);
    a V schedule interleaves the two kinds differently on the two ends, which is fine."""
    for src, fp in enumerate(everyone):
        for dst in sorted({peer for op, peer, _ in fp["messages"] if op == "send"}):
            for kind in ("F", "B"):
                sent = [w for op, peer, w in fp["messages"] if op == "send" and peer == dst and w.startswith(kind)]
                got = [w for op, peer, w in everyone[dst]["messages"]
                       if op == "recv" and peer == src and w.startswith(kind)]
                for i in range(max(len(sent), len(got))):
                    x, y = (sent[i] if i < len(sent) else "nothing"), (got[i] if i < len(got) else "nothing")
                    if x != y:
                        what = "activation" if kind == "F" else "gradient"
                        return (f"pre-flight: pipeline {what} message #{i} from rank {src} to rank {dst}: expected the "
                                f"same on both ends, got {x} sent by rank {src} and {y} awaited by rank {dst}; give "
                                "every rank the same Plan (microbatches, schedule, virtual)")
    return None
