"""StepTrace: a Chrome-trace / Perfetto timeline of real steps on every rank, merged into one JSON file.

    with job.trace("trace.json"):          # every rank enters it; rank 0 writes the file on exit
        for _ in range(3):
            job.step(x, y, loss_fn); opt.step(); opt.zero_grad()

Open the file in https://ui.perfetto.dev or chrome://tracing as it is (Trace Event Format, "X" complete
events). One process per rank (named with its pp/dp/tp coordinates), one thread: the rank's Python thread.
What it records, all with wall-clock timestamps in µs (one host's ranks share the clock):

  step         each job.step (cat "step");
  compute      each pipeline action, `2F0` (cat "compute": forward or backward of a stage on a micro-batch);
  module       inside each forward, each run of a module of the model (cat "module", named by its path, e.g.
               `blocks.0` and within it `blocks.0.attn`, two levels deep; args: type, depth), from marks at the module
               boundaries of a copy of the graph that runs only while tracing (`marked`); backward actions
               stay one event each (autograd runs them, not the graph's code);
  p2p          each pipeline send or receive, `0SEND_F3` (cat "p2p", args: bytes, peer; a receive's span
               includes its wait for the message);
  collective   each functional collective meshc's graphs and runtime call, in forward and backward (cat
               "collective", args: kind, axis, bytes: the tensor this rank contributes, as CommCensus counts);
  wait         each wait_tensor on a collective's result, and the end-of-step wait on pipeline sends;
  trace        the tracer's own work inside a step: copying a graph with module marks, once per graph.

Beside the events, the file's otherData holds each rank's communication per step that no compute hid
(`exposed_ms`: waits on collectives, the collective calls themselves, pipeline transfers; `exposed`) and the cost
model's prediction of the same for the job's plan on the hardware profile (`predicted_ms`, by axis: tp, ep, cp, pp,
dp, and the pipeline's bubble, in which a stage's receives wait for the other stage), side by side.

Collectives are seen at dispatch (as runtime/monitor/census.py counts them), so the mode costs a Python call per
ATen op while it is on, and a module mark a Python call per boundary; nothing is recorded, and nothing
costs, outside `job.trace(...)`.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
import weakref
from pathlib import Path

import torch.distributed as dist
import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError

from meshc.runtime.monitor.census import _KINDS

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("meshc_trace", default=None)
_MARKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> its copy with module marks
MODULE_DEPTH = 2  # module levels recorded below the root module (blocks.0, then blocks.0.attn)


def _now_us() -> float:
    return time.time_ns() / 1e3


class StepTrace(compat.dispatch_mode_base()):
    """The events of one rank while it is entered (as a context manager and a dispatch mode)."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.rank = mesh.rank
        self.axis_of = mesh.axis_of_groups()
        self.events: list[dict] = []
        self.tid = threading.get_ident() % 2**31
        self._token = None
        self._open: list[tuple[str, str, float]] = []  # modules entered and not yet left: (path, type, start)

    def __enter__(self):
        self._token = _ACTIVE.set(self)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        _ACTIVE.reset(self._token)
        return out

    def add(self, name: str, cat: str, start: float, end: float, **args) -> None:
        self.events.append({"name": name, "cat": cat, "ph": "X", "ts": start, "dur": max(end - start, 0.0),
                            "pid": self.rank, "tid": self.tid, "args": args})

    def mark(self, path: str, kind: str, begin: bool) -> None:
        """A module boundary in a marked graph: entering `path` or leaving it (marks nest, as the modules do)."""
        now = _now_us()
        if begin:
            self._open.append((path, kind, now))
            return
        while self._open:
            name, kind, start = self._open.pop()
            self.add(name, "module", start, now, type=kind, depth=len(self._open) + 1)
            if name == path:
                break

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "_c10d_functional":
            return func(*args, **kwargs)
        name = compat.op_name(func)
        start = _now_us()
        out = func(*args, **kwargs)
        end = _now_us()
        if name in _KINDS:
            tensor = args[0]
            group = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
            axis = self.axis_of.get(group, str(group))
            nbytes = tensor.numel() * tensor.element_size()
            self.add(f"{_KINDS[name]} {axis}", "collective", start, end, kind=_KINDS[name], axis=axis, bytes=nbytes)
        elif name == "wait_tensor":
            self.add("wait", "wait", start, end)
        return out


@contextlib.contextmanager
def region(name: str, cat: str, **args):
    """Record what runs inside as one event of the active trace (nothing, at no cost, when none is active)."""
    trace = _ACTIVE.get()
    if trace is None:
        yield
        return
    start = _now_us()
    try:
        yield
    finally:
        trace.add(name, cat, start, _now_us(), **args)


def active() -> bool:
    return _ACTIVE.get() is not None


def marked(gm: fx.GraphModule) -> fx.GraphModule:
    """While a trace records: `gm` with a mark where each module run begins and ends (made once per graph, sharing
    its parameters and submodules); otherwise `gm` itself."""
    trace = _ACTIVE.get()
    if trace is None:
        return gm
    out = _MARKED.get(gm)
    if out is None:  # the tracer's own cost, shown as such: a few ms per graph, once per process
        start = _now_us()
        out = _MARKED[gm] = _with_marks(gm)
        trace.add("marking modules", "trace", start, _now_us(), nodes=len(gm.graph.nodes))
    return out


def _module_mark(path: str, kind: str, begin: bool) -> None:
    trace = _ACTIVE.get()
    if trace is not None:
        trace.mark(path, kind, begin)


def _levels(node) -> list[tuple[str, str]] | None:
    """(path, type name) of the modules `node` runs in below the root module, MODULE_DEPTH at most; None for a
    node that names none (inputs, or one a pass inserted without a module: it stays in the current ones)."""
    stack = node.meta.get("nn_module_stack")
    if not stack or node.op in ("placeholder", "get_attr", "output"):
        return None
    inner = [(path, kind) for path, kind in stack.values() if path][:MODULE_DEPTH]
    return [(path, getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]) for path, kind in inner]


def _with_marks(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    opened: list[tuple[str, str]] = []
    for node in list(graph.nodes):
        want = [] if node.op == "output" else _levels(node)
        if want is None:
            continue
        keep = 0
        while keep < min(len(opened), len(want)) and opened[keep] == want[keep]:
            keep += 1
        with graph.inserting_before(node):
            for path, kind in reversed(opened[keep:]):
                graph.call_function(_module_mark, (path, kind, False))
            for path, kind in want[keep:]:
                graph.call_function(_module_mark, (path, kind, True))
        opened = want
    return fx.GraphModule(gm, graph)


COMM = ("wait", "collective", "p2p")  # the categories of time a rank spends communicating, not computing


def exposed(events: list[dict]) -> dict:
    """One rank's communication per step, ms, averaged over the steps recorded: the time it waited for collectives'
    results (wait), spent inside collective calls (collective: the issue, and on a backend that runs them in the
    call, the whole transfer), and in pipeline receives and the sends' end-of-step wait (p2p); what no compute hid.
    `step` is the steps' own span; `exposed` the three summed."""
    steps = [ev for ev in events if ev["cat"] == "step"]
    out = {"steps": len(steps), "step": 0.0, **{cat: 0.0 for cat in COMM}}
    for s in steps:
        out["step"] += s["dur"] / 1e3
        for ev in events:
            if ev["cat"] in COMM and s["ts"] <= ev["ts"] <= s["ts"] + s["dur"]:
                out[ev["cat"]] += ev["dur"] / 1e3
    n = max(len(steps), 1)
    out.update({k: v / n for k, v in out.items() if k != "steps"})
    out["exposed"] = sum(out[cat] for cat in COMM)
    return out


@contextlib.contextmanager
def record(mesh, path, predicted=None):
    """Trace this rank while inside; on exit every rank's events go to rank 0, which writes `path` (JSON), with
    each rank's exposed communication per step (`exposed`) beside `predicted()`: the cost model's (ms by axis)."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        raise MeshcValueError(f"job.trace: expected a path ending in .json, got {str(path)!r}; name it trace.json")
    if active():
        raise MeshcValueError("job.trace: expected no trace already recording, got one; leave it before another")
    trace = StepTrace(mesh)
    with trace:
        yield trace
    events = trace.events
    if dist.is_initialized() and mesh.world_size > 1:
        everyone: list = [None] * mesh.world_size
        dist.all_gather_object(everyone, (events, mesh.coords()))
    else:
        everyone = [(events, mesh.coords())]
    if mesh.rank == 0:
        write(path, everyone, predicted() if predicted is not None else None)


def write(path: Path, everyone: list, predicted: dict | None = None) -> None:
    """The merged Trace Event Format file: one process per rank, events sorted by time within each thread."""
    out = []
    for rank, (events, coords) in enumerate(everyone):
        label = " ".join(f"{a}={c}" for a, c in coords.items())
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({label})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        # an enclosing event first where two start together, so viewers nest them
        out += sorted(events, key=lambda ev: (ev["tid"], ev["ts"], -ev["dur"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms",
                               "otherData": {"producer": "meshc job.trace", "ranks": len(everyone),
                                             "exposed_ms": {str(r): exposed(ev) for r, (ev, _) in enumerate(everyone)},
                                             "predicted_ms": predicted}}))
    os.replace(tmp, path)
